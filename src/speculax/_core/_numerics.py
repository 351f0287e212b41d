"""The number rules every piece shares: the arithmetic dtype, subnormals, integer
indices and the order of summation. See `docs/concepts.md`, "Numbers".
"""

import operator
from collections.abc import Sequence
from typing import Any, TypeVar, cast

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


def index_array(
    x: ArrayLike | Sequence[Any], unrepresentable: int | None = -1
) -> Array:
    """An integer input (tokens, lengths, counts) as a JAX array, narrowed without
    wrapping.

    JAX without x64 keeps at most 32-bit integers and would wrap a NumPy `int64`
    such as $2^{32} + 3$ to $3$, a plausible wrong token. Values that `int32` cannot
    hold become `unrepresentable` here, before any narrowing: $-1$ by default, which
    every check of a token or length rejects as out of range (parents, for which
    $-1$ means an unused slot, pass $-2$); `None` saturates instead, for counts such
    as `top_k` where every value from $V$ up means the same. JAX arrays pass through
    (see `as_index` for their narrowing). Nested Python ints are read exactly (see
    `host_integers`), and an empty nested list, which NumPy would call float, is an
    empty integer array.
    """
    if isinstance(x, Array):
        return x
    array = host_integers(x)
    if isinstance(x, Sequence) and array.size == 0:
        return jnp.asarray(array, jnp.int32)
    if not is_integer_array(array):
        # Not an integer array: the caller's dtype check names the argument.
        return jnp.asarray(array)
    limits = np.iinfo(np.int32)
    # Compared by value (NumPy compares every integer dtype, and Python ints, with a
    # Python int exactly), then assigned into int32: no promotion to float on the
    # way, as `np.where` would make of `uint64` and a negative sentinel.
    above, below = array > limits.max, array < limits.min
    narrowed = np.zeros(array.shape, np.int32)
    fits = ~(above | below)
    narrowed[fits] = array[fits]
    narrowed[above] = limits.max if unrepresentable is None else unrepresentable
    narrowed[below] = limits.min if unrepresentable is None else unrepresentable
    return jnp.asarray(narrowed)


def as_index(
    x: Integer[Array, "*shape"], unrepresentable: int | None = -1
) -> Int[Array, "*shape"]:
    """Integers of any dtype as `int32`, exactly: values that `int32` cannot hold
    (from `uint32`, or `int64` and `uint64` under x64) become `unrepresentable`, or
    the nearest value `int32` holds for `None`, as in `index_array`. Narrower dtypes
    widen exactly, so that comparisons with the vocabulary size never overflow the
    input's own dtype.
    """
    info = jnp.iinfo(x.dtype)
    limits = jnp.iinfo(jnp.int32)
    above = jnp.zeros(x.shape, bool) if info.max <= limits.max else x > limits.max
    below = jnp.zeros(x.shape, bool) if info.min >= limits.min else x < limits.min
    narrowed = x.astype(jnp.int32)
    if unrepresentable is None:
        return jnp.where(above, limits.max, jnp.where(below, limits.min, narrowed))
    return jnp.where(above | below, unrepresentable, narrowed)


def integer_input(
    x: ArrayLike | Sequence[Any], name: str, unrepresentable: int | None = -1
) -> Int[Array, "..."]:
    """An integer argument `name` of any shape as `int32`, by value (`index_array`,
    then `as_index`); a `TypeError` naming it for any other dtype (floats, bools)."""
    array = index_array(x, unrepresentable)
    if not jnp.issubdtype(array.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype; got {array.dtype}")
    return as_index(array, unrepresentable)


def host_integers(x: ArrayLike | Sequence[Any]) -> np.ndarray:
    """`x` as a NumPy array, nested Python ints exactly: NumPy reads ints beyond 64
    bits as objects, and a mix of negative ints and ints beyond `int64` as
    `float64`, which would make integers look like floats; those come back as an
    array of Python ints (dtype `object`). Anything else is as NumPy reads it."""
    array = np.asarray(x)
    if array.dtype.kind in "fO" and not isinstance(x, np.ndarray | np.generic):
        exact = np.asarray(x, dtype=object)
        if exact.size and all(_is_python_int(v) for v in exact.flat):
            return exact
    return array


def is_integer_array(array: np.ndarray) -> bool:
    """Whether a NumPy array (from `host_integers`) holds integers: an integer
    dtype, or Python ints only."""
    if array.dtype.kind in "iu":
        return True
    return array.dtype.kind == "O" and all(_is_python_int(v) for v in array.flat)


def _is_python_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_Static = TypeVar("_Static", int, int | None)


def integer_by_value(value: _Static) -> _Static:
    """A static integer field's converter: a NumPy integer as the Python int of its
    value (runtime type checking would refuse it for an `int`, and a static field
    must not hold an array). Anything else is left for the checks to name."""
    return cast(_Static, int(value)) if isinstance(value, np.integer) else value


def static_integer(value: Any, name: str) -> int:
    """A static integer argument (a size, a count, a rank) as a Python int, by value:
    a Python int, a NumPy integer or a concrete integer array of shape `()`; a
    `TypeError` naming it for a float or a bool, which are never read as integers."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer; got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer; got {value!r}") from None


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
    added pairwise (`pairwise_rows`) and then the lanes (`pairwise_lanes`):
    explicit additions, which XLA may fuse but never reorders, in a program whose
    size grows with the logarithm of the block, not with the block. `lanes` is a
    power of two; it sets the order, and so the last bit, but never makes it depend
    on the batch.
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
    return pairwise_lanes(pairwise_rows(x.reshape(*lead, num_blocks, rows, lanes)))


def pairwise_rows(x: Float[Array, "*lead rows lanes"]) -> Float[Array, "*lead lanes"]:
    """The rows of `x` added pairwise, neighbours first (row $2i$ and row $2i + 1$,
    then those sums in pairs, and so on to one row), after padding with rows of
    zeros to a power of two.

    Any $2^k$ rows that start at a multiple of $2^k$ are summed together before
    they meet the others, so the sum of an array whose other rows are zero is the
    sum of those runs' sums placed where they lie, bit for bit: the truncation's
    masses sum only the groups of a block that can hold a kept token that way.
    """
    *lead, rows, _ = x.shape
    levels = max(rows - 1, 0).bit_length()
    x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, 2**levels - rows), (0, 0)])
    for _ in range(levels):
        x = x[..., 0::2, :] + x[..., 1::2, :]
    return x[..., 0, :]


def pairwise_lanes(x: Float[Array, "*lead lanes"]) -> Float[Array, " *lead"]:
    """The lanes of `x`, a power of two of them, added pairwise: the first half to
    the second, then again, to one."""
    width = x.shape[-1]
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width : 2 * width]
    return x[..., 0]
