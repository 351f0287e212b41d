"""The last stage of every round of the loop: what the step kept is appended to each
row's history, and the round is counted."""

from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int, PyTree

from ._cache import Cache
from ._state import LoopState


class Verified(NamedTuple):
    """What a round's step kept, per row: `num_accepted`, int32 `(B,)`, the kept
    drafts (the depth of the accepted path, for a tree), and `tokens`, int32
    `(B, W)`, those drafts, then the drawn token, then `-1`."""

    num_accepted: Int[Array, " batch"]
    tokens: Int[Array, "batch width"]


def append_verified(
    state: LoopState,
    buffer: Int[Array, "batch time"],
    caches: tuple[PyTree, Cache],
    verified: Verified,
    max_new_tokens: int,
    end_tokens: tuple[int, ...],
) -> LoopState:
    """Appends to each unfinished row the step's tokens, the kept drafts (or the
    accepted path) then the drawn token, as many as fit in the row's remaining room
    and cut after the end token, and counts the step.

    **Arguments:**

    - `state`: the [`speculax.LoopState`][] before the round.
    - `buffer`: int32 `(B, T)`, `state.buffer`, with the round's drafts written
        for a chain.
    - `caches`: the drafter's state and the target model's cache after the
        round: the slots of rejected drafts lie past the new history and are
        written over by the next round.
    - `verified`: what the step kept, as `Verified`.
    - `max_new_tokens`: $N$, a static integer.
    - `end_tokens`: the static token ids that end a row, none for none.

    **Returns:**

    The [`speculax.LoopState`][] after the round. A finished row keeps its history
    and counts (after a chain's round, its buffer past the history holds the
    round's drafts).
    """
    rows = jnp.arange(buffer.shape[0])
    offsets = jnp.arange(verified.tokens.shape[1])
    count, ended = _appended_count(state, verified, max_new_tokens, end_tokens)
    active = ~state.done
    count = jnp.where(active, count, 0)
    written = jnp.where(
        offsets < count[:, None],
        verified.tokens,
        jnp.take_along_axis(buffer, state.length[:, None] + offsets, axis=1),
    )
    buffer = buffer.at[rows[:, None], state.length[:, None] + offsets].set(written)
    length = state.length + count
    return LoopState(
        buffer=buffer,
        prompt_length=state.prompt_length,
        length=length,
        done=state.done
        | (active & ended)
        | (length - state.prompt_length >= max_new_tokens),
        num_steps=state.num_steps + active,
        num_accepted=state.num_accepted.at[:, state.step].set(
            jnp.where(active, verified.num_accepted, -1)
        ),
        step=state.step + 1,
        drafter_state=caches[0],
        target_cache=caches[1],
        temperature=state.temperature,
        top_k=state.top_k,
        top_p=state.top_p,
    )


def _appended_count(
    state: LoopState,
    verified: Verified,
    max_new_tokens: int,
    end_tokens: tuple[int, ...],
) -> tuple[Int[Array, " batch"], Bool[Array, " batch"]]:
    """How many of the step's tokens each row takes, finished or not: the kept
    drafts and the drawn token, at most the room left before `max_new_tokens`, and
    none past the end token; and whether the row takes the end token, `(B,)` each."""
    offsets = jnp.arange(verified.tokens.shape[1])
    room = max_new_tokens - (state.length - state.prompt_length)
    count = jnp.minimum(verified.num_accepted + 1, room)
    ended = jnp.zeros(state.length.shape, jnp.bool_)
    if end_tokens:
        is_end = jnp.isin(verified.tokens, jnp.asarray(end_tokens)) & (
            offsets < count[:, None]
        )
        ended = is_end.any(axis=1)
        # argmax is int64 under x64; the loop's carry keeps lengths in int32.
        first_end = jnp.argmax(is_end, axis=1).astype(count.dtype)
        count = jnp.where(ended, first_end + 1, count)
    return count, ended
