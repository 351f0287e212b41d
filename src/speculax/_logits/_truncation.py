"""The distribution a row of logits defines under one row's sampling parameters:
temperature, then top-$k$, then top-$p$, then renormalisation, as Hugging Face
transformers and vLLM's main sampler apply them. One definition, used by
[`speculax.probs_from_logits`][] and by [`speculax.LogitsStep`][], so that the drafts
are sampled from exactly the distributions they are verified against.

For a row $\\ell$ with largest logit $m$ and temperature $T > 0$ the scaled logits are
$s_v = (\\ell_v - m) \\cdot (1 / T)$ ($0$ where $\\ell_v = m$, so that a tiny $T$ gives
$-\\infty$, never NaN), and the row keeps the tokens with $s_v \\ge \\tau$:

- top-$k$: $\\tau_k$ is the $k$-th largest $s_v$, the largest $t$ with
    $\\#\\{v : s_v \\ge t\\} \\ge k$ (ties with it kept);
- top-$p$: $\\tau$ is the largest $t \\ge \\tau_k$ with
    $\\sum_{s_v \\ge t} e^{s_v} \\ge p \\sum_{s_v \\ge \\tau_k} e^{s_v}$: the smallest
    set of most likely tokens whose probability reaches $p$, ties with its least
    likely kept.

Its probabilities are $e^{s_v} / Z$ on the kept tokens, $Z = \\sum_{s_v \\ge \\tau}
e^{s_v}$. Temperature $0$ is greedy: the one-hot of the first largest logit.

Both thresholds are found without sorting, by a search over the integer keys that
order float32 values (float64 under x64) as integers: each step counts (top-$k$) or
sums (top-$p$) against candidates, one at a time by bisection (at most 32 steps
each, 64 for float64) or, on the accelerators' path, 31 side by side (at most 7
steps, 13), and the search stops as soon as one value is left between the bounds.
The steps read only the groups of tokens (`GROUP_SIZE` one row at a time, a block
all at once) whose maximum reaches a lower bound of the threshold found from the
groups' maxima, or the whole row when there are too many (or the row is short: at
most `FEW_GROUPS` groups of `GROUP_SIZE`).
Every sum, $Z$ and the masses compared, is added in the fixed order of
`ordered_row_sums`, so that a row has the same bits searched in a few groups or
whole, alone or in a batch, and split over devices (`axis_name`, see
`docs/sharding.md`), where counts and maxima combine exactly. On CPU the rows are
processed two at a time, so that the repeated passes read a row from cache (all at
once on other backends: `speculax.row_strategy`); see `docs/from_logits.md` for
the cost.
"""

import functools
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, UInt

from .._core._numerics import (
    BLOCK_SIZE,
    arithmetic_dtype,
    flush_subnormal,
    ordered_block_sums,
    pairwise_lanes,
    pairwise_rows,
)
from .._core._row_strategy import rows_one_at_a_time
from .._core._rows import read_row
from .._core._vocab_axis import (
    any_over_vocab,
    count_over_vocab,
    first_of_largest,
    full_vocab,
    gather_blocks,
    max_over_vocab,
)
from ._parameters import SamplingParameters


class RowStatistics(eqx.Module):
    """What one pass over each row of logits yields, the same leading shape as the
    rows: everything `probability` needs besides a logit.

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


def scaled_logits(
    logits: Float[Array, "..."],
    maximum: Float[Array, "..."],
    temperature: Float[Array, "..."],
) -> Float[Array, "..."]:
    """$s = (\\ell - m) \\cdot (1 / T)$, exactly $0$ where $\\ell = m$ and $-\\infty$
    where $\\ell = -\\infty$ (and never $-0$ or subnormal), in the arithmetic dtype;
    $T = 0$ (greedy) is read as 1. Arguments broadcast."""
    shifted = logits.astype(maximum.dtype) - maximum
    divisor = jnp.where(temperature > 0, temperature, 1).astype(maximum.dtype)
    # A product with the reciprocal, written out: XLA CPU turns a division into one
    # in some programs and not in others, which would give the same row different
    # last bits in a batch, alone, or split over devices. The reciprocal is
    # subnormal, so zero, for a temperature above 1 / smallest normal (8.5e37 in
    # float32): a -inf logit would become -inf * 0 = NaN rather than keep its
    # probability 0.
    scaled = jnp.where(shifted == -jnp.inf, -jnp.inf, shifted * (1 / divisor))
    # Subnormal values flushed to zero, as XLA CPU compares them, and +0 added to
    # turn -0 into +0: the integer keys of the values then order them as every
    # comparison does.
    return flush_subnormal(jnp.where(shifted == 0, 0, scaled)) + 0


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


# Compiled on its own, so that outside `jit` too the row loop reads the logits as an
# argument, never as a constant folded into the program.
@functools.partial(jax.jit, static_argnames="axis_name")
def request_statistics(
    logits: tuple[Float[Array, "requests _ vocab"], ...],
    parameters: SamplingParameters,
    axis_name: str | None = None,
) -> tuple[RowStatistics, ...]:
    """The statistics of every row of every request, for each array of `logits`
    (the target's and the draft's, say): shape `(requests, positions)` each, each
    row under its request's parameters. Arrays of one arithmetic dtype share one
    loop over their rows, so that the statistics are traced and compiled once
    whatever the arrays; a row's statistics are those it has alone, bit for bit.
    Inside `jax.shard_map` with `axis_name`, the mesh axis the vocabulary is split
    over, `logits` are this device's slices of the rows, and the statistics those
    of the whole rows, the same bits as on one device."""
    dtypes = {arithmetic_dtype(array) for array in logits}
    if len(dtypes) > 1:
        return tuple(
            statistics
            for array in logits
            for statistics in request_statistics((array,), parameters, axis_name)
        )
    (dtype,) = dtypes
    requests = logits[0].shape[0]

    def per_row(x):
        repeats = [array.shape[1] for array in logits]
        return jnp.concatenate(
            [jnp.repeat(x, n, total_repeat_length=requests * n) for n in repeats]
        )

    statistics = row_statistics(
        tuple(array.reshape(-1, array.shape[-1]) for array in logits),
        per_row(parameters.temperature.astype(dtype)),
        per_row(parameters.top_k),
        per_row(parameters.top_p.astype(dtype)),
        axis_name,
        may_truncate=parameters.may_truncate,
        all_greedy=parameters.all_greedy,
    )
    return tuple(
        jax.tree.map(
            lambda x, rows=rows, shape=array.shape[:2]: x[rows].reshape(shape),
            statistics,
        )
        for rows, array in zip(_row_ranges(logits), logits, strict=True)
    )


def _row_ranges(arrays: tuple[Array, ...]) -> list[slice]:
    """Where each array's rows lie among all the arrays' rows, read in turn."""
    counts = [array.shape[0] * array.shape[1] for array in arrays]
    starts = _first_rows(counts)
    return [
        slice(start, start + count) for start, count in zip(starts, counts, strict=True)
    ]


def _first_rows(counts: list[int]) -> list[int]:
    """The index of each array's first row among all the arrays' rows, given how
    many rows each has."""
    return np.cumsum([0, *counts[:-1]]).tolist()


def row_statistics(
    logits: Float[Array, "rows vocab"] | tuple[Float[Array, "_ vocab"], ...],
    temperature: Float[Array, " rows"],
    top_k: Int[Array, " rows"],
    top_p: Float[Array, " rows"],
    axis_name: str | None = None,
    *,
    may_truncate: bool = True,
    all_greedy: bool = False,
) -> RowStatistics:
    """The `RowStatistics` of each row, a loop over chunks of rows (two when the
    rows go one at a time, `rows_one_at_a_time`, as on CPU, where the thresholds'
    repeated passes then read from cache; all at once elsewhere), reading each row
    from memory once. `logits` may be several arrays of rows of one arithmetic
    dtype, read as one: their rows in turn. A chunk none of whose rows is truncated
    skips the threshold searches: temperature alone costs two passes over a row,
    one for its largest logit and one for its normaliser. With
    `may_truncate=False` (no row can be truncated, known before tracing) the
    searches are not traced at all, and the program is a fraction of the size; with
    `all_greedy` (every row greedy, known before tracing) one pass over a row finds
    all greedy verification reads (`_greedy_row`). `axis_name` as for
    `request_statistics`.
    """
    sources = tuple(logits) if isinstance(logits, tuple) else (logits,)
    num_rows = sum(source.shape[0] for source in sources)
    vocab = full_vocab(sources[0].shape[1], axis_name)
    dtype = arithmetic_dtype(*sources)
    if num_rows == 0:
        nothing = jnp.zeros((0,), dtype)
        return RowStatistics(
            nothing, jnp.zeros((0,), jnp.int32), nothing, nothing, jnp.zeros((0,), bool)
        )
    chunk = 2 if rows_one_at_a_time() else num_rows
    num_chunks = -(-num_rows // chunk)
    truncating = (temperature > 0) & (((top_k > 0) & (top_k < vocab)) | (top_p < 1))

    def one_chunk(first: Int[Array, ""]) -> RowStatistics:
        # The last chunk repeats the last row instead of reading past the array.
        rows = jnp.minimum(first + jnp.arange(chunk), num_rows - 1)
        if chunk == num_rows:
            # Every row, in order: the arrays themselves, not one read per row.
            block = jnp.concatenate([source.astype(dtype) for source in sources])
        else:
            block = jnp.stack([_read_row(sources, row, dtype) for row in rows])
        operands = (block, temperature[rows], top_k[rows], top_p[rows])
        if all_greedy:
            return jax.vmap(functools.partial(_greedy_row, axis_name=axis_name))(block)
        untruncated = jax.vmap(functools.partial(_untruncated_row, axis_name=axis_name))
        if not may_truncate:
            return untruncated(*operands)
        return jax.lax.cond(
            jnp.any(truncating[rows]),
            functools.partial(_truncated_rows, axis_name=axis_name),
            untruncated,
            *operands,
        )

    firsts = jnp.arange(num_chunks, dtype=jnp.int32) * chunk
    statistics = jax.lax.map(one_chunk, firsts)
    return jax.tree.map(lambda x: x.reshape(-1)[:num_rows], statistics)


def _read_row(
    sources: tuple[Float[Array, "_ vocab"], ...], row: Int[Array, ""], dtype: jnp.dtype
) -> Float[Array, " vocab"]:
    """Row `row` of the arrays' rows in turn, in place, converted to `dtype`."""
    if len(sources) == 1:
        return read_row(sources[0], row).astype(dtype)
    starts = _first_rows([source.shape[0] for source in sources])
    which = sum((row >= start).astype(jnp.int32) for start in starts[1:])
    branches = [
        functools.partial(
            lambda source, start, row: read_row(source, row - start).astype(dtype),
            source,
            start,
        )
        for source, start in zip(sources, starts, strict=True)
    ]
    return jax.lax.switch(which, branches, row)


class _Row(eqx.Module):
    """What every statistic of a row starts from: one pass for the blocks' maxima,
    the largest logit and its first index, one for the scaled logits' weights and
    their sum $Z$ (the weights of a chunk of rows stay in cache)."""

    blocks: Float[Array, "blocks block"]
    maximum: Float[Array, ""]
    argmax: Int[Array, ""]
    values: "_Values"
    mass: Float[Array, ""]


def _row(
    logits: Float[Array, " vocab"],
    temperature: Float[Array, ""],
    axis_name: str | None,
) -> _Row:
    blocks, largest, index = _blocks(logits)
    argmax, maximum = first_of_largest(index, largest, logits.shape[0], axis_name)
    values = _Values.of(scaled_logits(blocks, maximum, temperature), axis_name)
    return _Row(blocks, maximum, argmax, values, values.total())


def _untruncated_row(
    logits: Float[Array, " vocab"],
    temperature: Float[Array, ""],
    top_k: Int[Array, ""],
    top_p: Float[Array, ""],
    axis_name: str | None,
) -> RowStatistics:
    del top_k, top_p
    row = _row(logits, temperature, axis_name)
    return _statistics(row, jnp.array(-jnp.inf, row.mass.dtype), row.mass)


def _greedy_row(logits: Float[Array, " vocab"], axis_name: str | None) -> RowStatistics:
    """The statistics of a greedy row in one pass: its largest logit and first
    index, and whether it holds NaN or $+\\infty$, as `_bad` reads them off the
    normaliser (which a NaN, or $+\\infty - +\\infty$, makes NaN). The
    distribution is the one-hot of the argmax: nothing is truncated and its
    normaliser is 1."""
    _, largest, index = _blocks(logits)
    argmax, maximum = first_of_largest(index, largest, logits.shape[0], axis_name)
    bad = any_over_vocab(jnp.any(jnp.isnan(logits)), axis_name) | (maximum == jnp.inf)
    no_threshold = jnp.array(-jnp.inf, maximum.dtype)
    return RowStatistics(maximum, argmax, no_threshold, jnp.ones_like(maximum), bad)


def _statistics(
    row: _Row, threshold: Float[Array, ""], total: Float[Array, ""]
) -> RowStatistics:
    # The untruncated total, which every NaN or +inf logit makes NaN: a truncated
    # one may leave out a NaN whose key sorts below the threshold.
    return RowStatistics(
        row.maximum, row.argmax, threshold, total, _bad(row.maximum, row.mass)
    )


# One row at a time the searches read a row in groups of `GROUP_SIZE` tokens, at
# most `FEW_GROUPS` of them where every row of a chunk allows, else at most
# `SEARCHED_GROUPS`; all at once, in at most `FEW_GROUPS` blocks (`_group_size`). A
# row whose kept tokens may lie in more (on any device of its slices) is searched
# whole.
GROUP_SIZE = 16
FEW_GROUPS = 128
SEARCHED_GROUPS = 512


def _truncated_rows(
    logits: Float[Array, "rows vocab"],
    temperature: Float[Array, " rows"],
    top_k: Int[Array, " rows"],
    top_p: Float[Array, " rows"],
    axis_name: str | None,
) -> RowStatistics:
    """The statistics of a chunk of rows some of which are truncated.

    The searches read only the groups of `GROUP_SIZE` tokens that can hold a kept
    token: the groups' maxima bound the threshold from below (the
    $k$-th largest group maximum for top-$k$; for top-$p$ alone, the largest group
    maximum whose group maxima at or above it already hold the mass $p Z$), and a
    token below the bound is never kept. For the peaked rows of language models
    that is a few groups: the chunk's rows are searched among `FEW_GROUPS` of them
    where that is enough for all, else among `SEARCHED_GROUPS` (all at once, among
    `FEW_GROUPS` groups of a block each, `_group_size`). Only when some row
    needs more (on any device), or its bound does not hold as summed, are the
    chunk's rows searched whole, and that row's answer taken from there: the same
    answer, since a search's answer does not depend on where it starts, and every
    mass is summed in the same order either way (`_Values.mass`). For the same
    reason rows of at most `FEW_GROUPS` groups are searched whole from the start.
    """
    if logits.shape[-1] <= FEW_GROUPS * GROUP_SIZE:
        # A row (or this device's slice of it) no longer than the fewest groups
        # searched: searched whole, it reads no more than among its groups, and
        # one search is traced instead of three.
        return jax.vmap(_searched_whole, in_axes=(0, 0, 0, 0, None))(
            logits, temperature, top_k, top_p, axis_name
        )
    rows = jax.vmap(_bounded, in_axes=(0, 0, 0, 0, None))(
        logits, temperature, top_k, top_p, axis_name
    )
    needed = max_over_vocab(jnp.max(rows.holding), axis_name)

    def searched_among(most: int) -> Callable[[], tuple[RowStatistics, Array]]:
        search = functools.partial(_searched_in_groups, most=most, axis_name=axis_name)
        return lambda: jax.vmap(search)(logits, temperature, top_k, top_p, rows)

    if rows_one_at_a_time():
        few, pruned = jax.lax.cond(
            needed <= FEW_GROUPS,
            searched_among(FEW_GROUPS),
            searched_among(SEARCHED_GROUPS),
        )
    else:
        # Each tier is one more search traced and compiled, and a block holds the
        # tokens of 16 groups: one tier, and the whole row past it.
        few, pruned = searched_among(FEW_GROUPS)()

    def searched_whole():
        whole = jax.vmap(_searched_whole, in_axes=(0, 0, 0, 0, None))(
            logits, temperature, top_k, top_p, axis_name
        )
        return jax.tree.map(lambda a, b: jnp.where(pruned, a, b), few, whole)

    return jax.lax.cond(jnp.all(pruned), lambda: few, searched_whole)


class _Bounded(eqx.Module):
    """A row's statistics before its thresholds: the `_Row`'s, the search's lower
    bound, and how many groups of this device's slice can hold a kept token."""

    maximum: Float[Array, ""]
    argmax: Int[Array, ""]
    mass: Float[Array, ""]
    bound: Int[Array, ""]
    holding: Int[Array, ""]


def _bounded(
    logits: Float[Array, " vocab"],
    temperature: Float[Array, ""],
    top_k: Int[Array, ""],
    top_p: Float[Array, ""],
    axis_name: str | None,
) -> _Bounded:
    vocab = full_vocab(logits.shape[0], axis_name)
    row = _row(logits, temperature, axis_name)
    truncating_k, truncating_p = _truncating(vocab, temperature, top_k, top_p)
    group_maxima = _group_maxima(row, temperature, axis_name)
    group_size = _group_size(row.blocks.shape[1])
    bound = _bound(
        group_maxima,
        row.mass,
        truncating_k & (top_k <= vocab // group_size),
        truncating_p & ~truncating_k,
        top_k,
        top_p,
    )
    holding = jnp.sum(group_maxima.keys >= bound, dtype=jnp.int32)
    return _Bounded(row.maximum, row.argmax, row.mass, bound, holding)


def _group_maxima(
    row: _Row, temperature: Float[Array, ""], axis_name: str | None
) -> "_Values":
    """The largest scaled logit of each group of the row, a unit of one value."""
    num_blocks, block_size = row.blocks.shape
    group_size = _group_size(block_size)
    maxima = jnp.max(row.blocks.reshape(-1, group_size), axis=-1)
    return _Values.placed(
        scaled_logits(maxima, row.maximum, temperature)[:, None],
        None,
        num_blocks,
        axis_name,
    )


def _group_size(block_size: int) -> int:
    """The tokens of a group searched: `GROUP_SIZE` one row at a time; all at once a
    whole block, as for a row shorter than a block (which groups may not divide).
    All at once, whole blocks keep the search to one tier (among the blocks)."""
    if rows_one_at_a_time() and block_size % GROUP_SIZE == 0:
        return GROUP_SIZE
    return block_size


def _searched_in_groups(
    logits: Float[Array, " vocab"],
    temperature: Float[Array, ""],
    top_k: Int[Array, ""],
    top_p: Float[Array, ""],
    bounded: _Bounded,
    *,
    most: int,
    axis_name: str | None,
) -> tuple[RowStatistics, Bool[Array, ""]]:
    """The statistics of a row searched in the groups that can hold a kept token,
    at most `most` of them, and whether that sufficed (always, for a row that is
    not truncated)."""
    vocab = full_vocab(logits.shape[0], axis_name)
    truncating_k, truncating_p = _truncating(vocab, temperature, top_k, top_p)
    blocks, _, _ = _blocks(logits)
    num_blocks, block_size = blocks.shape
    group_size = _group_size(block_size)
    per_block = block_size // group_size
    groups = blocks.reshape(-1, group_size)
    maximum, bound = bounded.maximum, bounded.bound
    scaled_maxima = scaled_logits(jnp.max(groups, axis=-1), maximum, temperature)
    holding = _key(scaled_maxima) >= bound
    # Empty slots point past the last group, which `take` fills with -inf (a
    # negative index would wrap round to the last group).
    (chosen,) = jnp.nonzero(
        holding, size=min(most, groups.shape[0]), fill_value=groups.shape[0]
    )
    few = jnp.take(groups, chosen, axis=0, mode="fill", fill_value=-jnp.inf)
    values = _Values.placed(
        scaled_logits(few, maximum, temperature),
        _Runs.of_chosen(num_blocks, chosen, per_block),
        num_blocks,
        axis_name,
    )
    fit = bounded.holding <= chosen.shape[0]
    # The bound holds for the tokens read: exactly for a count; for a mass, as summed.
    pruned = ~any_over_vocab(~fit, axis_name) & (
        truncating_k | (values.mass(bound) >= top_p * bounded.mass)
    )
    truncating = truncating_k | truncating_p
    threshold, total = _search(
        values,
        bounded.mass,
        bound,
        truncating & pruned,
        truncating_k,
        truncating_p,
        top_k,
        top_p,
    )
    threshold = jnp.where(truncating, threshold, -jnp.inf)
    total = jnp.where(truncating, total, bounded.mass)
    bad = _bad(maximum, bounded.mass)
    statistics = RowStatistics(maximum, bounded.argmax, threshold, total, bad)
    return statistics, pruned | ~truncating


def _bound(
    group_maxima: "_Values",
    mass: Float[Array, ""],
    bounding_k: Bool[Array, ""],
    bounding_p: Bool[Array, ""],
    top_k: Int[Array, ""],
    top_p: Float[Array, ""],
) -> Int[Array, ""]:
    """A lower bound of the threshold from the groups' maxima, the same on every
    device: the $k$-th largest (`bounding_k`), or for top-$p$ alone (`bounding_p`)
    the largest whose group maxima at or above it hold the mass $p Z$; the key of
    $-\\infty$ otherwise. The second is summed in an order the split may change:
    any bound will do, since the caller checks it. One search for both, as a row
    bounds by one of them at most."""

    def holds(key: Int[Array, ""], count: Int[Array, ""]) -> Bool[Array, ""]:
        by_mass = group_maxima.mass_in_any_order(key) >= top_p * mass
        return jnp.where(bounding_k, count >= top_k, by_mass)

    lowest = _key(jnp.array(-jnp.inf, mass.dtype))
    return _largest_holding(group_maxima, holds, lowest, bounding_k | bounding_p)


def _searched_whole(
    logits: Float[Array, " vocab"],
    temperature: Float[Array, ""],
    top_k: Int[Array, ""],
    top_p: Float[Array, ""],
    axis_name: str | None,
) -> RowStatistics:
    vocab = full_vocab(logits.shape[0], axis_name)
    row = _row(logits, temperature, axis_name)
    truncating_k, truncating_p = _truncating(vocab, temperature, top_k, top_p)
    truncating = truncating_k | truncating_p
    threshold, total = _search(
        row.values,
        row.mass,
        _key(jnp.array(-jnp.inf, row.mass.dtype)),
        truncating,
        truncating_k,
        truncating_p,
        top_k,
        top_p,
    )
    # An untruncated row's total as `_untruncated_row` gives it, NaN included.
    return _statistics(row, threshold, jnp.where(truncating, total, row.mass))


def _truncating(
    vocab: int,
    temperature: Float[Array, ""],
    top_k: Int[Array, ""],
    top_p: Float[Array, ""],
) -> tuple[Bool[Array, ""], Bool[Array, ""]]:
    """Whether the row's top-$k$, and its top-$p$, remove tokens."""
    sampling = temperature > 0
    return sampling & (top_k > 0) & (top_k < vocab), sampling & (top_p < 1)


def _search(
    values: "_Values",
    mass: Float[Array, ""],
    lowest: Int[Array, ""],
    searching: Bool[Array, ""],
    truncating_k: Bool[Array, ""],
    truncating_p: Bool[Array, ""],
    top_k: Int[Array, ""],
    top_p: Float[Array, ""],
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """The threshold $\\tau$ and the kept mass $Z$, searched among the row's scaled
    logits with keys at or above `lowest`, all in `values`; `mass` is the
    untruncated total, for top-$p$ alone."""
    top_k_threshold = _largest_holding(
        values, lambda key, count: count >= top_k, lowest, searching & truncating_k
    )
    top_k_mass = jnp.where(truncating_k, values.mass(top_k_threshold), mass)
    threshold = _largest_holding(
        values,
        lambda key, count: values.mass(key) >= top_p * top_k_mass,
        top_k_threshold,
        searching & truncating_p,
    )
    return _value(threshold, mass.dtype), values.mass(threshold)


class _Values(eqx.Module):
    """Scaled logits as the searches read them, in units of consecutive tokens
    (rows of `keys`, in the order of the row): their integer keys, which order them
    with no flushing of subnormal candidates, and their weights. On a split
    vocabulary each device holds units of its own slice, and every count, sum and
    maximum is over the whole row, the same on every device.

    `runs` says how the units lie in the slice's `num_blocks` blocks of
    `BLOCK_SIZE` tokens (`None` for values that are counted, never summed in
    order).
    """

    keys: Int[Array, "units unit"]
    weights: Float[Array, "units unit"]
    runs: "_Runs | None"
    num_blocks: int = eqx.field(static=True)
    axis_name: str | None = eqx.field(static=True)

    @classmethod
    def placed(
        cls,
        scaled: Float[Array, "units unit"],
        runs: "_Runs | None",
        num_blocks: int,
        axis_name: str | None,
    ) -> "_Values":
        """Scaled logits in units placed by `runs` (`None`: not to be summed in
        order)."""
        return cls(
            _key(scaled),
            jnp.exp(scaled),
            runs,
            num_blocks,
            axis_name,
        )

    @classmethod
    def of(
        cls, scaled: Float[Array, "blocks block"], axis_name: str | None
    ) -> "_Values":
        """The blocks of a row's scaled logits."""
        num_blocks = scaled.shape[0]
        runs = _Runs.of_blocks(num_blocks)
        return cls.placed(scaled, runs, num_blocks, axis_name)

    def count(self, key: Int[Array, ""]) -> Int[Array, ""]:
        """How many values are at or above the value of `key`."""
        # Flat: XLA CPU reduces a flat array faster than one of two dimensions.
        count = jnp.sum(self.keys.reshape(-1) >= key, dtype=jnp.int32)
        return count_over_vocab(count, self.axis_name)

    def smallest_at_or_above(self, low: Int[Array, ""]) -> Int[Array, ""]:
        """The smallest key at or above `low`, or `low` if there is none."""
        keys = self.keys.reshape(-1)
        # The largest complement, which orders keys in reverse and, unlike negation,
        # never overflows, is the smallest key as devices combine it. The
        # complement of the largest integer, below every key's, marks none.
        none = jnp.iinfo(keys.dtype).min
        complements = jnp.max(jnp.where(keys >= low, ~keys, none))
        complement = max_over_vocab(complements, self.axis_name)
        return jnp.where(complement == none, low, ~complement)

    def mass(self, key: Int[Array, ""]) -> Float[Array, ""]:
        """The weights of the values at or above the value of `key`, summed as
        `ordered_row_sums` sums the row with the others zeroed: the same bits from
        any units that hold every value at or above `key`, alone or in a batch, on
        one device or split. A NaN value's key lies above every other or below, by
        its sign: a row's faults are read off its untruncated total instead."""
        return self._ordered_sum(jnp.where(self.keys < key, 0, self.weights))

    def total(self) -> Float[Array, ""]:
        """The sum of all the weights, NaN where one is, as `mass` sums."""
        return self._ordered_sum(self.weights)

    def mass_in_any_order(self, key: Int[Array, ""]) -> Float[Array, ""]:
        """`mass` summed in an order that depends on the units and the split (the
        same on every device): for bounds only."""
        local = jnp.sum(jnp.where(self.keys < key, 0, self.weights).reshape(-1))
        return jnp.sum(gather_blocks(local[None], self.axis_name))

    def _ordered_sum(self, weights: Float[Array, "units unit"]) -> Float[Array, ""]:
        # `ordered_block_sums` adds a block's rows of 8 lanes pairwise, neighbours
        # first, then the lanes. A unit is a run of rows that such a sum adds on
        # its own, and rows of zeros change nothing (x + 0 = x), so a block's lanes
        # are its units' sums placed where they lie in it (`_block_lanes`); the
        # blocks are then summed in the order fixed by their number, as
        # `ordered_row_sums` does.
        lanes, block = self._block_lanes(weights)
        in_place = jnp.zeros(self.num_blocks, lanes.dtype)
        in_place = in_place.at[block].set(pairwise_lanes(lanes), mode="drop")
        row = gather_blocks(in_place, self.axis_name)
        return ordered_block_sums(row, row.shape[-1], lanes=_LANES)[0]

    def _block_lanes(
        self, weights: Float[Array, "units unit"]
    ) -> tuple[Float[Array, "units lanes"], Int[Array, " units"]]:
        """The lanes of the block of each unit, and the block each unit stands for
        (past the last block for all but one unit of a block, and for the
        padding)."""
        num_units, unit = weights.shape
        rows = -(-unit // _LANES)
        weights = jnp.pad(weights, ((0, 0), (0, rows * _LANES - unit)))
        units = pairwise_rows(weights.reshape(num_units, rows, _LANES))
        if self.runs is None:
            raise TypeError("these values are not placed to be summed in order")
        # A unit (a group) is a power of two of rows, so it is a subtree of its
        # block's sum, and so is each node above it: level by level, every unit
        # holds the sum of its node, and adds that of the sibling node (held alike
        # by each of its units), or 0 where the sibling holds no unit. Addition is
        # commutative, so both siblings' units hold the same bits.
        for partner in self.runs.partners:
            units = units + jnp.take(units, partner, axis=0, mode="fill", fill_value=0)
        return units, self.runs.last_in_block


class _Runs(eqx.Module):
    """The units of each block, in the order of the row, as `_Values._block_lanes`
    sums them: at each level of a block's sum above the units, a unit of the
    sibling node of each unit's (past the last unit where there is none), and for
    the last unit of each block its block (past the last block for the others and
    for the padding, which is never summed)."""

    partners: Int[Array, "levels units"]
    last_in_block: Int[Array, " units"]

    @classmethod
    def of_blocks(cls, num_blocks: int) -> "_Runs":
        """Each unit a whole block, in order."""
        return cls(jnp.zeros((0, num_blocks), jnp.int32), jnp.arange(num_blocks))

    @classmethod
    def of_chosen(
        cls, num_blocks: int, chosen: Int[Array, " units"], per_block: int
    ) -> "_Runs":
        """The units `chosen` (in order, past the last for padding) of a row's
        `num_blocks` blocks, `per_block` units to a block."""
        block = chosen // per_block
        levels = (per_block - 1).bit_length()
        # Each block's places padded to a power of two, as its rows are: the node
        # of a unit at each level is then its position shifted by the level.
        position = block * 2**levels + chosen % per_block
        partners = [jnp.zeros((0, chosen.shape[0]), jnp.int32)]
        for level in range(levels):
            node = position >> level
            sibling = node ^ 1
            first = jnp.searchsorted(node, sibling, method="scan")
            found = jnp.take(node, first, mode="fill", fill_value=-1) == sibling
            partners.append(jnp.where(found, first, chosen.shape[0])[None])
        ends = jnp.concatenate([block[1:] != block[:-1], jnp.ones(1, bool)])
        return cls(
            jnp.concatenate(partners).astype(jnp.int32),
            jnp.where(ends & (block < num_blocks), block, num_blocks),
        )


# The lanes of `ordered_block_sums`, whose order the masses follow.
_LANES = 8


def _bad(maximum: Float[Array, ""], total: Float[Array, ""]) -> Bool[Array, ""]:
    """NaN or $+\\infty$ in the row, read off the normaliser: a NaN logit, or
    $+\\infty - +\\infty$, makes it NaN, as does a row all $-\\infty$, which is
    reported on its own."""
    # Not `maximum > -inf`: the maximum of a row holding NaN may be NaN.
    return jnp.isnan(total) & (maximum != -jnp.inf)


def _blocks(
    logits: Float[Array, " vocab"],
) -> tuple[Float[Array, "blocks block"], Float[Array, ""], Int[Array, ""]]:
    """The row in blocks of `BLOCK_SIZE` (the last padded with $-\\infty$), its
    largest logit and that logit's first index, in one pass over the row: the
    blocks' maxima, then the first block holding the largest, then the first index
    inside it (as `first_argmax`, whose reasons hold here too)."""
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
    return blocks, maximum, index.astype(jnp.int32)


def _largest_holding(
    values: _Values,
    holds: Callable[[Int[Array, ""], Int[Array, ""]], Bool[Array, ""]],
    lowest: Int[Array, ""],
    searching: Bool[Array, ""],
) -> Int[Array, ""]:
    """The key of the largest $t$ in $[$`lowest`$, 0]$ for which `holds(key,
    count)` (`count` the number of `values` at or above $t$), a predicate false
    above $0$ that turns from true to false once as $t$ grows, only at `values`; or
    `lowest` when not `searching`. When the predicate is false at `lowest` too (as
    a sum rounded differently from the total it is compared with may be), the
    smallest of the `values` at or above `lowest`, which keeps the same tokens.

    A search over the integer keys, so that the answer is exact: the key of one of
    the `values` (or `lowest`), whatever the steps taken. Each step tries the
    predicate at `_search_width() - 1` keys spread evenly between the bounds and
    keeps the interval between the last that holds and the first that does not: a
    bisection one row at a time, where each try is a pass over the row; 32
    ways at once on the accelerators' path, where the tries run side by side and a
    step is a loop iteration, serial there: 7 steps at most for float32 keys (13
    for float64) instead of 32. The search stops as soon as one value is left
    between the bounds. On a split vocabulary every device takes the same steps,
    from counts and masses of the whole row.
    """
    width = _search_width()
    zero = _key(jnp.zeros((), values.weights.dtype))
    # Just above +0, where no scaled logit lies.
    high = jnp.where(searching, zero + 1, lowest + 1)
    state = (lowest, high, values.count(lowest), jnp.zeros((), jnp.int32))

    def narrowing(state):
        low, high, count_low, count_high = state
        return (_distance(low, high) > 1) & (count_low - count_high > 1)

    def narrowed(state):
        low, high, count_low, count_high = state
        tried = _spread(low, high, width)
        counts = jax.vmap(values.count)(tried)
        # The predicate is monotone: the keys where it holds come first.
        held = jnp.sum(jax.vmap(holds)(tried, counts) & (tried < high))
        lows = jnp.concatenate([low[None], tried])
        highs = jnp.concatenate([tried, high[None]])
        counts_low = jnp.concatenate([count_low[None], counts])
        counts_high = jnp.concatenate([counts, count_high[None]])
        return lows[held], highs[held], counts_low[held], counts_high[held]

    low, _, _, _ = jax.lax.while_loop(narrowing, narrowed, state)
    # `low` holds (its smallest value is the answer, the only value left or `low`
    # itself), or is `lowest`: its smallest value, which keeps the same tokens,
    # so that every way of searching gives the same bits.
    return jnp.where(searching, values.smallest_at_or_above(low), lowest)


def _search_width() -> int:
    """How many intervals each step of `_largest_holding` splits its interval into:
    two one row at a time (`rows_one_at_a_time`), where every try costs a pass over
    the row; 32 at once, where the tries run side by side and the steps one
    after another."""
    return 2 if rows_one_at_a_time() else 32


def _spread(
    low: Int[Array, ""], high: Int[Array, ""], width: int
) -> Int[Array, " tried"]:
    """`width - 1` increasing keys that split $[$`low`, `high`$)$ into `width`
    intervals as even as integers allow, none longer than
    $\\lceil$(`high - low`) / `width`$\\rceil$ (past `high - low` intervals,
    empty ones at `high`)."""
    distance = _distance(low, high)
    step, longer = distance // width, distance % width
    part = jnp.arange(1, width, dtype=distance.dtype)
    offsets = part * step + jnp.minimum(part, longer)
    return low + offsets.astype(low.dtype)


_KEY_DTYPES = {jnp.dtype(jnp.float32): jnp.int32, jnp.dtype(jnp.float64): jnp.int64}
_UNSIGNED = {jnp.dtype(jnp.int32): jnp.uint32, jnp.dtype(jnp.int64): jnp.uint64}


def _key(x: Float[Array, "*shape"]) -> Int[Array, "*shape"]:
    """An integer that orders like `x` (not NaN; $-0$ below $+0$)."""
    key_dtype = _KEY_DTYPES[jnp.dtype(x.dtype)]
    bits = jax.lax.bitcast_convert_type(x, key_dtype)
    return jnp.where(bits < 0, bits ^ jnp.iinfo(key_dtype).max, bits)


def _value(key: Int[Array, ""], dtype: jnp.dtype) -> Float[Array, ""]:
    """The float whose key is `key`."""
    bits = jnp.where(key < 0, key ^ jnp.iinfo(key.dtype).max, key)
    return jax.lax.bitcast_convert_type(bits, dtype)


def _distance(low: Int[Array, ""], high: Int[Array, ""]) -> UInt[Array, ""]:
    """`high - low` without overflow, as an unsigned integer."""
    unsigned = _UNSIGNED[jnp.dtype(low.dtype)]
    return high.astype(unsigned) - low.astype(unsigned)
