import abc
from typing import ClassVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._numerics import first_argmax, upcast


class AbstractAcceptance(eqx.Module):
    """The acceptance test: decides, independently at each draft position, whether
    the draft token passes.

    Subclass it and implement `__call__` to write your own test; plug it into
    [`speculax.SpeculativeStep`][] with `SpeculativeStep(acceptance=...)`. Only the
    per-position verdicts are returned: the first failure ending the step is the job of
    the prefix count.

    Every test states two class variables:

    - `reads_uniforms`: whether it reads `accept_uniforms`; a deterministic test
        (`False`) lets a step be called without them.
    - `reads_draft_probs`: whether it reads `draft_probs`; the step's value checks
        read only what some piece reads.

    The concrete tests are final: to change one, wrap it in a piece of your own.
    """

    reads_uniforms: eqx.AbstractClassVar[bool]
    reads_draft_probs: eqx.AbstractClassVar[bool]

    @abc.abstractmethod
    def __call__(
        self,
        draft_tokens: Int[Array, "batch draft"],
        draft_probs: Float[Array, "batch draft vocab"] | None,
        target_probs: Float[Array, "batch draft+1 vocab"],
        accept_uniforms: Float[Array, "batch draft"],
    ) -> Bool[Array, "batch draft"]:
        """**Arguments:**

        - `draft_tokens`: $x_i$, the draft token at each position, in `[0, vocab)`.
        - `draft_probs`: $q_i$, the distribution each draft token was sampled from;
            `None` for deterministic drafts ($q_i$ the one-hot of $x_i$).
        - `target_probs`: $p_i$, the target distribution at each position, with one
            extra position $p_G$ after the last draft token.
        - `accept_uniforms`: $u_i$, uniform noise in `[0, 1)`.

        **Returns:**

        A boolean array of shape `(batch, draft)`: whether each position's test passes,
        regardless of the positions before it.
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
    """

    reads_uniforms: ClassVar[bool] = True
    reads_draft_probs: ClassVar[bool] = True

    def __call__(
        self,
        draft_tokens: Int[Array, "batch draft"],
        draft_probs: Float[Array, "batch draft vocab"] | None,
        target_probs: Float[Array, "batch draft+1 vocab"],
        accept_uniforms: Float[Array, "batch draft"],
    ) -> Bool[Array, "batch draft"]:
        draft_target, draft_draft = draft_token_probs(
            draft_tokens, draft_probs, target_probs
        )
        return accept_uniforms * draft_draft < draft_target


def draft_token_probs(
    draft_tokens: Int[Array, "batch draft"],
    draft_probs: Float[Array, "batch draft vocab"] | None,
    target_probs: Float[Array, "batch draft+1 vocab"],
) -> tuple[Float[Array, "batch draft"], Float[Array, "batch draft"]]:
    """Gathers $p_i(x_i)$ and $q_i(x_i)$, upcast to the arithmetic dtype; $q_i(x_i) = 1$
    for deterministic drafts (`draft_probs=None`).

    Point gathers straight from the inputs, not from `target_probs[:, :G]`: a slice
    with two users (the acceptance piece and the value checks) is materialised by XLA
    CPU for half-precision inputs, a copy of nearly the whole array. Identical gathers
    in the two users are merged by XLA.
    """
    batch, num_draft = draft_tokens.shape
    rows = jnp.arange(batch)[:, None]
    positions = jnp.arange(num_draft)[None, :]
    target = upcast(target_probs[rows, positions, draft_tokens])
    if draft_probs is None:
        return target, jnp.ones_like(target)
    return target, upcast(draft_probs[rows, positions, draft_tokens])


@final
class GreedyAcceptance(AbstractAcceptance):
    """Greedy verification: draft token $x_i$ passes when it is the target's most
    likely token at its position, $x_i = \\arg\\max_v p_i(v)$, ties going to the
    smallest token id. Deterministic: the draft probabilities and the uniforms are not
    read.

    Pair it with [`speculax.TargetRow`][] and [`speculax.Argmax`][], so that the
    correction or bonus token is $\\arg\\max_v p_n(v)$; [`speculax.greedy_step`][]
    builds that step.
    """

    reads_uniforms: ClassVar[bool] = False
    reads_draft_probs: ClassVar[bool] = False

    def __call__(
        self,
        draft_tokens: Int[Array, "batch draft"],
        draft_probs: Float[Array, "batch draft vocab"] | None,
        target_probs: Float[Array, "batch draft+1 vocab"],
        accept_uniforms: Float[Array, "batch draft"],
    ) -> Bool[Array, "batch draft"]:
        num_draft = draft_tokens.shape[1]
        # The argmax of every row, p_G's included, then the first G: a slice of the
        # input read by two reductions would be copied whole by XLA CPU.
        return first_argmax(target_probs)[:, :num_draft] == draft_tokens


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
    """

    reads_uniforms: ClassVar[bool] = False
    reads_draft_probs: ClassVar[bool] = False
    epsilon: float = eqx.field(static=True, default=0.09)
    alpha: float = eqx.field(static=True, default=0.3)

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
    ) -> Bool[Array, "batch draft"]:
        num_draft = draft_tokens.shape[1]
        target = upcast(target_probs[:, :num_draft])
        entropy = jnp.sum(jax.scipy.special.entr(target), axis=-1)
        threshold = jnp.minimum(self.epsilon, self.alpha * jnp.exp(-entropy))
        at_draft = jnp.take_along_axis(target, draft_tokens[..., None], axis=-1)
        return at_draft[..., 0] > threshold
