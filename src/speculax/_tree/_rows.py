"""What a tree walk reads of its row's inputs: the values at a child's token, and a
node's whole rows, read in place from the batch's arrays, on one device or on each
device's slice of a split vocabulary."""

import dataclasses
from typing import final

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._core._failures import holds_bad_values
from .._core._numerics import arithmetic_dtype
from .._core._rows import read_probs_row
from .._core._vocab_axis import (
    any_over_vocab,
    first_argmax_over_vocab,
    full_vocab,
    local_token,
    one_hot_over_vocab,
    ordered_row_sums,
    value_at_token,
    values_at,
)


@final
class TreeRows(eqx.Module):
    """Row `b` of the batch's tree inputs, read in place (the walk never copies a
    tree's `(N + 1, V)` slab); `dtype` is the arithmetic dtype. Under
    `jax.shard_map` with the vocabulary split over `axis_name`, the rows are this
    device's slice, and a row's sums, checks and values at a token are read across
    the devices; every other computation is elementwise, on the slice."""

    b: Int[Array, ""]
    tree_tokens: Int[Array, "batch nodes"]
    draft_probs: Float[Array, "batch nodes+1 vocab"] | None
    target_probs: Float[Array, "batch nodes+1 vocab"]
    accept_uniforms: Float[Array, "batch nodes"]
    # Each draft node's parent's rows as given at the node's token, upcast, read
    # for the whole batch at once: one exchange on a split vocabulary, not one per
    # node. The draft's is 1 for target-only drafts.
    given_target: Float[Array, "batch nodes"]
    given_draft: Float[Array, "batch nodes"]
    dtype: jnp.dtype = eqx.field(static=True)
    # Each row's most likely target token, where the walk's test reads it.
    most_likely: Int[Array, "batch nodes+1"] | None
    axis_name: str | None = eqx.field(static=True)

    @property
    def vocab(self) -> int:
        """$V$, the whole vocabulary's size."""
        return full_vocab(self.shard_vocab, self.axis_name)

    @property
    def shard_vocab(self) -> int:
        """The length of the rows read: $V$, or $V / d$ on a split vocabulary."""
        return self.target_probs.shape[-1]

    def row(self, b: Int[Array, ""]) -> "TreeRows":
        """The inputs of row `b`."""
        return dataclasses.replace(self, b=b)

    def token_of(self, node: Int[Array, ""]) -> Int[Array, ""]:
        """The token of draft `node`, clipped into the vocabulary."""
        return jnp.clip(self.tree_tokens[self.b, node - 1], 0, self.vocab - 1)

    def given_at(
        self, node: Int[Array, ""]
    ) -> tuple[Float[Array, ""], Float[Array, ""]]:
        """The rows of draft `node`'s parent as given at the node's token, upcast:
        the target's and the draft's (1 for target-only drafts)."""
        index = jnp.maximum(node - 1, 0)
        return self.given_target[self.b, index], self.given_draft[self.b, index]

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
            one_hot = one_hot_over_vocab(
                token, self.shard_vocab, self.dtype, self.axis_name
            )
            return own_target, one_hot
        return own_target, read_probs_row(self.draft_probs, self.b, node)

    def at_token(
        self, row: Float[Array, " vocab"], token: Int[Array, ""]
    ) -> Float[Array, ""]:
        """A row the walk made, at `token` (in the vocabulary)."""
        return value_at_token(row, token, self.axis_name)

    def local(self, token: Int[Array, ""]) -> Int[Array, ""]:
        """`token` as an index into the rows read, outside them on a device that
        does not hold it: what a sibling rule is given as the rejected token."""
        return local_token(token, self.shard_vocab, self.axis_name)

    def mass(self, row: Float[Array, " vocab"]) -> Float[Array, ""]:
        """A row's sum, the same bits on every split whose slices are whole blocks
        (`ordered_row_sums`)."""
        return ordered_row_sums(row, self.axis_name)

    def holds_bad(self, row: Float[Array, " vocab"]) -> Bool[Array, ""]:
        """Whether a row holds a negative or non-finite value (`holds_bad_values`)."""
        return any_over_vocab(holds_bad_values(row, axis=None), self.axis_name)


def tree_rows(
    parents: Int[Array, "batch nodes"],
    tree_tokens: Int[Array, "batch nodes"],
    draft_probs: Float[Array, "batch nodes+1 vocab"] | None,
    target_probs: Float[Array, "batch nodes+1 vocab"],
    accept_uniforms: Float[Array, "batch nodes"],
    *,
    most_likely: bool,
    axis_name: str | None,
) -> TreeRows:
    """The batch's tree inputs as a walk reads them (`TreeRows.row` picks a row):
    each draft node's values at its token read once, and where the walk reads
    them (`most_likely`) the most likely token of every target row. `draft_probs`
    is `None` for a walk that reads none. A bad parent is clipped into the tree:
    the checks report it, and discard what the walk makes of it."""
    num_nodes = parents.shape[1]
    vocab = full_vocab(target_probs.shape[-1], axis_name)
    parent = jnp.clip(parents, 0, num_nodes)
    token = jnp.clip(tree_tokens, 0, vocab - 1)
    given_target = values_at(target_probs, parent, token, axis_name=axis_name)
    given_draft = jnp.ones_like(given_target)
    if draft_probs is not None:
        given_draft = values_at(draft_probs, parent, token, axis_name=axis_name)
    most_likely_tokens = None
    if most_likely:
        most_likely_tokens, _ = first_argmax_over_vocab(target_probs, axis_name)
    return TreeRows(
        jnp.zeros((), jnp.int32),
        tree_tokens,
        draft_probs,
        target_probs,
        accept_uniforms,
        given_target,
        given_draft,
        arithmetic_dtype(draft_probs, target_probs),
        most_likely_tokens,
        axis_name,
    )
