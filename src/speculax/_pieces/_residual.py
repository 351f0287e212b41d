import abc
from typing import TYPE_CHECKING, ClassVar, final

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._core._failures import (
    RESULTS,
    Failure,
    overflow_failure,
    stopping_row_failures,
)
from .._core._numerics import BLOCK_SIZE, upcast
from .._core._vocab_axis import (
    any_over_vocab,
    first_argmax_over_vocab,
    one_hot_over_vocab,
)
from ._block import scaled_excess, stopping_ratio
from ._sampling import AbstractBlockSumSampler, AbstractSampler, Argmax, sample_residual
from ._stopping_rows import stopping_row_summary, stopping_rows


# Pyright does not see `eqx.AbstractClassVar` as the `ClassVar` it is when type
# checking, and reads it as an instance attribute, which a subclass's `ClassVar` may
# not override: equinox's documented workaround (pyright issue 4965).
if TYPE_CHECKING:
    from typing import ClassVar as AbstractClassVar
else:
    from equinox import AbstractClassVar


class AbstractResidual(eqx.Module):
    """Builds the unnormalised weights that the correction (or bonus) token is drawn
    from, for the one position $n$ of each batch element where drafting stopped.

    Subclass it and implement `__call__` to write your own; plug it into
    [`speculax.SpeculativeStep`][] with `SpeculativeStep(residual=...)`. An
    implementation should read only row $n$ of each batch element, and at most the
    probabilities of the draft tokens elsewhere.

    The step always passes the keyword `num_draft_tokens`, `None` for a full batch:
    in a ragged batch drafting stopped at $n$ with a draft to correct when $n < g_b$,
    and a bonus token is due when $n = g_b$.

    Every residual states the class variable `reads_draft_probs`, whether it reads
    `draft_probs` (the step's value checks read only what some piece reads), and the
    field `axis_name`: inside `jax.shard_map`, the mesh axis the vocabulary is split
    over, `None` for whole rows (see [`speculax.AbstractAcceptance`][]).

    The step draws the token by calling the residual and then the sampler on its
    `(batch, vocab)` weights, unless the residual is an `AbstractFusedResidual`
    with a fused path for that sampler (see there): a piece of your own is drawn
    this way, exactly as written.

    The concrete residuals are final: to change one, wrap it in a piece of your own.
    """

    reads_draft_probs: AbstractClassVar[bool]
    axis_name: eqx.AbstractVar[str | None]

    @abc.abstractmethod
    def __call__(
        self,
        num_accepted: Int[Array, " batch"],
        draft_tokens: Int[Array, "batch draft"],
        draft_probs: Float[Array, "batch draft vocab"] | None,
        target_probs: Float[Array, "batch draft+1 vocab"],
        *,
        num_draft_tokens: Int[Array, " batch"] | None = None,
    ) -> Float[Array, "batch vocab"]:
        """**Arguments:**

        - `num_accepted`: $n$, the number of accepted draft tokens, in `[0, draft]`.
        - `draft_tokens`: $x_i$, the draft tokens.
        - `draft_probs`: $q_i$, the draft distributions; `None` for deterministic
            drafts ($q_i$ the one-hot of $x_i$).
        - `target_probs`: $p_i$, the target distributions, one more position than the
            drafts.
        - `num_draft_tokens`: keyword only, $g_b \\le G$, the number of draft positions
            in use in each row of a ragged batch; `None` means $G$ for every row.

        **Returns:**

        Non-negative weights of shape `(batch, vocab)`, in the arithmetic dtype (float32
        for half and single inputs, float64 for float64 inputs), not necessarily
        normalised.
        """


class AbstractFusedResidual(AbstractResidual):
    """A residual that says how it is drawn together with a sampler, in one pass
    over the rows and without its `(batch, vocab)` weights.

    The step's draw (`draw_token`) asks the residual, through `fused_draw`, before
    it falls back to calling the residual and then the sampler: the residual names
    the samplers it fuses with, and a sampler states what it can draw from (the
    block sums of [`speculax.AbstractBlockSumSampler`][]). [`speculax.Residual`][] and
    [`speculax.BlockResidual`][] fuse with any block-sum sampler, such as
    [`speculax.InverseCDF`][]; [`speculax.TargetRow`][] with
    [`speculax.Argmax`][]. A new residual joins by subclassing this class and
    implementing `fused_draw`; a residual that only subclasses
    [`speculax.AbstractResidual`][] is always drawn as written.
    """

    @abc.abstractmethod
    def fused_draw(
        self,
        sampler: AbstractSampler,
        num_accepted: Int[Array, " batch"],
        draft_tokens: Int[Array, "batch draft"],
        draft_probs: Float[Array, "batch draft vocab"] | None,
        target_probs: Float[Array, "batch draft+1 vocab"],
        sample_uniforms: Float[Array, " batch"],
        *,
        num_draft_tokens: Int[Array, " batch"] | None,
        check_values: bool,
    ) -> (
        tuple[Int[Array, " batch"], list[tuple[Bool[Array, " batch"], RESULTS]]] | None
    ):
        """Draws the token at each row's stopping position $n$ with `sampler`, in
        one pass with the residual, or returns `None` where this residual has no
        fused path with this sampler (before computing anything): the step then
        calls the residual and the sampler in turn, and checks the rows
        separately.

        A fused path must compute what `sampler(self(...), sample_uniforms)` does,
        up to the order of additions: decide by what the sampler is (a final class,
        or an interface such as `AbstractBlockSumSampler` whose contract fixes the
        computation), never by what it merely resembles.

        **Arguments:**

        - `sampler`: the step's sampler; it shares this residual's `axis_name`.
        - `num_accepted`, `draft_tokens`, `draft_probs`, `target_probs`,
            `num_draft_tokens`: as for `__call__`.
        - `sample_uniforms`: $s$, as for the sampler.
        - `check_values`: keyword only, whether to return the value checks of the
            rows drawn from.

        **Returns:**

        `None`, or a tuple: the drawn tokens, int32 `(batch,)` (`-1` where nothing
        can be drawn), and, when `check_values`, the checks of the stopping rows in
        the order they are reported (those of `stopping_row_checks`, and for a
        sampler that normalises the weights the overflow of their total); an empty
        list otherwise.
        """


@final
class Residual(AbstractFusedResidual):
    """The residual distribution of speculative decoding.

    For $n < G$ the weights are $w(v) = \\max(p_n(v) - q_n(v), 0)$: the target mass the
    draft under-proposed, which is what makes the step lossless. For $n = G$ (every
    draft accepted) they are the bonus distribution $w(v) = p_G(v)$; in a ragged
    batch, $G$ is the row's own draft length $g_b$. With deterministic drafts ($q_n$
    the one-hot of $x_n$) the weights are $p_n$ with $x_n$ taken out. If the weights
    have no positive entry, which only rounding or unnormalised inputs can cause, they
    fall back to $w = p_n$.

    Reads the two rows $p_n$ and $q_n$ of each batch element and nothing else.

    Paired with the default [`speculax.InverseCDF`][] sampler in a
    [`speculax.SpeculativeStep`][], the pair runs as one: the step draws from block
    sums of the two rows without materialising the weights (see `docs/performance.md`).
    Called on its own, or beside any other sampler, it returns the weights as an
    ordinary `(batch, vocab)` array.

    **Arguments:**

    - `axis_name`: keyword only, the mesh axis the vocabulary is split over, or
        `None` (the default).
    """

    reads_draft_probs: ClassVar[bool] = True
    axis_name: str | None = eqx.field(static=True, default=None, kw_only=True)

    def __call__(
        self,
        num_accepted: Int[Array, " batch"],
        draft_tokens: Int[Array, "batch draft"],
        draft_probs: Float[Array, "batch draft vocab"] | None,
        target_probs: Float[Array, "batch draft+1 vocab"],
        *,
        num_draft_tokens: Int[Array, " batch"] | None = None,
    ) -> Float[Array, "batch vocab"]:
        return residual_weights(
            None,
            num_accepted,
            draft_tokens,
            draft_probs,
            target_probs,
            num_draft_tokens=num_draft_tokens,
            axis_name=self.axis_name,
        )

    def fused_draw(
        self,
        sampler: AbstractSampler,
        num_accepted: Int[Array, " batch"],
        draft_tokens: Int[Array, "batch draft"],
        draft_probs: Float[Array, "batch draft vocab"] | None,
        target_probs: Float[Array, "batch draft+1 vocab"],
        sample_uniforms: Float[Array, " batch"],
        *,
        num_draft_tokens: Int[Array, " batch"] | None,
        check_values: bool,
    ) -> (
        tuple[Int[Array, " batch"], list[tuple[Bool[Array, " batch"], RESULTS]]] | None
    ):
        if not isinstance(sampler, AbstractBlockSumSampler):
            return None
        return _draw_from_summary(
            None,
            sampler,
            num_accepted,
            draft_tokens,
            draft_probs,
            target_probs,
            sample_uniforms,
            num_draft_tokens=num_draft_tokens,
            check_values=check_values,
        )


@final
class BlockResidual(AbstractFusedResidual):
    """The residual of block verification (Sun et al., 2025; see
    [`speculax.block_step`][]): for $n < G$ the weights are
    $w(v) = \\max(P_n \\, p_n(v) - q_n(v), 0)$, where $P_n$ is the probability
    left for the accepted path (`docs/keeping_more.md`); for $n = G$ the bonus
    distribution $p_G$. With $P_n = 1$, which $n = 0$ always has, these are the
    weights of [`speculax.Residual`][], to the last bit; the rules for deterministic
    drafts, ragged batches and weights without mass are the same too.

    Reads the rows $p_n$ and $q_n$, and the $2 G$ probabilities $p_i(x_i)$ and
    $q_i(x_i)$ of the draft tokens.
    Paired with [`speculax.InverseCDF`][] in a step, it runs fused with it, as
    [`speculax.Residual`][] does.

    **Arguments:**

    - `axis_name`: keyword only, the mesh axis the vocabulary is split over, or
        `None` (the default).
    """

    reads_draft_probs: ClassVar[bool] = True
    axis_name: str | None = eqx.field(static=True, default=None, kw_only=True)

    def __call__(
        self,
        num_accepted: Int[Array, " batch"],
        draft_tokens: Int[Array, "batch draft"],
        draft_probs: Float[Array, "batch draft vocab"] | None,
        target_probs: Float[Array, "batch draft+1 vocab"],
        *,
        num_draft_tokens: Int[Array, " batch"] | None = None,
    ) -> Float[Array, "batch vocab"]:
        scale = stopping_ratio(
            num_accepted,
            draft_tokens,
            draft_probs,
            target_probs,
            axis_name=self.axis_name,
        )
        return residual_weights(
            scale,
            num_accepted,
            draft_tokens,
            draft_probs,
            target_probs,
            num_draft_tokens=num_draft_tokens,
            axis_name=self.axis_name,
        )

    def fused_draw(
        self,
        sampler: AbstractSampler,
        num_accepted: Int[Array, " batch"],
        draft_tokens: Int[Array, "batch draft"],
        draft_probs: Float[Array, "batch draft vocab"] | None,
        target_probs: Float[Array, "batch draft+1 vocab"],
        sample_uniforms: Float[Array, " batch"],
        *,
        num_draft_tokens: Int[Array, " batch"] | None,
        check_values: bool,
    ) -> (
        tuple[Int[Array, " batch"], list[tuple[Bool[Array, " batch"], RESULTS]]] | None
    ):
        if not isinstance(sampler, AbstractBlockSumSampler):
            return None
        # The weights are Residual's with p_n scaled by P_n: the same summary.
        scale = stopping_ratio(
            num_accepted,
            draft_tokens,
            draft_probs,
            target_probs,
            axis_name=self.axis_name,
        )
        return _draw_from_summary(
            scale,
            sampler,
            num_accepted,
            draft_tokens,
            draft_probs,
            target_probs,
            sample_uniforms,
            num_draft_tokens=num_draft_tokens,
            check_values=check_values,
        )


def residual_weights(
    scale: Float[Array, " batch"] | None,
    num_accepted: Int[Array, " batch"],
    draft_tokens: Int[Array, "batch draft"],
    draft_probs: Float[Array, "batch draft vocab"] | None,
    target_probs: Float[Array, "batch draft+1 vocab"],
    *,
    num_draft_tokens: Int[Array, " batch"] | None,
    axis_name: str | None,
) -> Float[Array, "batch vocab"]:
    """$\\max(P_n \\, p_n - q_n, 0)$ where drafting stopped at a draft, $p_n$
    where a bonus token is due or the weights have no mass; `scale` is $P_n$, or
    `None` for 1."""
    target_row, draft_row = stopping_rows(num_accepted, draft_probs, target_probs)
    target_row = upcast(target_row)
    num_draft = draft_tokens.shape[1]
    if num_draft == 0:
        return target_row
    limit = num_draft if num_draft_tokens is None else num_draft_tokens
    drafting = (num_accepted < limit)[:, None]
    if scale is None:
        scale = jnp.ones(num_accepted.shape, target_row.dtype)
    if draft_row is None:
        # Deterministic drafts: q_n is the one-hot of x_n, so max(P_n p_n - q_n, 0)
        # is P_n p_n with the rejected draft token taken out.
        rejected = jnp.take_along_axis(
            draft_tokens, jnp.minimum(num_accepted, num_draft - 1)[:, None], axis=1
        )
        draft_row = one_hot_over_vocab(
            rejected[:, 0], target_row.shape[-1], target_row.dtype, axis_name
        )
    excess = scaled_excess(scale, target_row, upcast(draft_row))
    weights = jnp.where(drafting, excess, target_row)
    has_mass = any_over_vocab(jnp.any(weights > 0, axis=-1), axis_name)
    return jnp.where(has_mass[:, None], weights, target_row)


@final
class TargetRow(AbstractFusedResidual):
    """The target distribution itself, $w = p_n$, whatever the drafts.

    For greedy verification (see [`speculax.GreedyAcceptance`][]), where the
    correction token is the target's most likely token at the stopping position.
    Beside the ratio test it is **not lossless**: the residual must remove what the
    draft already proposed.

    **Arguments:**

    - `axis_name`: keyword only, the mesh axis the vocabulary is split over, or
        `None` (the default); the rows are read as they are either way.
    """

    reads_draft_probs: ClassVar[bool] = False
    axis_name: str | None = eqx.field(static=True, default=None, kw_only=True)

    def __call__(
        self,
        num_accepted: Int[Array, " batch"],
        draft_tokens: Int[Array, "batch draft"],
        draft_probs: Float[Array, "batch draft vocab"] | None,
        target_probs: Float[Array, "batch draft+1 vocab"],
        *,
        num_draft_tokens: Int[Array, " batch"] | None = None,
    ) -> Float[Array, "batch vocab"]:
        del draft_tokens, draft_probs, num_draft_tokens
        return upcast(target_probs[jnp.arange(num_accepted.shape[0]), num_accepted])

    def fused_draw(
        self,
        sampler: AbstractSampler,
        num_accepted: Int[Array, " batch"],
        draft_tokens: Int[Array, "batch draft"],
        draft_probs: Float[Array, "batch draft vocab"] | None,
        target_probs: Float[Array, "batch draft+1 vocab"],
        sample_uniforms: Float[Array, " batch"],
        *,
        num_draft_tokens: Int[Array, " batch"] | None,
        check_values: bool,
    ) -> (
        tuple[Int[Array, " batch"], list[tuple[Bool[Array, " batch"], RESULTS]]] | None
    ):
        # Argmax is final, so its draw from p_n is the argmax of p_n.
        if not isinstance(sampler, Argmax):
            return None
        del draft_tokens, sample_uniforms
        failures = []
        if check_values:
            failures = stopping_row_checks(
                self,
                num_accepted,
                draft_probs,
                target_probs,
                num_draft_tokens=num_draft_tokens,
            )
        return _target_argmax(num_accepted, target_probs, sampler.axis_name), failures


def stopping_row_checks(
    residual: AbstractResidual,
    num_accepted: Int[Array, " batch"],
    draft_probs: Float[Array, "batch draft vocab"] | None,
    target_probs: Float[Array, "batch positions vocab"],
    *,
    num_draft_tokens: Int[Array, " batch"] | None,
) -> list[Failure]:
    """The checks of the stopping rows $p_n$ (and $q_n$ where `residual` reads the
    draft probabilities), by a pass of their own: for a draw that has no row summary
    to read them from."""
    # Only the summary's flags are read, whatever its block size.
    summary = stopping_row_summary(
        num_accepted,
        draft_probs if residual.reads_draft_probs else None,
        target_probs,
        block_size=BLOCK_SIZE,
        num_draft_tokens=num_draft_tokens,
        axis_name=residual.axis_name,
    )
    return stopping_row_failures(summary.row_mass)


def _draw_from_summary(
    scale: Float[Array, " batch"] | None,
    sampler: AbstractBlockSumSampler,
    num_accepted: Int[Array, " batch"],
    draft_tokens: Int[Array, "batch draft"],
    draft_probs: Float[Array, "batch draft vocab"] | None,
    target_probs: Float[Array, "batch draft+1 vocab"],
    sample_uniforms: Float[Array, " batch"],
    *,
    num_draft_tokens: Int[Array, " batch"] | None,
    check_values: bool,
) -> tuple[Int[Array, " batch"], list[Failure]]:
    """The fused draw of $\\max(P_n \\, p_n - q_n, 0)$ (`scale` is $P_n$, `None` for
    1): one pass over $p_n$ and $q_n$ yields the block sums the sampler draws from
    and the row totals the value checks read; no `(batch, vocab)` weights are made.
    For deterministic drafts $q_n$ is the one-hot of $x_n$, made in the pass."""
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
    return sample_residual(summary, sampler, sample_uniforms), failures


def _target_argmax(
    num_accepted: Int[Array, " batch"],
    target_probs: Float[Array, "batch positions vocab"],
    axis_name: str | None,
) -> Int[Array, " batch"]:
    """`Argmax` of `TargetRow`'s weights: the first argmax of $p_n$, taken from the
    argmax of every target row, the computation of [`speculax.GreedyAcceptance`][],
    which XLA merges with it, so that no row is read twice and no `(batch, vocab)`
    copy of $p_n$ is made. Greedy verification reads only which token is most
    likely: unlike `Argmax` on a row without mass, a row whose largest value is not
    positive (logits, with `check_values=False`) still gives its most likely
    token, not -1."""
    token, _ = first_argmax_over_vocab(target_probs, axis_name)
    return jnp.take_along_axis(token, num_accepted[:, None], axis=1)[:, 0]
