"""What a tree walk reads of its row's inputs: the values at a child's token, and a
node's whole rows, read in place from the batch's arrays."""

from typing import final

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._core._numerics import upcast
from .._core._rows import read_probs_row
from .._core._vocab_axis import one_hot_over_vocab


@final
class TreeRows(eqx.Module):
    """Row `b` of the batch's tree inputs, read in place (the walk never copies a
    tree's `(N + 1, V)` slab); `dtype` is the arithmetic dtype."""

    b: Int[Array, ""]
    tree_tokens: Int[Array, "batch nodes"]
    draft_probs: Float[Array, "batch nodes+1 vocab"] | None
    target_probs: Float[Array, "batch nodes+1 vocab"]
    accept_uniforms: Float[Array, "batch nodes"]
    dtype: jnp.dtype = eqx.field(static=True)
    # Each row's most likely target token, where the walk's test reads it.
    most_likely: Int[Array, "batch nodes+1"] | None = None

    @property
    def vocab(self) -> int:
        """$V$."""
        return self.target_probs.shape[-1]

    def token_of(self, node: Int[Array, ""]) -> Int[Array, ""]:
        """The token of draft `node`, clipped into the vocabulary."""
        return jnp.clip(self.tree_tokens[self.b, node - 1], 0, self.vocab - 1)

    def given_at(
        self, node: Int[Array, ""], token: Int[Array, ""]
    ) -> tuple[Float[Array, ""], Float[Array, ""]]:
        """`node`'s rows as given at a child's `token` (in the vocabulary), upcast:
        the target's and the draft's (1 for target-only drafts)."""
        raw_target = upcast(self.target_probs[self.b, node, token])
        if self.draft_probs is None:
            return raw_target, jnp.ones((), self.dtype)
        return raw_target, upcast(self.draft_probs[self.b, node, token])

    def is_most_likely(
        self, node: Int[Array, ""], token: Int[Array, ""]
    ) -> Bool[Array, ""]:
        """Whether `token` is `node`'s most likely target token; `False` where the
        most likely tokens were not found."""
        if self.most_likely is None:
            return jnp.array(False)
        return self.most_likely[self.b, node] == token

    def own_rows(
        self, node: Int[Array, ""], token: Int[Array, ""]
    ) -> tuple[Float[Array, " vocab"], Float[Array, " vocab"]]:
        """`node`'s whole rows as given, upcast, `(V,)` each: the target's and the
        draft's (the one-hot of the child's `token` for target-only drafts)."""
        own_target = read_probs_row(self.target_probs, self.b, node)
        if self.draft_probs is None:
            return own_target, one_hot_over_vocab(token, self.vocab, self.dtype, None)
        return own_target, read_probs_row(self.draft_probs, self.b, node)
