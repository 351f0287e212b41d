"""Reads and reductions over a vocabulary that may be split over a mesh axis.

Inside `jax.shard_map`, a piece built with `axis_name=` sees its device's slice of
every row, $V / d$ consecutive tokens starting at `axis_index * V / d`; with
`axis_name=None` it sees whole rows, and every function here is the plain
single-device computation. Only small arrays cross devices: one value per row or
per draft position, or one per block of `BLOCK_SIZE` tokens. See `docs/sharding.md`.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._numerics import BLOCK_SIZE, first_argmax, ordered_block_sums, upcast


def full_vocab(shard_vocab: int, axis_name: str | None) -> int:
    """The vocabulary size $V$, from the size of one device's slice."""
    if axis_name is None:
        return shard_vocab
    return shard_vocab * jax.lax.axis_size(axis_name)


def vocab_offset(shard_vocab: int, axis_name: str | None) -> Int[Array, ""] | int:
    """The first token of this device's slice."""
    if axis_name is None:
        return 0
    return jax.lax.axis_index(axis_name) * shard_vocab


def probs_at_tokens(
    draft_tokens: Int[Array, "batch draft"],
    draft_probs: Float[Array, "batch draft vocab"] | None,
    target_probs: Float[Array, "batch draft+1 vocab"],
    *,
    axis_name: str | None,
) -> tuple[Float[Array, "batch draft"], Float[Array, "batch draft"]]:
    """Gathers $p_i(x_i)$ and $q_i(x_i)$, upcast to the arithmetic dtype; $q_i(x_i) = 1$
    for deterministic drafts (`draft_probs=None`).

    Point gathers straight from the inputs, not from `target_probs[:, :G]`: a slice
    with two users (the acceptance piece and the value checks) is materialised by XLA
    CPU for half-precision inputs, a copy of nearly the whole array. Identical gathers
    in the two users are merged by XLA. On a split vocabulary the device that holds a
    token reads it and the others add zeros, so the sum over devices is exact.
    """
    positions = jnp.arange(draft_tokens.shape[1])[None, :]
    target = values_at(target_probs, positions, draft_tokens, axis_name=axis_name)
    if draft_probs is None:
        return target, jnp.ones_like(target)
    return target, values_at(draft_probs, positions, draft_tokens, axis_name=axis_name)


def values_at(
    probs: Float[Array, "batch positions vocab"],
    positions: Int[Array, "#batch points"],
    tokens: Int[Array, "batch points"],
    *,
    axis_name: str | None,
) -> Float[Array, "batch points"]:
    """`probs[b, positions[b, k], tokens[b, k]]`, upcast, by one point gather (the
    tokens in `[0, V)`)."""
    return upcast(entries_at(probs, positions, tokens, axis_name=axis_name))


def entries_at(
    x: Float[Array, "batch positions vocab"],
    positions: Int[Array, "#batch points"],
    tokens: Int[Array, "batch points"],
    *,
    axis_name: str | None,
) -> Float[Array, "batch points"]:
    """`x[b, positions[b, k], tokens[b, k]]` as they are, in `x`'s dtype, by one
    point gather (the tokens in `[0, V)`)."""
    index, owned = _in_slice(tokens, x.shape[-1], axis_name)
    rows = jnp.arange(tokens.shape[0])[:, None]
    return _from_owner(x[rows, positions, index], owned, axis_name)


def local_token(
    token: Int[Array, "*rows"], shard_vocab: int, axis_name: str | None
) -> Int[Array, "*rows"]:
    """The index of `token` (in `[0, V)`) into this device's slice of the
    vocabulary: outside `[0, V / d)` on the devices that do not hold it."""
    return token - vocab_offset(shard_vocab, axis_name)


def value_at_token(
    x: Float[Array, "*rows vocab"], token: Int[Array, "*rows"], axis_name: str | None
) -> Float[Array, "*rows"]:
    """Each row of `x` at its `token` (in `[0, V)`). On a split vocabulary the
    device that holds the token reads it and the others add zeros, so the sum over
    devices is exact."""
    index, owned = _in_slice(token, x.shape[-1], axis_name)
    value = jnp.take_along_axis(x, index[..., None], axis=-1)[..., 0]
    return _from_owner(value, owned, axis_name)


def _in_slice(
    token: Int[Array, "*rows"], shard_vocab: int, axis_name: str | None
) -> tuple[Int[Array, "*rows"], Bool[Array, "*rows"]]:
    """Where `token` lies in this device's slice (clipped into it), and whether the
    slice holds it."""
    local = local_token(token, shard_vocab, axis_name)
    owned = (local >= 0) & (local < shard_vocab)
    return jnp.clip(local, 0, shard_vocab - 1), owned


def _from_owner(
    value: Float[Array, "*rows"], owned: Bool[Array, "*rows"], axis_name: str | None
) -> Float[Array, "*rows"]:
    """The `value` that the device holding each token read, on every device."""
    if axis_name is None:
        return value
    return jax.lax.psum(jnp.where(owned, value, 0), axis_name)


def one_hot_over_vocab(
    token: Int[Array, "*rows"], shard_vocab: int, dtype, axis_name: str | None
) -> Float[Array, "*rows vocab"]:
    """The one-hot rows of `token` over this device's slice of the vocabulary (zero
    on the devices that do not hold it), made from an iota, never read."""
    own_tokens = jnp.arange(shard_vocab) + vocab_offset(shard_vocab, axis_name)
    return (own_tokens == token[..., None]).astype(dtype)


def any_over_vocab(
    flags: Bool[Array, "*rows"], axis_name: str | None
) -> Bool[Array, "*rows"]:
    """Whether a flag raised on one device's slice is raised on any."""
    if axis_name is None:
        return flags
    return jax.lax.pmax(flags.astype(jnp.int32), axis_name) > 0


def count_over_vocab(
    counts: Int[Array, "*rows"], axis_name: str | None
) -> Int[Array, "*rows"]:
    """The sum over devices of per-slice integer counts: exact, in any order."""
    if axis_name is None:
        return counts
    return jax.lax.psum(counts, axis_name)


def max_over_vocab(x: Array, axis_name: str | None) -> Array:
    """The largest over devices of per-slice maxima: exact."""
    if axis_name is None:
        return x
    return jax.lax.pmax(x, axis_name)


def sum_over_vocab(
    x: Float[Array, "*rows"], axis_name: str | None
) -> Float[Array, "*rows"]:
    """The sum over devices of per-slice partial sums, for decisions that only ask
    whether a total is zero, infinite or NaN."""
    if axis_name is None:
        return x
    return jax.lax.psum(x, axis_name)


def gather_blocks(
    block_mass: Float[Array, "*rows local_blocks"], axis_name: str | None
) -> Float[Array, "*rows blocks"]:
    """The block sums of whole rows, from those of each device's slice."""
    if axis_name is None:
        return block_mass
    return jax.lax.all_gather(block_mass, axis_name, axis=-1, tiled=True)


def ordered_row_sums(
    x: Float[Array, "*rows vocab"], axis_name: str | None
) -> Float[Array, " *rows"]:
    """Row sums in an order fixed by the row alone: block sums
    (`ordered_block_sums`, `BLOCK_SIZE` tokens), then the sum of the blocks in a
    fixed order too. The same bits alone, in any batch and on any split of the
    vocabulary whose slices are whole blocks.
    """
    blocks = gather_blocks(ordered_block_sums(x, BLOCK_SIZE, lanes=8), axis_name)
    return ordered_block_sums(blocks, blocks.shape[-1], lanes=8)[..., 0]


def first_argmax_over_vocab(
    x: Float[Array, "*rows vocab"], axis_name: str | None
) -> tuple[Int[Array, " *rows"], Float[Array, " *rows"]]:
    """The first index of each row's largest value (`first_argmax`), and that value,
    over the whole vocabulary. Exact on any split for rows without NaN: each device
    proposes its own first largest index, and the smallest index holding the largest
    value wins.
    """
    index = first_argmax(x)
    largest = jnp.take_along_axis(x, index[..., None], axis=-1)[..., 0]
    return first_of_largest(index, largest, x.shape[-1], axis_name)


def first_of_largest(
    index: Int[Array, "*rows"],
    largest: Float[Array, "*rows"],
    shard_vocab: int,
    axis_name: str | None,
) -> tuple[Int[Array, " *rows"], Float[Array, " *rows"]]:
    """The first index of each row's largest value over the whole vocabulary, and
    that value, from each device's `largest` value of its slice and the first
    `index` into the slice holding it: the smallest index holding the largest
    value wins."""
    if axis_name is None:
        return index, largest
    largest_anywhere = jax.lax.pmax(largest, axis_name)
    index = index + vocab_offset(shard_vocab, axis_name)
    unclaimed = jnp.iinfo(jnp.int32).max
    candidate = jnp.where(largest == largest_anywhere, index, unclaimed)
    index = jax.lax.pmin(candidate, axis_name)
    # A row holding a NaN matches nowhere; any index in [0, V) will do for it.
    return jnp.where(index == unclaimed, 0, index), largest_anywhere
