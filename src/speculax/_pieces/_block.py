"""The numbers of block verification (Sun et al., 2025) that its pieces share. See
`docs/keeping_more.md`."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._core._numerics import flush_subnormal, upcast
from .._core._vocab_axis import one_hot_over_vocab, ordered_row_sums, probs_at_tokens
from ._stopping_rows import summary_loops_over_rows


def path_acceptance(
    draft_tokens: Int[Array, "batch draft"],
    draft_probs: Float[Array, "batch draft vocab"] | None,
    target_probs: Float[Array, "batch draft+1 vocab"],
    *,
    axis_name: str | None,
) -> Float[Array, "batch draft+1"]:
    """$P_0 = 1$ and $P_{i+1} = \\min(1, P_i \\, p_i(x_i) / q_i(x_i))$: the largest
    probability with which the target can keep the first $i + 1$ draft tokens, given
    what block verification kept before. In the arithmetic dtype.

    As the ratio test does, the ratio is never divided by zero: when
    $P_i \\, p_i(x_i) \\ge q_i(x_i)$ the result is 1 if $P_i \\, p_i(x_i) > 0$ and 0
    otherwise, so that a token the target gives probability 0 ends every path
    through it, whatever $q_i(x_i)$.
    """
    target_at, draft_at = probs_at_tokens(
        draft_tokens, draft_probs, target_probs, axis_name=axis_name
    )
    ratios = [jnp.ones(draft_tokens.shape[:1], target_at.dtype)]
    for i in range(draft_tokens.shape[1]):
        ratios.append(next_ratio(ratios[-1], target_at[:, i], draft_at[:, i]))
    return jnp.stack(ratios, axis=1)


def stopping_ratio(
    num_accepted: Int[Array, " batch"],
    draft_tokens: Int[Array, "batch draft"],
    draft_probs: Float[Array, "batch draft vocab"] | None,
    target_probs: Float[Array, "batch draft+1 vocab"],
    *,
    axis_name: str | None,
) -> Float[Array, " batch"]:
    """$P_n$, the ratio the residual at the stopping position $n$ scales $p_n$ by."""
    ratios = path_acceptance(
        draft_tokens, draft_probs, target_probs, axis_name=axis_name
    )
    return jnp.take_along_axis(ratios, num_accepted[:, None], axis=1)[:, 0]


def next_ratio(
    ratio: Float[Array, "*rows"],
    target_at: Float[Array, "*rows"],
    draft_at: Float[Array, "*rows"],
) -> Float[Array, "*rows"]:
    """$\\min(1, P \\, p(x) / q(x))$, without dividing by zero (see
    `path_acceptance`)."""
    kept = flush_subnormal(ratio * target_at)
    below = kept / jnp.where(draft_at > 0, draft_at, 1)
    return jnp.where(kept >= draft_at, (kept > 0).astype(kept.dtype), below)


def block_continuation(
    mass: Float[Array, "*rows"], ratio: Float[Array, "*rows"]
) -> Float[Array, "*rows"]:
    """$h = r / (r + (1 - P))$, or 1 when the denominator is 0: the probability
    with which block verification keeps a path whose next position was rejected.
    Summed as $r + (1 - P)$, never $(r + 1) - P$, so that block and traversal
    verification round alike. An infinite mass, from unnormalised rows whose total
    overflows, gives 1 rather than NaN: the traversal reports such a row as an
    overflow, and the block step's checks read the row it draws from (a middle row
    that overflows is not reported there)."""
    total = mass + (1 - ratio)
    ordinary = (total > 0) & jnp.isfinite(total)
    return jnp.where(ordinary, mass / jnp.where(ordinary, total, 1), 1)


def scaled_excess(
    scale: Float[Array, "*rows"],
    target_row: Float[Array, "*rows vocab"],
    draft_row: Float[Array, "*rows vocab"],
) -> Float[Array, "*rows vocab"]:
    """$\\max(P \\, p - q, 0)$, a difference of two normal numbers that is subnormal
    counting as zero. With $P = 1$ the residual of token-by-token verification, to
    the last bit."""
    return flush_subnormal(jnp.maximum(scale[..., None] * target_row - draft_row, 0))


def continuation_masses(
    ratios: Float[Array, "batch positions"],
    draft_tokens: Int[Array, "batch draft"],
    draft_probs: Float[Array, "batch draft vocab"] | None,
    target_probs: Float[Array, "batch draft+1 vocab"],
    *,
    axis_name: str | None,
) -> Float[Array, "batch inner"]:
    """$r_k = \\sum_v \\max(P_k \\, p_k(v) - q_k(v), 0)$ for $k = 1, \\dots, G - 1$,
    summed in a fixed order (`ordered_row_sums`); $q_k$ is the one-hot of $x_k$
    for deterministic drafts.

    On CPU a loop over the batch, each row's $G - 1$ positions read in place: XLA
    CPU materialises the batched form's `(B, G - 1, V)` excess and runs it twice as
    slowly. Elsewhere the batched form, which a GPU runs in parallel; and for
    half-precision inputs, as for the stopping rows' summary, since XLA CPU would
    convert the whole array inside the loop.
    """
    batch, num_draft = draft_tokens.shape
    vocab = target_probs.shape[-1]

    def masses(ratio, target, draft, tokens):
        # One batch row's or all of them: `ratio` (..., G - 1), rows (..., G - 1, V).
        target = upcast(target)
        if draft is None:
            draft = one_hot_over_vocab(tokens, vocab, target.dtype, axis_name)
        excess = scaled_excess(ratio, target, upcast(draft))
        return ordered_row_sums(excess, axis_name)

    inner = slice(1, num_draft)
    if not summary_loops_over_rows(target_probs, draft_probs) or batch == 0:
        draft = None if draft_probs is None else draft_probs[:, inner]
        return masses(
            ratios[:, inner], target_probs[:, inner], draft, draft_tokens[:, inner]
        )

    def one_row(b):
        draft = None if draft_probs is None else draft_probs[b, inner]
        return masses(
            ratios[b, inner], target_probs[b, inner], draft, draft_tokens[b, inner]
        )

    return jax.lax.map(one_row, jnp.arange(batch))
