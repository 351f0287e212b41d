"""The stages of one round of the loop with a chain of drafts, in order: the
drafter proposes $G$ tokens, the target scores them in one call, and the step
verifies them (`_append` then appends what the step keeps)."""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._chain._step import SpeculativeStep, StepOutput
from .._logits._step import LogitsStep
from ._append import Verified, append_verified
from ._cache import AbstractCachedModel, Cache, read_chain
from ._drafter import AbstractDrafter, Drafts, ended_chains
from ._model import widened
from ._sampling import AbstractDraftSampling, RowParameters, row_probs
from ._state import LoopState


def chain_round(
    drafter: AbstractDrafter,
    target_model: AbstractCachedModel,
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
    drafts, num_draft_tokens = ended_chains(
        drafter.draft(state, draft_uniforms, num_draft, draft_sampling)
    )
    rows = jnp.arange(state.buffer.shape[0])[:, None]
    buffer = state.buffer.at[rows, state.length[:, None] + jnp.arange(num_draft)].set(
        drafts.tokens
    )
    target_logits, target_cache = score_chain(target_model, buffer, state, num_draft)
    verified = verify_chain(
        step,
        drafts,
        num_draft_tokens,
        target_logits,
        state,
        accept_uniforms,
        sample_uniforms,
    )
    return append_verified(
        state,
        buffer,
        (drafts.state, target_cache),
        Verified(verified["num_accepted"], verified["tokens"]),
        max_new_tokens,
        end_tokens,
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
    drafts: Drafts,
    num_draft_tokens: Int[Array, " batch"] | None,
    target_logits: Float[Array, "batch positions vocab"],
    state: LoopState,
    accept_uniforms: Float[Array, "batch draft"],
    sample_uniforms: Float[Array, " batch"],
) -> StepOutput:
    """The step on the round's drafts: a [`speculax.SpeculativeStep`][] on the rows
    $q_i$ the drafts were drawn from and the target's rows $p_i$ under each row's
    parameters; a [`speculax.LogitsStep`][] on both models' logits and the
    parameters, from which it makes both itself. Deterministic drafts (no rows) are
    verified as such by either, each row's first `num_draft_tokens` (all $G$ for
    `None`)."""
    if isinstance(step, SpeculativeStep):
        target_probs = row_probs(
            target_logits, RowParameters(state.temperature, state.top_k, state.top_p)
        )
        return step(
            drafts.tokens,
            None if drafts.rows is None else drafts.rows.probs,
            target_probs,
            accept_uniforms,
            sample_uniforms,
            num_draft_tokens=num_draft_tokens,
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
        drafts.tokens,
        None if drafts.rows is None else widened(drafts.rows.logits),
        widened(target_logits),
        accept_uniforms,
        sample_uniforms,
        temperature=state.temperature,
        top_k=state.top_k,
        top_p=state.top_p,
        num_draft_tokens=num_draft_tokens,
    )
