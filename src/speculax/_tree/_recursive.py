"""Tree verification by recursive rejection sampling over a draft tree. See
`docs/trees.md`."""

from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._core._failures import not_a_probability
from .._core._numerics import flush_subnormal
from .._pieces._sampling import AbstractSampler, Argmax, InverseCDF
from ._abstract import AbstractTreeStep
from ._child_tests import AbstractChildTest, GreedyChildTest, RatioChildTest
from ._rows import TreeRows
from ._siblings import AbstractSiblingRule, IndependentSiblings
from ._taken_out import left_at, take_out
from ._walk import TreeWalk, start_walk


@final
class TreeStep(AbstractTreeStep):
    """One verification step over a batch of draft trees, by recursive rejection
    sampling: lossless when the sibling rule matches how the children were drawn.

    At each node, starting at the root, the children are tried in index order; a
    child $c$ passes when $u_c \\, q(c) < p(c)$ and the walk moves into it. A failed
    child leaves the distributions of the sibling rule for the next one. When every
    child of a node fails, the token is drawn from what they left; when the walk
    reaches a node without children, the bonus token is drawn from its target row.
    A residual without mass falls back to the node's target row, as in the chain
    step. Called as [`speculax.AbstractTreeStep.__call__`][].

    **Arguments:**

    - `siblings`: an [`speculax.AbstractSiblingRule`][]; default
        [`speculax.IndependentSiblings`][].
    - `sampler`: an [`speculax.AbstractSampler`][]; default
        [`speculax.InverseCDF`][].
    - `child_test`: keyword only, an [`speculax.AbstractChildTest`][]; default
        [`speculax.RatioChildTest`][], the test above.
    - `max_depth`: keyword only, the longest path kept, a static positive integer,
        or `None` (the default) for the number of draft nodes $N$. Nodes deeper are
        ignored.
    - `check_values`, `throw`: keyword only, as for [`speculax.SpeculativeStep`][].
    - `axis_name`: keyword only, inside `jax.shard_map` the mesh axis the
        vocabulary is split over, the sampler's too; or `None` (the default).
        [`speculax.sharded_step`][] sets it.
    """

    siblings: AbstractSiblingRule = IndependentSiblings()
    sampler: AbstractSampler = InverseCDF()
    child_test: AbstractChildTest = eqx.field(default=RatioChildTest(), kw_only=True)
    max_depth: int | None = eqx.field(static=True, default=None, kw_only=True)
    check_values: bool = eqx.field(static=True, default=True, kw_only=True)
    throw: bool = eqx.field(static=True, default=True, kw_only=True)
    axis_name: str | None = eqx.field(static=True, default=None, kw_only=True)

    @property
    def _coin_reader(self) -> str | None:
        return type(self).__name__ if self.child_test.reads_uniforms else None

    @property
    def _reads_most_likely(self) -> bool:
        return self.child_test.reads_most_likely

    @property
    def _reads_draft_probs(self) -> bool:
        return self.child_test.reads_draft_probs

    @property
    def _draws_most_likely(self) -> bool:
        # All three are final: what a failed greedy child leaves under the
        # independent rule holds the same most likely token, which Argmax draws.
        return (
            isinstance(self.child_test, GreedyChildTest)
            and isinstance(self.siblings, IndependentSiblings)
            and isinstance(self.sampler, Argmax)
        )

    def _walk(
        self, max_depth: int, parents: Int[Array, "batch nodes"], rows: TreeRows
    ) -> TreeWalk:
        """Every node is visited once, in index order, and tested when its parent
        is the current node (parents come first, so the children of a node all
        follow it). Only a failed test reads whole rows."""
        b, tree_tokens = rows.b, rows.tree_tokens

        def visit(j, walk: TreeWalk) -> TreeWalk:
            token = tree_tokens[b, j]
            is_child = (parents[b, j] == walk.current) & (walk.depth < max_depth)
            return jax.lax.cond(is_child, test, skip, j, token, walk)

        def skip(j, token, walk: TreeWalk) -> TreeWalk:
            del j, token
            return walk

        def test(j, token, walk: TreeWalk) -> TreeWalk:
            walk, passed, target_left = _test_child(
                self.child_test, rows, parents[b], j, token, walk
            )
            return jax.lax.cond(passed, accept, reject, j, token, target_left, walk)

        def accept(j, token, target_left, walk: TreeWalk) -> TreeWalk:
            del target_left
            return _accept(j, token, walk)

        def reject(j, token, target_left, walk: TreeWalk) -> TreeWalk:
            if walk.takes_out:
                return take_out(target_left, walk)
            return _reject(self.siblings, rows, token, walk)

        takes_out = rows.draft_probs is None and self.siblings.takes_out_one_hot_drafts
        start = start_walk(rows.shard_vocab, rows.dtype, max_depth, takes_out=takes_out)
        return jax.lax.fori_loop(0, parents.shape[1], visit, start)


def _test_child(
    child_test: AbstractChildTest,
    rows: TreeRows,
    parents: Int[Array, " nodes"],
    j: Int[Array, ""],
    token: Int[Array, ""],
    walk: TreeWalk,
) -> tuple[TreeWalk, Bool[Array, ""], Float[Array, ""]]:
    """Tests draft node `j + 1`, a child of the current node with token `token`,
    against the current distributions by `child_test`. Returns the walk with the
    checks of the values read at the token, whether the child passed, and the
    current target at the token, unnormalised."""
    at = jnp.clip(token, 0, rows.vocab - 1)
    raw_target, raw_draft = rows.given_at(j + 1)
    if walk.takes_out:
        target_left = left_at(rows, parents, j, at, raw_target, walk)
        draft_at = raw_draft
    else:
        target_left = rows.at_token(walk.target, at)
        draft_at = raw_draft
        if rows.draft_probs is not None:
            draft_at = jnp.where(walk.updated, rows.at_token(walk.draft, at), raw_draft)
    target_at = jnp.where(walk.updated, target_left / walk.target_mass, raw_target)
    walk = eqx.tree_at(
        lambda w: (w.bad_target, w.bad_draft),
        walk,
        (
            walk.bad_target | not_a_probability(raw_target),
            walk.bad_draft | not_a_probability(raw_draft),
        ),
    )
    passed = child_test(
        target_at,
        draft_at,
        rows.accept_uniforms[rows.b, j],
        rows.is_most_likely(walk.current, at),
    )
    return walk, passed, target_left


def _accept(j: Int[Array, ""], token: Int[Array, ""], walk: TreeWalk) -> TreeWalk:
    """Moves the walk into the child that passed, draft node `j + 1` of token
    `token`: it becomes the current node, with its own rows."""
    # int32 whatever the loop's index type (int64 under x64).
    node = (j + 1).astype(jnp.int32)
    return eqx.tree_at(
        lambda w: (w.current, w.depth, w.updated, w.path_tokens, w.path_nodes),
        walk,
        (
            node,
            walk.depth + 1,
            jnp.array(False),
            walk.path_tokens.at[walk.depth].set(token),
            walk.path_nodes.at[walk.depth].set(node),
        ),
    )


def _reject(
    siblings: AbstractSiblingRule, rows: TreeRows, token: Int[Array, ""], walk: TreeWalk
) -> TreeWalk:
    """Applies the sibling rule for the child of token `token` that failed: the
    current node's distributions become what it leaves, the target unnormalised
    with its mass (the node's own target row where it leaves no mass), the draft
    normalised; the node's rows are read whole, and checked at its first failure."""
    own_target, own_draft = rows.own_rows(walk.current, token)
    # Both rows here are normalised: the node's own rows as given, or what the
    # children before left, divided by its mass.
    target = jnp.where(walk.updated, walk.target / walk.target_mass, own_target)
    if rows.draft_probs is None:
        draft = own_draft
    else:
        draft = jnp.where(walk.updated, walk.draft, own_draft)
    left, draft = siblings(target, draft, rows.local(token))
    # A difference of two normal numbers can be subnormal: it counts as zero.
    left = flush_subnormal(left)
    mass = rows.mass(left)
    fallback = mass == 0
    left = jnp.where(fallback, own_target, left)
    # The own row's mass only where it stands in: on a split vocabulary each sum
    # gathers the row's block sums. A scalar out of the conditional, not a row.
    mass = jax.lax.cond(
        fallback, lambda: rows.mass(own_target).astype(mass.dtype), lambda: mass
    )
    draft_mass = rows.mass(draft)
    draft = jnp.where(draft_mass > 0, draft / draft_mass, 0)
    # The node's rows as given are checked whole at its first failed test: a bad
    # value anywhere in them would reach the draw.
    first = ~walk.updated
    return eqx.tree_at(
        lambda w: (
            w.updated,
            w.target,
            w.target_mass,
            w.draft,
            w.bad_target_row,
            w.bad_draft_row,
            w.overflow,
        ),
        walk,
        (
            jnp.array(True),
            left,
            mass,
            draft,
            walk.bad_target_row | (first & rows.holds_bad(own_target)),
            walk.bad_draft_row | (first & rows.holds_bad(own_draft)),
            walk.overflow | jnp.isinf(mass),
        ),
    )


def greedy_tree_step(
    *, max_depth: int | None = None, check_values: bool = True, throw: bool = True
) -> TreeStep:
    """The tree step of greedy verification, what engines run at temperature 0: a
    child passes when it is its parent's most likely target token, and the final
    token is the most likely target token at the end of the path. No uniforms and
    no draft probabilities are read; every target row is read once, for its most
    likely token, and the walk reads nothing else of it but the row it ends at.
    Since only which token is most likely is read, logits give the tokens of their
    probabilities where `check_values=False` (the value checks read probabilities,
    and refuse logits by name).

    The same answers as [`speculax.TreeStep`][] with `draft_probs=None` on the
    one-hot rows of the most likely tokens, without making them (`docs/trees.md`,
    "Greedy trees").

    **Arguments:**

    - `max_depth`, `check_values`, `throw`: keyword only, as for
        [`speculax.TreeStep`][].

    **Returns:**

    `TreeStep(IndependentSiblings(), Argmax(), child_test=GreedyChildTest())`.

    **Example:**

    ```python
    import jax.numpy as jnp
    import speculax

    step = speculax.greedy_tree_step()
    # Two children of the root, tokens 1 and 2; node 2 has a child, token 0.
    out = step(
        parents=jnp.array([[0, 0, 2]]),
        tree_tokens=jnp.array([[1, 2, 0]]),
        draft_probs=None,
        target_probs=jnp.array(
            [[[0.1, 0.3, 0.6], [1.0, 0.0, 0.0], [0.2, 0.5, 0.3], [0.0, 0.0, 1.0]]]
        ),
    )
    # 2 is the root's most likely token, 1 node 2's: the child of token 0 fails.
    assert out["tokens"].tolist() == [[2, 1, -1, -1]]
    ```
    """
    return TreeStep(
        IndependentSiblings(),
        Argmax(),
        child_test=GreedyChildTest(),
        max_depth=max_depth,
        check_values=check_values,
        throw=throw,
    )
