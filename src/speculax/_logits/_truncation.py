"""The distribution a row of logits defines under one row's sampling parameters:
temperature, then top-$k$, then top-$p$, then renormalisation, as Hugging Face
transformers and vLLM's main sampler apply them. One definition, used by
[`speculax.probs_from_logits`][] and by [`speculax.LogitsStep`][], so that the drafts
are sampled from exactly the distributions they are verified against.

For a row $\\ell$ with largest logit $m$ and temperature $T > 0$ the scaled logits are
$s_v = (\\ell_v - m) / T$ ($0$ where $\\ell_v = m$, so that a tiny $T$ gives $-\\infty$,
never NaN), and the row keeps the tokens with $s_v \\ge \\tau$:

- top-$k$: $\\tau_k$ is the $k$-th largest $s_v$, the largest $t$ with
    $\\#\\{v : s_v \\ge t\\} \\ge k$ (ties with it kept);
- top-$p$: $\\tau$ is the largest $t \\ge \\tau_k$ with
    $\\sum_{s_v \\ge t} e^{s_v} \\ge p \\sum_{s_v \\ge \\tau_k} e^{s_v}$: the smallest
    set of most likely tokens whose probability reaches $p$, ties with its least
    likely kept.

Its probabilities are $e^{s_v} / Z$ on the kept tokens, $Z = \\sum_{s_v \\ge \\tau}
e^{s_v}$. Temperature $0$ is greedy: the one-hot of the first largest logit.

Both thresholds are found without sorting, by bisection over the 32-bit keys that
order float32 values as integers: each step counts (top-$k$) or sums (top-$p$) one
row against a candidate, at most 32 steps each, fewer when the interval is narrow.
On CPU the rows are processed two at a time, so that the repeated passes read a row
from cache; see `docs/from_logits.md` for the cost.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Shaped, UInt

from .._numerics import BLOCK_SIZE


class RowStatistics(eqx.Module):
    """What one pass over each row of logits yields, the same leading shape as the
    rows: everything [`probability`][] needs besides a logit.

    - `maximum`: the largest logit $m$.
    - `argmax`: the first index holding it, the greedy token.
    - `threshold`: $\\tau$, the smallest scaled logit kept ($-\\infty$ keeps all).
    - `total`: $Z$, the sum of $e^{s_v}$ over the kept tokens.
    - `bad`: the row holds NaN or $+\\infty$.
    """

    maximum: Float[Array, "*rows"]
    argmax: Int[Array, "*rows"]
    threshold: Float[Array, "*rows"]
    total: Float[Array, "*rows"]
    bad: Bool[Array, "*rows"]

    @property
    def empty(self) -> Bool[Array, "*rows"]:
        """The row has no finite logit: all $-\\infty$."""
        return self.maximum == -jnp.inf


def arithmetic_dtype(logits: Shaped[Array, "..."]) -> jnp.dtype:
    """float32 for half-precision and float32 logits, float64 for float64 ones."""
    return jnp.promote_types(logits.dtype, jnp.float32)


def scaled_logits(
    logits: Float[Array, "..."],
    maximum: Float[Array, "..."],
    temperature: Float[Array, "..."],
) -> Float[Array, "..."]:
    """$s = (\\ell - m) / T$, exactly $0$ where $\\ell = m$ (and never $-0$), in the
    arithmetic dtype; $T = 0$ (greedy) is read as 1. Arguments broadcast."""
    shifted = logits.astype(maximum.dtype) - maximum
    divisor = jnp.where(temperature > 0, temperature, 1).astype(maximum.dtype)
    # Adding +0 turns -0 into +0, so that the bit patterns order the values.
    return jnp.where(shifted == 0, 0, shifted / divisor) + 0


def probability(
    logits: Float[Array, "..."],
    tokens: Int[Array, "..."],
    statistics: RowStatistics,
    temperature: Float[Array, "..."],
) -> Float[Array, "..."]:
    """The probability of `tokens`, whose logits are `logits`, under their rows'
    distributions (`statistics` and `temperature` broadcast against them)."""
    scaled = scaled_logits(logits, statistics.maximum, temperature)
    kept = scaled >= statistics.threshold
    sampled = jnp.where(kept, jnp.exp(scaled) / statistics.total, 0)
    greedy = (tokens == statistics.argmax).astype(sampled.dtype)
    return jnp.where(temperature > 0, sampled, greedy)


def row_statistics(
    logits: Float[Array, "rows vocab"],
    temperature: Float[Array, " rows"],
    top_k: Int[Array, " rows"],
    top_p: Float[Array, " rows"],
) -> RowStatistics:
    """The [`RowStatistics`][] of each row, a loop over chunks of rows (two on CPU,
    where the thresholds' repeated passes then read from cache; all at once
    elsewhere), reading each row from memory once. A chunk none of whose rows is
    truncated skips the threshold searches: temperature alone costs two passes over
    a row, one for its largest logit and one for its normaliser.
    """
    num_rows, vocab = logits.shape
    dtype = arithmetic_dtype(logits)
    if num_rows == 0:
        nothing = jnp.zeros((0,), dtype)
        return RowStatistics(
            nothing, jnp.zeros((0,), jnp.int32), nothing, nothing, jnp.zeros((0,), bool)
        )
    chunk = 2 if loops_over_rows() else num_rows
    num_chunks = -(-num_rows // chunk)
    truncating = (temperature > 0) & (((top_k > 0) & (top_k < vocab)) | (top_p < 1))

    def one_chunk(first: Int[Array, ""]) -> RowStatistics:
        # The last chunk repeats the last row instead of reading past the array.
        rows = jnp.minimum(first + jnp.arange(chunk), num_rows - 1)
        block = jnp.stack([read_row(logits, row) for row in rows])
        operands = (block, temperature[rows], top_k[rows], top_p[rows])
        return jax.lax.cond(
            jnp.any(truncating[rows]),
            jax.vmap(_truncated_row),
            jax.vmap(_untruncated_row),
            *operands,
        )

    firsts = jnp.arange(num_chunks, dtype=jnp.int32) * chunk
    statistics = jax.lax.map(one_chunk, firsts)
    return jax.tree.map(lambda x: x.reshape(-1)[:num_rows], statistics)


def loops_over_rows() -> bool:
    """Whether to work row by row (`lax.map`): on CPU, where a row then stays in
    cache and XLA's batched gathers are slow; elsewhere the rows go at once, since a
    loop would run serially on an accelerator."""
    return jax.default_backend() == "cpu"


def read_row(
    logits: Float[Array, "*lead vocab"], *index: Int[Array, ""]
) -> Float[Array, " vocab"]:
    """`logits[index]` in the arithmetic dtype, by `dynamic_slice`, inside a loop.

    The optimisation barrier ties the array to the loop's index: without it XLA CPU
    hoists the conversion of a half-precision array out of the loop, converting the
    whole array to float32 first (twice its size, and an extra pass).
    """
    logits, position = jax.lax.optimization_barrier((logits, index))
    vocab = logits.shape[-1]
    start = (*position, jnp.zeros((), jnp.asarray(position[0]).dtype))
    row = jax.lax.dynamic_slice(logits, start, (1,) * len(position) + (vocab,))
    return row.reshape(vocab).astype(arithmetic_dtype(logits))


def _untruncated_row(
    logits: Float[Array, " vocab"],
    temperature: Float[Array, ""],
    top_k: Int[Array, ""],
    top_p: Float[Array, ""],
) -> RowStatistics:
    del top_k, top_p
    maximum, argmax = _maximum_and_first_argmax(logits)
    scaled = scaled_logits(logits, maximum, temperature)
    lowest = jnp.array(-jnp.inf, scaled.dtype)
    total = _mass_from(scaled, jnp.exp(scaled), lowest)
    return RowStatistics(maximum, argmax, lowest, total, _bad(maximum, total))


def _truncated_row(
    logits: Float[Array, " vocab"],
    temperature: Float[Array, ""],
    top_k: Int[Array, ""],
    top_p: Float[Array, ""],
) -> RowStatistics:
    vocab = logits.shape[0]
    maximum, argmax = _maximum_and_first_argmax(logits)
    sampling = temperature > 0
    scaled = scaled_logits(logits, maximum, temperature)
    weights = jnp.exp(scaled)
    lowest = jnp.array(-jnp.inf, scaled.dtype)
    top_k_threshold = _largest_holding(
        lambda t: jnp.sum(scaled >= t) >= top_k,
        lowest,
        sampling & (top_k > 0) & (top_k < vocab),
    )
    top_k_mass = _mass_from(scaled, weights, top_k_threshold)
    threshold = _largest_holding(
        lambda t: _mass_from(scaled, weights, t) >= top_p * top_k_mass,
        top_k_threshold,
        sampling & (top_p < 1),
    )
    total = _mass_from(scaled, weights, threshold)
    return RowStatistics(maximum, argmax, threshold, total, _bad(maximum, total))


def _mass_from(
    scaled: Float[Array, " vocab"],
    weights: Float[Array, " vocab"],
    threshold: Float[Array, ""],
) -> Float[Array, ""]:
    """The sum of the weights of the tokens kept by `threshold`; NaN when a scaled
    logit is NaN, since NaN is never below it."""
    return jnp.sum(jnp.where(scaled < threshold, 0, weights))


def _bad(maximum: Float[Array, ""], total: Float[Array, ""]) -> Bool[Array, ""]:
    """NaN or $+\\infty$ in the row, read off the normaliser: a NaN logit, or
    $+\\infty - +\\infty$, makes it NaN, as does a row all $-\\infty$, which is
    reported on its own."""
    # Not `maximum > -inf`: the maximum of a row holding NaN may be NaN.
    return jnp.isnan(total) & (maximum != -jnp.inf)


def _maximum_and_first_argmax(
    logits: Float[Array, " vocab"],
) -> tuple[Float[Array, ""], Int[Array, ""]]:
    """The largest logit and its first index, in one pass over the row: the blocks'
    maxima, then the first block holding the largest, then the first index inside
    it (as `first_argmax`, whose reasons hold here too)."""
    vocab = logits.shape[0]
    block_size = min(BLOCK_SIZE, vocab)
    num_blocks = -(-vocab // block_size)
    padded = jnp.pad(
        logits, (0, num_blocks * block_size - vocab), constant_values=-jnp.inf
    )
    blocks = padded.reshape(num_blocks, block_size)
    block_maxima = jnp.max(blocks, axis=-1)
    maximum = jnp.max(block_maxima)
    block = jnp.argmax(block_maxima == maximum)
    inside = jax.lax.dynamic_index_in_dim(blocks, block, keepdims=False)
    index = block * block_size + jnp.argmax(inside == maximum)
    return maximum, index.astype(jnp.int32)


def _largest_holding(
    holds: Callable[[Float[Array, ""]], Bool[Array, ""]],
    lowest: Float[Array, ""],
    searching: Bool[Array, ""],
) -> Float[Array, ""]:
    """The largest $t$ in $[$`lowest`$, 0]$ for which `holds`, a predicate true at
    `lowest` and false above $0$ that turns from true to false once as $t$ grows; or
    `lowest` when not `searching`. Bisection over the integer keys of the floats
    (at most one step per bit), so the answer is exact: a value of the row, where
    `holds` changes only at values of the row.
    """
    low = _key(lowest)
    # Just above +0, where no scaled logit lies.
    high = jnp.where(searching, _key(jnp.zeros_like(lowest)) + 1, low + 1)

    def narrowing(state):
        low, high = state
        return _distance(low, high) > 1

    def bisect(state):
        low, high = state
        middle = low + (_distance(low, high) // 2).astype(low.dtype)
        inside = holds(_value(middle, lowest.dtype))
        return jnp.where(inside, middle, low), jnp.where(inside, high, middle)

    low, _ = jax.lax.while_loop(narrowing, bisect, (low, high))
    return _value(low, lowest.dtype)


_KEY_DTYPES = {jnp.dtype(jnp.float32): jnp.int32, jnp.dtype(jnp.float64): jnp.int64}
_UNSIGNED = {jnp.dtype(jnp.int32): jnp.uint32, jnp.dtype(jnp.int64): jnp.uint64}


def _key(x: Float[Array, ""]) -> Int[Array, ""]:
    """An integer that orders like `x` (not NaN; $-0$ below $+0$)."""
    key_dtype = _KEY_DTYPES[jnp.dtype(x.dtype)]
    bits = jax.lax.bitcast_convert_type(x, key_dtype)
    return jnp.where(bits < 0, bits ^ jnp.iinfo(key_dtype).max, bits)


def _value(key: Int[Array, ""], dtype: jnp.dtype) -> Float[Array, ""]:
    bits = jnp.where(key < 0, key ^ jnp.iinfo(key.dtype).max, key)
    return jax.lax.bitcast_convert_type(bits, dtype)


def _distance(low: Int[Array, ""], high: Int[Array, ""]) -> UInt[Array, ""]:
    """`high - low` without overflow, as an unsigned integer."""
    unsigned = _UNSIGNED[jnp.dtype(low.dtype)]
    return high.astype(unsigned) - low.astype(unsigned)
