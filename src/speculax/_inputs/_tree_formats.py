"""Draft trees in the formats serving engines use, as the `parents` of
[`speculax.TreeStep`][]. Host-side NumPy: a tree's shape is known before the step
runs."""

from collections.abc import Sequence
from typing import Any

import numpy as np
from jaxtyping import Int

from .._core._numerics import host_integers, is_integer_array, static_integer
from ._input_array import InputArray


def parents_from_paths(
    paths: Sequence[Sequence[Any]],
) -> Int[np.ndarray, " nodes"]:
    """The `parents` of a tree given as vLLM's `speculative_token_tree`: one path of
    child ranks per draft node, e.g. `[(0,), (1,), (0, 0), (0, 1)]` for two children
    of the root and two of its first child.

    Node $j$ of the step is `paths[j - 1]`, so the order of the list is the order of
    the nodes: every path must come after its parent's, and siblings in the order of
    their ranks, which is the order the step tries them in.

    **Arguments:**

    - `paths`: a sequence of $N$ non-empty sequences of non-negative integers
        (Python or NumPy ints, read by value).

    **Returns:**

    An int32 NumPy array of shape `(N,)`; tile it over the batch.

    **Raises:**

    `TypeError` for a rank that is not an integer (a float or a bool); `ValueError`
    for no paths, an empty, repeated or negative path, a path before its parent,
    or siblings that do not hold the ranks $0, 1, \\dots$ in turn.

    **Example:**

    ```python
    import speculax

    parents = speculax.parents_from_paths([(0,), (1,), (0, 0), (0, 1)])
    assert parents.tolist() == [0, 0, 1, 1]
    ```
    """
    if len(paths) == 0:
        raise ValueError("paths must hold at least one path, a tree of draft nodes")
    node_of: dict[tuple[int, ...], int] = {(): 0}
    last_rank: dict[tuple[int, ...], int] = {}
    parents = []
    for j, given in enumerate(paths, start=1):
        # By value, never truncated: a rank of 1.5 is not rank 1.
        path = tuple(
            static_integer(rank, f"paths[{j - 1}][{k}]") for k, rank in enumerate(given)
        )
        if not path or min(path) < 0:
            raise ValueError(
                f"paths[{j - 1}] must be non-empty and non-negative: {path}"
            )
        if path in node_of:
            raise ValueError(f"paths[{j - 1}] repeats the path {path}")
        parent = path[:-1]
        if parent not in node_of:
            raise ValueError(
                f"paths[{j - 1}] = {path} comes before its parent {parent}"
            )
        # A rank is which of the parent's candidates the node holds (its k-th most
        # likely token for top-k drafts): a gap renumbered would change the tree.
        if path[-1] != last_rank.get(parent, -1) + 1:
            raise ValueError(
                f"paths[{j - 1}] = {path} is not the next rank: siblings come in "
                f"the order of their ranks 0, 1, ..., and those before it have "
                f"ranks 0 to {last_rank.get(parent, -1)}"
            )
        last_rank[parent] = path[-1]
        node_of[path] = j
        parents.append(node_of[parent])
    return np.asarray(parents, np.int32)


def tree_from_linked_lists(
    next_token: InputArray, next_sibling: InputArray
) -> tuple[Int[np.ndarray, "batch nodes"], Int[np.ndarray, "batch nodes+1"]]:
    """The `parents` of trees given as SGLang's and TensorRT-LLM's first-child /
    next-sibling arrays (`retrive_next_token`, `retrive_next_sibling`), with the order
    to put each row's nodes in.

    In those arrays position 0 is the root, `next_token[b, i]` is the first child of
    position $i$ and `next_sibling[b, i]` the next sibling (`-1` for none); a
    position's children are tried first child first. The step wants parents before
    children and siblings in index order, so the nodes are renumbered depth first:
    step node $k$ of row $b$ is engine position `order[b, k]`. Gather the step's
    inputs with it: `tree_tokens = candidates[b, order[b, 1:]]`, and rows
    `order[b]` of the draft and target probabilities; the step's `accepted_nodes`
    map back to engine positions (KV-cache entries) as `order[b, accepted_nodes]`.
    Positions no list reaches are left out; their slots come last, with parent `-1`
    and order `0`.

    **Arguments:**

    - `next_token`, `next_sibling`: integer `(B, M)`, $M = N + 1$ positions, any
        integer dtype (NumPy or JAX arrays, or nested lists), read by value.

    **Returns:**

    `parents`, int32 `(B, N)`, and `order`, int32 `(B, N + 1)`.

    **Raises:**

    `TypeError` for arrays that are not integers (floats, bools); `ValueError` for
    shapes that disagree, no positions at all, an index outside `[-1, M)`, a
    position reached twice (a cycle or a shared child), the root as a child, or a
    sibling of the root.

    **Example:**

    ```python
    import numpy as np
    import speculax

    # The root's children are positions 1 and 2; position 1's are 4, then 3.
    parents, order = speculax.tree_from_linked_lists(
        np.array([[1, 4, -1, -1, -1]]), np.array([[-1, 2, -1, -1, 3]])
    )
    assert parents.tolist() == [[0, 1, 1, 0]]
    assert order.tolist() == [[0, 1, 4, 3, 2]]
    ```
    """
    next_token = _links(next_token, "next_token")
    next_sibling = _links(next_sibling, "next_sibling")
    if next_token.ndim != 2 or next_token.shape != next_sibling.shape:
        raise ValueError(
            "next_token and next_sibling must have the same shape (B, M); got "
            f"{next_token.shape} and {next_sibling.shape}"
        )
    batch, positions = next_token.shape
    if positions == 0:
        raise ValueError(
            "next_token must hold the root at position 0; got no positions"
        )
    for name, links in (("next_token", next_token), ("next_sibling", next_sibling)):
        # Compared by value, in the dtype given (exactly, for Python ints).
        outside = ((links < -1) | (links >= positions)).astype(bool)
        if np.any(outside):
            b, i = np.argwhere(outside)[0]
            raise ValueError(
                f"{name} must lie in [-1, {positions}); got {links[b, i]} at [{b}, {i}]"
            )
    # In range, so int64 holds them (Python ints beyond 64 bits are refused above).
    next_token, next_sibling = (
        next_token.astype(np.int64),
        next_sibling.astype(np.int64),
    )
    if np.any(next_sibling[:, 0] != -1):
        raise ValueError("next_sibling must be -1 at position 0: the root has none")
    parents = np.full((batch, positions - 1), -1, np.int32)
    order = np.zeros((batch, positions), np.int32)
    for b in range(batch):
        numbered = [0]
        new_index = {0: 0}
        # Depth first, children in list order: a stack of (position, its parent).
        stack = _children(0, next_token[b], next_sibling[b], positions)[::-1]
        stack = [(child, 0) for child in stack]
        while stack:
            position, parent = stack.pop()
            if position in new_index:
                raise ValueError(
                    f"row {b}: position {position} is reached twice (a cycle, a "
                    "shared child, or the root as a child)"
                )
            new_index[position] = len(numbered)
            parents[b, len(numbered) - 1] = new_index[parent]
            numbered.append(position)
            children = _children(position, next_token[b], next_sibling[b], positions)
            stack.extend((child, position) for child in reversed(children))
        order[b, : len(numbered)] = numbered
    return parents, order


def _links(x: InputArray, name: str) -> np.ndarray:
    """One of the linked lists as a NumPy array of its integers, exactly
    (`host_integers`); a `TypeError` naming it for floats or bools, which
    positions never are."""
    links = host_integers(x)
    if not is_integer_array(links):
        raise TypeError(f"{name} must have an integer dtype; got {links.dtype}")
    return links


def _children(
    position: int,
    next_token: Int[np.ndarray, " positions"],
    next_sibling: Int[np.ndarray, " positions"],
    positions: int,
) -> list[int]:
    """The children of `position`, first child first, by the linked lists."""
    children = []
    child = int(next_token[position])
    while child != -1:
        children.append(child)
        if len(children) > positions:
            raise ValueError(f"the siblings after position {position} form a cycle")
        child = int(next_sibling[child])
    return children
