"""The state of one row's walk over its tree, which every tree step returns to the
shared final draw and checks."""

from typing import final

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


@final
class TreeWalk(eqx.Module):
    """The state of one row's walk over its tree; when the walk ends, where it ended
    and what it found wrong, which the final draw and the checks read."""

    current: Int[Array, ""]
    depth: Int[Array, ""]
    # Whether `target` and `draft` hold the distributions left by rejected children
    # (`target` unnormalised, with its mass) rather than the current node's rows.
    updated: Bool[Array, ""]
    target: Float[Array, " vocab"]
    target_mass: Float[Array, ""]
    draft: Float[Array, " vocab"]
    path_tokens: Int[Array, " path"]
    path_nodes: Int[Array, " path"]
    # A bad value at a tested token, and in a whole row read at a failed test.
    bad_target: Bool[Array, ""]
    bad_draft: Bool[Array, ""]
    bad_target_row: Bool[Array, ""]
    bad_draft_row: Bool[Array, ""]
    # Whether what a rejected child left summed past the largest float.
    overflow: Bool[Array, ""]
    # A walk that takes the rejected tokens out (`_taken_out`) keeps no row: its
    # `target` and `draft` are empty, and `target_mass` is the mass left once the
    # tokens of the rejected children of `current` are out.
    takes_out: bool = eqx.field(static=True)


def start_walk(
    vocab: int, dtype: jnp.dtype, max_depth: int, *, takes_out: bool = False
) -> TreeWalk:
    """A walk at the root, before any node is visited; one that `takes_out` the
    rejected tokens keeps no `(V,)` row."""
    row_length = 0 if takes_out else vocab
    return TreeWalk(
        current=jnp.zeros((), jnp.int32),
        depth=jnp.zeros((), jnp.int32),
        updated=jnp.array(False),
        target=jnp.zeros((row_length,), dtype),
        target_mass=jnp.ones((), dtype),
        draft=jnp.zeros((row_length,), dtype),
        path_tokens=jnp.full((max_depth + 1,), -1, jnp.int32),
        path_nodes=jnp.full((max_depth + 1,), -1, jnp.int32),
        bad_target=jnp.array(False),
        bad_draft=jnp.array(False),
        bad_target_row=jnp.array(False),
        bad_draft_row=jnp.array(False),
        overflow=jnp.array(False),
        takes_out=takes_out,
    )
