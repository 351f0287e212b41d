"""One pass over the two rows the step draws from: $p_n$ and $q_n$ of each batch
element, at the stopping position $n$.

The default residual and sampler, and the value checks, need only block sums of
these rows and, afterwards, the entries of one block per row; this module computes
both without materialising a `(batch, vocab)` array. See `docs/performance.md`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._core._numerics import flush_subnormal, ordered_block_sums, upcast
from .._core._row_strategy import rows_one_at_a_time
from .._core._rows import read_probs_row
from .._core._vocab_axis import one_hot_over_vocab, sum_over_vocab, vocab_offset


def stopping_rows(
    num_accepted: Int[Array, " batch"],
    draft_probs: Float[Array, "batch draft vocab"] | None,
    target_probs: Float[Array, "batch positions vocab"],
    rejected: Int[Array, " batch"] | None = None,
) -> tuple[Float[Array, "batch vocab"], Float[Array, "batch vocab"] | None]:
    """Gathers $p_n$ and $q_n$ in their input dtype.

    For deterministic drafts (`draft_probs=None`) $q_n$ is the one-hot of the draft
    token `rejected`, made from an iota and never read from memory; it is `None`
    when there are no draft positions, or no drafts to subtract (`rejected=None`
    too). When $n = G$ it is the last draft row, a stand-in that the caller must mask
    out.
    """
    batch = jnp.arange(num_accepted.shape[0])
    target_row = target_probs[batch, num_accepted]
    vocab = target_probs.shape[-1]
    if draft_probs is None:
        if rejected is None:
            return target_row, None
        return target_row, one_hot_over_vocab(rejected, vocab, target_row.dtype, None)
    num_draft = draft_probs.shape[1]
    if num_draft == 0:
        return target_row, None
    draft_row = draft_probs[batch, jnp.minimum(num_accepted, num_draft - 1)]
    return target_row, draft_row


class RowSummary(eqx.Module):
    """What one pass over the rows $p_n$ and $q_n$ of every batch element yields.

    Blocks are consecutive runs of `block_size` tokens (the last one shorter when
    `block_size` does not divide the vocabulary). For valid inputs
    `block_mass` holds the block sums of the weights the step draws from:
    $\\max(P_n \\, p_n - q_n, 0)$ where `subtracting` ($P_n$ the `scale` of block
    verification, 1 when it is `None`), else $p_n$ (when $n = G$, for
    deterministic drafts, and for a row whose residual has no mass: the fallback).
    A negative or non-finite value in $p_n$ makes its block's entry NaN, and one in
    $q_n$ while subtracting makes it $-\\infty$: this is how the value checks
    (`stopping_row_failures`) see them, at no extra pass, in `row_mass`, the sum of a
    row's blocks (over the whole vocabulary under vocabulary sharding). It is NaN
    for a bad $p_n$, $-\\infty$ for a bad $q_n$, and $+\\infty$ when the weights'
    total overflows the arithmetic dtype, which only $p_n$ can cause, since
    $\\max(p_n - q_n, 0) \\le p_n$ (with a bad $q_n$ too, $-\\infty + \\infty$ is
    NaN, still naming $p_n$).
    """

    block_mass: Float[Array, "batch blocks"]
    row_mass: Float[Array, " batch"]
    num_accepted: Int[Array, " batch"]
    subtracting: Bool[Array, " batch"]
    draft_probs: Float[Array, "batch draft vocab"] | None
    target_probs: Float[Array, "batch positions vocab"]
    rejected: Int[Array, " batch"] | None
    scale: Float[Array, " batch"] | None
    block_size: int = eqx.field(static=True)


def stopping_row_summary(
    num_accepted: Int[Array, " batch"],
    draft_probs: Float[Array, "batch draft vocab"] | None,
    target_probs: Float[Array, "batch positions vocab"],
    *,
    block_size: int,
    num_draft_tokens: Int[Array, " batch"] | None = None,
    draft_tokens: Int[Array, "batch draft"] | None = None,
    axis_name: str | None = None,
    scale: Float[Array, " batch"] | None = None,
) -> RowSummary:
    """The block sums of the weights the step draws from, $\\max(P_n \\, p_n - q_n,
    0)$ or $p_n$, in one pass over the two rows, reading nothing else.

    The step computes it once and hands it to the value checks and, for the default
    residual and sampler, to the sampling, so that the two rows are read once between
    them. A row whose residual turns out to have no mass (possible only through
    rounding or unnormalised inputs) is summed again as $p_n$, in a second pass that
    runs only when some row needs it. The rows are read one at a time or all at
    once as `summary_loops_over_rows` chooses.

    **Arguments:**

    - `num_accepted`, `draft_probs`, `target_probs`, `num_draft_tokens`: as for the
        residual.
    - `draft_tokens`: read only with `draft_probs=None`, for deterministic drafts:
        $q_n$ is then the one-hot of $x_n$, made in the pass rather than read, so
        the summary covers $p_n$ with $x_n$ taken out, reading $p_n$ alone. With
        both `None` the summary covers $p_n$ alone, enough for the value checks.
    - `block_size`: the number of tokens summed into one block (at most the
        vocabulary size is used).
    - `axis_name`: inside `shard_map`, the mesh axis the vocabulary is split over:
        the block sums are then those of this device's slice, and whether a row has
        mass is decided over the whole row.
    - `scale`: $P_n$ of block verification ([`speculax.BlockResidual`][]), or
        `None` for 1, the weights of [`speculax.Residual`][].

    **Returns:**

    A `RowSummary`.
    """
    per_row = summary_loops_over_rows(target_probs, draft_probs)
    num_draft = target_probs.shape[1] - 1
    # The draft positions are the draft's own rows: the chain step's target has one
    # more, and a caller drawing from given rows p_n and q_n passes one of each.
    if draft_probs is not None:
        num_draft = draft_probs.shape[1]
    elif draft_tokens is not None:
        num_draft = draft_tokens.shape[1]
    limit = num_draft if num_draft_tokens is None else num_draft_tokens
    block_size = min(block_size, target_probs.shape[-1])
    rejected = None
    if draft_probs is None and draft_tokens is not None and num_draft > 0:
        rejected = jnp.take_along_axis(
            draft_tokens, jnp.minimum(num_accepted, num_draft - 1)[:, None], axis=1
        )[:, 0]
        # As an index into this device's slice; -1 (matching no token) elsewhere.
        shard_vocab = target_probs.shape[-1]
        rejected = rejected - vocab_offset(shard_vocab, axis_name)
        rejected = jnp.where((rejected >= 0) & (rejected < shard_vocab), rejected, -1)

    def summarise_with_mass(subtracting):
        block_mass = _row_block_sums(
            num_accepted,
            subtracting,
            draft_probs,
            target_probs,
            rejected,
            scale,
            block_size,
            per_row,
        )
        # The barrier keeps XLA from merging this sum with the block sums into one
        # reduction over the rows, which would read them a second time.
        row_mass = jnp.sum(jax.lax.optimization_barrier(block_mass), axis=-1)
        return block_mass, sum_over_vocab(row_mass, axis_name)

    def fall_back(subtracting, row_mass):
        # Rows whose residual has no mass stop subtracting (the fallback to p_n); if
        # there are any, the rows are summed again. A flagged row keeps its flag.
        fallback = subtracting & (row_mass == 0)
        return subtracting & ~fallback, jnp.any(fallback)

    subtracting = (num_accepted < limit) & (
        draft_probs is not None or rejected is not None
    )
    if per_row:
        # A loop of at most two passes, so that the row loop is compiled once.
        def loop_body(state):
            subtracting, _, _, _ = state
            block_mass, row_mass = summarise_with_mass(subtracting)
            subtracting, again = fall_back(subtracting, row_mass)
            return subtracting, block_mass, row_mass, again

        shape = jax.eval_shape(summarise_with_mass, subtracting)
        initial = (
            subtracting,
            *(jnp.zeros(x.shape, x.dtype) for x in shape),
            jnp.array(True),
        )
        subtracting, block_mass, row_mass, _ = jax.lax.while_loop(
            lambda state: state[-1], loop_body, initial
        )
    else:
        # A conditional second pass: inside a loop XLA CPU would convert a whole
        # half-precision array to float32 on every pass.
        block_mass, row_mass = summarise_with_mass(subtracting)
        subtracting, again = fall_back(subtracting, row_mass)
        block_mass, row_mass = jax.lax.cond(
            again,
            lambda: summarise_with_mass(subtracting),
            lambda: (block_mass, row_mass),
        )
    return RowSummary(
        block_mass,
        row_mass,
        num_accepted,
        subtracting,
        draft_probs,
        target_probs,
        rejected,
        scale,
        block_size,
    )


def block_weights(
    summary: RowSummary, block_index: Int[Array, " batch"]
) -> Float[Array, "batch block"]:
    """The weights inside one block per batch element, $\\max(P_n \\, p_n - q_n, 0)$
    where the summary is subtracting and $p_n$ elsewhere, upcast, zero beyond the
    vocabulary: $2 \\cdot$ `block_size` reads per element.
    """
    num_accepted, draft_probs, target_probs = (
        summary.num_accepted,
        summary.draft_probs,
        summary.target_probs,
    )
    block_size = summary.block_size
    batch, _, vocab = target_probs.shape
    num_draft = 0 if draft_probs is None else draft_probs.shape[1]
    rows = jnp.arange(batch)[:, None]
    token = block_index[:, None] * block_size + jnp.arange(block_size)[None, :]
    inside = token < vocab
    token = jnp.minimum(token, vocab - 1)
    stop = num_accepted[:, None]
    target = target_probs[rows, stop, token]
    draft = None
    if draft_probs is not None and num_draft > 0:
        draft = draft_probs[rows, jnp.minimum(stop, num_draft - 1), token]
    elif summary.rejected is not None:
        draft = (token == summary.rejected[:, None]).astype(target.dtype)
    scale = None if summary.scale is None else summary.scale[:, None]
    weights = _weights(target, draft, summary.subtracting[:, None], scale)
    return jnp.where(inside, weights, 0)


def _weights(
    target: Float[Array, "*shape"],
    draft: Float[Array, "*shape"] | None,
    subtracting: Bool[Array, "..."] | None,
    scale: Float[Array, "..."] | None,
) -> Float[Array, "*shape"]:
    """$\\max(P_n \\, p_n - q_n, 0)$ where `subtracting` (which broadcasts against the
    rows, as `scale` does; `None` for $P_n = 1$), else $p_n$, upcast; $p_n$ alone
    without a draft.
    """
    target = upcast(target)
    if draft is None or subtracting is None:
        return target
    scaled = target if scale is None else scale * target
    # A difference of two normal numbers can be subnormal: it counts as zero too.
    excess = flush_subnormal(jnp.maximum(scaled - upcast(draft), 0))
    return jnp.where(subtracting, excess, target)


def _row_block_sums(
    num_accepted: Int[Array, " batch"],
    subtracting: Bool[Array, " batch"],
    draft_probs: Float[Array, "batch draft vocab"] | None,
    target_probs: Float[Array, "batch positions vocab"],
    rejected: Int[Array, " batch"] | None,
    scale: Float[Array, " batch"] | None,
    block_size: int,
    per_row: bool,
) -> Float[Array, "batch blocks"]:
    """Block sums of the flagged weights (see `RowSummary`), by a loop over the
    batch or a batched gather.

    Everything a row needs is one elementwise fusion feeding one reduction, so that
    XLA reads each of the two rows once.
    """
    batch, _, vocab = target_probs.shape
    num_draft = 0 if draft_probs is None else draft_probs.shape[1]

    lanes = summation_lanes(target_probs, draft_probs)

    def block_sums(target_row, draft_row, subtracting, scale):
        # Works on (..., vocab) rows; `subtracting` and `scale` broadcast against
        # them.
        x = _weights(target_row, draft_row, subtracting, scale)
        if draft_row is not None:
            x = jnp.where(subtracting & _invalid(draft_row), -jnp.inf, x)
        x = jnp.where(_invalid(target_row), jnp.nan, x)
        return ordered_block_sums(x, block_size, lanes)

    if per_row and batch > 0:

        def one_row(b):
            # Explicit int32 indices: dynamic_slice wants one index type, and under
            # x64 Python ints would become int64.
            stop = num_accepted[b].astype(jnp.int32)
            target_row = read_probs_row(target_probs, b, stop)
            if draft_probs is not None and num_draft > 0:
                draft_row = read_probs_row(
                    draft_probs, b, jnp.minimum(stop, num_draft - 1)
                )
            elif rejected is not None:
                draft_row = one_hot_over_vocab(
                    rejected[b], vocab, target_row.dtype, None
                )
            else:
                return block_sums(target_row, None, None, None)
            row_scale = None if scale is None else scale[b]
            return block_sums(target_row, draft_row, subtracting[b], row_scale)

        return jax.lax.map(one_row, jnp.arange(batch, dtype=jnp.int32))
    target_row, draft_row = stopping_rows(
        num_accepted, draft_probs, target_probs, rejected
    )
    return block_sums(
        target_row,
        draft_row,
        subtracting[:, None],
        None if scale is None else scale[:, None],
    )


def summation_lanes(
    target_probs: Float[Array, "batch positions vocab"],
    draft_probs: Float[Array, "batch draft vocab"] | None,
) -> int:
    """The lanes the summary adds its blocks in (`ordered_block_sums`) for these
    inputs: they fix the last bit of every block sum, so a step that must draw the
    same token as the chain step's summary sums its weights in the same lanes. They
    depend on the inputs' dtypes alone, never on the row strategy, so that both
    strategies draw the same token even for a uniform on a block's edge.

    The lane counts measured fastest on XLA CPU: 32 for float32 rows, which go one at
    a time there (16 took 1.1-1.3 times as long at V = 128256 and 262144, 8 twice as
    long), 8 for half-precision rows, which are gathered all at once (16 took three
    times as long).
    """
    return 8 if _half_inputs(target_probs, draft_probs) else 32


def summary_loops_over_rows(
    target_probs: Float[Array, "batch positions vocab"],
    draft_probs: Float[Array, "batch draft vocab"] | None,
) -> bool:
    """Whether `stopping_row_summary` loops over the batch for these inputs
    (`lax.map` of `dynamic_slice`s: on XLA CPU several times faster than a batched
    gather, whose fused form is not vectorised) rather than gathering the rows of
    the whole batch at once, which suits GPUs, where a loop over the batch would
    run serially: the row strategy in force (`rows_one_at_a_time`), except that
    half-precision inputs always take the gather: XLA CPU converts a whole
    half-precision array to float32 before slicing it inside a loop, an extra pass
    and a temporary twice the array's size."""
    return rows_one_at_a_time() and not _half_inputs(target_probs, draft_probs)


def _invalid(x: Float[Array, "*shape"]) -> Bool[Array, "*shape"]:
    # Negative, NaN or infinite, in two comparisons (NaN fails both).
    return ~((x >= 0) & (x < jnp.inf))


def _half_inputs(
    target_probs: Float[Array, "batch positions vocab"],
    draft_probs: Float[Array, "batch draft vocab"] | None,
) -> bool:
    """Whether either input is in half precision."""
    arrays = [target_probs] if draft_probs is None else [target_probs, draft_probs]
    return any(x.dtype.itemsize < 4 for x in arrays)
