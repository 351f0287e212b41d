"""The demo's draft heads on the target's features: Medusa's heads and the
EAGLE-style head, their trainable weights (the target's embedding and LM head are
shared, not trained), the loss they are trained on, and the shipped weights."""

import io
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..._drafters._eagle import EagleHead
from ..._drafters._medusa import MedusaHeads
from ._models import CausalTransformer, kept_features
from ._shipped import STORAGE_DTYPE, WEIGHTS_DIR, file_object


NUM_HEADS = 4
MEDUSA_WEIGHTS = "medusa.eqx"
EAGLE_WEIGHTS = "eagle.eqx"

# Trainable weights by name, as `heads_of` builds the drafters from them.
HeadWeights = dict[str, Float[Array, "..."]]


def initial_weights(target: CausalTransformer) -> tuple[HeadWeights, HeadWeights]:
    """Untrained weights of Medusa's heads and of the EAGLE-style head for
    `target`: each residual block starts as the identity (a zero weight), so an
    untrained Medusa head proposes what the target's LM head does of the feature,
    and EAGLE's fusing layer reads the feature alone."""
    width = target.embedding.shape[1]
    fuse = jnp.concatenate([jnp.eye(width), jnp.zeros((width, width))])
    return (
        {
            "weight": jnp.zeros((NUM_HEADS, width, width)),
            "bias": jnp.zeros((NUM_HEADS, width)),
        },
        {
            "fuse": fuse,
            "weight": jnp.zeros((width, width)),
            "bias": jnp.zeros(width),
        },
    )


def heads_of(
    target: CausalTransformer, medusa: HeadWeights, eagle: HeadWeights
) -> tuple[MedusaHeads, EagleHead]:
    """The drafters: the trainable weights, with the target's embedding and LM head,
    reading the features a `FeatureKeeping` target keeps."""
    lm_head = lm_of(target)
    return (
        MedusaHeads(medusa["weight"], medusa["bias"], lm_head, features=kept_features),
        EagleHead(
            target.embedding,
            eagle["fuse"],
            eagle["weight"],
            eagle["bias"],
            lm_head,
            features=kept_features,
        ),
    )


def heads_loss(
    target: CausalTransformer,
    medusa: HeadWeights,
    eagle: HeadWeights,
    rows: Int[Array, "batch length"],
    features: Float[Array, "batch length width"],
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """Each drafter's mean cross entropy on rows of tokens and the target's features
    of them: Medusa's head $k$ predicts token $t + 2 + k$ from the feature of token
    $t$; the EAGLE-style head predicts token $t + 2$ from the feature of token $t$
    and token $t + 1$ (one step, the feature given), plus the squared error of the
    feature it predicts against the target's of token $t + 1$, as EAGLE trains."""
    medusa_head, eagle_head = heads_of(target, medusa, eagle)
    length = rows.shape[1]
    medusa_losses = []
    for k in range(NUM_HEADS):
        usable = length - 2 - k
        feature = features[:, :usable]
        mixed = jnp.einsum("btf,fg->btg", feature, medusa_head.weight[k])
        hidden = feature + jax.nn.silu(mixed + medusa_head.bias[k])
        medusa_losses.append(_cross_entropy(hidden @ lm_of(target), rows[:, 2 + k :]))
    fused = jnp.concatenate(
        [features[:, :-2], target.embedding[rows[:, 1:-1]]], axis=-1
    ) @ jnp.asarray(eagle_head.fuse)
    predicted = fused + jax.nn.silu(
        fused @ jnp.asarray(eagle_head.weight) + jnp.asarray(eagle_head.bias)
    )
    regression = jnp.mean(jnp.square(predicted - features[:, 1:-1]))
    eagle_loss = _cross_entropy(predicted @ lm_of(target), rows[:, 2:])
    return jnp.mean(jnp.stack(medusa_losses)), eagle_loss + regression


def lm_of(target: CausalTransformer) -> Float[Array, "width vocab"]:
    """The target's LM head, which the heads share."""
    return target.unembedding.T


def _cross_entropy(
    logits: Float[Array, "batch time vocab"], tokens: Int[Array, "batch time"]
) -> Float[Array, ""]:
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, tokens[..., None], axis=-1))


def save_heads(weights: HeadWeights, path: str | Path | io.BufferedIOBase) -> None:
    """Writes trainable weights in float16, as `eqx.tree_serialise_leaves` does."""
    stored = {name: value.astype(STORAGE_DTYPE) for name, value in weights.items()}
    eqx.tree_serialise_leaves(file_object(path), stored)


def load_heads(path: str | Path | io.BufferedIOBase, like: HeadWeights) -> HeadWeights:
    """Reads the weights `save_heads` wrote, of the shapes of `like`, in float32."""
    skeleton = {
        name: jax.ShapeDtypeStruct(value.shape, STORAGE_DTYPE)
        for name, value in like.items()
    }
    loaded = eqx.tree_deserialise_leaves(file_object(path), skeleton)
    return {name: value.astype(jnp.float32) for name, value in loaded.items()}


def load_demo_heads(target: CausalTransformer) -> tuple[MedusaHeads, EagleHead]:
    """The demo's Medusa heads ($K = 4$) and EAGLE-style head for the demo's
    target, with the weights `scripts/train_demo_heads.py` trained and the package
    ships; they read the features of the target wrapped in `FeatureKeeping`."""
    medusa, eagle = initial_weights(target)
    return heads_of(
        target,
        load_heads(WEIGHTS_DIR / MEDUSA_WEIGHTS, medusa),
        load_heads(WEIGHTS_DIR / EAGLE_WEIGHTS, eagle),
    )
