"""Exact output distributions of the tree step, by enumeration of every draft tree."""

import dataclasses
import itertools
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, TypeAlias, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Float

from .._pieces._sampling import AbstractSampler
from .._tree._abstract import AbstractTreeStep
from .._tree._child_tests import GreedyChildTest, RatioChildTest
from .._tree._recursive import TreeStep
from .._tree._traversal import TraversalStep
from ._cells import Cell, Name, narrowed
from ._chain import SamplerCells, refuse_sampler, sampler_cells


Model: TypeAlias = Callable[[tuple[int, ...]], Float[np.ndarray, " vocab"]]
"""A language model for the tree enumerations: a function from a prefix of tokens
(a tuple of ints, the root's own prefix being `()`) to the normalised float64
distribution of the next token, of shape `(vocab,)`."""
Drafting: TypeAlias = Literal["independent", "without replacement", "deterministic"]
"""How the drafter drew a tree's tokens, for the tree enumerations: each node's
children from its draft row independently (`"independent"`), one after another
without replacement (`"without replacement"`), or not at all, the tokens given
(`"deterministic"`)."""
_MAX_TREES = 200_000
# Past this many trees the enumeration takes tens of seconds or more.
_SLOW_TREES = 10_000


def tree_output_distribution(
    step: AbstractTreeStep,
    parents: Sequence[int],
    target: Model,
    draft: Model,
    vocab: int,
    *,
    drafting: Drafting,
    tree_tokens: Sequence[int] | None = None,
    target_only: bool = False,
) -> dict[tuple[int, ...], float]:
    """Computes exactly, in float64, the distribution of the tokens one tree step
    emits, over every draft tree of the shape `parents` and over the uniforms.

    Each draft node's token is enumerated, with the probability that the drafter
    gives the tree: the children of node $k$ drawn from $q_k$, which is
    `draft(prefix)` for the tokens on the path to $k$, either independently, or one
    after another without replacement; or fixed (`"deterministic"`, from
    `tree_tokens`). The target row of node $k$ is `target(prefix)`. The uniforms are
    integrated out analytically, with the step's own rule walked in float64. For a
    [`speculax.TreeStep`][], a child $c$ tested against $(p, q)$ passes with probability
    $\\min(1, p(c)/q(c))$ (1 when $q(c) = 0 < p(c)$) under
    [`speculax.RatioChildTest`][], and where it is the node's most likely token under
    [`speculax.GreedyChildTest`][]; a rejection leaves what `step.siblings` returns,
    normalised, with the step's fallback to the node's target row; or, with one-hot
    drafts and a rule that `takes_out_one_hot_drafts`, the target row with the rejected
    tokens taken out, divided by one less their probabilities, as the step keeps it (the
    rule is called too, and refused if it leaves anything else). For a
    [`speculax.TraversalStep`][], the nodes are tested in post-order, each passing with
    its $\\alpha$, and a deletion updates the parent through `step.siblings` as the step
    does (a rule that states `subtracts_a_kept_draft` but returns anything but
    $\\max(p - q, 0)$ and $q$ is refused: the step keeps two numbers for it). The final
    token's law is found by calling `step.sampler` on the weights the walk ends with, as
    [`speculax.testing.output_distribution`][] does: exactly, for a sampler that draws
    each token on one interval of its uniform (inverse CDF over the vocabulary in any
    order, lossy or not) or reads no uniform.

    **Arguments:**

    - `step`: the [`speculax.TreeStep`][] or [`speculax.TraversalStep`][] whose rule,
        sibling rule, sampler and `max_depth` to use.
    - `parents`: the parent of each draft node $1, \\dots, N$, as for the step
        (`-1` for an unused slot).
    - `target`, `draft`: functions from a tuple of tokens to a normalised float64
        distribution of shape `(vocab,)`. `draft` is not read for
        `"deterministic"`, whose $q$ is each child's one-hot.
    - `vocab`: $V$.
    - `drafting`: keyword only, how the children were drawn: `"independent"`,
        `"without replacement"` or `"deterministic"`.
    - `tree_tokens`: keyword only, the tokens of the nodes, for `"deterministic"`.
    - `target_only`: keyword only, whether the step is given no draft probabilities
        (`draft_probs=None`) whatever the drafter did: the target-only rule, each
        child's $q$ its own one-hot. Default `False`.

    **Returns:**

    A dict from each emitted token sequence (the accepted path, then the drawn
    token) to its probability; the probabilities sum to 1.

    **Raises:**

    `ValueError` for bad parents, a missing or unneeded `tree_tokens`, more than
    200,000 draft trees, a child test other than [`speculax.RatioChildTest`][] and
    [`speculax.GreedyChildTest`][], or a sampler seen to draw a token on more than
    one interval of its uniform or a token outside $[0, V)$; `TypeError` for a step
    of another kind.
    """
    parents = list(parents)
    used = _checked_nodes(step, parents, vocab, drafting, tree_tokens)
    ends = Ends()
    walker = tree_walker(
        step,
        children_in_use(parents, used),
        target,
        draft,
        vocab,
        one_hot_draft=target_only or reads_one_hot_drafts(step, drafting),
        coin=lambda node: (node,),
        ends=ends,
    )
    if drafting == "deterministic":
        assert tree_tokens is not None
        assignments = [({j: int(tree_tokens[j - 1]) for j in used}, 1.0)]
    else:
        assignments = _draft_trees(used, parents, draft, vocab, drafting)
    for tokens, weight in assignments:
        walker.walk_tree(tokens, Cell({}, weight))
    return ends.distribution(step.sampler)


def tree_lossless_error(
    step: AbstractTreeStep,
    parents: Sequence[int],
    target: Model,
    draft: Model,
    vocab: int,
    *,
    drafting: Drafting,
    tree_tokens: Sequence[int] | None = None,
    target_only: bool = False,
) -> float:
    """How far `step` is from lossless on draft trees of the shape `parents`: the
    largest absolute difference, over every token sequence $s$ emitted with positive
    probability before its end and every token $a$, between
    $P(\\text{the emitted tokens start with } s a)$ and
    $P(\\text{they start with } s \\text{ and go on}) \\cdot$ `target(s)[a]`.

    Zero exactly when every emitted token, given the ones before it, is distributed
    as the target model; a lossless step gives rounding error only, about
    $10^{-16}$. The arguments are those of
    [`speculax.testing.tree_output_distribution`][].

    **Cost:** $V^N$ draft trees are enumerated, $N$ the nodes in use (one tree for
    `"deterministic"`), each walked in Python with up to $N$ calls of `target`, of
    `draft` and of the compiled sibling rule: on the order of a millisecond per
    tree on a CPU, more with slow models. Four nodes at $V = 4$ (256 trees) take
    half a second, six at $V = 4$ (4,096) a few seconds, six at $V = 6$ (46,656) a
    minute or more. A `UserWarning` says so before the enumeration starts when it
    holds more than 10,000 trees, and more than 200,000 is a `ValueError`.
    """
    in_use = sum(1 for parent in parents if parent >= 0)
    num_trees = 1 if drafting == "deterministic" else vocab**in_use
    if _SLOW_TREES < num_trees <= _MAX_TREES:
        warnings.warn(
            f"tree_lossless_error enumerates {vocab}^{in_use} = {num_trees:,} draft "
            f"trees, about a millisecond each: expect {num_trees // 1000} s or more",
            stacklevel=2,
        )
    distribution = tree_output_distribution(
        step,
        parents,
        target,
        draft,
        vocab,
        drafting=drafting,
        tree_tokens=tree_tokens,
        target_only=target_only,
    )
    starts: dict[tuple[int, ...], float] = {}
    for sequence, probability in distribution.items():
        for length in range(len(sequence) + 1):
            prefix = sequence[:length]
            starts[prefix] = starts.get(prefix, 0.0) + probability
    error = abs(sum(distribution.values()) - 1)
    for prefix, reach in starts.items():
        # `reach` counts sequences that start with `prefix`, ended or not; those
        # that go on are the ones the next token is emitted for.
        go_on = reach - distribution.get(prefix, 0.0)
        if go_on <= 0:
            continue
        expected = go_on * np.asarray(target(prefix), np.float64)
        for a in range(vocab):
            error = max(error, abs(starts.get((*prefix, a), 0.0) - expected[a]))
    return float(error)


def check_tree_step(step: AbstractTreeStep) -> None:
    """Refuses a tree step whose rule the enumeration does not know: one other than
    [`speculax.TreeStep`][] and [`speculax.TraversalStep`][]."""
    if type(step) not in (TreeStep, TraversalStep):
        raise TypeError(
            f"step must be a TreeStep or a TraversalStep; got {type(step).__name__}"
        )


def _checked_nodes(
    step: AbstractTreeStep,
    parents: list[int],
    vocab: int,
    drafting: Drafting,
    tree_tokens: Sequence[int] | None,
) -> list[int]:
    """The draft nodes in use, after the checks of
    [`speculax.testing.tree_output_distribution`][]'s arguments: the step's kind,
    the parents, `tree_tokens` and the number of draft trees."""
    check_tree_step(step)
    num_nodes = len(parents)
    used = [j for j in range(1, num_nodes + 1) if parents[j - 1] >= 0]
    for j in used:
        parent = parents[j - 1]
        if not 0 <= parent < j or (parent > 0 and parents[parent - 1] < 0):
            raise ValueError(
                f"node {j} has parent {parent}: not in [0, {j}), or not in use"
            )
    if (drafting == "deterministic") != (tree_tokens is not None):
        raise ValueError('tree_tokens is needed exactly for drafting="deterministic"')
    if drafting != "deterministic" and vocab ** len(used) > _MAX_TREES:
        raise ValueError(f"{vocab}^{len(used)} draft trees is too many to enumerate")
    return used


def children_in_use(
    parents: Sequence[int], used: Sequence[int]
) -> dict[int, list[int]]:
    """The children of the root and of each draft node in use, in index order."""
    return {k: [j for j in used if parents[j - 1] == k] for k in [0, *used]}


def reads_one_hot_drafts(step: AbstractTreeStep, drafting: str) -> bool:
    """Whether the step reads each child's $q$ as its own one-hot: for drafts it is
    given as deterministic, or for a child test that reads no $q$."""
    return drafting in ("deterministic", "top-k") or (
        isinstance(step, TreeStep) and not step.child_test.reads_draft_probs
    )


@final
@dataclasses.dataclass
class Ends:
    """Where a tree step's walks ended: the tokens before the draw, the row of
    weights the step draws from (each distinct row stored once, by its bytes), the
    cell of the random numbers read, and a tag the walker gives it."""

    ends: list[tuple[tuple[int, ...], int, Cell, Any]] = dataclasses.field(
        default_factory=list
    )
    rows: dict[bytes, int] = dataclasses.field(default_factory=dict)
    drawn_from: list[np.ndarray] = dataclasses.field(default_factory=list)

    def emit(
        self,
        prefix: tuple[int, ...],
        weights: Float[np.ndarray, " vocab"],
        cell: Cell,
        tag: Any,
    ):
        """Records a walk that ends after the tokens `prefix` in `cell`, the final
        token drawn from `weights`."""
        if cell.probability > 0:
            row = self.rows.setdefault(weights.tobytes(), len(self.rows))
            if row == len(self.drawn_from):
                self.drawn_from.append(weights)
            self.ends.append((prefix, row, cell, tag))

    def sampler_cells(self, sampler: AbstractSampler) -> SamplerCells:
        """The cells of the final draw's uniform, from `sampler` itself, for every
        row at once; a sampler that draws a token on more than one interval is
        refused."""
        cells = sampler_cells(sampler, np.stack(self.drawn_from))
        if not np.all(cells.valid):
            raise refuse_sampler(
                "step.sampler", sampler, cells, int(np.argmin(cells.valid))
            )
        return cells

    def distribution(self, sampler: AbstractSampler) -> dict[tuple[int, ...], float]:
        """The law of the emitted tokens: each recorded end, then the token
        `sampler` draws from its row."""
        drawn = self.sampler_cells(sampler).probs()
        distribution: dict[tuple[int, ...], float] = {}
        for prefix, row, cell, _ in self.ends:
            for v in np.flatnonzero(drawn[row]):
                key = (*prefix, int(v))
                distribution[key] = (
                    distribution.get(key, 0.0) + cell.probability * drawn[row, v]
                )
        return distribution


def tree_walker(
    step: AbstractTreeStep,
    children: dict[int, list[int]],
    target: Model,
    draft: Model,
    vocab: int,
    *,
    one_hot_draft: bool,
    coin: Callable[[int], Name],
    ends: Ends,
    tag: Any = None,
    rule: Callable | None = None,
) -> "_Walker":
    """A walker of `step`'s rule over trees with these `children`, in float64,
    emitting into `ends` with `tag`: node $j$'s coin is the number `coin(j)`, and
    `rule` the step's compiled sibling rule (compiled here if not given)."""
    return _Walker(
        children=children,
        max_depth=len(children) - 1 if step.max_depth is None else step.max_depth,
        target=target,
        draft=draft,
        vocab=vocab,
        one_hot_draft=one_hot_draft,
        takes_out=one_hot_draft
        and isinstance(step, TreeStep)
        and step.siblings.takes_out_one_hot_drafts,
        subtracts_a_kept_draft=isinstance(step, TraversalStep)
        and step.siblings.subtracts_a_kept_draft,
        traverses=isinstance(step, TraversalStep),
        pass_threshold=_pass_law(step),
        sibling_rule=compiled_rule(step) if rule is None else rule,
        coin=coin,
        ends=ends,
        tag=tag,
    )


@final
@dataclasses.dataclass
class _Walker:
    """A tree step's walks, in float64, over draft trees of one shape, each test of
    a child narrowing the cell of its coin.

    A plain dataclass, not an `eqx.Module`: the walks recurse through its methods
    thousands of times, where a module would wrap each bound method in a new
    module."""

    children: dict[int, list[int]]
    max_depth: int
    target: Model
    draft: Model
    vocab: int
    # Whether each child's q is its own one-hot (target-only or given tokens).
    one_hot_draft: bool
    # Whether a rejection takes the token out of p, as `TreeStep` does for a rule
    # that `takes_out_one_hot_drafts`, rather than calling the rule on rows.
    takes_out: bool
    # Whether the traversal keeps two numbers per node, the rule stating that it is
    # p' = max(p - q, 0), q' = q: checked at every deletion.
    subtracts_a_kept_draft: bool
    traverses: bool
    # The uniform below which a child passes, from (p, q, the node's own target
    # row, the child's token), and whether the test reads its coin at all.
    pass_threshold: Callable[[np.ndarray, np.ndarray, np.ndarray, int], tuple]
    sibling_rule: Callable[[np.ndarray, np.ndarray, int], tuple[np.ndarray, np.ndarray]]
    coin: Callable[[int], Name]
    ends: Ends
    tag: Any

    def walk_tree(self, tokens: dict[int, int], cell: Cell):
        """Walks the tree with these node tokens from the root, in `cell`."""
        if self.traverses:
            self.traverse(0, 0, (), tokens, cell, [1.0])
        else:
            self.walk(0, 0, (), tokens, cell)

    def split(
        self, cell: Cell, node: int, threshold: float, reads_coin: bool = True
    ) -> tuple[Cell | None, Cell | None]:
        """The parts of `cell` where `node` passes (its coin below `threshold`) and
        where it fails; a test that reads no coin passes at threshold 1."""
        if not reads_coin:
            return (cell, None) if threshold >= 1 else (None, cell)
        name = self.coin(node)
        return (
            narrowed(cell, [(name, 0.0, threshold)]),
            narrowed(cell, [(name, threshold, 1.0)]),
        )

    def walk(
        self,
        node: int,
        depth: int,
        prefix: tuple[int, ...],
        tokens: dict[int, int],
        cell: Cell,
    ):
        """Recursive rejection sampling at `node`, reached by the tokens `prefix` in
        `cell`: each child tried in turn, passing with $\\min(1, p(c)/q(c))$, a
        rejection leaving what the sibling rule returns."""
        own = np.asarray(self.target(prefix), np.float64)
        p, q = own, np.asarray(self.draft(prefix), np.float64)
        weights = own
        taken_out, mass = set(), 1.0
        for child in self.children[node] if depth < self.max_depth else []:
            token = tokens[child]
            if self.one_hot_draft:
                q = np.eye(self.vocab)[token]
            passed, failed = self.split(
                cell, child, *self.pass_threshold(p, q, own, token)
            )
            if passed is not None:
                self.walk(child, depth + 1, (*prefix, token), tokens, passed)
            if failed is None:
                return
            cell = failed
            if self.takes_out:
                self.check_taking_out(p, q, token)
                taken_out, mass = _take_out(own, token, taken_out, mass)
                p, weights = _left_by_taking_out(own, taken_out, mass)
                continue
            left, q = self.sibling_rule(p, q, token)
            if left.sum() == 0:
                left = own
            weights, p = left, left / left.sum()
            q = q / q.sum() if q.sum() > 0 else q
        self.ends.emit(prefix, weights, cell, self.tag)

    def check_taking_out(self, p: np.ndarray, one_hot: np.ndarray, token: int):
        """Refuses a sibling rule that states `takes_out_one_hot_drafts` but leaves
        anything but $\\max(p - e_c, 0)$ for the one-hot of the rejected token."""
        left, _ = self.sibling_rule(p, one_hot, token)
        if not np.array_equal(left, np.maximum(p - one_hot, 0)):
            raise ValueError(
                "step.siblings states takes_out_one_hot_drafts = True, but does not "
                "leave max(p - q, 0) for the one-hot q of a rejected token"
            )

    def traverse(
        self,
        node: int,
        depth: int,
        prefix: tuple[int, ...],
        tokens: dict[int, int],
        cell: Cell,
        alphas: list[float],
    ) -> Cell | None:
        """Traversal verification of the subtree under `node`, entered with the
        probability `alphas[-1]` of keeping the path to it; returns the part of
        `cell` where the walk goes on past it (its test and every test under it
        failed), having updated the parent's entry of `alphas`."""
        own = np.asarray(self.target(prefix), np.float64)
        p, q = own, np.asarray(self.draft(prefix), np.float64)
        weights = own
        for child in self.children[node] if depth < self.max_depth else []:
            token = tokens[child]
            if self.one_hot_draft:
                q = np.eye(self.vocab)[token]
            alphas.append(_next_ratio(alphas[-1], float(p[token]), float(q[token])))
            path = (*prefix, token)
            going_on = self.traverse(child, depth + 1, path, tokens, cell, alphas)
            alphas.pop()
            if going_on is None:
                return None
            cell = going_on
            left, left_draft = self.sibling_rule(alphas[-1] * p, q, token)
            if self.subtracts_a_kept_draft and not (
                np.array_equal(left_draft, q)
                and np.array_equal(left, np.maximum(alphas[-1] * p - q, 0))
            ):
                raise ValueError(
                    "step.siblings states subtracts_a_kept_draft = True, but does not "
                    "return max(p - q, 0) and the q it was given"
                )
            q = left_draft
            mass = float(left.sum())
            total = mass + (1 - alphas[-1])
            alphas[-1] = mass / total if total > 0 else 1.0
            if mass == 0:
                left = own
            weights, p = left, left / left.sum()
            q = q / q.sum() if q.sum() > 0 else q
        if node == 0:
            # The root always passes.
            self.ends.emit(prefix, weights, cell, self.tag)
            return None
        kept, going_on = self.split(cell, node, min(max(alphas[-1], 0.0), 1.0))
        if kept is not None:
            self.ends.emit(prefix, weights, kept, self.tag)
        return going_on


def _take_out(
    own: np.ndarray, token: int, taken_out: set[int], mass: float
) -> tuple[set[int], float]:
    """The tokens taken out of the target row `own` and the mass left, after a
    rejection of `token`, as `TreeStep` keeps them: a token already out takes
    nothing more."""
    mass -= 0.0 if token in taken_out else float(own[token])
    return taken_out | {token}, mass


def _left_by_taking_out(
    own: np.ndarray, taken_out: set[int], mass: float
) -> tuple[np.ndarray, np.ndarray]:
    """`(p, weights)` after tokens are taken out of `own`: the target the next
    child is tested against, `own` without them divided by the mass left, and the
    weights a final token would be drawn from (`own` where nothing is left)."""
    left = np.where(np.isin(np.arange(own.shape[0]), list(taken_out)), 0, own)
    return left / mass, left if np.any(left > 0) else own


def _next_ratio(ratio: float, target_at: float, draft_at: float) -> float:
    """$\\min(1, \\alpha \\, p(c) / q(c))$, with the step's rule for zeros."""
    kept = ratio * target_at
    if kept >= draft_at:
        return 1.0 if kept > 0 else 0.0
    return kept / draft_at


def _pass_law(
    step: AbstractTreeStep,
) -> Callable[[np.ndarray, np.ndarray, np.ndarray, int], tuple[float, bool]]:
    """The uniform below which `step`'s child test passes a child of token `token`,
    from the node's current $(p, q)$ and its own target row, and whether the test
    reads its coin: for [`speculax.RatioChildTest`][] (and the traversal, whose
    test is its own) $u \\, q(c) < p(c)$; for [`speculax.GreedyChildTest`][] 1 or 0,
    reading no coin. Any other test is refused, as its law cannot be read from
    it."""
    test = step.child_test if isinstance(step, TreeStep) else RatioChildTest()
    if isinstance(test, RatioChildTest):
        return lambda p, q, own, token: (
            _pass_probability(float(p[token]), float(q[token])),
            True,
        )
    if isinstance(test, GreedyChildTest):
        return lambda p, q, own, token: (float(token == int(np.argmax(own))), False)
    raise ValueError(
        "step.child_test must be RatioChildTest or GreedyChildTest, whose laws the "
        f"enumeration knows; got {type(test).__name__}"
    )


def _pass_probability(target_at: float, draft_at: float) -> float:
    """The probability that $u \\, q(c) < p(c)$ for a uniform $u$: the uniform
    below which it holds."""
    if draft_at > 0:
        return min(1.0, target_at / draft_at)
    return 1.0 if target_at > 0 else 0.0


def _draft_trees(
    used: list[int],
    parents: list[int],
    draft: Model,
    vocab: int,
    drafting: Drafting,
) -> Iterator[tuple[dict[int, int], float]]:
    """Every assignment of tokens to the used nodes, with its probability under the
    drafter; assignments of probability 0 are left out."""
    for values in itertools.product(range(vocab), repeat=len(used)):
        tokens = dict(zip(used, values, strict=True))
        weight = 1.0
        for j in used:
            parent = parents[j - 1]
            prefix = _path(j, parents, tokens)[:-1]
            q = np.asarray(draft(prefix), np.float64)
            token = tokens[j]
            if drafting == "independent":
                weight *= q[token]
            else:
                before = [tokens[k] for k in used if k < j and parents[k - 1] == parent]
                if token in before:
                    weight = 0.0
                    break
                remaining = 1 - sum(q[t] for t in before)
                weight *= q[token] / remaining if remaining > 0 else 0.0
            if weight == 0:
                break
        if weight > 0:
            yield tokens, weight


def _path(node: int, parents: list[int], tokens: dict[int, int]) -> tuple[int, ...]:
    """The tokens on the path from the root to `node`, the node's own last."""
    path = []
    while node > 0:
        path.append(tokens[node])
        node = parents[node - 1]
    return tuple(reversed(path))


def compiled_rule(
    step: AbstractTreeStep,
) -> Callable[[np.ndarray, np.ndarray, int], tuple[np.ndarray, np.ndarray]]:
    """The step's sibling rule on float64 NumPy rows, compiled once, and called once
    for each distinct `(p, q, token)`: the draft trees of an enumeration share their
    prefixes, and a call of a compiled function costs a millisecond."""
    rule = eqx.filter_jit(step.siblings)
    answers: dict[tuple[bytes, bytes, int], tuple[np.ndarray, np.ndarray]] = {}

    def call(p, q, token):
        p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
        key = (p.tobytes(), q.tobytes(), int(token))
        if key not in answers:
            with jax.enable_x64(True):
                left, draft = rule(
                    jnp.asarray(p), jnp.asarray(q), jnp.asarray(token, jnp.int32)
                )
            answers[key] = np.asarray(left, np.float64), np.asarray(draft, np.float64)
        left, draft = answers[key]
        return left.copy(), draft.copy()

    return call
