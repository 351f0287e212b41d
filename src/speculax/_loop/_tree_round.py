"""The stages of one round of the loop with a draft tree, in order: the drafter
fills the tree level by level (a draft model with its cache, any other drafter by
its definition) or grows each row's own (a dynamic tree), the target scores it in
one call with each row's ancestor mask, a tree step verifies it, and each cache
keeps the accepted path's entries where the next round reads its history."""

from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PyTree

from .._pieces._sampling import InverseCDF
from .._tree._abstract import AbstractTreeStep, TreeOutput
from ._append import Verified, append_verified
from ._cache import AbstractCachedModel, Cache, read_new
from ._draft_tree import DraftTree
from ._drafter import AbstractDrafter, DraftRows
from ._dynamic_tree import DynamicTree, ExpandedNodes, ancestor_mask, grown_tree
from ._model_drafter import ModelDrafter, history_end_logits
from ._sampling import AbstractDraftSampling, RowParameters, row_probs
from ._state import LoopState


class DraftedTree(NamedTuple):
    """A round's draft trees, one per row, as a tree step takes them.

    - `parents`: int32 `(B, N)`, each draft node's parent: a template's, `-1` for
        a node left out (a child drawn without replacement from a row with no
        token left, and the nodes below it), or the row's own in a dynamic tree.
    - `tokens`: int32 `(B, N)`, each draft node's token (0 where left out).
    - `probs`: float `(B, N + 1, V)`, row $k$ the distribution node $k$'s children
        were drawn from, or ranked in (zeros for a node without children); `None`
        for a dynamic tree, whose deterministic drafts are verified without rows.
    """

    parents: Int[Array, "batch nodes"]
    tokens: Int[Array, "batch nodes"]
    probs: Float[Array, "batch positions vocab"] | None


class TreeRead(NamedTuple):
    """One call of a model on some nodes of a round's trees, after each row's
    history: `nodes`, the nodes read (0 the root), in index order; `positions`,
    int32 `(B, K)`; `mask`, bool `(B, K, K)`, the ancestor mask among them;
    `cache_length`, int32 `(B,)`, where they are written; and `is_chain`, whether
    the nodes form a chain (each the child of the one before), known before
    tracing."""

    nodes: tuple[int, ...]
    positions: Int[Array, "batch new"]
    mask: Bool[Array, "batch new new"]
    cache_length: Int[Array, " batch"]
    is_chain: bool


def tree_read(
    tree: DraftTree, nodes: tuple[int, ...], length: Int[Array, " batch"]
) -> TreeRead:
    """The call that reads `nodes` of the tree after histories of `length` tokens:
    node $k$ at position `length - 1` + its depth, seeing its ancestors among
    `nodes`. The root, if read, is written at slot `length - 1`; else the first node
    is written at slot `length`, after the root."""
    index = np.asarray(nodes)
    batch = length.shape[0]
    mask = tree.ancestors[index][:, index]
    offset = 0 if nodes[0] == 0 else 1
    depths = np.asarray(tree.depths)[index]
    return TreeRead(
        nodes=nodes,
        positions=(length - 1)[:, None] + jnp.asarray(depths),
        mask=jnp.broadcast_to(jnp.asarray(mask), (batch, *mask.shape)),
        cache_length=length - 1 + offset,
        # Each node at the position of the slot it is written in, seeing those
        # before it.
        is_chain=bool(
            (mask == np.tril(np.ones_like(mask))).all()
            and (depths == offset + np.arange(len(nodes))).all()
        ),
    )


def read_tree(
    model: AbstractCachedModel,
    read: TreeRead,
    root: Int[Array, " batch"],
    tokens: Int[Array, "batch nodes"],
    cache: Cache,
) -> tuple[Float[Array, "batch new vocab"], Cache]:
    """Calls `model` as `read` says, on the nodes' tokens (the root's `root`)."""
    with_root = jnp.concatenate([root[:, None], tokens], axis=1)
    return read_new(
        model,
        with_root[:, np.asarray(read.nodes)],
        read.positions,
        read.mask,
        cache,
        read.cache_length,
        chain=read.is_chain,
    )


def whole_tree_read(
    tree: DraftTree | DynamicTree,
    parents: Int[Array, "batch nodes"],
    length: Int[Array, " batch"],
) -> TreeRead:
    """The call that reads the root and every draft node of each row's tree after
    histories of `length` tokens, node $k$ written at slot `length - 1 + k`: the
    template's mask for a `DraftTree`, each row's own, of its `parents`, for a
    `DynamicTree`."""
    if isinstance(tree, DraftTree):
        return tree_read(tree, tuple(range(tree.num_nodes + 1)), length)
    mask, depths = ancestor_mask(parents, tree.depth)
    return TreeRead(
        nodes=tuple(range(tree.num_nodes + 1)),
        positions=(length - 1)[:, None] + depths,
        mask=mask,
        cache_length=length - 1,
        is_chain=False,
    )


def draft_reads(tree: DraftTree, length: Int[Array, " batch"]) -> list[TreeRead]:
    """The calls in which the draft model scores the tree's inner nodes after the
    root, one per level $1, \\dots, D - 1$: level $d$ reads every node of depth
    $1, \\dots, d$ (the root is read before, with the history's last tokens)."""
    return [
        tree_read(tree, tree.read_up_to(level), length)
        for level in range(1, tree.depth)
    ]


def tree_round(
    drafter: AbstractDrafter,
    target_model: AbstractCachedModel,
    state: LoopState,
    uniforms: tuple[Array, Array, Array],
    tree: DraftTree | DynamicTree,
    step: AbstractTreeStep,
    draft_sampling: AbstractDraftSampling,
    max_new_tokens: int,
    end_tokens: tuple[int, ...],
) -> LoopState:
    """One round with a draft tree, as [`speculax.SpeculativeLoop.advance`][] runs
    it, from the `(draft, accept, sample)` uniforms: draft, score, verify, keep the
    path's cache entries and append."""
    draft_uniforms, accept_uniforms, sample_uniforms = uniforms
    drafted, drafter_state, draft_slots = drafted_tree(
        drafter, state, draft_uniforms, tree, draft_sampling
    )
    target_logits, target_cache = score_tree(
        target_model,
        state,
        drafted,
        whole_tree_read(tree, drafted.parents, state.length),
    )
    verified = verify_tree(
        step,
        drafted,
        target_logits,
        state,
        tree.drafting,
        accept_uniforms,
        sample_uniforms,
    )
    caches = keep_path(
        (drafter_state, target_cache),
        verified["accepted_nodes"],
        state.length,
        tree.depth,
        draft_slots,
    )
    kept = Verified(verified["num_accepted"], verified["tokens"][:, : tree.depth + 1])
    return append_verified(
        state, state.buffer, caches, kept, max_new_tokens, end_tokens
    )


def drafted_tree(
    drafter: AbstractDrafter,
    state: LoopState,
    draft_uniforms: Float[Array, "batch nodes"],
    tree: DraftTree | DynamicTree,
    draft_sampling: AbstractDraftSampling,
) -> tuple[DraftedTree, PyTree, Int[Array, "batch positions"]]:
    """Each row's tree filled by the drafter, its state after, and where its last
    call wrote each node (`draft_slots`, see `keep_path`): a draft model reads the
    tree with its cache (`draft_tree`, `draft_dynamic_tree`); any other drafter,
    stateless, fills it from its definition (`tree_by_definition`) or grows it
    (`dynamic_tree`)."""
    batch = state.length.shape[0]
    if isinstance(drafter, ModelDrafter):
        model = drafter.cached_model
        if isinstance(tree, DynamicTree):
            return draft_dynamic_tree(model, state, tree, draft_sampling)
        drafted, cache = draft_tree(model, state, draft_uniforms, tree, draft_sampling)
        slots = jnp.broadcast_to(template_slots(tree), (batch, tree.num_nodes + 1))
        return drafted, cache, slots
    if state.drafter_state is not None:
        raise TypeError(
            "a draft tree is filled by a draft model, or by a drafter without a "
            f"state; {type(drafter).__name__} keeps one: draft a chain (num_draft) "
            "with it"
        )
    if isinstance(tree, DynamicTree):
        drafted = dynamic_tree(drafter, state, tree, draft_sampling)
    else:
        drafted = tree_by_definition(
            drafter, state, draft_uniforms, tree, draft_sampling
        )
    # A drafter without a state wrote no cache.
    unwritten = jnp.full((batch, tree.num_nodes + 1), -1, jnp.int32)
    return drafted, state.drafter_state, unwritten


def template_slots(tree: DraftTree) -> Int[Array, " positions"]:
    """Where the draft model's last call on a template wrote each node, from slot
    `length - 1`: its last level's read, from slot `length` on (`-1` for a node of
    depth $D$, or the root, which it does not read)."""
    last_read = tree.read_up_to(tree.depth - 1)
    slots = np.full(tree.num_nodes + 1, -1)
    slots[np.asarray(last_read, int)] = 1 + np.arange(len(last_read))
    return jnp.asarray(slots, jnp.int32)


def dynamic_tree(
    drafter: AbstractDrafter,
    state: LoopState,
    tree: DynamicTree,
    draft_sampling: AbstractDraftSampling,
) -> DraftedTree:
    """Each row's tree grown from the rows `drafter.drawn_after` promises, as
    [`speculax.DynamicTree`][] defines it: the row after a node of depth $d$ is row
    $d$ of the drafts after the history followed by the node's path. One call of
    `drawn_after` per depth, the $k$ expanded nodes at once."""
    batch, depth = state.length.shape[0], tree.depth

    def rows_after(
        paths: Int[Array, "batch k depth"], d: Int[Array, ""], *_: object
    ) -> tuple[Float[Array, "batch k vocab"], None]:
        return _rows_after_paths(drafter, state, paths, d, depth, draft_sampling), None

    root = _rows_after_paths(
        drafter,
        state,
        jnp.zeros((batch, 1, depth), jnp.int32),
        0,
        depth,
        draft_sampling,
    )[:, 0]
    grown, _ = grown_tree(tree, root, rows_after)
    return DraftedTree(grown.parents, grown.tokens, None)


def draft_dynamic_tree(
    draft_model: AbstractCachedModel,
    state: LoopState,
    tree: DynamicTree,
    draft_sampling: AbstractDraftSampling,
) -> tuple[DraftedTree, Cache, Int[Array, "batch positions"]]:
    """Each row's tree grown by the draft model with its cache: the root's row read
    as for a chain, then at each depth $d$ one call that reads every node expanded
    so far (all $M = (D - 1) k$ entries of the `ExpandedNodes`, each seeing its
    ancestors among them, those not yet expanded seeing only themselves), written
    from slot `length` on, whose rows at the expanded nodes of depth $d$ are made
    by `draft_sampling`.

    **Returns:**

    `(drafted, draft_cache, draft_slots)`: the `DraftedTree`, the draft model's
    cache after its last call, and where that call wrote each node (`keep_path`).
    """
    batch, k = state.length.shape[0], tree.top_k
    logits, after_root = history_end_logits(draft_model, state)
    root = _sampled(draft_sampling, logits[:, None], state)[:, 0]

    def rows_after(
        paths: Int[Array, "batch k depth"],
        d: Int[Array, ""],
        expanded: ExpandedNodes,
        cache: Cache,
    ) -> tuple[Float[Array, "batch k vocab"], Cache]:
        del paths
        # Entries numbered from 1 below the history's last token, the root.
        mask, depths = ancestor_mask(expanded.parents + 1, tree.depth)
        logits, cache = read_new(
            draft_model,
            expanded.tokens,
            (state.length - 1)[:, None] + depths[:, 1:],
            mask[:, 1:, 1:],
            after_root,
            state.length,
            chain=False,
        )
        level = jax.lax.dynamic_slice_in_dim(logits, (d - 1) * k, k, axis=1)
        return _sampled(draft_sampling, level, state), cache

    grown, cache = grown_tree(tree, root, rows_after, after_root)
    slots = jnp.where(grown.expanded >= 0, grown.expanded + 1, -1)
    draft_slots = jnp.concatenate([jnp.full((batch, 1), -1, jnp.int32), slots], 1)
    return DraftedTree(grown.parents, grown.tokens, None), cache, draft_slots


def tree_by_definition(
    drafter: AbstractDrafter,
    state: LoopState,
    draft_uniforms: Float[Array, "batch nodes"],
    tree: DraftTree,
    draft_sampling: AbstractDraftSampling,
) -> DraftedTree:
    """Fills each row's tree level by level from the rows `drafter.drawn_after`
    promises: the children of a node of depth $d$ are drawn (`tree.drafting`,
    draft node $j$ with uniform $j - 1$) from row $d$ of the drafts after the
    history followed by the node's path, the row a chain through the node would
    draw its next draft from. One call of `drawn_after` per level, every node of
    the level at once."""
    batch = state.length.shape[0]

    def level_rows(
        nodes: list[int], tokens: Int[Array, "batch nodes"]
    ) -> Float[Array, "batch level vocab"]:
        paths = jnp.stack([_path_tokens(tree, node, tokens) for node in nodes], 1)
        return _rows_after_paths(
            drafter, state, paths, tree.depths[nodes[0]], tree.depth, draft_sampling
        )

    tokens = jnp.zeros((batch, tree.num_nodes), jnp.int32)
    root = level_rows([0], tokens)[:, 0]
    drafted = DraftedTree(
        parents=jnp.broadcast_to(
            jnp.asarray(tree.parents, jnp.int32), (batch, tree.num_nodes)
        ),
        tokens=tokens,
        probs=jnp.zeros((batch, tree.num_nodes + 1, root.shape[-1]), root.dtype),
    )
    drafted = _children_drawn(drafted, tree, 0, root, draft_uniforms)
    for level in range(1, tree.depth):
        nodes = [
            node
            for node in range(1, tree.num_nodes + 1)
            if tree.depths[node] == level and tree.children(node)
        ]
        rows = level_rows(nodes, drafted.tokens)
        for i, node in enumerate(nodes):
            drafted = _children_drawn(drafted, tree, node, rows[:, i], draft_uniforms)
    return drafted


def _rows_after_paths(
    drafter: AbstractDrafter,
    state: LoopState,
    paths: Int[Array, "batch paths depth"],
    level: int | Int[Array, ""],
    depth: int,
    draft_sampling: AbstractDraftSampling,
) -> Float[Array, "batch paths vocab"]:
    """Row `level` of the $D$ drafts `drafter.drawn_after` promises after each
    history followed by each of its paths (`(B, M, D)`, 0s past a path's end):
    the row a node at the end of the path has its children from. The paths are
    vmapped over, the target's cache shared rather than copied: the drafter reads
    only its slots of the history."""
    batch = state.length.shape[0]
    parameters = RowParameters(state.temperature, state.top_k, state.top_p)
    slots = state.length[:, None] + jnp.arange(depth)
    buffers = jax.vmap(
        lambda path: state.buffer.at[jnp.arange(batch)[:, None], slots].set(path),
        in_axes=1,
    )(paths)
    rows = jax.vmap(
        lambda buffer: tree_rows(
            drafter,
            buffer,
            state.length,
            state.target_cache,
            depth,
            parameters,
            draft_sampling,
        )
    )(buffers)
    return _checked_rows(
        jnp.moveaxis(rows[:, :, level], 0, 1),
        state,
        f"the drafter ({type(drafter).__name__}) gives a",
    )


def _path_tokens(
    tree: DraftTree, node: int, tokens: Int[Array, "batch nodes"]
) -> Int[Array, "batch depth"]:
    """The tokens of the path from the root's child to `node`, then 0s: `(B, D)`."""
    path = []
    while node:
        path.append(tokens[:, node - 1])
        node = tree.parents[node - 1]
    padding = [jnp.zeros_like(tokens[:, 0])] * (tree.depth - len(path))
    return jnp.stack([*reversed(path), *padding], axis=1)


def tree_rows(
    drafter: AbstractDrafter,
    tokens: Int[Array, "batch time"],
    length: Int[Array, " batch"],
    target_cache: PyTree,
    depth: int,
    parameters: RowParameters,
    draft_sampling: AbstractDraftSampling,
) -> Float[Array, "batch depth vocab"]:
    """The rows of $D$ drafts after each history, as `drawn_after` promises them
    (its arguments): row $d$ is the one a node of depth $d$ on the path `tokens`
    holds after the history has its children drawn from. A `TypeError` for
    deterministic drafts, whose tree has no rows to rank."""
    rows = drafter.drawn_after(
        tokens, length, target_cache, depth, parameters, draft_sampling
    )
    if not isinstance(rows, DraftRows):
        raise TypeError(
            "a draft tree is filled from the rows its drafts are drawn from, and "
            f"{type(drafter).__name__} drafts deterministic tokens without rows: "
            "draft a chain (num_draft) with it"
        )
    return rows.probs


def draft_tree(
    draft_model: AbstractCachedModel,
    state: LoopState,
    draft_uniforms: Float[Array, "batch nodes"],
    tree: DraftTree,
    draft_sampling: AbstractDraftSampling,
) -> tuple[DraftedTree, Cache]:
    """Fills each row's tree level by level: the draft model's row at every node of
    a level, made by `draft_sampling` under the row's parameters, and the node's
    children drawn from it (`tree.drafting`), draft node $j$ with uniform $j - 1$.

    The first call reads two slots from $\\max(\\text{length} - 2, 0)$, as for a
    chain (the root's row); level $d$'s call reads every node of depth
    $1, \\dots, d$ after the history, each seeing its ancestors.

    **Returns:**

    `(drafted, draft_cache)`: the `DraftedTree`, and the draft model's cache after
    its last call.
    """
    batch = state.length.shape[0]
    rows = jnp.arange(batch)
    logits, after_root = history_end_logits(draft_model, state)
    probs = _sampled(draft_sampling, logits[:, None], state)[:, 0]
    drafted = DraftedTree(
        parents=jnp.broadcast_to(
            jnp.asarray(tree.parents, jnp.int32), (batch, tree.num_nodes)
        ),
        tokens=jnp.zeros((batch, tree.num_nodes), jnp.int32),
        probs=jnp.zeros((batch, tree.num_nodes + 1, probs.shape[-1]), probs.dtype),
    )
    drafted = _children_drawn(drafted, tree, 0, probs, draft_uniforms)
    cache = after_root
    root = state.buffer[rows, state.length - 1]
    for level, read in enumerate(draft_reads(tree, state.length), start=1):
        logits, cache = read_tree(draft_model, read, root, drafted.tokens, after_root)
        scored = [
            (k, node)
            for k, node in enumerate(read.nodes)
            if tree.depths[node] == level and tree.children(node)
        ]
        level_probs = _sampled(
            draft_sampling, logits[:, np.asarray([k for k, _ in scored])], state
        )
        for i, (_, node) in enumerate(scored):
            drafted = _children_drawn(
                drafted, tree, node, level_probs[:, i], draft_uniforms
            )
    return drafted, cache


def _sampled(
    draft_sampling: AbstractDraftSampling,
    logits: Float[Array, "batch nodes vocab"],
    state: LoopState,
) -> Float[Array, "batch nodes vocab"]:
    """`draft_sampling`'s rows of some nodes' logits, each under its row's
    parameters."""
    batch, count, vocab = logits.shape
    parameters = RowParameters(
        *(
            None if x is None else jnp.repeat(x, count)
            for x in (state.temperature, state.top_k, state.top_p)
        )
    )
    probs = draft_sampling(logits.reshape(batch * count, vocab), *parameters)
    return _checked_rows(
        probs.reshape(batch, count, vocab), state, "draft_model gives logits whose"
    )


def _checked_rows(
    probs: Float[Array, "batch nodes vocab"], state: LoopState, whose: str
) -> Float[Array, "batch nodes vocab"]:
    """`probs`, raising at run time where a row not done has a node's row that is
    no distribution: the tree step is given no row of "top-k" drafts to check,
    and a draw from a row that is no distribution is a token the row never meant.
    `whose` begins the message."""
    not_a_distribution = ~jnp.isfinite(probs).all(axis=-1) | ~(probs.sum(axis=-1) > 0)
    return eqx.error_if(
        probs,
        not_a_distribution & ~state.done[:, None],
        f"{whose} draft row at a node of the draft tree has NaN or an infinite "
        "value, or no token of positive probability",
    )


def _children_drawn(
    drafted: DraftedTree,
    tree: DraftTree,
    node: int,
    probs: Float[Array, "batch vocab"],
    draft_uniforms: Float[Array, "batch nodes"],
) -> DraftedTree:
    """`drafted` with `node`'s row set to `probs` and its children's tokens drawn
    from it, in rank order, as `tree.drafting` says."""
    children = tree.children(node)
    rows = jnp.arange(probs.shape[0])
    parents, tokens = drafted.parents, drafted.tokens
    if tree.drafting == "top-k":
        ranked = jax.lax.top_k(probs, len(children))[1]
        for rank, child in enumerate(children):
            tokens = tokens.at[:, child - 1].set(ranked[:, rank])
    elif tree.drafting == "independent":
        # One draw traced for all the node's children, each with its own uniform.
        index = np.asarray(children) - 1
        drawn = jax.vmap(
            lambda uniform: InverseCDF()(probs, uniform), in_axes=1, out_axes=1
        )(draft_uniforms[:, index])
        tokens = tokens.at[:, index].set(drawn)
    else:
        node_used = parents[:, node - 1] >= 0 if node else jnp.ones(rows.shape, bool)
        index = jnp.asarray(children, jnp.int32) - 1

        # One draw traced for all the node's children, in rank order, each taking
        # its token out of the row the next is drawn from.
        def child_drawn(k: Int[Array, ""], carry: tuple) -> tuple:
            parents, tokens, left = carry
            token = InverseCDF()(left, draft_uniforms[:, index[k]])
            # A child with no token left is left out, with the nodes below it.
            drawn = node_used & (left.sum(axis=-1) > 0)
            parents = parents.at[:, index[k]].set(jnp.where(drawn, node, -1))
            token = jnp.where(drawn, token, 0)
            left = left.at[rows, token].set(jnp.where(drawn, 0, left[rows, token]))
            return parents, tokens.at[:, index[k]].set(token), left

        parents, tokens, _ = jax.lax.fori_loop(
            0, len(children), child_drawn, (parents, tokens, probs)
        )
    # A template's tree keeps the row of every node (only a dynamic tree has none).
    assert drafted.probs is not None
    return DraftedTree(parents, tokens, drafted.probs.at[:, node].set(probs))


def score_tree(
    target_model: AbstractCachedModel,
    state: LoopState,
    drafted: DraftedTree,
    read: TreeRead,
) -> tuple[Float[Array, "batch positions vocab"], Cache]:
    """The target's logits at every node of each row's tree, in one call, `read`
    (`whole_tree_read`), that reads the root (the history's last token) and the
    $N$ draft nodes, each seeing its ancestors: node $k$ written at slot
    `length - 1 + k`.

    **Returns:**

    `(target_logits, target_cache)`: the `(B, N + 1, V)` logits, row $k$ after the
    path to node $k$, and the target's cache after the call.
    """
    root = state.buffer[jnp.arange(state.length.shape[0]), state.length - 1]
    return read_tree(target_model, read, root, drafted.tokens, state.target_cache)


def verify_tree(
    step: AbstractTreeStep,
    drafted: DraftedTree,
    target_logits: Float[Array, "batch positions vocab"],
    state: LoopState,
    drafting: str,
    accept_uniforms: Float[Array, "batch nodes"],
    sample_uniforms: Float[Array, " batch"],
) -> TreeOutput:
    """The tree step on the round's trees: the target's rows under each row's
    parameters, and the rows the children were drawn from (none for `"top-k"`
    drafts, which the step takes as deterministic)."""
    target_probs = row_probs(
        target_logits, RowParameters(state.temperature, state.top_k, state.top_p)
    )
    draft_probs = None if drafting == "top-k" else drafted.probs
    return step(
        drafted.parents,
        drafted.tokens,
        draft_probs,
        target_probs,
        accept_uniforms,
        sample_uniforms,
    )


def keep_path(
    caches: tuple[Cache, Cache],
    accepted_nodes: Int[Array, "batch width"],
    length: Int[Array, " batch"],
    depth: int,
    draft_slots: Int[Array, "batch positions"],
) -> tuple[Cache, Cache]:
    """Each model's cache with the accepted path's entries moved to where the next
    round reads its history: path node $i$ (depth $i$) to slot `length - 1 + i`,
    from the slot its last call wrote it in. The target wrote node $k$ at
    `length - 1 + k`; the draft wrote node $k$ at `length - 1 + draft_slots[:, k]`
    (none where `-1`: a node its last call did not read, which is never a path
    node the next round reads from the cache). Only the path's slots are written,
    in place: no copy of a cache is made.

    **Arguments:**

    - `caches`: the draft's and the target's caches after the round's calls.
    - `accepted_nodes`: int32, the path's nodes, then `-1`, as the tree step
        returns them.
    - `length`: int32 `(B,)`, the histories' lengths before the round.
    - `depth`: $D$, the tree's depth.
    - `draft_slots`: int32 `(B, N + 1)`, as `drafted_tree` returns them.
    """
    accepted_nodes = accepted_nodes[:, :depth]
    on_path = accepted_nodes >= 0
    node = jnp.where(on_path, accepted_nodes, 0)
    draft_from = jnp.where(on_path, jnp.take_along_axis(draft_slots, node, axis=1), -1)
    return (
        _moved(caches[0], length - 1, draft_from),
        _moved(caches[1], length - 1, jnp.where(on_path, node, -1)),
    )


def _moved(
    cache: Cache, base: Int[Array, " batch"], sources: Int[Array, "batch depth"]
) -> Cache:
    """`cache` with slot `base + 1 + i` of each row set to slot `base + sources[:, i]`,
    where `sources[:, i] >= 0`."""
    rows = jnp.arange(base.shape[0])[:, None]
    targets = base[:, None] + 1 + jnp.arange(sources.shape[1])

    def move(leaf: Array) -> Array:
        taken = leaf[rows, base[:, None] + jnp.maximum(sources, 0)]
        written = jnp.where(sources >= 0, targets, leaf.shape[1])
        return leaf.at[rows, written].set(taken, mode="drop")

    return jax.tree.map(move, cache)
