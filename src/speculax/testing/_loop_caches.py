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
    empty_cache,
    read_chain,
    read_history,
)
from .._loop._loop import SpeculativeLoop
from .._loop._state import LoopState


_MODELS = ("draft_model", "target_model")
_FAULTS = (
    "{} gives other logits for new tokens read after a history in its cache than "
    "for the same tokens read with the history in one call: its cache does not hold "
    "what it read (a new token not written at cache_length + k?)",
    "{} reads its cache at or past cache_length: the step changed when those slots "
    "held other entries. The loop leaves rejected drafts there, so the next step "
    "would read a wrong history",
    "{}'s cache after a step differs, in the slots the next step reads as history, "
    "from its cache after reading the new history in one call: it keeps an entry the "
    "history does not hold (a rejected draft, or a new token not written at "
    "cache_length + k)",
)


def filled_caches(
    loop: SpeculativeLoop,
    models: tuple[AbstractCachedModel, AbstractCachedModel],
    buffer: jax.Array,
) -> tuple[Any, Any]:
    """The draft's and the target's caches with every token of `buffer` read in one
    call, as `loop.start` fills them with a prompt."""
    slots = buffer.shape[1]
    if loop.num_draft:
        draft_cache = read_history(models[0], buffer, slots, _MODELS[0])[1]
    else:
        draft_cache = empty_cache(models[0], buffer.shape[0], slots, _MODELS[0])
    return draft_cache, read_history(models[1], buffer, slots, _MODELS[1])[1]


def cache_faults(
    loop: SpeculativeLoop,
    models: tuple[AbstractCachedModel, AbstractCachedModel],
    buffer: jax.Array,
    length: jax.Array,
    advanced: Callable[[tuple[Any, Any]], LoopState],
    after: LoopState,
) -> jax.Array:
    """Which assumptions each row's caches break, bool `(B, 3, 2)`: entry
    `[b, f, m]` for fault `f` (the order of `_FAULTS`) of model `m` (draft, target).

    **Arguments:**

    - `loop`, `models`: the loop and its two models, with caches.
    - `buffer`, `length`: the histories before the step.
    - `advanced`: the step from the caches it is given.
    - `after`: the step from the caches filled with the histories.
    """
    fresh = filled_caches(loop, models, buffer)
    vocab = read_history(models[1], buffer[:, :1], 1, _MODELS[1])[0].shape[-1]
    other = jnp.where(jnp.arange(buffer.shape[1]) < length[:, None], buffer, vocab - 1)
    scrambled = filled_caches(loop, models, other)
    refilled = filled_caches(loop, models, after.buffer)
    left = (after.draft_cache, after.target_cache)
    calls = _round_calls(loop, length)
    faults = []
    for model, valid, valid_after in zip(
        (0, 1), _cached_lengths(length), _cached_lengths(after.length), strict=True
    ):
        if model == 0 and not loop.num_draft:
            faults.append(jnp.zeros((3, buffer.shape[0]), jnp.bool_))
            continue
        mixed = list(fresh)
        mixed[model] = _slots_below(valid, fresh[model], scrambled[model])
        faults.append(
            jnp.stack(
                [
                    ~_reads_as_whole(models[model], fresh[model], buffer, calls[model]),
                    _outcome_differs(after, advanced(tuple(mixed))),
                    ~_agree_below(valid_after, left[model], refilled[model]),
                ]
            )
        )
    return jnp.stack(faults, axis=-1).transpose(1, 0, 2)


def check_caches(faults: np.ndarray) -> None:
    """Raises for the first fault of `cache_faults` seen in any cell, naming the
    model."""
    for fault, message in enumerate(_FAULTS):
        for model, name in enumerate(_MODELS):
            if faults[:, fault, model].any():
                raise ValueError(message.format(name))


def _cached_lengths(length: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The slots of the draft's and the target's cache that a step reads as
    history, for histories of `length` tokens (see `speculax.LoopState`)."""
    return jnp.maximum(length - 2, 0), length - 1


def _reads_as_whole(
    model: AbstractCachedModel,
    cache: Any,
    buffer: jax.Array,
    calls: list[tuple[jax.Array, int]],
) -> jax.Array:
    """Whether the model's logits in a round's calls, each reading `width` tokens
    from slot `first` on after what the calls before wrote, are those of reading
    the whole buffer in one call, per row."""
    whole, _ = read_history(model, buffer, buffer.shape[1], "model")
    agree = jnp.ones(buffer.shape[:1], jnp.bool_)
    for first, width in calls:
        logits, cache = read_chain(model, buffer, first, width, cache)
        window = first[:, None] + jnp.arange(width)
        expected = jnp.take_along_axis(whole, window[..., None], axis=1)
        agree &= (logits == expected).reshape(buffer.shape[0], -1).all(axis=1)
    return agree


def _round_calls(
    loop: SpeculativeLoop, length: jax.Array
) -> tuple[list[tuple[jax.Array, int]], list[tuple[jax.Array, int]]]:
    """The calls a round makes of the draft and of the target, as `(first slot,
    number of tokens)`: the draft reads the history's last two tokens, then each
    draft but the last; the target reads the last token and the drafts."""
    draft_calls = [(jnp.maximum(length - 2, 0), 2)]
    draft_calls += [(length - 1 + i, 1) for i in range(1, loop.num_draft)]
    return draft_calls, [(length - 1, loop.num_draft + 1)]


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
