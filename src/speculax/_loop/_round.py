"""The stages of one round of the loop, in order: draft $G$ tokens one at a time,
score them with the target in one call, (verify them with the step,) and append what
the step keeps to each row's history."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._chain._step import StepOutput
from .._pieces._sampling import InverseCDF
from ._model import LanguageModel, model_probs, probs_dtype
from ._state import LoopState


def draft_chain(
    draft_model: LanguageModel,
    state: LoopState,
    draft_uniforms: Float[Array, "batch draft"],
    num_draft: int,
) -> tuple[
    Int[Array, "batch time"],
    Int[Array, "batch draft"],
    Float[Array, "batch draft vocab"],
]:
    """Draws each row's $G$ draft tokens one at a time, token $i$ from $q_i$ by
    inverse CDF with uniform $i$, writing each into the buffer past the row's
    history before the draft model reads it for the next.

    **Arguments:**

    - `draft_model`: a [`speculax.LanguageModel`][].
    - `state`: the [`speculax.LoopState`][] before the round.
    - `draft_uniforms`: float `(B, G)`.
    - `num_draft`: $G$, a static integer.

    **Returns:**

    `(buffer, draft_tokens, draft_probs)`: the int32 `(B, T)` buffer with the drafts
    at positions `length` to `length + G - 1`, the int32 `(B, G)` drafts, and the
    `(B, G, V)` rows $q_i$ they were drawn from, in `probs_dtype`.
    """
    batch = state.buffer.shape[0]
    rows = jnp.arange(batch)
    last = state.length - 1
    logits_shape = jax.eval_shape(draft_model, state.buffer, last[:, None])

    def draft(i: Int[Array, ""], carry: tuple[Array, Array]) -> tuple[Array, Array]:
        buffer, draft_probs = carry
        logits = draft_model(buffer, (last + i)[:, None])[:, 0]
        # The same rows are drawn from and given to the step: q_i is one array.
        probs = model_probs(logits)
        token = InverseCDF()(probs, draft_uniforms[:, i])
        buffer = buffer.at[rows, state.length + i].set(token)
        return buffer, draft_probs.at[:, i].set(probs)

    draft_probs = jnp.zeros(
        (batch, num_draft, logits_shape.shape[-1]), probs_dtype(logits_shape.dtype)
    )
    buffer = state.buffer
    # Traced even for zero iterations, where there is no uniform to index.
    if num_draft > 0:
        buffer, draft_probs = jax.lax.fori_loop(
            0, num_draft, draft, (buffer, draft_probs)
        )
    draft_tokens = jnp.take_along_axis(
        buffer, state.length[:, None] + jnp.arange(num_draft), axis=1
    )
    return buffer, draft_tokens, draft_probs


def score_chain(
    target_model: LanguageModel,
    buffer: Int[Array, "batch time"],
    length: Int[Array, " batch"],
    num_draft: int,
) -> Float[Array, "batch positions vocab"]:
    """The target's rows $p_0, \\dots, p_G$ for each row's drafts, in one call: $p_i$
    the softmax of the target's logits after the history and the first $i$ drafts.

    **Arguments:**

    - `target_model`: a [`speculax.LanguageModel`][].
    - `buffer`: int32 `(B, T)`, each history followed by its $G$ drafts.
    - `length`: int32 `(B,)`, the length of each history.
    - `num_draft`: $G$, a static integer.

    **Returns:**

    The `(B, G + 1, V)` rows $p_i$, in `probs_dtype`.
    """
    positions = (length - 1)[:, None] + jnp.arange(num_draft + 1)
    return model_probs(target_model(buffer, positions))


def append_verified(
    state: LoopState,
    buffer: Int[Array, "batch time"],
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
