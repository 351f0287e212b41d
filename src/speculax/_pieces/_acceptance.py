import abc
from typing import TYPE_CHECKING, ClassVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._core._numerics import upcast
from .._core._vocab_axis import (
    first_argmax_over_vocab,
    ordered_row_sums,
    probs_at_tokens,
)
from ._block import block_continuation, continuation_masses, path_acceptance


# Pyright does not see `eqx.AbstractClassVar` as the `ClassVar` it is when type
# checking, and reads it as an instance attribute, which a subclass's `ClassVar` may
# not override: equinox's documented workaround (pyright issue 4965).
if TYPE_CHECKING:
    from typing import ClassVar as AbstractClassVar
else:
    from equinox import AbstractClassVar


class AbstractAcceptance(eqx.Module):
    """The acceptance test: decides at each draft position whether the test there
    passes, position $i$ reading its own uniform $u_i$ alone.

    Subclass it and implement `__call__` to write your own test; plug it into
    [`speculax.SpeculativeStep`][] with `SpeculativeStep(acceptance=...)`. Only the
    per-position verdicts are returned: turning them into the number of tokens kept
    is the job of the prefix count.

    Every test states two class variables and one field:

    - `reads_uniforms`: whether it reads `accept_uniforms`; a deterministic test
        (`False`) lets a step be called without them.
    - `reads_draft_probs`: whether it reads `draft_probs`; the step's value checks
        read only what some piece reads.
    - `axis_name`: inside `jax.shard_map`, the name of the mesh axis the vocabulary
        is split over (the last axis of the probabilities), as
        `eqx.nn.BatchNorm(axis_name=...)` names the axis it reduces over; `None`
        when the test sees whole rows. A test that cannot work on a slice of the
        vocabulary fixes it at `None` with
        `axis_name: str | None = eqx.field(default=None, static=True, init=False)`,
        which [`speculax.sharded_step`][] refuses by name on a split vocabulary.

    The concrete tests are final: to change one, wrap it in a piece of your own.
    """

    reads_uniforms: AbstractClassVar[bool]
    reads_draft_probs: AbstractClassVar[bool]
    axis_name: eqx.AbstractVar[str | None]

    @abc.abstractmethod
    def __call__(
        self,
        draft_tokens: Int[Array, "batch draft"],
        draft_probs: Float[Array, "batch draft vocab"] | None,
        target_probs: Float[Array, "batch draft+1 vocab"],
        accept_uniforms: Float[Array, "batch draft"],
        *,
        num_draft_tokens: Int[Array, " batch"] | None = None,
    ) -> Bool[Array, "batch draft"]:
        """**Arguments:**

        - `draft_tokens`: $x_i$, the draft token at each position, in `[0, vocab)`.
        - `draft_probs`: $q_i$, the distribution each draft token was sampled from;
            `None` for deterministic drafts ($q_i$ the one-hot of $x_i$).
        - `target_probs`: $p_i$, the target distribution at each position, with one
            extra position $p_G$ after the last draft token.
        - `accept_uniforms`: $u_i$, uniform noise in `[0, 1)`.
        - `num_draft_tokens`: keyword only, $g_b \\le G$, the number of draft
            positions in use in each row of a ragged batch; `None` means $G$ for
            every row. The step always passes it, and ignores the verdicts at and
            past $g_b$ whatever they are.

        **Returns:**

        A boolean array of shape `(batch, draft)`: whether each position's test passes,
        whatever the verdicts at other positions (turning them into a count is the
        job of the prefix count).
        """


@final
class RatioAcceptance(AbstractAcceptance):
    """The rejection-sampling test of speculative decoding: draft token $x_i$ passes
    when $u_i < p_i(x_i) / q_i(x_i)$.

    The comparison is evaluated as $u_i \\, q_i(x_i) < p_i(x_i)$, which is the same test
    without a division: when $q_i(x_i) = 0$ the token passes exactly when
    $p_i(x_i) > 0$, and a token the target gives probability $0$ never passes, whatever
    $u_i$. Reads $2 \\cdot \\text{batch} \\cdot \\text{draft}$ probabilities and nothing
    else.

    **Arguments:**

    - `axis_name`: keyword only, the mesh axis the vocabulary is split over, or
        `None` (the default).
    """

    reads_uniforms: ClassVar[bool] = True
    reads_draft_probs: ClassVar[bool] = True
    axis_name: str | None = eqx.field(static=True, default=None, kw_only=True)

    def __call__(
        self,
        draft_tokens: Int[Array, "batch draft"],
        draft_probs: Float[Array, "batch draft vocab"] | None,
        target_probs: Float[Array, "batch draft+1 vocab"],
        accept_uniforms: Float[Array, "batch draft"],
        *,
        num_draft_tokens: Int[Array, " batch"] | None = None,
    ) -> Bool[Array, "batch draft"]:
        del num_draft_tokens
        draft_target, draft_draft = probs_at_tokens(
            draft_tokens, draft_probs, target_probs, axis_name=self.axis_name
        )
        return accept_uniforms * draft_draft < draft_target


@final
class GreedyAcceptance(AbstractAcceptance):
    """Greedy verification: draft token $x_i$ passes when it is the target's most
    likely token at its position, $x_i = \\arg\\max_v p_i(v)$, ties going to the
    smallest token id. Deterministic: the draft probabilities and the uniforms are not
    read.

    Pair it with [`speculax.TargetRow`][] and [`speculax.Argmax`][], so that the
    correction or bonus token is $\\arg\\max_v p_n(v)$; [`speculax.greedy_step`][]
    builds that step.

    **Arguments:**

    - `axis_name`: keyword only, the mesh axis the vocabulary is split over, or
        `None` (the default).
    """

    reads_uniforms: ClassVar[bool] = False
    reads_draft_probs: ClassVar[bool] = False
    axis_name: str | None = eqx.field(static=True, default=None, kw_only=True)

    def __call__(
        self,
        draft_tokens: Int[Array, "batch draft"],
        draft_probs: Float[Array, "batch draft vocab"] | None,
        target_probs: Float[Array, "batch draft+1 vocab"],
        accept_uniforms: Float[Array, "batch draft"],
        *,
        num_draft_tokens: Int[Array, " batch"] | None = None,
    ) -> Bool[Array, "batch draft"]:
        del num_draft_tokens
        num_draft = draft_tokens.shape[1]
        # The argmax of every row, p_G's included, then the first G: a slice of the
        # input read by two reductions would be copied whole by XLA CPU.
        token, _ = first_argmax_over_vocab(target_probs, self.axis_name)
        return token[:, :num_draft] == draft_tokens


@final
class TypicalAcceptance(AbstractAcceptance):
    """Typical acceptance (Medusa, Cai et al. 2024): draft token $x_i$ passes when
    $p_i(x_i) > \\min(\\epsilon, \\alpha \\exp(-H(p_i)))$, with $H$ the entropy of
    the target distribution at that position.

    !!! warning

        **Not lossless, by design**: it accepts plausible tokens that exact rejection
        sampling would reject, trading fidelity to the target distribution for longer
        accepted runs. [`speculax.testing.lossless_error`][] reports it so.

    Deterministic: the uniforms and the draft probabilities are not read.

    **Arguments:**

    - `epsilon`: the hard threshold $\\epsilon$ (Medusa's `posterior_threshold`),
        in `(0, 1]`. Default 0.09.
    - `alpha`: the entropy-scaled threshold $\\alpha$ (Medusa's `posterior_alpha`),
        non-negative. Default 0.3.
    - `axis_name`: keyword only, the mesh axis the vocabulary is split over, or
        `None` (the default).

    The entropy is summed in a fixed order (blocks of 256 tokens, then the blocks),
    so that a row's verdicts are the same alone, in any batch and on any split of
    the vocabulary into whole blocks.
    """

    reads_uniforms: ClassVar[bool] = False
    reads_draft_probs: ClassVar[bool] = False
    epsilon: float = eqx.field(static=True, default=0.09)
    alpha: float = eqx.field(static=True, default=0.3)
    axis_name: str | None = eqx.field(static=True, default=None, kw_only=True)

    def __check_init__(self):
        if not 0 < self.epsilon <= 1:
            raise ValueError(f"epsilon must lie in (0, 1]; got {self.epsilon}")
        if self.alpha < 0:
            raise ValueError(f"alpha must be non-negative; got {self.alpha}")

    def __call__(
        self,
        draft_tokens: Int[Array, "batch draft"],
        draft_probs: Float[Array, "batch draft vocab"] | None,
        target_probs: Float[Array, "batch draft+1 vocab"],
        accept_uniforms: Float[Array, "batch draft"],
        *,
        num_draft_tokens: Int[Array, " batch"] | None = None,
    ) -> Bool[Array, "batch draft"]:
        del num_draft_tokens
        num_draft = draft_tokens.shape[1]
        target = upcast(target_probs[:, :num_draft])
        entropy = ordered_row_sums(jax.scipy.special.entr(target), self.axis_name)
        threshold = jnp.minimum(self.epsilon, self.alpha * jnp.exp(-entropy))
        at_draft, _ = probs_at_tokens(
            draft_tokens, None, target_probs, axis_name=self.axis_name
        )
        return at_draft > threshold


@final
class BlockAcceptance(AbstractAcceptance):
    """The test of block verification (Sun et al., 2025), which judges the drafts as
    a block: with the ratios $P_i$ of [`speculax.BlockResidual`][] ($P_0 = 1$,
    $P_{i+1} = \\min(1, P_i \\, p_i(x_i) / q_i(x_i))$), position $i$ passes when
    $u_i < h_{i+1}$, where

    $$h_k = \\frac{r_k}{r_k + (1 - P_k)}, \\qquad
    r_k = \\sum_v \\max(P_k \\, p_k(v) - q_k(v), 0)$$

    for $k < G$ ($h_k = 1$ when the denominator is 0), and $h_G = P_G$; in a ragged
    batch $G$ is the row's own $g_b$. A pass at position $i$ keeps the first $i + 1$
    drafts whatever happened before it: pair it with [`speculax.LastPassCount`][],
    not the first-failure count, and with [`speculax.BlockResidual`][];
    [`speculax.block_step`][] builds that step. Indices here count draft positions
    from 0; see `docs/keeping_more.md` for the paper's, which count from 1.

    Reads every row of $p_1, \\dots, p_{G-1}$ and $q_1, \\dots, q_{G-1}$ for the
    masses $r_k$, summed in a fixed order, so that a row's verdicts are the same
    alone and in any batch. For deterministic drafts ($q_k$ the one-hot of $x_k$)
    only the target rows are read.

    **Arguments:**

    - `axis_name`: keyword only, the mesh axis the vocabulary is split over, or
        `None` (the default).
    """

    reads_uniforms: ClassVar[bool] = True
    reads_draft_probs: ClassVar[bool] = True
    axis_name: str | None = eqx.field(static=True, default=None, kw_only=True)

    def __call__(
        self,
        draft_tokens: Int[Array, "batch draft"],
        draft_probs: Float[Array, "batch draft vocab"] | None,
        target_probs: Float[Array, "batch draft+1 vocab"],
        accept_uniforms: Float[Array, "batch draft"],
        *,
        num_draft_tokens: Int[Array, " batch"] | None = None,
    ) -> Bool[Array, "batch draft"]:
        batch, num_draft = draft_tokens.shape
        ratios = path_acceptance(
            draft_tokens, draft_probs, target_probs, axis_name=self.axis_name
        )
        mass = continuation_masses(
            ratios,
            draft_tokens,
            draft_probs,
            target_probs,
            axis_name=self.axis_name,
        )
        continuing = block_continuation(mass, ratios[:, 1:num_draft])
        # The last test of a row, at g_b - 1, keeps the whole block or nothing: no
        # later position can pass after it, so its threshold is P_g itself.
        position = jnp.arange(num_draft)[None, :]
        last = num_draft if num_draft_tokens is None else num_draft_tokens
        is_last = position + 1 == jnp.reshape(last, (-1, 1))
        continuing = jnp.concatenate(
            [continuing, jnp.ones((batch, min(num_draft, 1)), continuing.dtype)], axis=1
        )
        threshold = jnp.where(is_last, ratios[:, 1:], continuing)
        return accept_uniforms < threshold
