"""What the loop's exact enumeration assumes of a model's cache, checked in every
cell: it fills each state's caches afresh with the state's history, which gives the
loop's own outcome only if a cache is read and written as the interface says."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._loop._cache import (
    AbstractCachedModel,
    path_buffers,
    read_chain,
    read_history,
)
from .._loop._draft_tree import DraftTree
from .._loop._drafter import AbstractDrafter
from .._loop._dynamic_tree import DynamicTree
from .._loop._loop import SpeculativeLoop, drafts_after_history
from .._loop._model_drafter import ModelDrafter
from .._loop._state import LoopState
from .._loop._tree_round import TreeRead, draft_reads, read_tree, whole_tree_read


_MODELS = ("draft_model", "target_model")
_FAULTS = (
    "{} gives other logits for new tokens read after a history in its cache than "
    "for the same tokens read with the history in one call, by up to {:.3g}: its "
    "cache does not hold what it read (a new token not written at cache_length + "
    "k?), or, for a difference of rounding, the model does not compute a token's "
    "logits to the same bits read in pieces as read whole (float attention summed "
    "in another order), which the exact test needs to tell the rows apart",
    "{}'s cache is read at or past cache_length, by the model or by a drafter "
    "reading its entries: the step changed when those slots held other entries. "
    "The loop leaves rejected drafts there, so the next step would read a wrong "
    "history",
    "{}'s cache after a step differs, in the slots the next step reads as history, "
    "from its cache after reading the new history in one call: it keeps an entry the "
    "history does not hold (a rejected draft, or a new token not written at "
    "cache_length + k)",
)


Models = tuple[AbstractDrafter, AbstractCachedModel]
"""The drafter and the target model."""


def filled_caches(loop: SpeculativeLoop, models: Models, buffer: jax.Array) -> tuple:
    """The drafter's state and the target's cache with every token of `buffer`
    read, as `loop.start` makes them of a prompt."""
    slots = buffer.shape[1]
    logits, target_cache = read_history(models[1], buffer, slots, _MODELS[1])
    return _filled_state(loop, models, buffer, logits.shape[-1]), target_cache


def _filled_state(
    loop: SpeculativeLoop, models: Models, buffer: jax.Array, vocab: int
) -> Any:
    """The drafter's state with every token of `buffer` read."""
    return models[0].init(buffer, buffer.shape[1], drafts_after_history(loop), vocab)


def check_drafter_state(
    loop: SpeculativeLoop, models: Models, prompt: jax.Array
) -> None:
    """Raises unless the enumeration can check the drafter's state: a draft model's
    cache, or no state at all. It fills each state's afresh from the history, which
    gives the loop's outcome only if the state is what the history makes it."""
    if isinstance(models[0], ModelDrafter):
        return
    state = jax.eval_shape(lambda: filled_caches(loop, models, prompt)[0])
    if jax.tree.leaves(state):
        raise ValueError(
            f"the drafter ({type(models[0]).__name__}) keeps a state, which the exact "
            "enumeration cannot check: it checks a draft model's cache (a "
            "speculax.ModelDrafter), and fills every other drafter's state afresh "
            "from the history, which is exact only for a drafter without one"
        )


def scrambled_caches(
    loop: SpeculativeLoop,
    models: Models,
    buffer: jax.Array,
    length: jax.Array,
    fresh: tuple[Any, Any],
) -> list[tuple[Any, Any]]:
    """For each model the round reads, the caches `fresh` (filled with the
    histories) with that model's slots at and past what it reads as history holding
    the entries of other tokens: a step from them must keep the same tokens. The
    target's slot of the history's last token is among them: the loop's holds a
    rejected draft's entry there, which neither the target nor a drafter reading
    the target's entries may read."""
    vocab = read_history(models[1], buffer[:, :1], 1, _MODELS[1])[0].shape[-1]
    variants = []
    for model in _read_models(loop, models):
        valid = _cached_lengths(length)[model]
        kept = jnp.arange(buffer.shape[1]) < valid[:, None]
        other = jnp.where(kept, buffer, (buffer + 1) % vocab)
        if model:
            refilled = read_history(models[1], other, buffer.shape[1], _MODELS[1])[1]
        else:
            refilled = _filled_state(loop, models, other, vocab)
        mixed = list(fresh)
        mixed[model] = _slots_below(valid, fresh[model], refilled)
        variants.append((mixed[0], mixed[1]))
    return variants


def cache_faults(
    loop: SpeculativeLoop,
    models: Models,
    buffer: jax.Array,
    length: jax.Array,
    fresh: tuple[Any, Any],
    after: list[LoopState],
    drafts: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Which assumptions each row's caches break, bool `(B, 3, 2)`: entry
    `[b, f, m]` for fault `f` (the order of `_FAULTS`) of model `m` (draft, target);
    and by how much the logits of the first fault differ, float `(B, 2)`.

    **Arguments:**

    - `loop`, `models`: the loop, its drafter and its target.
    - `buffer`, `length`: the histories before the step.
    - `fresh`: both caches filled with the histories.
    - `after`: the step from `fresh`, then from each of `scrambled_caches`.
    - `drafts`: for a draft tree, its tokens by node, then its parents (`-1` for a
        node left out), which the round's calls read.
    """
    refilled = filled_caches(loop, models, after[0].buffer)
    left = (after[0].drafter_state, after[0].target_cache)
    calls = _round_calls(loop, buffer, length, drafts)
    faults = [jnp.zeros((3, buffer.shape[0]), jnp.bool_)] * 2
    differences = [jnp.zeros(buffer.shape[:1])] * 2
    for model, scrambled in zip(_read_models(loop, models), after[1:], strict=True):
        differences[model] = _difference_from_whole(
            _cached_model(models, model), fresh[model], buffer, calls[model]
        )
        faults[model] = jnp.stack(
            [
                differences[model] != 0,
                _outcome_differs(after[0], scrambled),
                ~_agree_below(
                    _cached_lengths(after[0].length)[model],
                    left[model],
                    refilled[model],
                ),
            ]
        )
    return (
        jnp.stack(faults, axis=-1).transpose(1, 0, 2),
        jnp.stack(differences, axis=-1),
    )


def _read_models(loop: SpeculativeLoop, models: Models) -> tuple[int, ...]:
    """The models whose caches a round reads: the draft model (0) if the drafter
    is one and drafts, and the target (1)."""
    return (0, 1) if loop.num_nodes and isinstance(models[0], ModelDrafter) else (1,)


def _cached_model(models: Models, model: int) -> AbstractCachedModel:
    """The model whose cache `_read_models` names: the target, or the draft model
    of a drafter that is one."""
    if model == 1:
        return models[1]
    assert isinstance(models[0], ModelDrafter)
    return models[0].cached_model


def check_caches(faults: np.ndarray, differences: np.ndarray) -> None:
    """Raises for the first fault of `cache_faults` seen in any cell, naming the
    model (and for the first, the largest difference of its logits)."""
    for fault, message in enumerate(_FAULTS):
        for model, name in enumerate(_MODELS):
            if faults[:, fault, model].any():
                largest = float(np.max(np.abs(differences[:, model])))
                raise ValueError(message.format(name, largest))


def _cached_lengths(length: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The slots of the draft's and the target's cache that a step reads as
    history, for histories of `length` tokens (see `speculax.LoopState`)."""
    return jnp.maximum(length - 2, 0), length - 1


# One call of a round, from the cache before it and the logits of reading the whole
# buffer: the call's logits, the cache after it, and the logits it should give.
_Call = Callable[
    [AbstractCachedModel, Any, jax.Array], tuple[jax.Array, Any, jax.Array]
]


def _difference_from_whole(
    model: AbstractCachedModel,
    cache: Any,
    buffer: jax.Array,
    calls: list[_Call],
) -> jax.Array:
    """The largest difference, per row, between the model's logits in a round's
    calls, each after what the calls before wrote, and those of reading each new
    token's history and what it sees in one call: 0 where they agree bit for bit
    (infinite where they disagree on an infinity or a NaN)."""
    whole, _ = read_history(model, buffer, buffer.shape[1], "model")
    largest = jnp.zeros(buffer.shape[:1])
    for call in calls:
        logits, cache, expected = call(model, cache, whole)
        same = (logits == expected) | (jnp.isnan(logits) & jnp.isnan(expected))
        difference = jnp.where(same, 0, jnp.abs(logits - expected))
        difference = jnp.where(jnp.isnan(difference), jnp.inf, difference)
        largest = jnp.maximum(largest, difference.reshape(largest.shape[0], -1).max(1))
    return largest


def _round_calls(
    loop: SpeculativeLoop, buffer: jax.Array, length: jax.Array, drafts: jax.Array
) -> tuple[list[_Call], list[_Call]]:
    """The calls a round makes of the draft and of the target. For a chain, on the
    buffer: the draft reads the history's last two tokens, then each draft but the
    last; the target reads the last token and the drafts. For a tree, on its
    drafts: the draft reads the last two tokens, then each level of a template
    (not those of a dynamic tree's expanded nodes, which the drafts do not say);
    the target the root and every node."""
    first_two = _chain_call(buffer, jnp.maximum(length - 2, 0), 2)
    tree = loop.draft_tree
    if tree is None:
        draft_calls = [first_two]
        draft_calls += [
            _chain_call(buffer, length - 1 + i, 1) for i in range(1, loop.num_nodes)
        ]
        return draft_calls, [_chain_call(buffer, length - 1, loop.num_nodes + 1)]
    tokens = jnp.maximum(drafts[:, : tree.num_nodes], 0)
    parents = drafts[:, tree.num_nodes :]
    if isinstance(tree, DraftTree):
        # The loop reads the template whole, nodes left out included.
        parents = jnp.broadcast_to(jnp.asarray(tree.parents), parents.shape)
    # Each node expected to read its path as the parents give it, found anew.
    paths = _paths_of_parents(parents, tree.depth, length)
    target_call = _tree_call(
        buffer, length, whole_tree_read(tree, parents, length), tokens, paths
    )
    if isinstance(tree, DynamicTree):
        # A draft model's reads of the nodes it expanded, which the drafts do not
        # say, are not checked here: a row they make wrong grows another tree
        # than the enumeration's, and an entry they leave wrong is caught in the
        # cache after the round.
        return [first_two], [target_call]
    draft_calls = [
        _tree_call(buffer, length, read, tokens, paths)
        for read in draft_reads(tree, length)
    ]
    return [first_two, *draft_calls], [target_call]


def _chain_call(buffer: jax.Array, first: jax.Array, width: int) -> _Call:
    """The call that reads `width` tokens of `buffer` from slot `first` on, as a
    chain: it should give the whole buffer's logits there."""

    def call(model: AbstractCachedModel, cache: Any, whole: jax.Array) -> tuple:
        logits, cache = read_chain(model, buffer, first, width, cache)
        window = first[:, None] + jnp.arange(width)
        return logits, cache, jnp.take_along_axis(whole, window[..., None], axis=1)

    return call


def _tree_call(
    buffer: jax.Array,
    length: jax.Array,
    read: TreeRead,
    tokens: jax.Array,
    paths: TreeRead,
) -> _Call:
    """The call `read` of some nodes of a tree with these tokens, as the loop makes
    it: it should give, for each node, the logits of reading the history and the
    path to the node in one call, the path as `paths` (the whole tree's, found
    from its parents by `_paths_of_parents`) gives it."""
    batch, slots = buffer.shape
    root = buffer[jnp.arange(batch), length - 1]
    nodes = np.asarray(read.nodes)
    mask = paths.mask[:, nodes][:, :, nodes]

    def call(model: AbstractCachedModel, cache: Any, whole: jax.Array) -> tuple:
        del whole
        logits, cache = read_tree(model, read, root, tokens, cache)
        new = jnp.concatenate([root[:, None], tokens], axis=1)[:, nodes]
        rows = path_buffers(buffer, new, mask, read.cache_length)
        path_logits, _ = read_history(model, rows, slots, "model")
        positions = paths.positions[:, nodes].reshape(-1)
        expected = path_logits[jnp.arange(rows.shape[0]), positions]
        return logits, cache, expected.reshape(logits.shape)

    return call


def _paths_of_parents(parents: jax.Array, depth: int, length: jax.Array) -> TreeRead:
    """What the call reading each row's tree whole should give each node to read,
    found from the tree's parents otherwise than the loop finds it: node $j$ sees
    node $k$ when $k$ is reached from $j$ by at most `depth` steps up the parent
    relation (a power of its matrix), and sits `length - 1` plus its depth, the
    number of nodes it sees but itself."""
    batch, num_nodes = parents.shape
    parent_of = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), parents], axis=1)
    up = jax.nn.one_hot(parent_of, num_nodes + 1, dtype=jnp.int32)
    # The root is no parent of itself: a walk up ends there.
    up = up.at[:, 0, 0].set(0)
    reach = jnp.broadcast_to(jnp.eye(num_nodes + 1, dtype=jnp.int32), up.shape)
    seen = reach
    for _ in range(depth):
        reach = reach @ up
        seen = seen + reach
    mask = seen > 0
    return TreeRead(
        nodes=tuple(range(num_nodes + 1)),
        positions=(length - 1)[:, None] + mask.sum(axis=-1) - 1,
        mask=mask,
        cache_length=length - 1,
        is_chain=False,
    )


def _outcome_differs(left: LoopState, right: LoopState) -> jax.Array:
    """Whether two steps from the same histories wrote or kept other tokens."""
    return (
        (left.buffer != right.buffer).any(axis=1)
        | (left.length != right.length)
        | (left.num_accepted != right.num_accepted).any(axis=1)
    )


def _below(valid: jax.Array, leaf: jax.Array) -> jax.Array:
    """Whether each slot of a cache's array lies below `valid`, in a shape that
    broadcasts against the array."""
    below = jnp.arange(leaf.shape[1]) < valid[:, None]
    return below.reshape(*below.shape, *(1,) * (leaf.ndim - 2))


def _slots_below(valid: jax.Array, inside: Any, outside: Any) -> Any:
    """The cache whose slots below `valid` are those of `inside`, the others those
    of `outside`."""
    return jax.tree.map(
        lambda inside, outside: jnp.where(_below(valid, inside), inside, outside),
        inside,
        outside,
    )


def _agree_below(valid: jax.Array, left: Any, right: Any) -> jax.Array:
    """Whether two caches hold the same entries in every slot below `valid`, per
    row."""
    differ = [
        ((x != y) & _below(valid, x)).reshape(x.shape[0], -1).any(axis=1)
        for x, y in zip(jax.tree.leaves(left), jax.tree.leaves(right), strict=True)
    ]
    return ~jnp.stack(differ).any(axis=0)
