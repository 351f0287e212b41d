"""Traversal verification (Weng et al., 2025): tree verification that judges each
path from the root as a whole, visiting the nodes deepest first. See
`docs/keeping_more.md`."""

import functools
from collections.abc import Callable
from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._core._failures import not_a_probability
from .._core._numerics import flush_subnormal
from .._core._rows import read_probs_row
from .._pieces._block import block_continuation, next_ratio
from .._pieces._sampling import AbstractSampler, InverseCDF
from ._abstract import AbstractTreeStep
from ._rows import TreeRows
from ._siblings import AbstractSiblingRule, IndependentSiblings
from ._walk import TreeWalk, start_walk


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
    """What the lost children of the path's nodes left, by depth, in one of two
    forms. As rows: the target unnormalised, with its mass, and the draft
    normalised, kept with draft probabilities (else `None`). As two
    numbers, for a rule that subtracts a kept draft on stochastic drafts
    (`target` and `draft` are `None`): the target left is
    $\\max(a \\, (p - q) - d \\, q, 0)$ of the node's own rows as given, with
    `scale` $a$ and `draft_weight` $d$ (`_excess`), its mass in `target_mass`.
    Then what the rows read for them showed."""

    target: Float[Array, "depth vocab"] | None
    target_mass: Float[Array, " depth"]
    # Where the excess had no mass: the node's own target row stands in for it.
    fell_back: Bool[Array, " depth"]
    draft: Float[Array, "depth vocab"] | None
    scale: Float[Array, " depth"]
    draft_weight: Float[Array, " depth"]
    # Whether the node has lost one child: its target left is then
    # max(a p - q, 0), as block verification computes it.
    lost_one: Bool[Array, " depth"]
    bad_target_row: Bool[Array, ""]
    bad_draft_row: Bool[Array, ""]
    overflow: Bool[Array, ""]


@final
class _Links(eqx.Module):
    """A row's tree as the walk goes over it, from `_tree_links`: the depth of every
    node, and each node's first child and next sibling within the walk, indexed by
    node (the root and the $N$ draft nodes)."""

    depth: Int[Array, " positions"]
    first_child: Int[Array, " positions"]
    next_sibling: Int[Array, " positions"]


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

    The walk keeps what the lost children of the nodes on the current path left.
    For a rule that subtracts a draft it keeps ([`speculax.IndependentSiblings`][])
    on stochastic drafts, that is two numbers per depth: a node that lost $k$
    children has the target $\\max(a_k \\, p_u - b_k \\, q_u, 0)$ of its own rows,
    by $\\max(c \\max(x, 0) - y, 0) = \\max(c x - y, 0)$ for $c, y \\ge 0$, so a
    deletion is one pass over the node's two rows, and none under a node whose
    $\\alpha$ is 0, which is never kept, nor is anything below it. Otherwise it is a
    `(max_depth, V)` array per tree in flight (two for drafts without replacement,
    whose draft rows change), so set `max_depth` to the depth of the trees.

    **Arguments:**

    - `siblings`: an [`speculax.AbstractSiblingRule`][]; default
        [`speculax.IndependentSiblings`][].
    - `sampler`: an [`speculax.AbstractSampler`][]; default
        [`speculax.InverseCDF`][].
    - `max_depth`: keyword only, the longest path kept, a static positive integer,
        or `None` (the default) for the number of draft nodes $N$. Nodes deeper are
        ignored.
    - `check_values`, `throw`: keyword only, as for [`speculax.SpeculativeStep`][].
    - `axis_name`: keyword only, as for [`speculax.TreeStep`][].
    """

    siblings: AbstractSiblingRule = IndependentSiblings()
    sampler: AbstractSampler = InverseCDF()
    max_depth: int | None = eqx.field(static=True, default=None, kw_only=True)
    check_values: bool = eqx.field(static=True, default=True, kw_only=True)
    throw: bool = eqx.field(static=True, default=True, kw_only=True)
    axis_name: str | None = eqx.field(static=True, default=None, kw_only=True)

    @property
    def _coin_reader(self) -> str | None:
        return type(self).__name__

    @property
    def _reads_most_likely(self) -> bool:
        return False

    @property
    def _reads_draft_probs(self) -> bool:
        return True

    @property
    def _draws_most_likely(self) -> bool:
        return False

    def _walk(
        self, max_depth: int, parents: Int[Array, "batch nodes"], rows: TreeRows
    ) -> TreeWalk:
        """One event per loop iteration, entering a node or testing one: at most
        two per node and one for the root. Only a failed test reads whole rows.

        `_advance` enters and tests nodes until a test fails, `_delete` deletes the
        failed node and updates its parent, until a node passes; `_walk_end` reads
        where the walk ended."""
        vocab, dtype, draft_probs = rows.shard_vocab, rows.dtype, rows.draft_probs
        start = start_walk(vocab, dtype, max_depth)
        links = _tree_links(parents[rows.b], max_depth)

        # Both loops take the same branch functions, so JAX traces them once.
        test = functools.partial(_test, rows, links)
        enter = functools.partial(_enter_from_given_rows, rows, links)

        def delete_and_advance(state: tuple[_Position, _Left]):
            position, left = _delete(rows, links, self.siblings, *state)
            return _advance(test, enter, position), left

        position = _at_root(links, max_depth, dtype)
        by_numbers = draft_probs is not None and self.siblings.subtracts_a_kept_draft
        left = _nothing_left(
            max_depth,
            vocab,
            dtype,
            target_rows=not by_numbers,
            draft_rows=draft_probs is not None and not by_numbers,
        )
        # One deletion per iteration, the rows outside any branch and the inner
        # loop: XLA CPU copies the (max_depth, V) arrays into every branch.
        final, left = jax.lax.while_loop(
            lambda state: ~state[0].done,
            delete_and_advance,
            (_advance(test, enter, position), left),
        )
        return _walk_end(rows, links, start, final, left, max_depth)


def _at_root(links: _Links, max_depth: int, dtype: jnp.dtype) -> _Position:
    """The walk before its first event: entering the root's first child, or testing
    the root when it has none."""
    root_child = links.first_child[0]
    return _Position(
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


def _nothing_left(
    max_depth: int, vocab: int, dtype: jnp.dtype, *, target_rows: bool, draft_rows: bool
) -> _Left:
    """What the lost children left before any is lost: nothing, `(max_depth, V)`
    rows of zeros (of mass 1, never read) where `target_rows` and `draft_rows`
    ask for them, and the two numbers that give a node's own target row
    ($a = 1$, $d = -1$)."""
    zeros = jnp.zeros((max_depth, vocab), dtype)
    ones = jnp.ones((max_depth,), dtype)
    return _Left(
        target=zeros if target_rows else None,
        target_mass=ones,
        fell_back=jnp.zeros((max_depth,), bool),
        draft=zeros if draft_rows else None,
        scale=ones,
        draft_weight=-ones,
        lost_one=jnp.zeros((max_depth,), bool),
        bad_target_row=jnp.array(False),
        bad_draft_row=jnp.array(False),
        overflow=jnp.array(False),
    )


def _advance(
    test: Callable[[_Position], _Position],
    enter: Callable[[_Position], _Position],
    position: _Position,
) -> _Position:
    """Enters nodes and tests them until a test fails or the walk is done, by `test`
    (`_test`) and `enter` (`_enter_from_given_rows`). Every node entered here has a
    parent that has lost no child (only the first sibling after a deletion does, and
    `_delete` enters it), so only the inputs are read: the loop carries no row."""

    def going(position: _Position) -> Bool[Array, ""]:
        return ~position.done & ~position.failed

    def event(position: _Position) -> _Position:
        return jax.lax.cond(position.testing, test, enter, position)

    return jax.lax.while_loop(going, event, position)


def _enter_from_given_rows(
    rows: TreeRows, links: _Links, position: _Position
) -> _Position:
    """Enters `position.node` from a parent that has lost no child, whose rows are
    the inputs as given."""
    raw_target, raw_draft = rows.given_at(position.node)
    return _enter(links, position, raw_target, raw_draft, raw_target, raw_draft)


def _enter(
    links: _Links,
    position: _Position,
    target_at: Float[Array, ""],
    draft_at: Float[Array, ""],
    raw_target: Float[Array, ""],
    raw_draft: Float[Array, ""],
) -> _Position:
    """Enters `position.node` from its parent, whose current distributions give the
    node's token `target_at` and `draft_at` (`raw_target` and `raw_draft` as given,
    for the checks): the node's $\\alpha$ joins the path, and the walk goes on to
    its first child, or to testing it when it has none."""
    child = position.node
    at_depth = links.depth[child]
    ratio = next_ratio(position.ratio[at_depth - 1], target_at, draft_at)
    first = links.first_child[child]
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


def _test(rows: TreeRows, links: _Links, position: _Position) -> _Position:
    """Tests `position.node`, every child it had gone: it passes, ending the walk,
    when its coin is below its $\\alpha$; the root always passes."""
    node = position.node
    index = jnp.maximum(node - 1, 0)
    ratio = position.ratio[links.depth[node]]
    passed = (node == 0) | (rows.accept_uniforms[rows.b, index] < ratio)
    return eqx.tree_at(lambda p: (p.done, p.failed), position, (passed, ~passed))


def _delete(
    rows: TreeRows,
    links: _Links,
    siblings: AbstractSiblingRule,
    position: _Position,
    left: _Left,
) -> tuple[_Position, _Left]:
    """Deletes the node that failed its test, updates its parent through the sibling
    rule, and enters the next sibling, if any, from the updated parent."""
    node = position.node
    parent_depth = links.depth[node] - 1
    parent = position.path[parent_depth]
    first = ~position.updated[parent_depth]
    ratio = position.ratio[parent_depth]
    if left.target is None:
        mass, left = _subtract_the_draft(rows, left, parent, parent_depth, ratio, first)
    else:
        token = rows.token_of(node)
        mass, left = _apply_the_rule(
            rows, left, siblings, parent, parent_depth, token, ratio, first
        )
    position = _back_to_parent(
        position, parent, parent_depth, block_continuation(mass, ratio)
    )
    position = _enter_next_sibling(
        rows, links, position, node, parent, left, parent_depth
    )
    return position, left


def _apply_the_rule(
    rows: TreeRows,
    left: _Left,
    siblings: AbstractSiblingRule,
    parent: Int[Array, ""],
    parent_depth: Int[Array, ""],
    token: Int[Array, ""],
    ratio: Float[Array, ""],
    first: Bool[Array, ""],
) -> tuple[Float[Array, ""], _Left]:
    """The deletion of the child at `token` where `left` keeps rows: the sibling
    rule applied to the parent's current distributions, the target scaled by its
    $\\alpha$ `ratio`; returns the excess's mass and `left` updated."""
    tested = _tested_against(rows, left, parent, parent_depth, token, first)
    excess, draft = siblings(ratio * tested.target, tested.draft, rows.local(token))
    # A difference of two normal numbers can be subnormal: it counts as zero.
    excess = flush_subnormal(excess)
    mass = rows.mass(excess)
    left = _record_left(rows, left, parent, parent_depth, tested, excess, mass, draft)
    return mass, left


@final
class _Tested(eqx.Module):
    """What a failed child was tested against, `(V,)` each: its parent's current
    distributions, normalised, and whether its own rows hold a bad value, where
    this loss is its first (else what `_Left` holds, and no bad value)."""

    target: Float[Array, " vocab"]
    draft: Float[Array, " vocab"]
    bad_target: Bool[Array, ""]
    bad_draft: Bool[Array, ""]


def _tested_against(
    rows: TreeRows,
    left: _Left,
    parent: Int[Array, ""],
    parent_depth: Int[Array, ""],
    token: Int[Array, ""],
    first: Bool[Array, ""],
) -> _Tested:
    """The distributions the failed child at `token` was tested against, where
    `left` keeps rows: the parent's own rows at its `first` loss, checked whole
    then (a bad value anywhere in them would reach the draw); else what its lost
    children left, or its own target row where they left no mass. One branch of
    three reads only the rows it needs: a row is read from memory, where the rows
    left are in cache."""
    assert left.target is not None
    mass = left.target_mass[parent_depth]
    no_value = jnp.array(False)

    def first_loss() -> _Tested:
        own_target, own_draft = rows.own_rows(parent, token)
        bad_draft = no_value
        if rows.draft_probs is not None:
            bad_draft = rows.holds_bad(own_draft)
        return _Tested(own_target, own_draft, rows.holds_bad(own_target), bad_draft)

    def later_loss(target: Float[Array, " vocab"]) -> _Tested:
        if left.draft is None:
            # Deterministic drafts: the one-hot of the rejected token.
            draft = rows.own_rows(parent, token)[1]
        else:
            draft = left.draft[parent_depth]
        return _Tested(target, draft, no_value, no_value)

    target_left = left.target
    branch = jnp.where(first, 0, jnp.where(left.fell_back[parent_depth], 1, 2))
    return jax.lax.switch(
        branch,
        [
            first_loss,
            lambda: later_loss(rows.own_rows(parent, token)[0] / mass),
            lambda: later_loss(target_left[parent_depth] / mass),
        ],
    )


def _record_left(
    rows: TreeRows,
    left: _Left,
    parent: Int[Array, ""],
    parent_depth: Int[Array, ""],
    tested: _Tested,
    excess: Float[Array, " vocab"],
    mass: Float[Array, ""],
    draft: Float[Array, " vocab"],
) -> _Left:
    """Stores, as rows, what the deletion left at the parent's depth: the `excess`
    of `mass` (`_mass_kept`); the sibling rule's `draft` normalised, with draft
    probabilities; and the checks of what it read: the parent's rows as given, and
    whether the excess summed past the largest float."""
    assert left.target is not None
    target_rows = left.target.at[parent_depth].set(excess)
    draft_rows = left.draft
    if draft_rows is not None:
        draft_mass = rows.mass(draft)
        normalised = jnp.where(draft_mass > 0, draft / draft_mass, 0)
        draft_rows = draft_rows.at[parent_depth].set(normalised)
    left = _loss_recorded(
        left,
        parent_depth,
        mass,
        *_mass_kept(rows, parent, mass),
        tested.bad_target,
        tested.bad_draft,
    )
    return eqx.tree_at(
        lambda x: (x.target, x.draft),
        left,
        (target_rows, draft_rows),
        is_leaf=lambda x: x is None,
    )


def _loss_recorded(
    left: _Left,
    parent_depth: Int[Array, ""],
    mass: Float[Array, ""],
    kept_mass: Float[Array, ""],
    fell_back: Bool[Array, ""],
    bad_target: Bool[Array, ""],
    bad_draft: Bool[Array, ""],
) -> _Left:
    """`left` with what either form records of a deletion at the parent's depth:
    the mass kept and whether it fell back (`_mass_kept`), the bad values its rows
    showed, and whether the excess's `mass` summed past the largest float."""
    return eqx.tree_at(
        lambda x: (
            x.target_mass,
            x.fell_back,
            x.bad_target_row,
            x.bad_draft_row,
            x.overflow,
        ),
        left,
        (
            left.target_mass.at[parent_depth].set(kept_mass),
            left.fell_back.at[parent_depth].set(fell_back),
            left.bad_target_row | bad_target,
            left.bad_draft_row | bad_draft,
            left.overflow | jnp.isinf(mass),
        ),
    )


def _mass_kept(
    rows: TreeRows, parent: Int[Array, ""], mass: Float[Array, ""]
) -> tuple[Float[Array, ""], Bool[Array, ""]]:
    """The mass to keep for a deletion whose excess has `mass`: that mass, or where
    it has none the mass of the parent's own target row, which stands in for it;
    and whether it fell back so."""
    fallback = mass == 0
    # The own row is read only where it stands in: a conditional returning a row
    # would copy it.
    kept = jax.lax.cond(
        fallback,
        lambda: rows.mass(read_probs_row(rows.target_probs, rows.b, parent)).astype(
            mass.dtype
        ),
        lambda: mass,
    )
    return kept, fallback


def _excess(
    scale: Float[Array, ""],
    draft_weight: Float[Array, ""],
    lost_one: Bool[Array, ""],
    target: Float[Array, "*vocab"],
    draft: Float[Array, "*vocab"],
) -> Float[Array, "*vocab"]:
    """$\\max(a \\, (p - q) - d \\, q, 0)$ of a node's own rows as given, whole or
    at one token, or where it has `lost_one` child $\\max(a \\, p - q, 0)$, as block
    verification computes it; a subnormal value counts as zero (a difference of two
    normal numbers can be subnormal). What its lost children left, as `_Left` keeps
    it in two numbers. The form $a (p - q) - d q$ rounds $p - q$ once: with a good
    draft its mass $m$ is small and $a \\approx 1 / m$, where
    $a p - (a + d) q$ would lose $\\log_{10}(1 / m)$ digits."""
    left = jnp.where(
        lost_one,
        scale * target - draft,
        scale * (target - draft) - draft_weight * draft,
    )
    return flush_subnormal(jnp.maximum(left, 0))


def _subtract_the_draft(
    rows: TreeRows,
    left: _Left,
    parent: Int[Array, ""],
    parent_depth: Int[Array, ""],
    ratio: Float[Array, ""],
    first: Bool[Array, ""],
) -> tuple[Float[Array, ""], _Left]:
    """The deletion of a rule that subtracts a kept draft, in two numbers: where the
    parent's target is $\\max(a (p - q) - d q, 0) / m$ of its own rows, what the
    failed child leaves is
    $\\max(\\alpha a / m \\; (p - q) - (\\alpha d / m + 1) \\, q, 0)$; at its
    `first` loss, $\\max(\\alpha p - q, 0)$ of the rows as given, as the chain
    step's block verification reads them, which is $a = \\alpha$,
    $d = 1 - \\alpha$. One pass over the two rows, or none where $\\alpha = 0$;
    returns the excess's mass and `left` updated."""
    per_mass = ratio / jnp.where(first, 1, left.target_mass[parent_depth])
    scale = jnp.where(first, ratio, per_mass * left.scale[parent_depth])
    draft_weight = jnp.where(
        first, 1 - ratio, per_mass * left.draft_weight[parent_depth] + 1
    )
    # The one-hot of a token is read for deterministic drafts only, never here.
    any_token = jnp.zeros((), jnp.int32)
    no_value = jnp.array(False)

    def read_rows():
        own_target, own_draft = rows.own_rows(parent, any_token)
        excess = _excess(scale, draft_weight, first, own_target, own_draft)
        # A bad value in either row makes the mass NaN, so that the rows are
        # checked in the same pass, and told apart only where one is bad.
        bad = not_a_probability(own_target) | not_a_probability(own_draft)
        mass = rows.mass(jnp.where(bad, jnp.nan, excess))

        def tell_apart():
            target, draft = rows.own_rows(parent, any_token)
            return rows.holds_bad(target), rows.holds_bad(draft)

        bad_target, bad_draft = jax.lax.cond(
            jnp.isnan(mass), tell_apart, lambda: (no_value, no_value)
        )
        return (mass, *_mass_kept(rows, parent, mass), bad_target, bad_draft)

    def read_nothing():
        # A node whose alpha is 0 never passes, and every alpha under it is 0
        # whatever its rows say: the excess is 0, and its rows are never drawn
        # from, so the deletion reads nothing. (The root's alpha is never 0; a NaN
        # alpha comes from a bad value already reported.)
        nothing, one = jnp.zeros((), rows.dtype), jnp.ones((), rows.dtype)
        return nothing, one, jnp.array(True), no_value, no_value

    mass, kept_mass, fell_back, bad_target, bad_draft = jax.lax.cond(
        ratio > 0, read_rows, read_nothing
    )
    # Where the parent's own target stands in: p = 1 (p - q) + 1 q.
    scale = jnp.where(fell_back, 1, scale)
    draft_weight = jnp.where(fell_back, -1, draft_weight)
    left = _loss_recorded(
        left, parent_depth, mass, kept_mass, fell_back, bad_target, bad_draft
    )
    left = eqx.tree_at(
        lambda x: (x.scale, x.draft_weight, x.lost_one),
        left,
        (
            left.scale.at[parent_depth].set(scale),
            left.draft_weight.at[parent_depth].set(draft_weight),
            left.lost_one.at[parent_depth].set(first & ~fell_back),
        ),
    )
    return mass, left


def _back_to_parent(
    position: _Position,
    parent: Int[Array, ""],
    parent_depth: Int[Array, ""],
    ratio: Float[Array, ""],
) -> _Position:
    """Leaves the deleted node's subtree: the walk is at its parent, to be tested
    next, with the parent's updated $\\alpha$ `ratio`, marked as having lost a
    child."""
    return eqx.tree_at(
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


def _enter_next_sibling(
    rows: TreeRows,
    links: _Links,
    position: _Position,
    node: Int[Array, ""],
    parent: Int[Array, ""],
    left: _Left,
    parent_depth: Int[Array, ""],
) -> _Position:
    """Enters the deleted `node`'s next sibling, if it has one, from the updated
    parent, whose distributions are what its lost children `left` at its depth (the
    one-hot as given for target-only drafts). Without one, `position` stays at the
    parent."""
    sibling = links.next_sibling[node]
    sibling_token = rows.token_of(sibling)
    raw_target, raw_draft = rows.given_at(sibling)
    if left.target is None:
        scale = left.scale[parent_depth]
        draft_weight = left.draft_weight[parent_depth]
        lost_one = left.lost_one[parent_depth]
        excess_at = _excess(scale, draft_weight, lost_one, raw_target, raw_draft)
        draft_at = raw_draft
    else:
        excess_at = rows.at_token(left.target[parent_depth], sibling_token)
        draft_at = raw_draft
        if left.draft is not None:
            draft_at = rows.at_token(left.draft[parent_depth], sibling_token)
    excess_at = jnp.where(left.fell_back[parent_depth], raw_target, excess_at)
    target_at = excess_at / left.target_mass[parent_depth]
    entered = _enter(
        links,
        eqx.tree_at(lambda p: (p.node, p.testing), position, (sibling, False)),
        target_at,
        draft_at,
        raw_target,
        raw_draft,
    )
    return jax.tree.map(
        lambda there, here: jnp.where(sibling > 0, there, here), entered, position
    )


def _walk_end(
    rows: TreeRows,
    links: _Links,
    start: TreeWalk,
    final: _Position,
    left: _Left,
    max_depth: int,
) -> TreeWalk:
    """The walk's end as a `TreeWalk`: the node that passed, the path to it, what
    its lost children left (or its own rows), and the bad values met."""
    end = final.node
    end_depth = links.depth[end]
    on_path = jnp.arange(max_depth + 1) < end_depth
    path_nodes = jnp.where(on_path, jnp.roll(final.path, -1), -1)
    path_tokens = jnp.where(
        on_path, rows.tree_tokens[rows.b, jnp.maximum(path_nodes - 1, 0)], -1
    )
    # A node at max_depth has no children in the walk: its rows are its own.
    # Where the excess had no mass, its own target row.
    updated = final.updated.at[end_depth].get(mode="fill", fill_value=False)
    updated = updated & ~left.fell_back.at[end_depth].get(mode="fill", fill_value=False)
    kept = jnp.minimum(end_depth, max_depth - 1)
    if left.target is None:
        own_target, own_draft = rows.own_rows(end, jnp.zeros((), jnp.int32))
        scale, draft_weight = left.scale[kept], left.draft_weight[kept]
        lost_one = left.lost_one[kept]
        target = _excess(scale, draft_weight, lost_one, own_target, own_draft)
    else:
        target = left.target[kept]
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
            target,
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


def _tree_links(parents: Int[Array, " nodes"], max_depth: int) -> _Links:
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
    return _Links(depth, first_child, next_sibling)
