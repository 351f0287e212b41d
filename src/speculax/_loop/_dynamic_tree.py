"""A draft tree grown anew each round from the drafter's confidences, as EAGLE-2
grows it: each row keeps the nodes its draft finds most likely."""

from collections.abc import Callable
from typing import Literal, NamedTuple, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PyTree

from .._core._checks import check_static_int
from .._core._numerics import integer_by_value


@final
class DynamicTree(eqx.Module):
    """The draft tree of every round of a [`speculax.SpeculativeLoop`][], grown for
    each row from its drafter's rows, as EAGLE-2 (Li et al., 2024) grows it: the
    $N$ nodes with the highest cumulative draft log-probability among those the
    expansion reaches.

    Each draft node's score is $\\sum \\min(\\log q, 0)$ over its path, $q$ the
    drafter's row after the path to the node's parent, summed in the rows' dtype.
    The expansion reaches, level by level:

    - depth 1: the $k$ most likely tokens of the row after the history (ties to
        the lower token), the expanded nodes of depth 1;
    - depth $d + 1$, for $d = 1, \\dots, D - 1$: the $k$ most likely tokens of
        the row after each expanded node of depth $d$, $k^2$ candidates; the $k$
        of highest score (ties to the lower number) are the expanded nodes of
        depth $d + 1$.

    The candidates are numbered in that order: depth 1 by rank, then each depth's
    by expanded node (in order of score) and rank. The round's tree keeps the $N$
    of highest score (ties to the lower number), in the order of their numbers:
    as a node scores no more than its parent, and comes after it, every kept
    node's parent is kept. The drafts are deterministic, a function of the
    history, and a [`speculax.TreeStep`][] verifies them as such
    (`draft_probs=None`: a node passes with the target's probability of it), which
    is lossless whatever the tree's shape in each row.

    The drafter is a draft model, or one without a state that promises rows of
    its drafts (`drawn_after`), such as [`speculax.EagleHead`][] or
    [`speculax.MedusaHeads`][]. The row after a node is the drafter's row after
    the history followed by the node's path, under the loop's `draft_sampling`
    and the row's parameters: a draft model reads, at each depth, every node
    expanded so far with its cache (each seeing its ancestors) in one call; a
    stateless drafter gives row $d$ of its drafts after the path of a node of
    depth $d$.

    **Arguments:**

    Keyword only, static positive integers:

    - `num_nodes`: $N$, the draft nodes of each row's tree, at most the
        $k + (D - 1) k^2$ candidates.
    - `depth`: $D$, the depth the expansion reaches.
    - `top_k`: $k$, the children ranked after each expanded node, and the nodes
        expanded at each depth; at most $V$.

    **Example:**

    ```python
    import speculax

    tree = speculax.DynamicTree(num_nodes=6, depth=3, top_k=2)
    assert tree.num_candidates == 10
    ```
    """

    num_nodes: int = eqx.field(static=True, kw_only=True, converter=integer_by_value)
    depth: int = eqx.field(static=True, kw_only=True, converter=integer_by_value)
    top_k: int = eqx.field(static=True, kw_only=True, converter=integer_by_value)

    def __check_init__(self):
        for name in ("num_nodes", "depth", "top_k"):
            check_static_int(name, getattr(self, name), minimum=1)
        if self.num_nodes > self.num_candidates:
            raise ValueError(
                f"num_nodes must be at most the k + (D - 1) k^2 = "
                f"{self.num_candidates} candidates the expansion reaches at "
                f"top_k = {self.top_k} and depth = {self.depth}; got {self.num_nodes}"
            )

    @property
    def drafting(self) -> Literal["top-k"]:
        """How each node's children are filled: by rank, deterministic drafts."""
        return "top-k"

    @property
    def num_candidates(self) -> int:
        """The nodes the expansion reaches, $k + (D - 1) k^2$."""
        return self.top_k + (self.depth - 1) * self.top_k**2

    def check_vocabulary(self, vocab: int) -> None:
        """Raises unless rows of `vocab` tokens rank `top_k` children."""
        if self.top_k > vocab:
            raise ValueError(
                f"the dynamic tree's top_k = {self.top_k} is more than the "
                f"V = {vocab} tokens each row ranks"
            )


class ExpandedNodes(NamedTuple):
    """The nodes expanded so far in each row, depth by depth, $k$ per depth: a list
    of $M = (D - 1) k$ entries, entry $(d - 1) k + i$ the $i$-th expanded node of
    depth $d$. `tokens` and `parents`, int32 `(B, M)`: each entry's token and its
    parent's entry (`-1` for the root); an entry not yet expanded has token 0 and
    parent `-1`."""

    tokens: Int[Array, "batch expanded"]
    parents: Int[Array, "batch expanded"]


# The drafter's rows after the $k$ expanded nodes of depth $d$: from the `(B, k, D)`
# tokens of their paths (0 past their end), $d$, every node expanded so far, and
# what the drafter carries from one depth to the next (a draft model's cache), to
# the `(B, k, V)` rows and what it carries on.
RowsAfter = Callable[
    [Int[Array, "batch k depth"], Int[Array, ""], ExpandedNodes, PyTree],
    tuple[Float[Array, "batch k vocab"], PyTree],
]


class GrownTree(NamedTuple):
    """Each row's grown tree: `parents` and `tokens`, int32 `(B, N)`, each draft
    node's parent (0 the root) and token; `expanded`, int32 `(B, N)`, each node's
    entry among the `ExpandedNodes` at the end (`-1` for a node not expanded)."""

    parents: Int[Array, "batch nodes"]
    tokens: Int[Array, "batch nodes"]
    expanded: Int[Array, "batch nodes"]


def grown_tree(
    tree: DynamicTree,
    root_row: Float[Array, "batch vocab"],
    rows_after: RowsAfter,
    carried: PyTree = None,
) -> tuple[GrownTree, PyTree]:
    """Each row's tree, grown as [`speculax.DynamicTree`][] defines it, from the
    drafter's row after the history, `root_row`, and its rows after the nodes
    expanded at each depth, `rows_after`, which carries `carried` from one depth
    to the next; and what it carried last."""
    k, depth = tree.top_k, tree.depth
    batch = root_row.shape[0]
    first_probs, first_tokens = jax.lax.top_k(root_row, k)
    first_scores = log_probability(first_probs)
    candidates = _Candidates(
        tokens=_written(
            jnp.zeros((batch, tree.num_candidates), jnp.int32), first_tokens, 0
        ),
        # Each candidate's parent's number: 0 the root, candidate c's c + 1.
        parents=jnp.zeros((batch, tree.num_candidates), jnp.int32),
        scores=_written(
            jnp.full((batch, tree.num_candidates), -jnp.inf, first_scores.dtype),
            first_scores,
            0,
        ),
        paths=_written(
            jnp.zeros((batch, tree.num_candidates, depth), jnp.int32),
            jnp.zeros((batch, k, depth), jnp.int32).at[:, :, 0].set(first_tokens),
            0,
        ),
    )
    # Each entry's candidate, -1 until expanded: depth 1's are the first k.
    entries = jnp.arange((depth - 1) * k, dtype=jnp.int32)
    listed = jnp.broadcast_to(
        jnp.where(entries < k, entries, -1), (batch, len(entries))
    )

    def level(d: Int[Array, ""], carry: tuple) -> tuple:
        candidates, listed, carried = carry
        expanded = jax.lax.dynamic_slice_in_dim(listed, (d - 1) * k, k, axis=1)
        rows, carried = rows_after(
            candidates.paths[jnp.arange(batch)[:, None], expanded],
            d,
            _expanded_nodes(candidates, listed),
            carried,
        )
        candidates, expanded = _expanded_level(candidates, expanded, rows, d, k)
        at = d * k + jnp.arange(k)
        return candidates, listed.at[:, at].set(expanded, mode="drop"), carried

    if depth > 1:
        candidates, listed, carried = jax.lax.fori_loop(
            1, depth, level, (candidates, listed, carried)
        )
    # Ties to the lower number: a parent, which scores at least its children's
    # scores and comes before them, is kept before any of them.
    kept = jnp.sort(jax.lax.top_k(candidates.scores, tree.num_nodes)[1], axis=1)
    rows = jnp.arange(batch)[:, None]
    node_of = (
        jnp.zeros((batch, tree.num_candidates + 1), jnp.int32)
        .at[rows, kept + 1]
        .set(jnp.arange(1, tree.num_nodes + 1, dtype=jnp.int32))
    )
    grown = GrownTree(
        parents=node_of[rows, candidates.parents[rows, kept]],
        tokens=candidates.tokens[rows, kept],
        expanded=_entries(listed, tree.num_candidates)[rows, kept + 1],
    )
    return grown, carried


def log_probability(probs: Array) -> Array:
    """$\\min(\\log q, 0)$, in the rows' dtype: a node's score is its parent's plus
    this, never more than its parent's, even for a row that rounds above 1."""
    return jnp.minimum(jnp.log(probs), 0)


class _Candidates(eqx.Module):
    """The candidates reached so far, each row's `(B, C)`: tokens, parents'
    numbers, scores, and `paths`, `(B, C, D)`, the tokens of the path to each."""

    tokens: Int[Array, "batch candidates"]
    parents: Int[Array, "batch candidates"]
    scores: Float[Array, "batch candidates"]
    paths: Int[Array, "batch candidates depth"]


def _entries(
    listed: Int[Array, "batch expanded"], num_candidates: int
) -> Int[Array, "batch numbers"]:
    """Each candidate's entry among the expanded nodes, by its number (0 the root),
    `-1` for one not expanded."""
    batch, size = listed.shape
    number = jnp.where(listed >= 0, listed + 1, num_candidates + 1)
    return (
        jnp.full((batch, num_candidates + 1), -1, jnp.int32)
        .at[jnp.arange(batch)[:, None], number]
        .set(jnp.arange(size, dtype=jnp.int32), mode="drop")
    )


def _expanded_nodes(
    candidates: _Candidates, listed: Int[Array, "batch expanded"]
) -> ExpandedNodes:
    """The `ExpandedNodes` of the candidates `listed`."""
    rows = jnp.arange(listed.shape[0])[:, None]
    candidate = jnp.maximum(listed, 0)
    entry_of = _entries(listed, candidates.tokens.shape[1])
    listed_in = listed >= 0
    return ExpandedNodes(
        tokens=jnp.where(listed_in, candidates.tokens[rows, candidate], 0),
        parents=jnp.where(
            listed_in, entry_of[rows, candidates.parents[rows, candidate]], -1
        ),
    )


def _expanded_level(
    candidates: _Candidates,
    expanded: Int[Array, "batch k"],
    rows: Float[Array, "batch k vocab"],
    d: Int[Array, ""],
    k: int,
) -> tuple[_Candidates, Int[Array, "batch k"]]:
    """The candidates of depth $d + 1$, the children in `rows` of the expanded
    nodes of depth $d$, added, and the expanded nodes of depth $d + 1$."""
    batch, _, depth = candidates.paths.shape
    index = jnp.arange(batch)[:, None]
    paths = candidates.paths[index, expanded]
    probs, tokens = jax.lax.top_k(rows, k)
    scores = log_probability(probs)
    scores = (candidates.scores[index, expanded][:, :, None] + scores).reshape(
        batch, -1
    )
    tokens = tokens.reshape(batch, -1)
    child_paths = jnp.repeat(paths, k, axis=1)
    child_paths = jnp.where(jnp.arange(depth) == d, tokens[:, :, None], child_paths)
    first = k + (d - 1) * k * k
    candidates = _Candidates(
        tokens=_written(candidates.tokens, tokens, first),
        parents=_written(
            candidates.parents, jnp.repeat(expanded + 1, k, axis=1), first
        ),
        scores=_written(candidates.scores, scores, first),
        paths=_written(candidates.paths, child_paths, first),
    )
    return candidates, first + jax.lax.top_k(scores, k)[1]


def _written(array: Array, new: Array, first: Int[Array, ""] | int) -> Array:
    """`array` with `new` written along axis 1 from `first` on."""
    return jax.lax.dynamic_update_slice_in_dim(
        array, new.astype(array.dtype), first, axis=1
    )


def ancestor_mask(
    parents: Int[Array, "batch nodes"], depth: int
) -> tuple[Bool[Array, "batch positions positions"], Int[Array, "batch positions"]]:
    """Each row's ancestor mask of a tree given by its parents (root 0), entry
    $[k, j]$ whether node $j$ is node $k$ or one of its ancestors, and each node's
    depth, for trees of depth at most `depth`."""
    batch, num_nodes = parents.shape
    nodes = jnp.arange(num_nodes + 1, dtype=jnp.int32)
    # The root is its own parent, so that a walk up stays there.
    parent_of = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), parents], axis=1)

    def up(_: Int[Array, ""], carry: tuple) -> tuple:
        ancestor, mask, depths = carry
        depths = depths + (ancestor > 0)
        ancestor = jnp.take_along_axis(parent_of, ancestor, axis=1)
        return ancestor, mask | (ancestor[:, :, None] == nodes), depths

    start = jnp.broadcast_to(nodes, (batch, num_nodes + 1))
    _, mask, depths = jax.lax.fori_loop(
        0,
        depth,
        up,
        (start, start[:, :, None] == nodes, jnp.zeros_like(start)),
    )
    return mask, depths
