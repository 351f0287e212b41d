"""Sibling rules: what a rejected child of a draft tree leaves for the next one.
See `docs/trees.md`."""

import abc
from typing import TYPE_CHECKING, ClassVar, final

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


# Pyright does not see `eqx.AbstractClassVar` as the `ClassVar` it is when type
# checking, and reads it as an instance attribute, which a subclass's `ClassVar` may
# not override: equinox's documented workaround (pyright issue 4965).
if TYPE_CHECKING:
    from typing import ClassVar as AbstractClassVar
else:
    from equinox import AbstractClassVar


class AbstractSiblingRule(eqx.Module):
    """What a rejected child leaves for its next sibling: the distributions that the
    next child of the same node is tested against, and, if every child fails, the one
    the token is drawn from.

    At a node with target distribution $p$ and draft distribution $q$, a child $c$
    passes when $u_c \\, q(c) < p(c)$. When it fails, the rule returns the new
    $(p', q')$, unnormalised; the step normalises them. Which rule is lossless
    depends on how the children were drawn: the rule must match the drafter.

    Every rule states three class variables:

    - `takes_out_one_hot_drafts`: whether, given as $q$ the one-hot of the rejected
        token $c$ (deterministic drafts, `draft_probs=None`), the rule leaves
        $p' = \\max(p - e_c, 0)$: $p$ with $c$ taken out. Then
        [`speculax.TreeStep`][] does not call the rule on deterministic drafts: a
        rejection costs it two numbers, the probability taken out and the mass left
        (`docs/trees.md`, "Deterministic drafts"). A rule that does anything else
        states `False`, and is called on whole rows.
    - `subtracts_a_kept_draft`: whether the rule is $p' = \\max(p - q, 0)$ with
        $q' = q$, always. Then [`speculax.TraversalStep`][] keeps no
        `(max_depth, V)` array on stochastic drafts: after $k$ rejections a node's
        target is $\\max(a_k \\, p - b_k \\, q, 0)$ of its own rows, two numbers
        per node (`docs/keeping_more.md`, "What it costs"). A rule that
        does anything else states `False`, and the traversal keeps rows for it
        (of its target and of its draft).
    - `elementwise`: whether $(p', q')$ at each token depends only on $p$ and $q$
        at that token and on whether it is the rejected one. Only such a rule can
        run on a slice of the vocabulary ([`speculax.sharded_step`][] with a
        `vocab_axis`); a rule that reads its rows whole (a sum, a maximum) states
        `False`, and a step with an `axis_name` refuses it.

    The concrete rules are final: to change one, wrap it in a piece of your own.
    """

    takes_out_one_hot_drafts: AbstractClassVar[bool]
    subtracts_a_kept_draft: AbstractClassVar[bool]
    elementwise: AbstractClassVar[bool]

    @abc.abstractmethod
    def __call__(
        self,
        target: Float[Array, " vocab"],
        draft: Float[Array, " vocab"],
        rejected: Int[Array, ""],
    ) -> tuple[Float[Array, " vocab"], Float[Array, " vocab"]]:
        """**Arguments:**

        - `target`: $p$, the node's current target distribution, normalised, in the
            arithmetic dtype; for [`speculax.TraversalStep`][] times $\\alpha$, the
            probability of keeping the path to the node, so that what it leaves has
            mass $r$.
        - `draft`: $q$, the node's current draft distribution, normalised; for
            deterministic drafts the one-hot of the rejected token.
        - `rejected`: $c$, the token of the child that failed, as an index into
            the rows given. On a split vocabulary the rows are one device's slice,
            and `rejected` is relative to its first token: outside the rows on
            the devices that do not hold it.

        **Returns:**

        The unnormalised $(p', q')$ for the next sibling, non-negative, of shape
        `(vocab,)`. A $p'$ with no mass makes the step fall back to the node's target
        row.
        """


@final
class IndependentSiblings(AbstractSiblingRule):
    """For children drawn independently from $q$ (with replacement, as SpecInfer
    does): $p' = \\max(p - q, 0)$ and $q' = q$, the multi-step speculative sampling
    of SpecInfer. Also the rule for deterministic drafts (`draft_probs=None`), where
    $q$ is the one-hot of each child in turn and $p'$ is $p$ with the child taken
    out: the target-only rule of SGLang and TensorRT-LLM.
    """

    takes_out_one_hot_drafts: ClassVar[bool] = True
    subtracts_a_kept_draft: ClassVar[bool] = True
    elementwise: ClassVar[bool] = True

    def __call__(
        self,
        target: Float[Array, " vocab"],
        draft: Float[Array, " vocab"],
        rejected: Int[Array, ""],
    ) -> tuple[Float[Array, " vocab"], Float[Array, " vocab"]]:
        del rejected
        return jnp.maximum(target - draft, 0), draft


@final
class SiblingsWithoutReplacement(AbstractSiblingRule):
    """For children drawn from $q$ without replacement (one after another, each from
    $q$ renormalised without the ones before: Gumbel-top-k, stochastic beam search):
    $p' = \\max(p - q, 0)$ and $q'$ is $q$ without the rejected token, the recursive
    rejection sampling of Jeon et al. (2024). On deterministic drafts it is
    [`speculax.IndependentSiblings`][].
    """

    takes_out_one_hot_drafts: ClassVar[bool] = True
    subtracts_a_kept_draft: ClassVar[bool] = False
    elementwise: ClassVar[bool] = True

    def __call__(
        self,
        target: Float[Array, " vocab"],
        draft: Float[Array, " vocab"],
        rejected: Int[Array, ""],
    ) -> tuple[Float[Array, " vocab"], Float[Array, " vocab"]]:
        others = jnp.arange(draft.shape[-1]) != rejected
        return jnp.maximum(target - draft, 0), jnp.where(others, draft, 0)
