"""Prompt lookup: drafts copied from the row's own history, without a draft model."""

from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.core import Tracer
from jaxtyping import Array, ArrayLike, Float, Int, PyTree

from .._core._checks import check_static_int
from .._core._numerics import integer_by_value, integer_input
from .._loop._drafter import AbstractDrafter, Drafts, chain_lengths, cut_chains
from .._loop._sampling import AbstractDraftSampling, RowParameters
from .._loop._state import LoopState


def _max_draft_array(value: ArrayLike | None) -> Int[Array, "*batch"] | None:
    """`max_draft` as int32, read by value (a `TypeError` naming it for a float or
    a bool); `None` stays `None`."""
    return (
        None
        if value is None
        else integer_input(value, "max_draft", unrepresentable=None)
    )


@final
class PromptLookup(AbstractDrafter):
    """N-gram prompt lookup, a drafter without a draft model: the token proposed
    after a history is the one that followed the latest earlier occurrence of the
    history's longest suffix of $n \\in [n_\\min, n_\\max]$ tokens (prompt and
    generated text alike); where no suffix of $n_\\min$ tokens occurred before,
    nothing is proposed.

    Its drafts are deterministic: a function of the history alone, drawn from no
    row, which the step verifies as such (a draft passes with the target's
    probability of it, and the correction is drawn from the target's row without
    it), under any temperature, top-$k$ or top-$p$. Draft $i$ of a chain is the
    proposal after the history with the drafts before it appended, so a match is
    followed token by token as far as the chain goes. Each row's chain ends
    (`-1` from there on, as [`speculax.Drafts`][] says) where its lookup first
    finds nothing, or at its maximum draft length: a row without a match, or
    with a maximum of 0, has no drafts, and its token is drawn from the target's
    row. (Once a lookup matches, every later one in the chain does, since each
    proposal extends a run that occurred before: a row drafts none of its
    maximum or all of it, up to $G$.) It keeps no state, reads only the history,
    and a row's proposals never depend on the other rows.

    The loop is lossless with it as with any drafter: the drafts' quality moves
    only how many are accepted (high on text that repeats its context, such as
    code, documents quoted in answers or edits; `docs/loop.md`, "Prompt
    lookup").

    **Arguments:**

    - `min_ngram`, `max_ngram`: keyword only, $n_\\min$ and $n_\\max$, the
        shortest and longest suffix looked up, static integers with
        $1 \\le n_\\min \\le n_\\max$. Defaults 1 and 3.
    - `max_draft`: keyword only, integer `()` or `(B,)`, non-negative, in any
        integer dtype: each row's maximum draft length per round (one for every
        row, or one per row of the loop's batch), below the loop's $G$ where a
        row should draft less; `None` (the default) for $G$. An array, so that
        one compiled loop serves every choice.

    **Example:**

    ```python
    import jax.numpy as jnp
    import speculax

    lookup = speculax.PromptLookup(max_ngram=2)
    history = jnp.array([[5, 1, 2, 7, 5, 1, 8]])
    # The suffix [5, 1] occurred before, followed by 2; 8 never did.
    assert lookup.proposals(history, jnp.array([[5, 6]])).tolist() == [[2, -1]]
    ```
    """

    min_ngram: int = eqx.field(
        static=True, default=1, kw_only=True, converter=integer_by_value
    )
    max_ngram: int = eqx.field(
        static=True, default=3, kw_only=True, converter=integer_by_value
    )
    max_draft: Int[Array, "*batch"] | None = eqx.field(
        default=None, kw_only=True, converter=_max_draft_array
    )

    def __check_init__(self):
        check_static_int("min_ngram", self.min_ngram, minimum=1)
        check_static_int("max_ngram", self.max_ngram, minimum=1)
        if self.min_ngram > self.max_ngram:
            raise ValueError(
                f"min_ngram must be at most max_ngram; got min_ngram={self.min_ngram}"
                f" and max_ngram={self.max_ngram}"
            )
        if self.max_draft is None:
            return
        if self.max_draft.ndim > 1:
            raise ValueError(
                "max_draft must have shape () or (B,); got shape "
                f"{self.max_draft.shape}"
            )
        if not isinstance(self.max_draft, Tracer) and bool(jnp.any(self.max_draft < 0)):
            raise ValueError(
                f"max_draft must be non-negative; got {self.max_draft.tolist()}"
            )

    def init(
        self,
        prompt: Int[Array, "batch prompt"],
        slots: int,
        num_draft: int,
        vocab_size: int,
    ) -> None:
        return None

    def draft(
        self,
        state: LoopState,
        uniforms: Float[Array, "batch draft"],
        num_draft: int,
        draft_sampling: AbstractDraftSampling,
    ) -> Drafts:
        rows = jnp.arange(state.buffer.shape[0])

        def propose(i: Int[Array, ""], buffer: Int[Array, "batch time"]) -> Array:
            last = state.length - 1 + i
            proposed = self.proposals(buffer, last[:, None])[:, 0]
            return buffer.at[rows, last + 1].set(proposed)

        buffer = jax.lax.fori_loop(0, num_draft, propose, state.buffer)
        tokens = jnp.take_along_axis(
            buffer, state.length[:, None] + jnp.arange(num_draft), axis=1
        )
        return Drafts(self._ended(tokens), None, None)

    def drawn_after(
        self,
        tokens: Int[Array, "batch time"],
        length: Int[Array, " batch"],
        target_cache: PyTree,
        num_draft: int,
        parameters: RowParameters,
        draft_sampling: AbstractDraftSampling,
    ) -> Int[Array, "batch draft"]:
        return self._ended(
            self.proposals(tokens, (length - 1)[:, None] + jnp.arange(num_draft))
        )

    def proposals(
        self, tokens: Int[Array, "batch time"], positions: Int[Array, "batch positions"]
    ) -> Int[Array, "batch positions"]:
        """The token proposed after each position.

        **Arguments:**

        - `tokens`: integer `(B, T)`, the rows' histories (and anything past them).
        - `positions`: integer `(B, K)`, positions in `[0, T)`.

        **Returns:**

        int32 `(B, K)`: entry `[b, k]` is the token that followed the latest
        earlier occurrence of the longest suffix (of $n_\\min$ to $n_\\max$
        tokens) of the history `tokens[b, :positions[b, k] + 1]`, or `-1` if
        none occurred before.
        """
        per_position = jax.vmap(self._proposal, in_axes=(None, 0))
        return jax.vmap(per_position)(tokens, positions).astype(jnp.int32)

    def _proposal(
        self, history: Int[Array, " time"], position: Int[Array, ""]
    ) -> Int[Array, ""]:
        """The proposal after `history[:position + 1]`, from every earlier end of a
        match at once: how many tokens the suffix ending at `position` and the run
        ending at each earlier end have in common, counted back up to $n_\\max$."""
        ends = jnp.arange(history.shape[0])
        back = jnp.arange(self.max_ngram)[:, None]
        earlier = ends - back
        # An earlier end leaves at least as many tokens before it as the suffix
        # has, so `position - back` is in range wherever `earlier` is.
        agree = (earlier >= 0) & (
            history[jnp.maximum(earlier, 0)] == history[jnp.maximum(position - back, 0)]
        )
        length = jnp.sum(jnp.cumprod(agree.astype(jnp.int32), axis=0), axis=0)
        matched = (ends < position) & (length >= self.min_ngram)
        # The longest match first, then the latest.
        score = jnp.where(matched, length * history.shape[0] + ends, -1)
        end = jnp.argmax(score)
        return jnp.where(score[end] >= 0, history[end + 1], -1)

    def _ended(self, proposals: Int[Array, "batch draft"]) -> Int[Array, "batch draft"]:
        """Each row's chain of proposals ended at its first miss (where the
        lookups after it read a placeholder in its slot) or at its maximum draft
        length: `-1` from there on."""
        batch = proposals.shape[0]
        length = chain_lengths(proposals)
        if self.max_draft is not None:
            if self.max_draft.ndim and self.max_draft.shape[0] not in (1, batch):
                raise ValueError(
                    f"max_draft must have one entry per row, {batch}; got shape "
                    f"{self.max_draft.shape}"
                )
            length = jnp.minimum(length, self.max_draft)
        return cut_chains(proposals, length, -1)
