"""Medusa's heads: one head per draft position, each reading the target's feature
at the history's last verified position."""

from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PyTree

from .._loop._drafter import AbstractDrafter, DraftRows, Drafts, sampled_rows
from .._loop._sampling import AbstractDraftSampling, RowParameters
from .._loop._state import LoopState
from .._pieces._sampling import InverseCDF
from ._features import TargetFeatures, check_float_array, rows_times, verified_feature


@final
class MedusaHeads(AbstractDrafter):
    """Medusa's draft heads (Cai et al., 2024): head $k$ reads the target's feature
    $h$ at the history's last verified position (the one whose logits drew the
    history's last token) and gives the logits of draft $k$,
    $\\left(h + \\mathrm{SiLU}(h W_k + b_k)\\right) U$, a residual block and an LM
    head $U$ (the target's own, or one trained with the heads). Draft $k$ is drawn
    by inverse CDF from what the loop's `draft_sampling` makes of its logits, under
    the row's parameters: each draft's row depends on the history alone, not on
    the drafts before it.

    The heads keep no state: the feature is read from the target's cache each round
    (`docs/loop.md`, "The target's features"). A round of $G$ drafts uses the first
    $G$ heads. Each row's products are summed on their own, not in a batched dot
    product, so that a row drafts the same bits alone as in a batch: exact and
    small, slower than a dot product for a large LM head.

    **Arguments:**

    - `weight`: float `(K, F, F)`, each head's $W_k$, applied to the feature as a
        row vector.
    - `bias`: float `(K, F)`, each head's $b_k$.
    - `lm_head`: float `(F, V)`, $U$.
    - `features`: keyword only, where the target keeps its features: a function of
        its cache that returns them, float `(B, T, F)`. A static field: give a
        function defined once (a module's), since each new `lambda` is a new value
        and compiles the loop anew.
    """

    weight: Float[Array | np.ndarray, "heads feature feature"]
    bias: Float[Array | np.ndarray, "heads feature"]
    lm_head: Float[Array | np.ndarray, "feature vocab"]
    features: TargetFeatures = eqx.field(static=True, kw_only=True)

    def __check_init__(self):
        check_float_array("weight", self.weight, 3)
        check_float_array("bias", self.bias, 2)
        check_float_array("lm_head", self.lm_head, 2)
        heads, width = jnp.shape(self.weight)[:2]
        if jnp.shape(self.weight)[2] != width or jnp.shape(self.bias) != (
            heads,
            width,
        ):
            raise ValueError(
                "weight must have shape (K, F, F) and bias (K, F); got weight of "
                f"shape {jnp.shape(self.weight)} and bias of shape "
                f"{jnp.shape(self.bias)}"
            )
        if jnp.shape(self.lm_head)[0] != width:
            raise ValueError(
                f"lm_head must have shape (F, V) = ({width}, V), reading the heads' "
                f"features; got shape {jnp.shape(self.lm_head)}"
            )

    def init(
        self,
        prompt: Int[Array, "batch prompt"],
        slots: int,
        num_draft: int,
        vocab_size: int,
    ) -> None:
        if num_draft > jnp.shape(self.weight)[0]:
            raise ValueError(
                f"num_draft (a draft tree's depth) must be at most the number of "
                f"heads, {jnp.shape(self.weight)[0]}; got {num_draft}"
            )
        if jnp.shape(self.lm_head)[1] != vocab_size:
            raise ValueError(
                f"lm_head must score the target's vocabulary: it gives logits over "
                f"V = {jnp.shape(self.lm_head)[1]} tokens, target_model over "
                f"V = {vocab_size}"
            )
        return None

    def draft(
        self,
        state: LoopState,
        uniforms: Float[Array, "batch draft"],
        num_draft: int,
        draft_sampling: AbstractDraftSampling,
    ) -> Drafts:
        parameters = RowParameters(state.temperature, state.top_k, state.top_p)
        # The heads read the target's entries of the history alone: the state's
        # cache holds the same there as a cache that read the history whole.
        rows = self.drawn_after(
            state.buffer,
            state.length,
            state.target_cache,
            num_draft,
            parameters,
            draft_sampling,
        )
        tokens = jax.vmap(InverseCDF(), in_axes=1, out_axes=1)(rows.probs, uniforms)
        return Drafts(tokens, rows, None)

    def drawn_after(
        self,
        tokens: Int[Array, "batch time"],
        length: Int[Array, " batch"],
        target_cache: PyTree,
        num_draft: int,
        parameters: RowParameters,
        draft_sampling: AbstractDraftSampling,
    ) -> DraftRows:
        feature = verified_feature(self.features, target_cache, length)
        weight = jnp.asarray(self.weight)[:num_draft]
        bias = jnp.asarray(self.bias)[:num_draft]
        # `rows_times` for every head at once: h W_k, each row summed on its own.
        mixed = jnp.sum(feature[:, None, :, None] * weight, axis=-2)
        hidden = feature[:, None] + jax.nn.silu(mixed + bias)
        logits = rows_times(hidden, jnp.asarray(self.lm_head))
        return sampled_rows(logits, parameters, draft_sampling)
