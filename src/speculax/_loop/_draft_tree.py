"""The static tree a loop drafts each round: its shape, how the draft model fills it,
and the facts about its nodes that the round's calls are built from."""

from collections.abc import Sequence
from typing import Literal, final

import equinox as eqx
import numpy as np

from .._core._numerics import static_integer


TreeDrafting = Literal["top-k", "independent", "without replacement"]
"""How the draft model fills a [`speculax.DraftTree`][]: the children of each node
are its draft row's most likely tokens (`"top-k"`, deterministic drafts), or drawn
from that row independently (`"independent"`) or one after another without
replacement (`"without replacement"`)."""


def _parents(parents: Sequence[int] | np.ndarray) -> tuple[int, ...]:
    """The parents as a tuple of Python ints, read by value."""
    if np.ndim(parents) != 1:
        raise ValueError(
            f"parents must be one-dimensional, one per draft node; got shape "
            f"{np.shape(parents)}"
        )
    return tuple(
        static_integer(parent, f"parents[{j}]") for j, parent in enumerate(parents)
    )


@final
class DraftTree(eqx.Module):
    """The draft tree of every round of a [`speculax.SpeculativeLoop`][]: a static
    template of $N$ draft nodes, which the draft model fills level by level.

    Node 0 is the root, the last token of the row's history; draft node $j$ has
    parent `parents[j - 1]`, which comes before it. The children of a node are
    filled from the draft model's row $q$ after the path to the node, by rank (the
    order of their indices):

    - `"top-k"`: the child of rank $r$ is the $(r + 1)$-th most likely token of $q$
        (ties to the lower token). Deterministic: the step is given no draft rows
        (`draft_probs=None`), and the sibling rule for it is
        [`speculax.IndependentSiblings`][] or
        [`speculax.SiblingsWithoutReplacement`][] (the same on such drafts).
    - `"independent"`: each child drawn from $q$ by inverse CDF with its own
        uniform; verify with [`speculax.IndependentSiblings`][].
    - `"without replacement"`: the children drawn one after another, each from $q$
        without its earlier siblings' tokens; verify with
        [`speculax.SiblingsWithoutReplacement`][]. A child with no token left to
        draw (a row of smaller support than the node's children) is left out of
        the round's tree, with the nodes below it.

    Any other pair of drafting and sibling rule is lossy, and
    [`speculax.testing.loop_output_distribution`][] measures by how much.

    **Arguments:**

    - `parents`: the parent of each draft node $1, \\dots, N$, integers with
        `parents[j - 1]` in $[0, j)$; [`speculax.parents_from_paths`][] makes them
        of vLLM's paths.
    - `drafting`: keyword only, `"top-k"`, `"independent"` or
        `"without replacement"`.

    **Example:**

    ```python
    import speculax

    tree = speculax.DraftTree(
        speculax.parents_from_paths([(0,), (1,), (0, 0)]), drafting="independent"
    )
    assert tree.parents == (0, 0, 1) and tree.depths == (0, 1, 1, 2)
    ```
    """

    parents: tuple[int, ...] = eqx.field(static=True, converter=_parents)
    drafting: TreeDrafting = eqx.field(static=True, kw_only=True)

    def __check_init__(self):
        if not self.parents:
            raise ValueError("parents must hold at least one draft node")
        for j, parent in enumerate(self.parents, start=1):
            if not 0 <= parent < j:
                raise ValueError(
                    f"parents[{j - 1}] must lie in [0, {j}), a node before draft node "
                    f"{j}; got {parent}"
                )
        if self.drafting not in ("top-k", "independent", "without replacement"):
            raise ValueError(
                'drafting must be "top-k", "independent" or "without replacement"; '
                f"got {self.drafting!r}"
            )

    @property
    def num_nodes(self) -> int:
        """$N$, the number of draft nodes."""
        return len(self.parents)

    @property
    def depths(self) -> tuple[int, ...]:
        """The depth of each node $0, \\dots, N$, the root's 0."""
        depths = [0]
        for parent in self.parents:
            depths.append(depths[parent] + 1)
        return tuple(depths)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The rank of each draft node $1, \\dots, N$ among its siblings, from 0."""
        seen: dict[int, int] = {}
        ranks = []
        for parent in self.parents:
            ranks.append(seen.get(parent, 0))
            seen[parent] = ranks[-1] + 1
        return tuple(ranks)

    @property
    def ancestors(self) -> np.ndarray:
        """Bool `(N + 1, N + 1)`: entry $[k, j]$ whether node $j$ is node $k$ or one
        of its ancestors, the mask of a call that reads the tree whole."""
        seen = np.eye(self.num_nodes + 1, dtype=bool)
        for j, parent in enumerate(self.parents, start=1):
            seen[j] |= seen[parent]
        return seen

    @property
    def depth(self) -> int:
        """$D$, the depth of the deepest node."""
        return max(self.depths)

    def children(self, node: int) -> tuple[int, ...]:
        """The children of `node` (0 for the root), in rank order."""
        return tuple(
            j for j, parent in enumerate(self.parents, start=1) if parent == node
        )

    def read_up_to(self, level: int) -> tuple[int, ...]:
        """The draft nodes of depth $1, \\dots,$ `level`, in index order: what the
        draft model reads, after the history, to score the nodes at `level`."""
        return tuple(j for j in range(1, self.num_nodes + 1) if self.depths[j] <= level)

    def check_vocabulary(self, vocab: int) -> None:
        """Raises unless the tree can be filled from rows of `vocab` tokens: a
        `"top-k"` node ranks at most $V$ children."""
        most = max(len(self.children(node)) for node in range(self.num_nodes + 1))
        if self.drafting == "top-k" and most > vocab:
            raise ValueError(
                f'a node of the "top-k" draft tree has {most} children, more than '
                f"the V = {vocab} tokens it ranks"
            )
