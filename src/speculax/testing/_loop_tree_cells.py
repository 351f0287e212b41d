"""The cells of one round of the loop's random numbers with a draft tree: every tree
the drafter can fill from each state, every walk of the step over it and every drawn
token, with its probability, found from the step's own rule and pieces."""

import itertools
from collections.abc import Callable, Iterator

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._loop._cache import Model, as_cached_model, read_history
from .._loop._draft_tree import DraftTree
from .._loop._drafter import AbstractDrafter
from .._loop._dynamic_tree import DynamicTree, log_probability
from .._loop._keys import ACCEPT, DRAFT, SAMPLE
from .._loop._loop import SpeculativeLoop
from .._loop._model_drafter import history_logits
from .._loop._sampling import RowParameters, row_probs
from .._loop._tree_round import tree_rows
from .._tree._abstract import AbstractTreeStep
from ._cells import (
    Cell,
    Leaf,
    Name,
    States,
    cdf_edges,
    history_buffer,
    leaf_at_middle,
    narrowed,
)
from ._chain import in_chunks
from ._loop_cells import per_row
from ._tree import (
    Ends,
    check_tree_step,
    children_in_use,
    compiled_rule,
    reads_one_hot_drafts,
    tree_walker,
)


# A row of each model at every prefix of a state's trees: (draft, target), float64.
Rows = dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]]


def tree_step_leaves(
    loop: SpeculativeLoop,
    drafter: AbstractDrafter,
    target_model: Model,
    prompt: tuple[int, ...],
    states: States,
    names: dict[int, list[Name]],
    parameters: RowParameters,
) -> list[Leaf]:
    """Every cell of one round's random numbers with a draft tree, from each state,
    with positive probability: each tree the drafter fills narrows the `DRAFT`
    numbers of its nodes, each walk of the step the `ACCEPT` numbers of the nodes
    it tests, each drawn token the `SAMPLE` number.

    **Arguments:**

    As for `step_leaves`: the loop, with its `draft_tree` and tree step, the
    drafter (a draft model's) and the target,
    the prompt, the states, the names of the round's numbers and the parameters.

    **Returns:**

    The cells, as `Leaf`s, `drafts` the tree's tokens by node (`-1` for a node left
    out) followed by its parents (`-1` for a node left out), and `kept` the
    accepted path's tokens.
    """
    tree, step = loop.draft_tree, loop.step
    assert tree is not None and isinstance(step, AbstractTreeStep)
    check_tree_step(step)
    rows = _state_rows(loop, drafter, target_model, prompt, states, parameters)
    rule = compiled_rule(step)
    ends = Ends()
    for state, (((_, constraints), probability), state_rows) in enumerate(
        zip(states, rows, strict=True)
    ):
        start = Cell(dict(constraints), probability)
        _walk_every_tree(loop, state, state_rows, start, names, ends, rule)
    return _drawn_leaves(step, ends, names)


def _walk_every_tree(
    loop: SpeculativeLoop,
    state: int,
    rows: Rows,
    start: Cell,
    names: dict[int, list[Name]],
    ends: Ends,
    rule: Callable,
) -> None:
    """Walks the step over every tree the drafter fills from one state, in `start`,
    emitting the walks' ends into `ends` tagged with the state and the tree."""
    tree, step = loop.draft_tree, loop.step
    assert tree is not None and isinstance(step, AbstractTreeStep)

    def draft(prefix: tuple[int, ...]) -> np.ndarray:
        return rows[prefix][0]

    def target(prefix: tuple[int, ...]) -> np.ndarray:
        return rows[prefix][1]

    trees = (
        [(grown(tree, draft), start)]
        if isinstance(tree, DynamicTree)
        else drafted_trees(tree, draft, start, names[DRAFT])
    )
    for (tokens, parents), cell in trees:
        used = [j for j, token in enumerate(tokens, start=1) if token >= 0]
        walker = tree_walker(
            step,
            children_in_use(parents, used),
            target,
            draft,
            len(rows[()][0]),
            one_hot_draft=reads_one_hot_drafts(step, tree.drafting),
            coin=lambda node: names[ACCEPT][node - 1],
            ends=ends,
            tag=(state, (*tokens, *parents)),
            rule=rule,
        )
        walker.walk_tree({j: tokens[j - 1] for j in used}, cell)


def drafted_trees(
    tree: DraftTree,
    draft_row: Callable[[tuple[int, ...]], np.ndarray],
    cell: Cell,
    names: list[Name],
) -> Iterator[tuple[tuple[tuple[int, ...], tuple[int, ...]], Cell]]:
    """Every tree the loop's drafter can fill, as the tokens and the parents of its
    nodes (`-1` for a node left out), with the part of `cell` in which the `DRAFT`
    numbers `names` draw it: node $j$'s token by inverse CDF with number $j - 1$
    from the row `draft_row(path to its parent)`, without its earlier siblings'
    tokens for `"without replacement"` (left out, with the nodes below it, when
    none is left); or, for `"top-k"`, the token of its rank in that row, reading
    no number."""

    def fill(tokens: tuple[int, ...], cell: Cell) -> Iterator[tuple]:
        j = len(tokens) + 1
        if j > tree.num_nodes:
            parents = tuple(
                parent if token >= 0 else -1
                for parent, token in zip(tree.parents, tokens, strict=True)
            )
            yield (tokens, parents), cell
            return
        parent = tree.parents[j - 1]
        if parent and tokens[parent - 1] < 0:
            yield from fill((*tokens, -1), cell)
            return
        row = draft_row(_path(tree, parent, tokens))
        if tree.drafting == "top-k":
            ranked = np.argsort(-row, kind="stable")
            yield from fill((*tokens, int(ranked[tree.ranks[j - 1]])), cell)
            return
        weights = np.array(row, np.float64)
        if tree.drafting == "without replacement":
            earlier = [tokens[k - 1] for k in tree.children(parent) if k < j]
            weights[[token for token in earlier if token >= 0]] = 0
            if not weights.sum() > 0:
                yield from fill((*tokens, -1), cell)
                return
        edges = cdf_edges(weights)
        for token in range(len(weights)):
            drawn = narrowed(cell, [(names[j - 1], edges[token], edges[token + 1])])
            if drawn is not None:
                yield from fill((*tokens, token), drawn)

    return fill((), cell)


def grown(
    tree: DynamicTree, draft_row: Callable[[tuple[int, ...]], np.ndarray]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The tree a `DynamicTree` grows from the rows `draft_row(path)`, as its
    docstring defines it, read literally: its tokens and parents by node. Each
    score is summed in the rows' dtype, its terms by the loop's own
    `log_probability`, so that a tie the loop sees, this reading sees too."""

    def log_row(path: tuple[int, ...]) -> np.ndarray:
        return np.asarray(log_probability(jnp.asarray(draft_row(path))))

    def ranked(path: tuple[int, ...]) -> list[int]:
        # Ties to the lower token.
        return np.argsort(-draft_row(path), kind="stable")[: tree.top_k].tolist()

    # Each candidate as (score, path, parent's number), numbered from 1.
    candidates = [(log_row(())[token], (token,), 0) for token in ranked(())]
    expanded = list(range(1, tree.top_k + 1))
    for _ in range(1, tree.depth):
        first = len(candidates)
        for number in expanded:
            score, path, _ = candidates[number - 1]
            row = log_row(path)
            candidates += [
                (score + row[token], (*path, token), number) for token in ranked(path)
            ]
        level = range(first + 1, len(candidates) + 1)
        expanded = sorted(level, key=lambda n: (-candidates[n - 1][0], n))[: tree.top_k]
    numbers = range(1, len(candidates) + 1)
    kept = sorted(
        sorted(numbers, key=lambda n: (-candidates[n - 1][0], n))[: tree.num_nodes]
    )
    node_of = {number: node for node, number in enumerate(kept, start=1)} | {0: 0}
    return (
        tuple(candidates[n - 1][1][-1] for n in kept),
        tuple(node_of[candidates[n - 1][2]] for n in kept),
    )


def _path(tree: DraftTree, node: int, tokens: tuple[int, ...]) -> tuple[int, ...]:
    """The tokens on the path from the root to `node`, the node's own last."""
    path = []
    while node > 0:
        path.append(tokens[node - 1])
        node = tree.parents[node - 1]
    return tuple(reversed(path))


def _drawn_leaves(
    step: AbstractTreeStep, ends: Ends, names: dict[int, list[Name]]
) -> list[Leaf]:
    """The leaves of every end of the walks: each token the sampler draws from the
    end's row, on its interval of the `SAMPLE` number (none for a sampler that
    reads no uniform)."""
    if not ends.ends:
        return []
    cells = ends.sampler_cells(step.sampler)
    leaves = []
    for kept, row, cell, (state, drafts) in ends.ends:
        for low, high, token in zip(
            cells.lows[row], cells.highs[row], cells.tokens[row], strict=True
        ):
            if high <= low:
                continue
            uses = (
                [(names[SAMPLE][0], low, high)] if step.sampler.reads_uniforms else []
            )
            sampled = narrowed(cell, uses)
            if sampled is not None:
                leaves.append(
                    leaf_at_middle(state, sampled, names, drafts, kept, int(token))
                )
    return leaves


def _state_rows(
    loop: SpeculativeLoop,
    drafter: AbstractDrafter,
    target_model: Model,
    prompt: tuple[int, ...],
    states: States,
    parameters: RowParameters,
) -> list[Rows]:
    """Each state's rows of both models after every sequence of up to $D$ tokens:
    the drafter's (row $d$ of the drafts after the history, for a sequence of $d$
    tokens: a draft model's as `loop.draft_sampling` makes them), the target's
    under the parameters, in float64."""
    tree = loop.draft_tree
    assert tree is not None
    model = as_cached_model(target_model, "target_model")
    vocab = jax.eval_shape(
        lambda tokens: history_logits(model, tokens, tokens),
        jax.ShapeDtypeStruct((1, 1), jnp.int32),
    ).shape[-1]
    suffixes = [
        suffix
        for depth in range(tree.depth + 1)
        for suffix in itertools.product(range(vocab), repeat=depth)
    ]
    histories = [
        prompt + generated + suffix
        for (generated, _), _ in states
        for suffix in suffixes
    ]
    # One width for every step, so that the rows are compiled for once.
    width = len(prompt) + loop.max_new_tokens + tree.depth
    buffer, lengths = history_buffer(histories, width)
    levels = np.tile([len(suffix) for suffix in suffixes], len(states))
    draft, target = in_chunks(
        lambda *rows: _rows_after(loop, drafter, target_model, parameters, *rows),
        buffer,
        (lengths - levels).astype(np.int32),
        levels.astype(np.int32),
    )
    count = len(suffixes)
    return [
        {
            suffix: (draft[state * count + k], target[state * count + k])
            for k, suffix in enumerate(suffixes)
        }
        for state in range(len(states))
    ]


@eqx.filter_jit
def _rows_after(
    loop: SpeculativeLoop,
    drafter: AbstractDrafter,
    target_model: Model,
    parameters: RowParameters,
    buffer: jax.Array,
    length: jax.Array,
    level: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Both models' rows after each history of `length` tokens followed by `level`
    more: the drafter's row of draft `level` after the history, as `drawn_after`
    promises it (a draft model's by `loop.draft_sampling`), the target's by the
    parameters' rule."""
    parameters = per_row(parameters, buffer.shape[0])
    target_logits, target_cache = read_history(
        as_cached_model(target_model, "target_model"),
        buffer,
        buffer.shape[1],
        "target_model",
    )
    tree = loop.draft_tree
    assert tree is not None
    draft = tree_rows(
        drafter,
        buffer,
        length,
        target_cache,
        tree.depth,
        parameters,
        loop.draft_sampling,
    )
    rows = jnp.arange(length.shape[0])
    target = row_probs(target_logits[rows, length + level - 1], parameters)
    # A node of depth D has no children: its draft row is never read.
    return draft[rows, jnp.minimum(level, tree.depth - 1)], target
