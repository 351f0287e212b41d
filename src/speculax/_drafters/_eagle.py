"""An EAGLE-style head: drafting at the level of the target's features, each draft
from the feature it predicts and the token drawn before it."""

from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PyTree

from .._loop._drafter import AbstractDrafter, DraftRows, Drafts
from .._loop._sampling import AbstractDraftSampling, RowParameters
from .._loop._state import LoopState
from .._pieces._sampling import InverseCDF
from ._features import TargetFeatures, check_float_array, rows_times, verified_feature


@final
class EagleHead(AbstractDrafter):
    """An EAGLE-style draft head (Li et al., 2024): autoregression on the target's
    features. From a feature $f$ and the token $x$ that follows it, it predicts the
    next feature

    $$\\hat f = z + \\mathrm{SiLU}(z W + b), \\qquad z = [f, E_x] A,$$

    and the next token's logits $\\hat f U$, where $E$ embeds tokens, $A$ fuses the
    feature with the token, one residual block $(W, b)$ follows, and $U$ is an LM
    head (the target's own, or the head's). Draft 0 reads the target's feature at
    the history's last verified position and the history's last token; draft
    $i > 0$ reads the feature it predicted for draft $i - 1$ and that draft. Each
    draft is drawn by inverse CDF from what the loop's `draft_sampling` makes of
    its logits, under the row's parameters.

    The block is a residual MLP, not EAGLE's decoder layer: it attends to no
    earlier position, so the head keeps no state and reads the target's feature
    from the target's cache each round (`docs/loop.md`, "The target's features").
    Each row's products are summed on their own, as for
    [`speculax.MedusaHeads`][]: the same bits alone as in a batch, slower than a
    dot product for a large LM head.

    **Arguments:**

    - `embedding`: float `(V, F)`, $E$.
    - `fuse`: float `(2F, F)`, $A$.
    - `weight`: float `(F, F)`, $W$.
    - `bias`: float `(F,)`, $b$.
    - `lm_head`: float `(F, V)`, $U$.
    - `features`: keyword only, where the target keeps its features: a function of
        its cache that returns them, float `(B, T, F)`, defined once (a static
        field: each new `lambda` compiles the loop anew).
    """

    embedding: Float[Array | np.ndarray, "vocab feature"]
    fuse: Float[Array | np.ndarray, "fused feature"]
    weight: Float[Array | np.ndarray, "feature feature"]
    bias: Float[Array | np.ndarray, " feature"]
    lm_head: Float[Array | np.ndarray, "feature vocab"]
    features: TargetFeatures = eqx.field(static=True, kw_only=True)

    def __check_init__(self):
        for name, ndim in (
            ("embedding", 2),
            ("fuse", 2),
            ("weight", 2),
            ("bias", 1),
            ("lm_head", 2),
        ):
            check_float_array(name, getattr(self, name), ndim)
        vocab, width = jnp.shape(self.embedding)
        expected = {
            "fuse": (2 * width, width),
            "weight": (width, width),
            "bias": (width,),
            "lm_head": (width, vocab),
        }
        for name, shape in expected.items():
            if jnp.shape(getattr(self, name)) != shape:
                raise ValueError(
                    f"{name} must have shape {shape} for an embedding of shape "
                    f"(V, F) = {(vocab, width)}; got {jnp.shape(getattr(self, name))}"
                )

    def init(
        self,
        prompt: Int[Array, "batch prompt"],
        slots: int,
        num_draft: int,
        vocab_size: int,
    ) -> None:
        if jnp.shape(self.embedding)[0] != vocab_size:
            raise ValueError(
                f"embedding and lm_head must cover the target's vocabulary: they "
                f"cover V = {jnp.shape(self.embedding)[0]} tokens, target_model "
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
        feature = verified_feature(self.features, state.target_cache, state.length)
        token = state.buffer[jnp.arange(state.length.shape[0]), state.length - 1]
        feature = self._carried(feature, token, parameters, draft_sampling)

        # Each draft is traced once: the head reads the draft just drawn.
        def draw(carry: tuple, uniform: Float[Array, " batch"]) -> tuple:
            feature, token = carry
            feature, rows = self._next(feature, token, parameters, draft_sampling)
            token = InverseCDF()(rows.probs, uniform)
            return (feature, token), (token, rows)

        _, (tokens, rows) = jax.lax.scan(draw, (feature, token), uniforms.T)
        return Drafts(tokens.T, _draft_major(rows), None)

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
        positions = (length - 1)[:, None] + jnp.arange(num_draft)
        before = jnp.take_along_axis(tokens, positions, axis=1)
        feature = self._carried(feature, before[:, 0], parameters, draft_sampling)

        def read(feature: Array, token: Int[Array, " batch"]) -> tuple:
            return self._next(feature, token, parameters, draft_sampling)

        _, rows = jax.lax.scan(read, feature, before.T)
        return _draft_major(rows)

    def _carried(
        self,
        feature: Float[Array, "batch feature"],
        token: Int[Array, " batch"],
        parameters: RowParameters,
        draft_sampling: AbstractDraftSampling,
    ) -> Float[Array, "batch feature"]:
        """The target's feature in the dtype of the features the head predicts (its
        own and its weights', promoted): a scan's carry keeps one dtype, and a
        target may keep narrower features than the head's weights."""
        predicted = jax.eval_shape(
            lambda: self._next(feature, token, parameters, draft_sampling)[0]
        )
        return feature.astype(predicted.dtype)

    def _next(
        self,
        feature: Float[Array, "batch feature"],
        token: Int[Array, " batch"],
        parameters: RowParameters,
        draft_sampling: AbstractDraftSampling,
    ) -> tuple[Float[Array, "batch feature"], DraftRows]:
        """The feature predicted after `feature` and `token`, and the next draft's
        logits and rows."""
        joined = jnp.concatenate([feature, jnp.asarray(self.embedding)[token]], -1)
        fused = rows_times(joined, jnp.asarray(self.fuse))
        predicted = fused + jax.nn.silu(
            rows_times(fused, jnp.asarray(self.weight)) + jnp.asarray(self.bias)
        )
        logits = rows_times(predicted, jnp.asarray(self.lm_head))
        probs = draft_sampling(logits, *parameters)
        return predicted, DraftRows(logits, probs)


def _draft_major(rows: DraftRows) -> DraftRows:
    """Rows stacked by a scan over the drafts, `(G, B, V)`, as `(B, G, V)`."""
    return DraftRows(*(jnp.swapaxes(x, 0, 1) for x in rows))
