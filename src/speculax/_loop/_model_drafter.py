"""Drafting with a draft model: each draft drawn from the model's row after the
history and the drafts before it, the model reading them through its cache."""

from typing import Any, cast, final

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PyTree

from .._pieces._sampling import InverseCDF
from ._cache import (
    AbstractCachedModel,
    Cache,
    NamedModel,
    as_cached_model,
    empty_cache,
    read_chain,
    read_history,
)
from ._drafter import AbstractDrafter, DraftRows, Drafts, sampled_rows
from ._model import LanguageModel
from ._sampling import AbstractDraftSampling, RowParameters
from ._state import LoopState


@final
class ModelDrafter(AbstractDrafter):
    """Drafting with a draft model, what the loop does with a model it is given as
    its drafter: draft $i$ is drawn by inverse CDF from $q_i$, what the loop's
    `draft_sampling` makes of the model's logits after the history and the drafts
    before $i$ (by default their softmax under the row's parameters).

    The model reads the history through its cache: the round's first call reads the
    history's last two tokens again (the model has not read the last draft of the
    round before when all were kept, nor the token drawn after them), each later
    call the draft before. Its state is the model's cache, whose first
    `length - 2` slots hold the history.

    **Arguments:**

    - `model`: a [`speculax.AbstractCachedModel`][], or a
        [`speculax.LanguageModel`][], which is given a cache by
        [`speculax.Cacheless`][].
    """

    model: AbstractCachedModel | LanguageModel

    def __check_init__(self):
        as_cached_model(self.model, "draft_model")

    @property
    def cached_model(self) -> NamedModel:
        """The model with a cache, its calls checked and named `draft_model`."""
        return as_cached_model(self.model, "draft_model")

    def init(
        self,
        prompt: Int[Array, "batch prompt"],
        slots: int,
        num_draft: int,
        vocab_size: int,
    ) -> PyTree:
        model = self.cached_model
        if not num_draft:
            return empty_cache(model, prompt.shape[0], slots, "draft_model")
        logits, cache = read_history(model, prompt, slots, "draft_model")
        if logits.shape[-1] != vocab_size:
            raise ValueError(
                "draft_model and target_model must score the same vocabulary: "
                f"draft_model gives logits over V = {logits.shape[-1]} tokens, "
                f"target_model over V = {vocab_size}"
            )
        return cache

    def draft(
        self,
        state: LoopState,
        uniforms: Float[Array, "batch draft"],
        num_draft: int,
        draft_sampling: AbstractDraftSampling,
    ) -> Drafts:
        model = self.cached_model
        if num_draft == 0:
            no_drafts = jnp.zeros((state.length.shape[0], 0), jnp.int32)
            return Drafts(
                no_drafts, _no_rows(model, state, draft_sampling), state.drafter_state
            )
        logits, cache = history_end_logits(model, state)
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

        # Each draw is traced once, in the loop: the model reads the draft just
        # drawn for the next draw's logits, except after the last.
        def draw(i: Int[Array, ""], carry: tuple) -> tuple:
            buffer, drafted, cache, logits = carry
            buffer, probs = _drawn(state, buffer, logits, uniforms, i, draft_sampling)
            drafted = _set_rows(drafted, i, DraftRows(logits, probs))

            def read_next() -> tuple:
                next_logits, next_cache = read_chain(
                    model, buffer, state.length + i, 1, cache
                )
                return next_logits[:, 0], next_cache

            logits, cache = jax.lax.cond(
                i + 1 < num_draft, read_next, lambda: (logits, cache)
            )
            return buffer, drafted, cache, logits

        buffer, drafted, cache, _ = jax.lax.fori_loop(
            0, num_draft, draw, (state.buffer, drafted, cache, logits)
        )
        tokens = jnp.take_along_axis(
            buffer, state.length[:, None] + jnp.arange(num_draft), axis=1
        )
        return Drafts(tokens, drafted, cache)

    def drawn_after(
        self,
        tokens: Int[Array, "batch time"],
        length: Int[Array, " batch"],
        target_cache: PyTree,
        num_draft: int,
        parameters: RowParameters,
        draft_sampling: AbstractDraftSampling,
    ) -> DraftRows:
        positions = (length - 1)[:, None] + jnp.arange(num_draft)
        logits = history_logits(self.cached_model, tokens, positions)
        return sampled_rows(logits, parameters, draft_sampling)


def history_end_logits(
    model: AbstractCachedModel, state: LoopState
) -> tuple[Float[Array, "batch vocab"], Cache]:
    """The draft model's logits after each row's history, and its cache after the
    call that begins a round: the history's last two tokens read from slot
    $\\max(\\text{length} - 2, 0)$, the cache holding the history before them
    (see [`speculax.LoopState`][])."""
    first = jnp.maximum(state.length - 2, 0)
    logits, cache = read_chain(model, state.buffer, first, 2, state.drafter_state)
    return logits[jnp.arange(state.length.shape[0]), state.length - 1 - first], cache


def history_logits(
    model: AbstractCachedModel,
    tokens: Int[Array, "batch time"],
    positions: Int[Array, "batch positions"],
) -> Float[Array, "batch positions vocab"]:
    """The model's logits after the tokens up to each of `positions`, from one call
    that reads the whole buffer into an empty cache: the history as it is, whatever
    a loop's cache holds."""
    logits, _ = read_history(model, tokens, tokens.shape[1], "model")
    return jnp.take_along_axis(logits, positions[..., None], axis=1)


def as_drafter(drafter: Any) -> AbstractDrafter:
    """`drafter` as the loop runs it: a drafter as it is, a model (with a cache or
    without) as a [`speculax.ModelDrafter`][]; a `TypeError` naming the argument
    otherwise."""
    if not isinstance(drafter, AbstractDrafter):
        if not (isinstance(drafter, AbstractCachedModel) or callable(drafter)):
            raise TypeError(
                "drafter must be a speculax.AbstractDrafter, a "
                "speculax.AbstractCachedModel or a callable (tokens, positions) -> "
                f"logits; got a {type(drafter).__name__}"
            )
        drafter = ModelDrafter(cast(AbstractCachedModel | LanguageModel, drafter))
    return drafter


def _set_rows(
    drafted: DraftRows, i: Int[Array, ""] | int, rows: DraftRows
) -> DraftRows:
    """`drafted` with the rows of draft position `i` set to `rows`."""
    return jax.tree.map(lambda all_, row: all_.at[:, i].set(row), drafted, rows)


def _drawn(
    state: LoopState,
    buffer: Int[Array, "batch time"],
    logits: Float[Array, "batch vocab"],
    uniforms: Float[Array, "batch draft"],
    i: Int[Array, ""] | int,
    draft_sampling: AbstractDraftSampling,
) -> tuple[Int[Array, "batch time"], Float[Array, "batch vocab"]]:
    """Draft token $i$ drawn from $q_i$, the draft sampling's row of `logits`, and
    written into the buffer; with $q_i$."""
    probs = draft_sampling(logits, state.temperature, state.top_k, state.top_p)
    token = InverseCDF()(probs, uniforms[:, i])
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
        cache: Cache = state.drafter_state
        logits = read_chain(model, state.buffer, state.length - 1, 1, cache)[0][:, 0]
        probs = draft_sampling(logits, state.temperature, state.top_k, state.top_p)
        return DraftRows(logits, probs)

    return jax.tree.map(
        lambda row: jnp.zeros((row.shape[0], 0, row.shape[1]), row.dtype),
        jax.eval_shape(one_row),
    )
