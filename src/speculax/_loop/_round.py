"""The stages of one round of the loop, in order: draft $G$ tokens one at a time,
score them with the target in one call, (verify them with the step,) and append what
the step keeps to each row's history."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._chain._step import StepOutput
from .._pieces._sampling import InverseCDF
from ._cache import AbstractCachedModel, Cache, read_chain
from ._model import model_probs, probs_dtype
from ._state import LoopState


def draft_chain(
    draft_model: AbstractCachedModel,
    state: LoopState,
    draft_uniforms: Float[Array, "batch draft"],
    num_draft: int,
) -> tuple[
    Int[Array, "batch time"],
    Int[Array, "batch draft"],
    Float[Array, "batch draft vocab"],
    Cache,
]:
    """Draws each row's $G$ draft tokens one at a time, token $i$ from $q_i$ by
    inverse CDF with uniform $i$, writing each into the buffer past the row's
    history before the draft model reads it for the next.

    The first call reads the history's last two tokens again (one, for a history of
    one token), since the draft model has not read the last draft of the round
    before when all were kept, nor the token drawn after them; each later call reads
    the draft before.

    **Arguments:**

    - `draft_model`: a [`speculax.AbstractCachedModel`][].
    - `state`: the [`speculax.LoopState`][] before the round.
    - `draft_uniforms`: float `(B, G)`.
    - `num_draft`: $G$, a static integer.

    **Returns:**

    `(buffer, draft_tokens, draft_probs, draft_cache)`: the int32 `(B, T)` buffer
    with the drafts at positions `length` to `length + G - 1`, the int32 `(B, G)`
    drafts, the `(B, G, V)` rows $q_i$ they were drawn from, in `probs_dtype`, and
    the draft model's cache after reading the history and $G - 1$ drafts.
    """
    if num_draft == 0:
        no_drafts = jnp.zeros((state.length.shape[0], 0), jnp.int32)
        return state.buffer, no_drafts, _no_rows(draft_model, state), state.draft_cache
    rows = jnp.arange(state.buffer.shape[0])
    first = jnp.maximum(state.length - 2, 0)
    logits, cache = read_chain(draft_model, state.buffer, first, 2, state.draft_cache)
    buffer, probs = _drawn(
        state, state.buffer, logits[rows, state.length - 1 - first], draft_uniforms, 0
    )
    draft_probs = jnp.zeros((*probs.shape[:1], num_draft, probs.shape[1]), probs.dtype)

    def draft(i: Int[Array, ""], carry: tuple[Array, Array, Cache]) -> tuple:
        buffer, draft_probs, cache = carry
        logits, cache = read_chain(draft_model, buffer, state.length - 1 + i, 1, cache)
        buffer, probs = _drawn(state, buffer, logits[:, 0], draft_uniforms, i)
        return buffer, draft_probs.at[:, i].set(probs), cache

    buffer, draft_probs, cache = jax.lax.fori_loop(
        1, num_draft, draft, (buffer, draft_probs.at[:, 0].set(probs), cache)
    )
    draft_tokens = jnp.take_along_axis(
        buffer, state.length[:, None] + jnp.arange(num_draft), axis=1
    )
    return buffer, draft_tokens, draft_probs, cache


def _drawn(
    state: LoopState,
    buffer: Int[Array, "batch time"],
    logits: Float[Array, "batch vocab"],
    draft_uniforms: Float[Array, "batch draft"],
    i: Int[Array, ""] | int,
) -> tuple[Int[Array, "batch time"], Float[Array, "batch vocab"]]:
    """Draft token $i$ drawn from $q_i$, the softmax of `logits`, and written into
    the buffer; with $q_i$, the same array the step is given."""
    probs = model_probs(logits)
    token = InverseCDF()(probs, draft_uniforms[:, i])
    rows = jnp.arange(buffer.shape[0])
    return buffer.at[rows, state.length + i].set(token), probs


def _no_rows(
    model: AbstractCachedModel, state: LoopState
) -> Float[Array, "batch 0 vocab"]:
    """The draft rows of a round without drafts: `(B, 0, V)`, in `probs_dtype`."""
    logits = jax.eval_shape(
        lambda: read_chain(model, state.buffer, state.length - 1, 1, state.draft_cache)
    )[0]
    batch = state.buffer.shape[0]
    return jnp.zeros((batch, 0, logits.shape[-1]), probs_dtype(logits.dtype))


def score_chain(
    target_model: AbstractCachedModel,
    buffer: Int[Array, "batch time"],
    state: LoopState,
    num_draft: int,
) -> tuple[Float[Array, "batch positions vocab"], Cache]:
    """The target's rows $p_0, \\dots, p_G$ for each row's drafts, in one call: $p_i$
    the softmax of the target's logits after the history and the first $i$ drafts.

    **Arguments:**

    - `target_model`: a [`speculax.AbstractCachedModel`][].
    - `buffer`: int32 `(B, T)`, each history followed by its $G$ drafts.
    - `state`: the [`speculax.LoopState`][] before the round, with the history's
        length and the target's cache.
    - `num_draft`: $G$, a static integer.

    **Returns:**

    `(target_probs, target_cache)`: the `(B, G + 1, V)` rows $p_i$, in
    `probs_dtype`, and the target's cache after reading the history's last token
    and the drafts.
    """
    logits, cache = read_chain(
        target_model, buffer, state.length - 1, num_draft + 1, state.target_cache
    )
    return model_probs(logits), cache


def append_verified(
    state: LoopState,
    buffer: Int[Array, "batch time"],
    caches: tuple[Cache, Cache],
    verified: StepOutput,
    max_new_tokens: int,
    end_token: int | None,
) -> LoopState:
    """Appends to each unfinished row the step's tokens, the kept drafts then the
    drawn token, as many as fit in the row's remaining room and cut after the end
    token, and counts the step.

    **Arguments:**

    - `state`: the [`speculax.LoopState`][] before the round.
    - `buffer`: int32 `(B, T)`, `state.buffer` with the round's drafts written.
    - `caches`: the draft and target models' caches after the round's calls: the
        slots of rejected drafts lie past the new history and are written over by
        the next round.
    - `verified`: the step's [`speculax.StepOutput`][] on those drafts.
    - `max_new_tokens`: $N$, a static integer.
    - `end_token`: the static token id that ends a row, or `None`.

    **Returns:**

    The [`speculax.LoopState`][] after the round. A finished row keeps its history
    and counts (its buffer past the history takes the round's drafts).
    """
    rows = jnp.arange(buffer.shape[0])
    offsets = jnp.arange(verified["tokens"].shape[1])
    count, ended = _appended_count(state, verified, max_new_tokens, end_token)
    active = ~state.done
    count = jnp.where(active, count, 0)
    written = jnp.where(
        offsets < count[:, None],
        verified["tokens"],
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
            jnp.where(active, verified["num_accepted"], -1)
        ),
        step=state.step + 1,
        draft_cache=caches[0],
        target_cache=caches[1],
    )


def _appended_count(
    state: LoopState, verified: StepOutput, max_new_tokens: int, end_token: int | None
) -> tuple[Int[Array, " batch"], Bool[Array, " batch"]]:
    """How many of the step's tokens each row takes, finished or not: the kept
    drafts and the drawn token, at most the room left before `max_new_tokens`, and
    none past the end token; and whether the row takes the end token, `(B,)` each."""
    offsets = jnp.arange(verified["tokens"].shape[1])
    room = max_new_tokens - (state.length - state.prompt_length)
    count = jnp.minimum(verified["num_accepted"] + 1, room)
    ended = jnp.zeros(state.length.shape, jnp.bool_)
    if end_token is not None:
        is_end = (verified["tokens"] == end_token) & (offsets < count[:, None])
        ended = is_end.any(axis=1)
        count = jnp.where(ended, jnp.argmax(is_end, axis=1) + 1, count)
    return count, ended
