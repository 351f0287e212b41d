"""Rejections that only take a token out of the target row: deterministic drafts
under a rule that `takes_out_one_hot_drafts`. A rejected child costs two numbers,
its probability and the mass left, and only the final draw reads a `(V,)` row, with
the tokens taken out masked. See `docs/trees.md`, "Deterministic drafts"."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._core._failures import not_a_probability
from .._core._numerics import flush_subnormal
from .._core._vocab_axis import full_vocab, local_token
from ._rows import TreeRows
from ._walk import TreeWalk


def left_at(
    rows: TreeRows,
    parents: Int[Array, " nodes"],
    j: Int[Array, ""],
    token: Int[Array, ""],
    raw_target: Float[Array, ""],
    walk: TreeWalk,
) -> Float[Array, ""]:
    """What the current node's target row, with the tokens of its rejected children
    taken out, holds at draft node `j + 1`'s `token`: 0 where an earlier sibling of
    the same token was taken out, else `raw_target`, the row's value as given (a
    subnormal one counting as zero once a token is out, as a residual's does)."""
    nodes = jnp.arange(1, parents.shape[0] + 1)
    siblings_tokens = jnp.clip(rows.tree_tokens[rows.b], 0, rows.vocab - 1)
    earlier = (parents == walk.current) & (nodes <= j)
    taken_out = jnp.any(earlier & (siblings_tokens == token))
    return jnp.where(taken_out, 0, flush_subnormal(raw_target))


def take_out(target_left_at: Float[Array, ""], walk: TreeWalk) -> TreeWalk:
    """Takes the token of a child that failed its test out of the current node's
    target row: the mass left loses `target_left_at`, the row's value there
    (`left_at`). What is left keeps some mass: a child fails only where
    $p(c) / m \\le u < 1$, that is where $p(c)$ is below the mass left $m$."""
    mass = jnp.where(walk.updated, walk.target_mass, 1) - target_left_at
    return eqx.tree_at(
        lambda w: (w.updated, w.target_mass),
        walk,
        (jnp.array(True), mass.astype(walk.target_mass.dtype)),
    )


def draw_taken_out(
    draw: Callable[
        [Float[Array, "batch vocab"]],
        tuple[Int[Array, " batch"], Float[Array, " batch"]],
    ],
    walks: TreeWalk,
    parents: Int[Array, "batch nodes"],
    tree_tokens: Int[Array, "batch nodes"],
    own_row: Float[Array, "batch vocab"],
    axis_name: str | None,
) -> tuple[Int[Array, " batch"], Float[Array, " batch"], Bool[Array, " batch"]]:
    """The final tokens, `(B,)`, the totals of the weights drawn from, `(B,)`, by
    `draw` (the step's sampler), and whether each row drawn from holds a bad value
    (`not_a_probability`), `(B,)`. A row that took tokens out draws from `own_row`
    (the target row of the node its walk ended at) with the tokens of its
    children, every one rejected, taken out and subnormal values counting as zero;
    the others from `own_row` as given. Where nothing is left (the mass left, one
    less the probabilities taken out, may round above what the row holds), the row
    draws again from `own_row`, as the sibling rule's residual falls back to it.
    On a split vocabulary (`axis_name`), `own_row` is this device's slice, and each
    device masks the tokens it holds."""
    batch, shard_vocab = own_row.shape
    children = parents == walks.current[:, None]
    vocab = full_vocab(shard_vocab, axis_name)
    index = local_token(jnp.clip(tree_tokens, 0, vocab - 1), shard_vocab, axis_name)
    # Past the slice where the token is not a child's or not on this device.
    index = jnp.where(children & (index >= 0), index, shard_vocab)
    rows = jnp.arange(batch)[:, None]
    # A mask of bytes: the weights are made from it and the row in the passes
    # that read them, and made again only for a draw again.
    taken_out = (
        jnp.zeros((batch, shard_vocab), bool).at[rows, index].set(True, mode="drop")
    )

    def weights(given: Bool[Array, " batch"]) -> Float[Array, "batch vocab"]:
        left = jnp.where(taken_out, 0, flush_subnormal(own_row))
        kept = jnp.where((walks.updated & ~given)[:, None], left, own_row)
        # A bad value anywhere in the row, a token taken out included, makes the
        # total NaN: the check costs no pass of its own.
        return jnp.where(not_a_probability(own_row), jnp.nan, kept)

    drawn, total = draw(weights(jnp.zeros((batch,), bool)))
    # A total of non-negative numbers is zero only where every one is.
    no_mass = walks.updated & (total == 0)
    drawn, total = jax.lax.cond(
        jnp.any(no_mass), lambda: draw(weights(no_mass)), lambda: (drawn, total)
    )
    return drawn, total, jnp.isnan(total)
