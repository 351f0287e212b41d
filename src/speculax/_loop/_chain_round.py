"""The stages of one round of the loop with a chain of drafts, in order: draft $G$
tokens one at a time, score them with the target in one call, and verify them with
the step (`_append` then appends what the step keeps)."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._chain._step import SpeculativeStep, StepOutput
from .._logits._step import LogitsStep
from .._pieces._sampling import InverseCDF
from ._append import Verified, append_verified
from ._cache import AbstractCachedModel, Cache, read_chain
from ._model import widened
from ._sampling import AbstractDraftSampling, RowParameters, row_probs
from ._state import LoopState


class DraftRows(NamedTuple):
    """The draft model's rows at each draft position: its `logits`, `(B, G, V)` as
    the model returned them, and `probs`, the `(B, G, V)` rows $q_i$ the drafts were
    drawn from, in the draft sampling's dtype."""

    logits: Float[Array, "batch draft vocab"]
    probs: Float[Array, "batch draft vocab"]


def chain_round(
    models: tuple[AbstractCachedModel, AbstractCachedModel],
    state: LoopState,
    uniforms: tuple[Array, Array, Array],
    num_draft: int,
    step: SpeculativeStep | LogitsStep,
    draft_sampling: AbstractDraftSampling,
    max_new_tokens: int,
    end_tokens: tuple[int, ...],
) -> LoopState:
    """One round with a chain of $G$ drafts, as
    [`speculax.SpeculativeLoop.advance`][] runs it, from the `(draft, accept,
    sample)` uniforms: draft, score, verify and append."""
    draft_uniforms, accept_uniforms, sample_uniforms = uniforms
    buffer, draft_tokens, drafted, draft_cache = draft_chain(
        models[0], state, draft_uniforms, num_draft, draft_sampling
    )
    target_logits, target_cache = score_chain(models[1], buffer, state, num_draft)
    verified = verify_chain(
        step,
        draft_tokens,
        drafted,
        target_logits,
        state,
        accept_uniforms,
        sample_uniforms,
    )
    return append_verified(
        state,
        buffer,
        (draft_cache, target_cache),
        Verified(verified["num_accepted"], verified["tokens"]),
        max_new_tokens,
        end_tokens,
    )


def draft_chain(
    draft_model: AbstractCachedModel,
    state: LoopState,
    draft_uniforms: Float[Array, "batch draft"],
    num_draft: int,
    draft_sampling: AbstractDraftSampling,
) -> tuple[Int[Array, "batch time"], Int[Array, "batch draft"], DraftRows, Cache]:
    """Draws each row's $G$ draft tokens one at a time, token $i$ from $q_i$ by
    inverse CDF with uniform $i$, writing each into the buffer past the row's
    history before the draft model reads it for the next.

    The first call reads two slots from $\\max(\\text{length} - 2, 0)$: the history's
    last two tokens again, since the draft model has not read the last draft of the
    round before when all were kept, nor the token drawn after them (for a history
    of one token, the second slot is padding whose row and cache entry go unused);
    each later call reads the draft before.

    **Arguments:**

    - `draft_model`: a [`speculax.AbstractCachedModel`][].
    - `state`: the [`speculax.LoopState`][] before the round.
    - `draft_uniforms`: float `(B, G)`.
    - `num_draft`: $G$, a static integer.
    - `draft_sampling`: the [`speculax.AbstractDraftSampling`][] that makes $q_i$
        of the draft model's logits under the row's parameters.

    **Returns:**

    `(buffer, draft_tokens, rows, draft_cache)`: the int32 `(B, T)` buffer with the
    drafts at positions `length` to `length + G - 1`, the int32 `(B, G)` drafts,
    their `DraftRows` (the logits and the rows $q_i$ drawn from), and the draft
    model's cache after reading the history and $G - 1$ drafts.
    """
    if num_draft == 0:
        no_drafts = jnp.zeros((state.length.shape[0], 0), jnp.int32)
        return (
            state.buffer,
            no_drafts,
            _no_rows(draft_model, state, draft_sampling),
            state.draft_cache,
        )
    rows = jnp.arange(state.buffer.shape[0])
    first = jnp.maximum(state.length - 2, 0)
    logits, cache = read_chain(draft_model, state.buffer, first, 2, state.draft_cache)
    logits = logits[rows, state.length - 1 - first]
    row_shapes = DraftRows(
        logits,
        jax.eval_shape(
            draft_sampling, logits, state.temperature, state.top_k, state.top_p
        ),
    )
    drafted = jax.tree.map(
        lambda row: jnp.zeros((row.shape[0], num_draft, *row.shape[1:]), row.dtype),
        row_shapes,
    )

    # Each draw is traced once, in the loop: the model reads the draft just drawn
    # for the next draw's logits, except after the last.
    def draft(i: Int[Array, ""], carry: tuple) -> tuple:
        buffer, drafted, cache, logits = carry
        buffer, probs = _drawn(state, buffer, logits, draft_uniforms, i, draft_sampling)
        drafted = _set_rows(drafted, i, DraftRows(logits, probs))

        def read_next() -> tuple:
            next_logits, next_cache = read_chain(
                draft_model, buffer, state.length + i, 1, cache
            )
            return next_logits[:, 0], next_cache

        logits, cache = jax.lax.cond(
            i + 1 < num_draft, read_next, lambda: (logits, cache)
        )
        return buffer, drafted, cache, logits

    buffer, drafted, cache, _ = jax.lax.fori_loop(
        0, num_draft, draft, (state.buffer, drafted, cache, logits)
    )
    draft_tokens = jnp.take_along_axis(
        buffer, state.length[:, None] + jnp.arange(num_draft), axis=1
    )
    return buffer, draft_tokens, drafted, cache


def _set_rows(
    drafted: DraftRows, i: Int[Array, ""] | int, rows: DraftRows
) -> DraftRows:
    """`drafted` with the rows of draft position `i` set to `rows`."""
    return jax.tree.map(lambda all_, row: all_.at[:, i].set(row), drafted, rows)


def _drawn(
    state: LoopState,
    buffer: Int[Array, "batch time"],
    logits: Float[Array, "batch vocab"],
    draft_uniforms: Float[Array, "batch draft"],
    i: Int[Array, ""] | int,
    draft_sampling: AbstractDraftSampling,
) -> tuple[Int[Array, "batch time"], Float[Array, "batch vocab"]]:
    """Draft token $i$ drawn from $q_i$, the draft sampling's row of `logits`, and
    written into the buffer; with $q_i$."""
    probs = draft_sampling(logits, state.temperature, state.top_k, state.top_p)
    token = InverseCDF()(probs, draft_uniforms[:, i])
    rows = jnp.arange(buffer.shape[0])
    return buffer.at[rows, state.length + i].set(token), probs


def _no_rows(
    model: AbstractCachedModel,
    state: LoopState,
    draft_sampling: AbstractDraftSampling,
) -> DraftRows:
    """The draft rows of a round without drafts: `(B, 0, V)` each, in the dtypes of
    the model's logits and of the draft sampling's rows."""

    def one_row() -> DraftRows:
        logits = read_chain(
            model, state.buffer, state.length - 1, 1, state.draft_cache
        )[0][:, 0]
        probs = draft_sampling(logits, state.temperature, state.top_k, state.top_p)
        return DraftRows(logits, probs)

    return jax.tree.map(
        lambda row: jnp.zeros((row.shape[0], 0, row.shape[1]), row.dtype),
        jax.eval_shape(one_row),
    )


def score_chain(
    target_model: AbstractCachedModel,
    buffer: Int[Array, "batch time"],
    state: LoopState,
    num_draft: int,
) -> tuple[Float[Array, "batch positions vocab"], Cache]:
    """The target's logits after the history and each prefix of the drafts, in one
    call: position $i$ after the history and the first $i$ drafts.

    **Arguments:**

    - `target_model`: a [`speculax.AbstractCachedModel`][].
    - `buffer`: int32 `(B, T)`, each history followed by its $G$ drafts.
    - `state`: the [`speculax.LoopState`][] before the round, with the history's
        length and the target's cache.
    - `num_draft`: $G$, a static integer.

    **Returns:**

    `(target_logits, target_cache)`: the `(B, G + 1, V)` logits, and the target's
    cache after reading the history's last token and the drafts.
    """
    return read_chain(
        target_model, buffer, state.length - 1, num_draft + 1, state.target_cache
    )


def verify_chain(
    step: SpeculativeStep | LogitsStep,
    draft_tokens: Int[Array, "batch draft"],
    drafted: DraftRows,
    target_logits: Float[Array, "batch draft+1 vocab"],
    state: LoopState,
    accept_uniforms: Float[Array, "batch draft"],
    sample_uniforms: Float[Array, " batch"],
) -> StepOutput:
    """The step on the round's drafts: a [`speculax.SpeculativeStep`][] on the rows
    $q_i$ the drafts were drawn from and the target's rows $p_i$ under each row's
    parameters; a [`speculax.LogitsStep`][] on both models' logits and the
    parameters, from which it makes both itself."""
    if isinstance(step, SpeculativeStep):
        target_probs = row_probs(
            target_logits, RowParameters(state.temperature, state.top_k, state.top_p)
        )
        return step(
            draft_tokens, drafted.probs, target_probs, accept_uniforms, sample_uniforms
        )
    if state.temperature is None:
        raise ValueError(
            "a LogitsStep verifies under each row's sampling parameters, and the "
            "state has none: make it with SpeculativeLoop.start, which gives every "
            "row its parameters (temperature 1 and no truncation by default)"
        )
    # Both in `probs_dtype`, as the drafter read the draft's: the step then makes
    # the very rows the drafts were drawn from, in one precision for both models.
    return step(
        draft_tokens,
        widened(drafted.logits),
        widened(target_logits),
        accept_uniforms,
        sample_uniforms,
        temperature=state.temperature,
        top_k=state.top_k,
        top_p=state.top_p,
    )
