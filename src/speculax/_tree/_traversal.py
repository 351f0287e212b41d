"""Traversal verification (Weng et al., 2025): tree verification that judges each
path from the root as a whole, visiting the nodes deepest first. See
`docs/keeping_more.md`."""

from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._core._failures import holds_bad_values, not_a_probability
from .._core._numerics import arithmetic_dtype, flush_subnormal, upcast
from .._core._rows import read_probs_row
from .._core._vocab_axis import one_hot_over_vocab, ordered_row_sums
from .._pieces._block import block_continuation, next_ratio
from .._pieces._sampling import AbstractSampler, InverseCDF
from ._abstract import AbstractTreeStep, TreeWalk, start_walk
from ._siblings import AbstractSiblingRule, IndependentSiblings


@final
class _Position(eqx.Module):
    """Where one row's traversal stands, and what it knows of the path to there:
    arrays indexed by depth describe the path from the root to `node`, whose nodes
    alone can have lost children."""

    node: Int[Array, ""]
    # Whether `node` is next to be tested (every child it had is gone), rather than
    # entered; and whether it was tested and failed, its deletion pending.
    testing: Bool[Array, ""]
    failed: Bool[Array, ""]
    done: Bool[Array, ""]
    path: Int[Array, " levels"]
    # alpha of each node on the path: the probability of keeping the path to it.
    ratio: Float[Array, " levels"]
    # Whether the path's node at a depth has lost a child.
    updated: Bool[Array, " depth"]
    bad_target: Bool[Array, ""]
    bad_draft: Bool[Array, ""]


@final
class _Left(eqx.Module):
    """What the lost children of the path's nodes left, by depth: the target
    unnormalised, with its mass, the draft normalised; and what the rows read for
    them showed."""

    target: Float[Array, "depth vocab"]
    target_mass: Float[Array, " depth"]
    draft: Float[Array, "depth vocab"]
    bad_target_row: Bool[Array, ""]
    bad_draft_row: Bool[Array, ""]
    overflow: Bool[Array, ""]


@final
class TraversalStep(AbstractTreeStep):
    """One verification step over a batch of draft trees by traversal verification
    (Weng et al., 2025): the nodes are visited deepest first, and a node is kept
    with the probability $\\alpha$ of keeping the whole path from the root to it,
    not child by child. Lossless when the sibling rule matches how the children
    were drawn. On a chain it is [`speculax.block_step`][], to the last bit, and
    never keeps fewer tokens than the chain step; on trees it usually keeps more
    than [`speculax.TreeStep`][]'s recursive rejection sampling, but not on every
    tree (`docs/keeping_more.md` has a tree where it keeps 5% fewer).

    The root has $\\alpha = 1$, and a node $c$ with parent $u$ has
    $\\alpha(c) = \\min(1, \\alpha(u) \\, p_u(c) / q_u(c))$, computed when the walk
    enters $c$ from $u$'s current distributions. The walk goes down each node's
    children in index order, and tests a node once every child it had is gone
    (post-order): node $v$ passes when its coin $u_v < \\alpha(v)$, which keeps the
    path to $v$ and ends the walk, the token drawn from $v$'s current target
    distribution. A failed $v$ is deleted, and its parent $u$ updated through the
    sibling rule applied to $(\\alpha(u) \\, p_u, q_u)$: $p_u$ becomes what it leaves,
    $r = \\sum_x \\max(\\alpha(u) \\, p_u(x) - q_u(x), 0)$ for the independent and
    without-replacement rules, normalised, and
    $\\alpha(u) \\leftarrow r / (r + (1 - \\alpha(u)))$. The root, whose $\\alpha$
    stays 1, always passes. A residual without mass falls back to the node's target
    row, as in the chain step. Called as [`speculax.AbstractTreeStep.__call__`][].

    The walk keeps the rows of the nodes on the current path that lost a child: two
    `(max_depth, V)` arrays per tree in flight, so set `max_depth` to the depth of
    the trees.

    **Arguments:**

    - `siblings`: an [`speculax.AbstractSiblingRule`][]; default
        [`speculax.IndependentSiblings`][].
    - `sampler`: an [`speculax.AbstractSampler`][]; default
        [`speculax.InverseCDF`][].
    - `max_depth`: keyword only, the longest path kept, a static positive integer,
        or `None` (the default) for the number of draft nodes $N$. Nodes deeper are
        ignored.
    - `check_values`, `throw`: keyword only, as for [`speculax.SpeculativeStep`][].
    """

    siblings: AbstractSiblingRule = IndependentSiblings()
    sampler: AbstractSampler = InverseCDF()
    max_depth: int | None = eqx.field(static=True, default=None, kw_only=True)
    check_values: bool = eqx.field(static=True, default=True, kw_only=True)
    throw: bool = eqx.field(static=True, default=True, kw_only=True)

    def _walk(
        self,
        max_depth: int,
        b: Int[Array, ""],
        parents: Int[Array, "batch nodes"],
        tree_tokens: Int[Array, "batch nodes"],
        draft_probs: Float[Array, "batch nodes+1 vocab"] | None,
        target_probs: Float[Array, "batch nodes+1 vocab"],
        accept_uniforms: Float[Array, "batch nodes"],
    ) -> TreeWalk:
        """One event per loop iteration, entering a node or testing one: at most
        two per node and one for the root. Only a failed test reads whole rows."""
        vocab = target_probs.shape[-1]
        dtype = arithmetic_dtype(draft_probs, target_probs)
        start = start_walk(vocab, dtype, max_depth)
        depth, first_child, next_sibling = _tree_links(parents[b], max_depth)

        def token_of(node):
            return jnp.clip(tree_tokens[b, node - 1], 0, vocab - 1)

        def advance(position: _Position) -> _Position:
            """Enters nodes and tests them until a test fails or the walk is done.
            Every node entered here has a parent that has lost no child (only the
            first sibling after a deletion does, and `delete` enters it), so only
            the inputs are read: the loop carries no row."""

            def going(position: _Position) -> Bool[Array, ""]:
                return ~position.done & ~position.failed

            def event(position: _Position) -> _Position:
                return jax.lax.cond(position.testing, test, enter_fresh, position)

            return jax.lax.while_loop(going, event, position)

        def enter_fresh(position: _Position) -> _Position:
            child = position.node
            parent = position.path[depth[child] - 1]
            token = token_of(child)
            raw_target, raw_draft = raw_at(parent, token)
            return enter(position, raw_target, raw_draft, raw_target, raw_draft)

        def raw_at(parent, token):
            """The parent's rows as given, at the child's token."""
            raw_target = upcast(target_probs[b, parent, token])
            if draft_probs is None:
                return raw_target, jnp.ones((), dtype)
            return raw_target, upcast(draft_probs[b, parent, token])

        def enter(position, target_at, draft_at, raw_target, raw_draft) -> _Position:
            """Enters `position.node` from its parent, whose current distributions
            give the node's token `target_at` and `draft_at` (`raw_target` and
            `raw_draft` as given, for the checks)."""
            child = position.node
            at_depth = depth[child]
            ratio = next_ratio(position.ratio[at_depth - 1], target_at, draft_at)
            first = first_child[child]
            return eqx.tree_at(
                lambda p: (
                    p.node,
                    p.testing,
                    p.path,
                    p.ratio,
                    p.updated,
                    p.bad_target,
                    p.bad_draft,
                ),
                position,
                (
                    jnp.where(first > 0, first, child),
                    first == 0,
                    position.path.at[at_depth].set(child),
                    position.ratio.at[at_depth].set(ratio),
                    # Out of range (a leaf at max_depth) drops the update.
                    position.updated.at[at_depth].set(False, mode="drop"),
                    position.bad_target | not_a_probability(raw_target),
                    position.bad_draft | not_a_probability(raw_draft),
                ),
            )

        def test(position: _Position) -> _Position:
            node = position.node
            index = jnp.maximum(node - 1, 0)
            ratio = position.ratio[depth[node]]
            passed = (node == 0) | (accept_uniforms[b, index] < ratio)
            return eqx.tree_at(
                lambda p: (p.done, p.failed), position, (passed, ~passed)
            )

        def delete(position: _Position, left: _Left) -> tuple[_Position, _Left]:
            """Deletes the node that failed its test, updates its parent, and
            enters the next sibling, if any, from the updated parent."""
            node = position.node
            parent_depth = depth[node] - 1
            parent = position.path[parent_depth]
            token = token_of(node)
            updated = position.updated[parent_depth]
            own_target = read_probs_row(target_probs, b, parent)
            if draft_probs is None:
                own_draft = one_hot_over_vocab(token, vocab, dtype, None)
                draft = own_draft
            else:
                own_draft = read_probs_row(draft_probs, b, parent)
                draft = jnp.where(updated, left.draft[parent_depth], own_draft)
            target = jnp.where(
                updated,
                left.target[parent_depth] / left.target_mass[parent_depth],
                own_target,
            )
            ratio = position.ratio[parent_depth]
            excess, draft = self.siblings(ratio * target, draft, token)
            # A difference of two normal numbers can be subnormal: it counts as zero.
            excess = flush_subnormal(excess)
            mass = ordered_row_sums(excess, None)
            ratio = block_continuation(mass, ratio)
            excess, mass = jax.lax.cond(
                mass == 0,
                lambda: (own_target, ordered_row_sums(own_target, None)),
                lambda: (excess, mass),
            )
            draft_mass = ordered_row_sums(draft, None)
            draft = jnp.where(draft_mass > 0, draft / draft_mass, 0)
            position = eqx.tree_at(
                lambda p: (p.node, p.testing, p.failed, p.ratio, p.updated),
                position,
                (
                    parent,
                    jnp.array(True),
                    jnp.array(False),
                    position.ratio.at[parent_depth].set(ratio),
                    position.updated.at[parent_depth].set(True),
                ),
            )
            sibling = next_sibling[node]
            sibling_token = token_of(sibling)
            raw_target, raw_draft = raw_at(parent, sibling_token)
            draft_at = raw_draft if draft_probs is None else draft[sibling_token]
            entered = enter(
                eqx.tree_at(lambda p: (p.node, p.testing), position, (sibling, False)),
                excess[sibling_token] / mass,
                draft_at,
                raw_target,
                raw_draft,
            )
            position = jax.tree.map(
                lambda a, b: jnp.where(sibling > 0, a, b), entered, position
            )
            # The node's rows as given are checked whole when it first loses a
            # child: a bad value anywhere in them would reach the draw.
            first = ~updated
            left = _Left(
                target=left.target.at[parent_depth].set(excess),
                target_mass=left.target_mass.at[parent_depth].set(mass),
                draft=left.draft.at[parent_depth].set(draft),
                bad_target_row=left.bad_target_row
                | (first & holds_bad_values(own_target, axis=None)),
                bad_draft_row=left.bad_draft_row
                | (first & holds_bad_values(own_draft, axis=None)),
                overflow=left.overflow | jnp.isinf(mass),
            )
            return position, left

        def delete_and_advance(state: tuple[_Position, _Left]):
            position, left = delete(*state)
            return advance(position), left

        root_child = first_child[0]
        position = _Position(
            node=jnp.where(root_child > 0, root_child, 0),
            testing=root_child == 0,
            failed=jnp.array(False),
            done=jnp.array(False),
            path=jnp.zeros((max_depth + 1,), jnp.int32),
            ratio=jnp.ones((max_depth + 1,), dtype),
            updated=jnp.zeros((max_depth,), bool),
            bad_target=jnp.array(False),
            bad_draft=jnp.array(False),
        )
        left = _Left(
            target=jnp.zeros((max_depth, vocab), dtype),
            target_mass=jnp.ones((max_depth,), dtype),
            draft=jnp.zeros((max_depth, vocab), dtype),
            bad_target_row=jnp.array(False),
            bad_draft_row=jnp.array(False),
            overflow=jnp.array(False),
        )
        # One deletion per iteration, the rows outside any branch and the inner
        # loop: XLA CPU copies the (max_depth, V) arrays into every branch.
        final, left = jax.lax.while_loop(
            lambda state: ~state[0].done,
            delete_and_advance,
            (advance(position), left),
        )
        end = final.node
        end_depth = depth[end]
        on_path = jnp.arange(max_depth + 1) < end_depth
        path_nodes = jnp.where(on_path, jnp.roll(final.path, -1), -1)
        path_tokens = jnp.where(
            on_path, tree_tokens[b, jnp.maximum(path_nodes - 1, 0)], -1
        )
        # A node at max_depth has no children in the walk: its rows are its own.
        updated = final.updated.at[end_depth].get(mode="fill", fill_value=False)
        kept = jnp.minimum(end_depth, max_depth - 1)
        return eqx.tree_at(
            lambda w: (
                w.current,
                w.depth,
                w.updated,
                w.target,
                w.target_mass,
                w.path_tokens,
                w.path_nodes,
                w.bad_target,
                w.bad_draft,
                w.bad_target_row,
                w.bad_draft_row,
                w.overflow,
            ),
            start,
            (
                end,
                end_depth,
                updated,
                left.target[kept],
                left.target_mass[kept],
                path_tokens.astype(jnp.int32),
                path_nodes,
                final.bad_target,
                final.bad_draft,
                left.bad_target_row,
                left.bad_draft_row,
                left.overflow,
            ),
        )


def _tree_links(
    parents: Int[Array, " nodes"], max_depth: int
) -> tuple[Int[Array, " nodes+1"], Int[Array, " nodes+1"], Int[Array, " nodes+1"]]:
    """The depth of every node (`max_depth + 1` for a node outside the walk: unused,
    too deep, or under a bad parent), and each node's first child and next sibling
    within the walk, in index order (0 for none: the root is nobody's child or
    sibling)."""
    num_nodes = parents.shape[0]
    outside = max_depth + 1

    def depth_of(j, depth):
        parent = parents[j]
        valid = (parent >= 0) & (parent <= j)
        below = jnp.minimum(depth[jnp.clip(parent, 0, num_nodes)] + 1, outside)
        return depth.at[j + 1].set(jnp.where(valid, below, outside))

    depth = jnp.zeros((num_nodes + 1,), jnp.int32)
    depth = jax.lax.fori_loop(0, num_nodes, depth_of, depth)
    nodes = jnp.arange(1, num_nodes + 1, dtype=jnp.int32)
    in_walk = depth[1:] <= max_depth
    none = jnp.zeros((), jnp.int32)

    def first_of(is_candidate):
        # The smallest candidate node of each row, or 0.
        smallest = jnp.min(
            jnp.where(is_candidate, nodes[None, :], num_nodes + 1), axis=1
        )
        return jnp.where(smallest > num_nodes, none, smallest).astype(jnp.int32)

    every_node = jnp.arange(num_nodes + 1)[:, None]
    first_child = first_of(in_walk[None, :] & (parents[None, :] == every_node))
    own_parent = jnp.concatenate([jnp.array([-1]), parents])[:, None]
    later = nodes[None, :] > every_node
    next_sibling = first_of(in_walk[None, :] & (parents[None, :] == own_parent) & later)
    return depth, first_child, next_sibling
