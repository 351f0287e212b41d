"""The checks of SPEC section 3: structure at trace time, values at run time."""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._acceptance import draft_token_probs


def check_structure(
    draft_tokens: Array,
    draft_probs: Array | None,
    target_probs: Array,
    accept_uniforms: Array | None,
    sample_uniforms: Array | None,
    num_draft_tokens: Array | None,
) -> None:
    """Raises `ValueError` for a wrong rank or disagreeing sizes and `TypeError` for a
    wrong kind of dtype, naming the argument, the expected and the actual. Arguments
    given as `None` (deterministic drafts, uniforms to be drawn or not needed, no
    ragged lengths) are skipped.

    Works on shapes and dtypes only, so it runs at trace time under `jit` and `vmap`.
    """
    arguments = {
        "draft_tokens": (draft_tokens, "(B, G)", jnp.integer),
        "draft_probs": (draft_probs, "(B, G, V)", jnp.floating),
        "target_probs": (target_probs, "(B, G + 1, V)", jnp.floating),
        "accept_uniforms": (accept_uniforms, "(B, G)", jnp.floating),
        "sample_uniforms": (sample_uniforms, "(B,)", jnp.floating),
        "num_draft_tokens": (num_draft_tokens, "(B,)", jnp.integer),
    }
    for name, (x, pattern, kind) in arguments.items():
        if x is None:
            continue
        rank = len(pattern.strip("(,)").split(","))
        if x.ndim != rank:
            raise ValueError(
                f"{name} must have rank {rank}, shape {pattern}; got shape "
                f"{tuple(x.shape)}"
            )
        if not jnp.issubdtype(x.dtype, kind):
            kind_name = "an integer" if kind is jnp.integer else "a floating-point"
            raise TypeError(f"{name} must have {kind_name} dtype; got {x.dtype}")

    batch, num_draft = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if vocab < 1:
        raise ValueError(
            f"target_probs must have a vocabulary axis of size at least 1; got shape "
            f"{target_probs.shape}"
        )
    expected = {
        "draft_probs": ("(B, G, V)", (batch, num_draft, vocab), _shape(draft_probs)),
        "target_probs": (
            "(B, G + 1, V)",
            (batch, num_draft + 1, vocab),
            target_probs.shape,
        ),
        "accept_uniforms": ("(B, G)", (batch, num_draft), _shape(accept_uniforms)),
        "sample_uniforms": ("(B,)", (batch,), _shape(sample_uniforms)),
        "num_draft_tokens": ("(B,)", (batch,), _shape(num_draft_tokens)),
    }
    for name, (pattern, want, got) in expected.items():
        if got is not None and tuple(got) != want:
            raise ValueError(
                f"{name} must have shape {pattern} = {want}, with B and G from "
                f"draft_tokens {tuple(draft_tokens.shape)} and V from target_probs; "
                f"got {tuple(got)}"
            )


def _shape(x: Array | None) -> tuple[int, ...] | None:
    return None if x is None else tuple(x.shape)


def check_cheap_values(
    draft_tokens: Int[Array, "batch draft"],
    draft_probs: Float[Array, "batch draft vocab"] | None,
    target_probs: Float[Array, "batch draft+1 vocab"],
    accept_uniforms: Float[Array, "batch draft"],
    sample_uniforms: Float[Array, " batch"],
    num_draft_tokens: Int[Array, " batch"] | None,
) -> Int[Array, "batch draft"]:
    """Checks the tokens, the uniforms and the draft tokens' probabilities, which the
    step reads anyway, at the draft positions in use (below `num_draft_tokens`).

    **Returns:**

    `draft_tokens`, tied to the checks so that the step cannot run ahead of them.
    """
    batch, num_draft = draft_tokens.shape
    if num_draft_tokens is None:
        in_use = jnp.ones((batch, num_draft), bool)
    else:
        # Tied into `in_use`, and through it into the returned tokens.
        lengths = eqx.error_if(
            num_draft_tokens,
            (num_draft_tokens < 0) | (num_draft_tokens > num_draft),
            f"num_draft_tokens must lie in [0, G] = [0, {num_draft}]; got a length "
            "outside it",
        )
        in_use = jnp.arange(num_draft)[None, :] < lengths[:, None]
    draft_tokens = check_tokens_and_uniforms(
        draft_tokens, accept_uniforms, sample_uniforms, target_probs.shape[-1], in_use
    )
    target_at_draft, draft_at_draft = draft_token_probs(
        draft_tokens, draft_probs, target_probs
    )
    return check_draft_token_probs(
        draft_tokens, target_at_draft, draft_at_draft, in_use
    )


def check_tokens_and_uniforms(
    draft_tokens: Int[Array, "batch draft"],
    accept_uniforms: Float[Array, "batch draft"],
    sample_uniforms: Float[Array, " batch"],
    vocab: int,
    in_use: Bool[Array, "batch draft"],
) -> Int[Array, "batch draft"]:
    """Checks that the draft tokens lie in `[0, vocab)` and the uniforms in `[0, 1)`,
    at the positions in use.

    **Returns:**

    `draft_tokens`, tied to all three checks.
    """
    draft_tokens = eqx.error_if(
        draft_tokens,
        in_use & ((draft_tokens < 0) | (draft_tokens >= vocab)),
        f"draft_tokens must lie in [0, V) = [0, {vocab}); got a token outside it",
    )
    draft_tokens = eqx.error_if(
        draft_tokens,
        in_use & outside_unit_interval(accept_uniforms),
        "accept_uniforms must lie in [0, 1); got a value outside it or NaN",
    )
    return eqx.error_if(
        draft_tokens,
        outside_unit_interval(sample_uniforms),
        "sample_uniforms must lie in [0, 1); got a value outside it or NaN",
    )


def check_draft_token_probs(
    draft_tokens: Int[Array, "batch draft"],
    target_at_draft: Float[Array, "batch draft"],
    draft_at_draft: Float[Array, "batch draft"],
    in_use: Bool[Array, "batch draft"],
) -> Int[Array, "batch draft"]:
    """Checks $p_i(x_i)$ and $q_i(x_i)$, as gathered, at the positions in use.

    **Returns:**

    `draft_tokens`, tied to the checks.
    """
    draft_tokens = eqx.error_if(
        draft_tokens,
        in_use & not_a_probability(target_at_draft),
        "target_probs must be finite and non-negative; got a negative, NaN or infinite "
        "p_i(x_i) at a draft token",
    )
    return eqx.error_if(
        draft_tokens,
        in_use & not_a_probability(draft_at_draft),
        "draft_probs must be finite and non-negative; got a negative, NaN or infinite "
        "q_i(x_i) at a draft token",
    )


def check_stopping_rows(
    num_accepted: Int[Array, " batch"], excess_block_mass: Float[Array, "batch blocks"]
) -> Int[Array, " batch"]:
    """Checks the rows $p_n$ and $q_n$ that the step draws from, through the flags in
    the block sums of their one-pass summary (`RowSummary.excess_block_mass`: NaN
    for a bad value in $p_n$, $+\\infty$ for one in $q_n$): nearly free when the
    summary serves the sampling too.

    **Returns:**

    `num_accepted`, tied to the checks.
    """
    num_accepted = eqx.error_if(
        num_accepted,
        jnp.any(jnp.isnan(excess_block_mass), axis=-1),
        "target_probs must be finite and non-negative; got a negative, NaN or infinite "
        "value in the row p_n at the stopping position n = num_accepted",
    )
    return eqx.error_if(
        num_accepted,
        jnp.any(excess_block_mass == jnp.inf, axis=-1),
        "draft_probs must be finite and non-negative; got a negative, NaN or "
        "infinite value in the row q_n at the stopping position n = num_accepted",
    )


def check_all_probs(
    draft_probs: Float[Array, "batch draft vocab"] | None,
    target_probs: Float[Array, "batch positions vocab"],
) -> tuple[
    Float[Array, "batch draft vocab"] | None, Float[Array, "batch positions vocab"]
]:
    """Scans every probability for negative or non-finite values: a full pass over
    both arrays, so opt-in.
    """
    if draft_probs is not None:
        draft_probs = eqx.error_if(
            draft_probs,
            not_a_probability(draft_probs),
            "draft_probs must be finite and non-negative; got a negative, NaN or "
            "infinite value",
        )
    target_probs = eqx.error_if(
        target_probs,
        not_a_probability(target_probs),
        "target_probs must be finite and non-negative; got a negative, NaN or infinite "
        "value",
    )
    return draft_probs, target_probs


def check_sampled(token: Int[Array, " batch"], vocab: int) -> Int[Array, " batch"]:
    """Checks that the sampler found a token, which fails only when the weights at the
    stopping position have no positive mass.
    """
    return eqx.error_if(
        token,
        (token < 0) | (token >= vocab),
        "no token can be drawn: the residual at the stopping position n has no "
        "positive mass, even after falling back to target_probs[b, n], which has no "
        "positive entry",
    )


def outside_unit_interval(u: Float[Array, "*shape"]) -> Array:
    return ~((u >= 0) & (u < 1))


def not_a_probability(x: Float[Array, "*shape"]) -> Array:
    return ~(jnp.isfinite(x) & (x >= 0))
