"""The correction or bonus token of each row: the residual, then the sampler, run as
one pass where the residual has a fused path with the sampler."""

from jaxtyping import Array, Float, Int

from .._core._failures import Failure
from .._pieces._residual import (
    AbstractFusedResidual,
    AbstractResidual,
    stopping_row_checks,
)
from .._pieces._sampling import AbstractSampler


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

    **The pieces say when they run fused.** A residual that is an
    `AbstractFusedResidual` is asked first (`fused_draw`), and draws the token with
    this sampler in one pass where it can:

    - [`speculax.Residual`][] and [`speculax.BlockResidual`][] (whose weights are
        the same with $p_n$ scaled by $P_n$) beside a sampler that draws from block
        sums, `AbstractBlockSumSampler` such as [`speculax.InverseCDF`][]: one pass
        over the rows $p_n$ and $q_n$ yields the block sums of the weights
        (`stopping_row_summary`), and the sampler reads one chosen block of each row
        again (`sample_residual`): no `(batch, vocab)` weights are made. For
        deterministic drafts (`draft_probs=None`) $q_n$ is the one-hot of $x_n$,
        made in the pass, so $p_n$ is the only row read. The value checks read the
        same pass's row totals.
    - [`speculax.TargetRow`][] beside [`speculax.Argmax`][] (greedy verification):
        the token is the argmax of $p_n$, taken from the argmax of every target row,
        the same computation as [`speculax.GreedyAcceptance`][]'s, which XLA merges
        with it, so that no row is read twice.

    **Any other pair runs as written:** the residual's `(batch, vocab)` weights, then
    the sampler. The value checks then take a pass of their own over the rows, and
    only when `check_values`.

    The pair shares one `axis_name`, as [`speculax.SpeculativeStep`][] checks when
    it is built; it is used here for the fused paths and the checks' summary.

    **Returns:**

    The drawn tokens, int32 `(batch,)` (`-1` where nothing can be drawn), and the
    checks of the stopping rows, in the order they are reported.
    """
    if isinstance(residual, AbstractFusedResidual):
        fused = residual.fused_draw(
            sampler,
            num_accepted,
            draft_tokens,
            draft_probs,
            target_probs,
            sample_uniforms,
            num_draft_tokens=num_draft_tokens,
            check_values=check_values,
        )
        if fused is not None:
            return fused
    failures = []
    if check_values:
        failures = stopping_row_checks(
            residual,
            num_accepted,
            draft_probs,
            target_probs,
            num_draft_tokens=num_draft_tokens,
        )
    weights = residual(
        num_accepted,
        draft_tokens,
        draft_probs,
        target_probs,
        num_draft_tokens=num_draft_tokens,
    )
    return sampler(weights, sample_uniforms), failures
