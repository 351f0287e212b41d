"""Prompt lookup: drafts copied from the row's own history, without a draft model."""

from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._core._checks import check_static_int
from .._core._numerics import integer_by_value


@final
class PromptLookup(eqx.Module):
    """N-gram prompt lookup as a draft model: the next token proposed after a
    history is the one that followed the latest earlier occurrence of the
    history's longest suffix of $n \\in [n_\\min, n_\\max]$ tokens (prompt and
    generated text alike), or the history's last token when no suffix of
    $n_\\min$ tokens occurred before.

    It is a [`speculax.LanguageModel`][] whose logits are $0$ at the proposed token
    and $-\\infty$ elsewhere, so that under any temperature, top-$k$ or top-$p$ the
    draft's row $q_i$ is the one-hot of the proposal: deterministic drafts, which
    the step verifies by the target's probability of each one (a draft passes with
    probability $p_i(x_i)$, and the correction is drawn from $p_i$ without $x_i$).
    The loop calls it once per draft of a chain, and each call looks up the history
    with the drafts before it appended, so a match is followed token by token as
    far as the chain goes. It reads only the tokens up to each position, as the
    loop requires of a model, and a row's proposals never depend on the other rows.

    The loop is lossless with it as with any draft model: the drafts' quality moves
    only how many are accepted (high on text that repeats its context, such as
    code, documents quoted in answers or edits; `docs/loop.md`, "Drafting without
    a model").

    **Arguments:**

    - `vocab_size`: $V$, the size of the vocabulary of the logits it returns, a
        positive static integer (the target model's).
    - `min_ngram`, `max_ngram`: keyword only, $n_\\min$ and $n_\\max$, the shortest
        and longest suffix looked up, static integers with
        $1 \\le n_\\min \\le n_\\max$. Defaults 1 and 3.

    **Example:**

    ```python
    import jax.numpy as jnp
    import speculax

    lookup = speculax.PromptLookup(vocab_size=10, max_ngram=2)
    history = jnp.array([[5, 1, 2, 7, 5, 1]])
    # The suffix [5, 1] occurred before, followed by 2.
    assert lookup.proposals(history, jnp.array([[5]])).tolist() == [[2]]
    ```
    """

    vocab_size: int = eqx.field(static=True, converter=integer_by_value)
    min_ngram: int = eqx.field(
        static=True, default=1, kw_only=True, converter=integer_by_value
    )
    max_ngram: int = eqx.field(
        static=True, default=3, kw_only=True, converter=integer_by_value
    )

    def __check_init__(self):
        check_static_int("vocab_size", self.vocab_size, minimum=1)
        check_static_int("min_ngram", self.min_ngram, minimum=1)
        check_static_int("max_ngram", self.max_ngram, minimum=1)
        if self.min_ngram > self.max_ngram:
            raise ValueError(
                f"min_ngram must be at most max_ngram; got min_ngram={self.min_ngram}"
                f" and max_ngram={self.max_ngram}"
            )

    def __call__(
        self, tokens: Int[Array, "batch time"], positions: Int[Array, "batch positions"]
    ) -> Float[Array, "batch positions vocab"]:
        """The logits of the token after each position, as a
        [`speculax.LanguageModel`][] gives them.

        **Arguments:**

        - `tokens`: integer `(B, T)`, the rows' histories (and anything past them).
        - `positions`: integer `(B, K)`, positions in `[0, T)`.

        **Returns:**

        float32 `(B, K, V)`: $0$ at the proposal after `tokens[b, :positions[b, k]
        + 1]` (`proposals`), $-\\infty$ elsewhere.
        """
        proposed = self.proposals(tokens, positions)
        return jnp.where(
            jnp.arange(self.vocab_size) == proposed[..., None], 0.0, -jnp.inf
        ).astype(jnp.float32)

    def proposals(
        self, tokens: Int[Array, "batch time"], positions: Int[Array, "batch positions"]
    ) -> Int[Array, "batch positions"]:
        """The token proposed after each position.

        **Arguments:**

        As for `__call__`.

        **Returns:**

        int32 `(B, K)`: entry `[b, k]` is the token that followed the latest
        earlier occurrence of the longest suffix (of $n_\\min$ to $n_\\max$
        tokens) of the history `tokens[b, :positions[b, k] + 1]`, or the history's
        last token if none occurred before.
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
        return jnp.where(score[end] >= 0, history[end + 1], history[position])
