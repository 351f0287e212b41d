"""Child tests: whether a child of the current node passes, in
[`speculax.TreeStep`][]'s walk. See `docs/trees.md`."""

import abc
from typing import TYPE_CHECKING, ClassVar, final

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float


# Pyright does not see `eqx.AbstractClassVar` as the `ClassVar` it is when type
# checking, and reads it as an instance attribute, which a subclass's `ClassVar` may
# not override: equinox's documented workaround (pyright issue 4965).
if TYPE_CHECKING:
    from typing import ClassVar as AbstractClassVar
else:
    from equinox import AbstractClassVar


class AbstractChildTest(eqx.Module):
    """The test of a child $c$ of the current node $u$ in [`speculax.TreeStep`][]'s
    walk: whether it passes, from the node's current distributions $(p, q)$ at $c$
    and the child's coin.

    Every test states three class variables:

    - `reads_uniforms`: whether it reads the coin; a test that does not (`False`)
        lets the step be called without `accept_uniforms`.
    - `reads_draft_probs`: whether it reads $q$; where it does not (`False`), the
        step treats the drafts as deterministic ($q$ the one-hot of each child) and
        reads no `draft_probs`.
    - `reads_most_likely`: whether it reads whether $c$ is $u$'s most likely target
        token; the step finds every row's most likely token once, before the walk,
        only for a test that does.

    The concrete tests are final: to change one, wrap it in a piece of your own.
    """

    reads_uniforms: AbstractClassVar[bool]
    reads_draft_probs: AbstractClassVar[bool]
    reads_most_likely: AbstractClassVar[bool]

    @abc.abstractmethod
    def __call__(
        self,
        target_at: Float[Array, ""],
        draft_at: Float[Array, ""],
        uniform: Float[Array, ""],
        most_likely: Bool[Array, ""],
    ) -> Bool[Array, ""]:
        """**Arguments:**

        - `target_at`: $p(c)$, the node's current target distribution at the
            child's token, normalised.
        - `draft_at`: $q(c)$, the current draft distribution there; 1 for
            deterministic drafts.
        - `uniform`: $u_c$, the child's coin in `[0, 1)`; 0 where the test reads no
            uniform.
        - `most_likely`: whether $c = \\arg\\max_v p_u(v)$ over the node's target row
            as given, ties going to the smallest token id; `False` where the test
            does not read it.

        **Returns:**

        Whether the child passes, a boolean scalar.
        """


@final
class RatioChildTest(AbstractChildTest):
    """The test of recursive rejection sampling: $c$ passes when
    $u_c \\, q(c) < p(c)$, with the chain step's conventions for $q(c) = 0$ (see
    [`speculax.RatioAcceptance`][]). The default of [`speculax.TreeStep`][]."""

    reads_uniforms: ClassVar[bool] = True
    reads_draft_probs: ClassVar[bool] = True
    reads_most_likely: ClassVar[bool] = False

    def __call__(
        self,
        target_at: Float[Array, ""],
        draft_at: Float[Array, ""],
        uniform: Float[Array, ""],
        most_likely: Bool[Array, ""],
    ) -> Bool[Array, ""]:
        del most_likely
        return uniform * draft_at < target_at


@final
class GreedyChildTest(AbstractChildTest):
    """Greedy verification: $c$ passes when it is $u$'s most likely target token,
    $c = \\arg\\max_v p_u(v)$, ties going to the smallest token id. Reads neither the
    coin nor $q$: the drafts are treated as deterministic.

    A failed child is never the most likely token, so what it leaves (its token
    taken out) has the same most likely token, and [`speculax.Argmax`][] draws it.
    [`speculax.greedy_tree_step`][] builds that step: [`speculax.TreeStep`][] with
    `draft_probs=None` on the one-hot rows of the most likely tokens, without
    making them.
    """

    reads_uniforms: ClassVar[bool] = False
    reads_draft_probs: ClassVar[bool] = False
    reads_most_likely: ClassVar[bool] = True

    def __call__(
        self,
        target_at: Float[Array, ""],
        draft_at: Float[Array, ""],
        uniform: Float[Array, ""],
        most_likely: Bool[Array, ""],
    ) -> Bool[Array, ""]:
        del target_at, draft_at, uniform
        return jnp.asarray(most_likely)
