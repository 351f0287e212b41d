"""The number rules every piece shares: the arithmetic dtype, subnormals, integer
indices and the order of summation. See `docs/concepts.md`, "Numbers".
"""

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, Integer


def arithmetic_dtype(*arrays: Array | None) -> jnp.dtype:
    """float32 for half- and single-precision arrays, float64 where one of them is
    float64 (under x64); `None` is skipped."""
    return jnp.result_type(jnp.float32, *(x.dtype for x in arrays if x is not None))


def upcast(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    """Casts half-precision values to float32 (float32 and float64 stay as they are)
    and counts every value below the smallest normal number of that arithmetic dtype
    as zero.

    Arithmetic is float32 for float16, bfloat16 and float32 inputs, float64 for
    float64 inputs. XLA CPU flushes subnormal numbers to zero, while other backends
    may keep them; flushing them here, explicitly, makes every decision (acceptance,
    the residual, its fallback, the checks and the sampler) see the same zeros on
    every backend. Pieces call this *after* gathering what they need, so that the
    cast never materialises a converted copy of a whole probability array.
    """
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return flush_subnormal(x)


def flush_subnormal(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    """`x` with every value whose magnitude is below the smallest normal number of its
    dtype replaced by zero; NaN and infinities pass through.
    """
    return jnp.where(jnp.abs(x) < jnp.finfo(x.dtype).smallest_normal, 0, x)


def index_array(x: ArrayLike | Sequence[Any], unrepresentable: int = -1) -> Array:
    """An integer input (tokens, lengths) as a JAX array, narrowed without wrapping.

    JAX without x64 keeps at most 32-bit integers and would wrap a NumPy `int64`
    such as $2^{32} + 3$ to $3$, a plausible wrong token. Values that `int32` cannot
    hold become `unrepresentable` here, before any narrowing: $-1$ by default, which
    every check of a token or length rejects as out of range (parents, for which
    $-1$ means an unused slot, pass $-2$). JAX arrays pass through (see `as_index`
    for their narrowing). An empty nested list, which NumPy would call float, is an
    empty integer array.
    """
    if isinstance(x, Array):
        return x
    array = np.asarray(x)
    if isinstance(x, Sequence) and array.size == 0:
        return jnp.asarray(array, jnp.int32)
    if array.dtype.kind not in "iu":
        # Not an integer array: the structure check names the argument and its dtype.
        return jnp.asarray(array)
    limits = np.iinfo(np.int32)
    fits = (array >= limits.min) & (array <= limits.max)
    return jnp.asarray(np.where(fits, array, unrepresentable).astype(np.int32))


def as_index(
    x: Integer[Array, "*shape"], unrepresentable: int = -1
) -> Int[Array, "*shape"]:
    """Integers of any dtype as `int32`, exactly: values that `int32` cannot hold
    (from `uint32`, or `int64` and `uint64` under x64) become `unrepresentable`, as
    in `index_array`. Narrower dtypes widen exactly, so that comparisons with the
    vocabulary size never overflow the input's own dtype.
    """
    info = jnp.iinfo(x.dtype)
    limits = jnp.iinfo(jnp.int32)
    fits = jnp.ones(x.shape, bool)
    if info.max > limits.max:
        fits &= x <= limits.max
    if info.min < limits.min:
        fits &= x >= limits.min
    return jnp.where(fits, x.astype(jnp.int32), unrepresentable)


# The number of vocabulary entries the sampler sums into one block: the only place
# this number is written.
BLOCK_SIZE = 256


def first_argmax(x: Float[Array, "*rows vocab"]) -> Int[Array, " *rows"]:
    """`jnp.argmax` along the last axis, the same answer for rows without NaN (ties
    going to the first index), in one pass over `x`. A row holding a NaN, which no
    check lets through where it matters, gets some index in `[0, vocab)`.

    XLA CPU runs `jnp.argmax`, a reduction over (value, index) pairs, without
    vectorising it: ten times slower than this at $V = 128256$. Here one plain
    max-reduction finds each block's largest value, an argmax over those few hundred
    finds the first block that holds the row's largest value, and an argmax inside
    that one block finds the index.
    """
    *lead, vocab = x.shape
    block_size = min(BLOCK_SIZE, vocab)
    num_blocks = -(-vocab // block_size)
    padded = jnp.pad(
        x,
        [(0, 0)] * len(lead) + [(0, num_blocks * block_size - vocab)],
        constant_values=-jnp.inf,
    )
    blocks = padded.reshape(*lead, num_blocks, block_size)
    # A plain max of the raw values: any elementwise step before it (say, to rank
    # NaN first, as argmax does) makes XLA CPU's reduction six times slower.
    block = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)
    chosen = jnp.take_along_axis(blocks, block[..., None, None], axis=-2)[..., 0, :]
    return (block * block_size + jnp.argmax(chosen, axis=-1)).astype(jnp.int32)


def ordered_block_sums(
    x: Float[Array, "*rows vocab"], block_size: int, lanes: int
) -> Float[Array, "*rows blocks"]:
    """Sums of consecutive blocks of `block_size` entries along the last axis (the
    last block shorter when `block_size` does not divide the vocabulary), added in
    an order fixed by `block_size` and `lanes` alone.

    XLA chooses the order of its own reductions by the shape of the whole array, so
    the same row can sum to a different last bit alone and inside a batch, and a
    uniform near a block's edge then draws a different token. Here each block is
    split into rows of `lanes` entries (zero-padded, and $x + 0 = x$), the rows are
    added one after another as whole vectors, and the lanes are then added pairwise:
    explicit additions, which XLA may fuse but never reorders. `lanes` is a power of
    two; it sets the order, and so the last bit, but never makes it depend on the
    batch.
    """
    vocab = x.shape[-1]
    num_full = vocab // block_size
    sums = _sum_blocks(x[..., : num_full * block_size], block_size, lanes)
    if num_full * block_size == vocab:
        return sums
    # The short last block apart: padding the whole row to full blocks would keep
    # XLA CPU from vectorising the full ones (four times slower at V = 50257).
    tail = _sum_blocks(x[..., num_full * block_size :], block_size, lanes)
    return jnp.concatenate([sums, tail], axis=-1)


def _sum_blocks(
    x: Float[Array, "*rows vocab"], block_size: int, lanes: int
) -> Float[Array, "*rows blocks"]:
    *lead, vocab = x.shape
    num_blocks = -(-vocab // block_size)
    rows = -(-block_size // lanes)
    no_padding = [(0, 0)] * len(lead)
    x = jnp.pad(x, [*no_padding, (0, num_blocks * block_size - vocab)])
    x = x.reshape(*lead, num_blocks, block_size)
    x = jnp.pad(x, [*no_padding, (0, 0), (0, rows * lanes - block_size)])
    x = x.reshape(*lead, num_blocks, rows, lanes)
    total = x[..., 0, :]
    for row in range(1, rows):
        total = total + x[..., row, :]
    width = lanes
    while width > 1:
        width //= 2
        total = total[..., :width] + total[..., width : 2 * width]
    return total[..., 0]
