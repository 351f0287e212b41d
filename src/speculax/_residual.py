import abc
from typing import ClassVar, final

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ._numerics import flush_subnormal, upcast
from ._stopping_rows import stopping_rows
from ._vocab_axis import any_over_vocab, vocab_offset


class AbstractResidual(eqx.Module):
    """Builds the unnormalised weights that the correction (or bonus) token is drawn
    from, for the one position $n$ of each batch element where drafting stopped.

    Subclass it and implement `__call__` to write your own; plug it into
    [`speculax.SpeculativeStep`][] with `SpeculativeStep(residual=...)`. An
    implementation should read only row $n$ of each batch element: the other
    $G$ positions are never needed.

    The step always passes the keyword `num_draft_tokens`, `None` for a full batch:
    in a ragged batch drafting stopped at $n$ with a draft to correct when $n < g_b$,
    and a bonus token is due when $n = g_b$.

    Every residual states the class variable `reads_draft_probs`, whether it reads
    `draft_probs` (the step's value checks read only what some piece reads), and the
    field `axis_name`: inside `jax.shard_map`, the mesh axis the vocabulary is split
    over, `None` for whole rows (see [`speculax.AbstractAcceptance`][]).

    The concrete residuals are final: to change one, wrap it in a piece of your own.
    """

    reads_draft_probs: eqx.AbstractClassVar[bool]
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


@final
class Residual(AbstractResidual):
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
        target_row, draft_row = stopping_rows(num_accepted, draft_probs, target_probs)
        target_row = upcast(target_row)
        num_draft = draft_tokens.shape[1]
        if num_draft == 0:
            return target_row
        limit = num_draft if num_draft_tokens is None else num_draft_tokens
        drafting = (num_accepted < limit)[:, None]
        if draft_row is None:
            # Deterministic drafts: q_n is the one-hot of x_n, so max(p_n - q_n, 0)
            # is p_n with the rejected draft token taken out.
            rejected = jnp.take_along_axis(
                draft_tokens, jnp.minimum(num_accepted, num_draft - 1)[:, None], axis=1
            )
            vocab = target_row.shape[-1]
            token = jnp.arange(vocab) + vocab_offset(vocab, self.axis_name)
            is_rejected = token[None, :] == rejected
            excess = jnp.where(is_rejected, jnp.maximum(target_row - 1, 0), target_row)
        else:
            # A difference of two normal numbers can be subnormal: it counts as zero.
            excess = flush_subnormal(jnp.maximum(target_row - upcast(draft_row), 0))
        weights = jnp.where(drafting, excess, target_row)
        has_mass = any_over_vocab(jnp.any(weights > 0, axis=-1), self.axis_name)
        return jnp.where(has_mass[:, None], weights, target_row)


@final
class TargetRow(AbstractResidual):
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
