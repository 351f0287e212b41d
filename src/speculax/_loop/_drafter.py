"""The drafter interface: what proposes each round's chain of drafts, and what the
loop and its exact enumeration ask of it."""

import abc
from typing import NamedTuple

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PyTree

from ._sampling import AbstractDraftSampling, RowParameters
from ._state import LoopState


class DraftRows(NamedTuple):
    """The rows of a round's drafts: `logits`, float `(B, G, V)`, and `probs`, the
    float `(B, G, V)` rows $q_i$ the drafts were drawn from, in the draft
    sampling's dtype. A [`speculax.SpeculativeStep`][] verifies by `probs`, a
    [`speculax.LogitsStep`][] by `logits` (of which the loop's default draft
    sampling makes `probs`)."""

    logits: Float[Array, "batch draft vocab"]
    probs: Float[Array, "batch draft vocab"]


def sampled_rows(
    logits: Float[Array, "batch draft vocab"],
    parameters: RowParameters,
    draft_sampling: AbstractDraftSampling,
) -> DraftRows:
    """The rows of drafts drawn from logits: the logits, and what `draft_sampling`
    makes of each draft position's under the row's parameters, all positions in
    one call of it."""
    batch, num_draft, vocab = logits.shape
    flat = RowParameters(
        *(None if x is None else jnp.repeat(x, num_draft) for x in parameters)
    )
    probs = draft_sampling(logits.reshape(batch * num_draft, vocab), *flat)
    return DraftRows(logits, probs.reshape(batch, num_draft, vocab))


class Drafts(NamedTuple):
    """A round's chain of drafts, as a [`speculax.AbstractDrafter`][] returns them.

    - `tokens`: int32 `(B, G)`, the drafts. A chain of deterministic drafts may
        end before $G$: from a row's first `-1` on it has no drafts, and the step
        verifies only those before it (a row of `-1` only is verified without
        drafts, its token drawn from the target's row).
    - `rows`: the [`speculax.DraftRows`][] they were drawn from, or `None` for
        deterministic drafts, which the step verifies as such (`draft_probs=None`:
        a draft passes with the target's probability of it).
    - `state`: the drafter's state after the round, with the structure, shapes and
        dtypes of the state it was given.
    """

    tokens: Int[Array, "batch draft"]
    rows: DraftRows | None
    state: PyTree


def chain_lengths(tokens: Int[Array, "batch draft"]) -> Int[Array, " batch"]:
    """The number of drafts in each row's chain: those before its first `-1`."""
    return jnp.sum(jnp.cumprod(tokens >= 0, axis=1), axis=1, dtype=jnp.int32)


def cut_chains(
    tokens: Int[Array, "batch draft"], lengths: Int[Array, " batch"], fill: int
) -> Int[Array, "batch draft"]:
    """Each row's first `lengths` tokens, then `fill`."""
    in_chain = jnp.arange(tokens.shape[1]) < lengths[:, None]
    return jnp.where(in_chain, tokens, fill)


def ended_chains(drafts: Drafts) -> tuple[Drafts, Int[Array, " batch"] | None]:
    """The drafts as the loop reads and verifies them, and the number of drafts in
    each row's chain: deterministic drafts to each row's first `-1`, token 0 in
    the slots past it (the target reads them, but the step reads none of their
    logits); drafts drawn from rows all $G$ as they are (no lengths, which keeps
    the ragged path out of the step's program)."""
    if drafts.rows is not None:
        return drafts, None
    lengths = chain_lengths(drafts.tokens)
    return drafts._replace(tokens=cut_chains(drafts.tokens, lengths, 0)), lengths


class AbstractDrafter(eqx.Module):
    """What proposes each round's drafts in a [`speculax.SpeculativeLoop`][]: a
    draft model ([`speculax.ModelDrafter`][], what the loop makes of a model it is
    given), or a drafter without one ([`speculax.PromptLookup`][]).

    The loop is lossless with any drafter that keeps one promise: draft $i$ is drawn
    from `rows.probs[:, i]` by inverse CDF with the row's `DRAFT` uniform $i$
    (or, for `rows=None`, is a function of the history alone), where those rows
    are a function of the history and the drafts before $i$, the ones
    `drawn_after` gives. Deterministic drafts may end a row's chain early with
    `-1`, as `drawn_after` says where.
    [`speculax.testing.loop_output_distribution`][] checks the promise in every
    cell it enumerates: the drafts and rows of the loop's round must equal those
    `drawn_after` gives, bit for bit.

    Subclass it and implement `init`, `draft` and `drawn_after`.
    """

    @abc.abstractmethod
    def init(
        self,
        prompt: Int[Array, "batch prompt"],
        slots: int,
        num_draft: int,
        vocab_size: int,
    ) -> PyTree:
        """The drafter's state before the first round: a draft model's cache
        filled with the prompts, say.

        **Arguments:**

        - `prompt`: int32 `(B, P)`, the prompts, padded past each row's length.
        - `slots`: $T$, the width of the loop's token buffer (the prompt, the new
            tokens and a round's drafts).
        - `num_draft`: $G$, the drafts per round: for $G = 0$ the loop never
            asks for any, and the state need not be filled. For a draft tree,
            its depth $D$, the drafts after the history whose rows fill it.
        - `vocab_size`: $V$, the target model's vocabulary, which a drafter's
            rows must score (raise a `ValueError` otherwise).

        **Returns:**

        A PyTree of arrays (or `None`), which the loop carries as
        `LoopState.drafter_state` and gives back to `draft`.
        """

    @abc.abstractmethod
    def draft(
        self,
        state: LoopState,
        uniforms: Float[Array, "batch draft"],
        num_draft: int,
        draft_sampling: AbstractDraftSampling,
    ) -> Drafts:
        """Proposes each row's $G$ drafts after its history.

        **Arguments:**

        - `state`: the [`speculax.LoopState`][] before the round: each row's
            history (the first `length` tokens of `buffer`), its sampling
            parameters, `drafter_state`, and `target_cache`, whose slots below
            `length - 1` hold the target's entries (its features, for a target
            that keeps them there) of the history but its last token.
        - `uniforms`: float `(B, G)`, the row's `DRAFT` uniforms, draft $i$'s
            at $i$.
        - `num_draft`: $G$, a static integer.
        - `draft_sampling`: the loop's [`speculax.AbstractDraftSampling`][], how
            rows are made of a draft model's logits; a drafter without logits
            ignores it.

        **Returns:**

        The [`speculax.Drafts`][]: tokens `(B, G)`, their rows or `None`, and the
        new state.
        """

    @abc.abstractmethod
    def drawn_after(
        self,
        tokens: Int[Array, "batch time"],
        length: Int[Array, " batch"],
        target_cache: PyTree,
        num_draft: int,
        parameters: RowParameters,
        draft_sampling: AbstractDraftSampling,
    ) -> DraftRows | Int[Array, "batch draft"]:
        """What each draft after a history is drawn from, found by reading the
        history whole, without the drafter's state: the definition `draft`
        follows, which the exact enumeration reads.

        **Arguments:**

        - `tokens`: int32 `(B, T)`, each row's history, its first `length`
            tokens, followed by $G$ drafts (and anything past them); for a draft
            tree, by the path to a node and then 0s, $G$ being the tree's depth.
        - `length`: int32 `(B,)`, the histories' lengths.
        - `target_cache`: the target model's cache after reading `tokens` in one
            call. The drafter may read its slots below `length - 1`, the entries
            (features, say) of the history but its last token, which the loop's
            `state.target_cache` holds as they are when it drafts; the other
            slots hold entries the loop's does not.
        - `num_draft`: $G$, a static integer.
        - `parameters`: each row's sampling parameters, `(B,)` each or `None`.
        - `draft_sampling`: as for `draft`.

        **Returns:**

        For drafts drawn from rows, the [`speculax.DraftRows`][] of each, `(B, G,
        V)`, row $i$ the one draft $i$ is drawn from after the history and the
        drafts before it; for deterministic drafts (`draft` returns
        `rows=None`), the int32 `(B, G)` drafts proposed, `-1` from where a row's
        chain ends, if it ends before $G$.
        """
