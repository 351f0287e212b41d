"""The correction or bonus token of each row: the residual, then the sampler, run as
one pass when they are the default pair."""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._core._failures import Failure, overflow_failure, stopping_row_failures
from .._core._numerics import BLOCK_SIZE, upcast
from .._core._vocab_axis import first_argmax_over_vocab
from .._pieces._block import stopping_ratio
from .._pieces._residual import AbstractResidual, BlockResidual, Residual, TargetRow
from .._pieces._sampling import AbstractSampler, Argmax, InverseCDF, sample_residual
from .._pieces._stopping_rows import stopping_row_summary


def draw_token(
    residual: AbstractResidual,
    sampler: AbstractSampler,
    num_accepted: Int[Array, " batch"],
    draft_tokens: Int[Array, "batch draft"],
    draft_probs: Float[Array, "batch draft vocab"] | None,
    target_probs: Float[Array, "batch draft+1 vocab"],
    sample_uniforms: Float[Array, " batch"],
    *,
    num_draft_tokens: Int[Array, " batch"] | None,
    check_values: bool,
) -> tuple[Int[Array, " batch"], list[Failure]]:
    """Draws the token at each row's stopping position $n$, and returns it with the
    value checks of the rows it was drawn from (none unless `check_values`).

    **The default pair runs fused.** With exactly [`speculax.Residual`][] (or
    [`speculax.BlockResidual`][], whose weights are the same with $p_n$ scaled by
    $P_n$) and [`speculax.InverseCDF`][] (final classes, so nothing else can change
    what they compute), one pass over the rows $p_n$ and $q_n$ yields the block
    sums of the weights (`stopping_row_summary`), and the sampler reads one chosen
    block of each row again (`sample_residual`): no `(batch, vocab)` weights are
    made. For deterministic drafts (`draft_probs=None`) $q_n$ is the one-hot of
    $x_n$, made in the pass, so $p_n$ is the only row read. The value checks read
    the same pass's row totals.

    **Greedy verification reads each target row once.** With exactly
    [`speculax.TargetRow`][] and [`speculax.Argmax`][] the token is the argmax of
    $p_n$, taken from the argmax of every target row: the same computation as
    [`speculax.GreedyAcceptance`][]'s, which XLA merges with it, so that no row is
    read twice and no `(batch, vocab)` copy of $p_n$ is made.

    **Any other pair runs as written:** the residual's `(batch, vocab)` weights, then
    the sampler. The value checks then take a pass of their own over the rows, and
    only when `check_values`.

    The pair shares one `axis_name`, as [`speculax.SpeculativeStep`][] checks when
    it is built; it is used here for the fused paths and the checks' summary.

    **Returns:**

    The drawn tokens, int32 `(batch,)` (`-1` where nothing can be drawn), and the
    checks of the stopping rows, in the order they are reported.
    """
    if type(residual) in (Residual, BlockResidual) and type(sampler) is InverseCDF:
        scale = None
        if type(residual) is BlockResidual:
            scale = stopping_ratio(
                num_accepted,
                draft_tokens,
                draft_probs,
                target_probs,
                axis_name=residual.axis_name,
            )
        summary = stopping_row_summary(
            num_accepted,
            draft_probs,
            target_probs,
            block_size=sampler.block_size,
            num_draft_tokens=num_draft_tokens,
            draft_tokens=draft_tokens,
            axis_name=sampler.axis_name,
            scale=scale,
        )
        failures = []
        if check_values:
            failures = [
                *stopping_row_failures(summary.row_mass),
                overflow_failure(summary.row_mass),
            ]
        return sample_residual(summary, sample_uniforms, sampler.axis_name), failures
    failures = []
    if check_values:
        # Only the summary's flags are read, whatever its block size.
        summary = stopping_row_summary(
            num_accepted,
            draft_probs if residual.reads_draft_probs else None,
            target_probs,
            block_size=BLOCK_SIZE,
            num_draft_tokens=num_draft_tokens,
            axis_name=residual.axis_name,
        )
        failures = stopping_row_failures(summary.row_mass)
    if type(residual) is TargetRow and type(sampler) is Argmax:
        return _target_argmax(num_accepted, target_probs, sampler.axis_name), failures
    weights = residual(
        num_accepted,
        draft_tokens,
        draft_probs,
        target_probs,
        num_draft_tokens=num_draft_tokens,
    )
    return sampler(weights, sample_uniforms), failures


def _target_argmax(
    num_accepted: Int[Array, " batch"],
    target_probs: Float[Array, "batch positions vocab"],
    axis_name: str | None,
) -> Int[Array, " batch"]:
    """`Argmax` of `TargetRow`'s weights: the argmax of $p_n$, or -1 where its
    largest weight is zero (below the smallest normal number counting as zero)."""
    token, largest = first_argmax_over_vocab(target_probs, axis_name)
    at_stop = num_accepted[:, None]
    token = jnp.take_along_axis(token, at_stop, axis=1)[:, 0]
    largest = jnp.take_along_axis(largest, at_stop, axis=1)[:, 0]
    return jnp.where(upcast(largest) > 0, token, -1)
