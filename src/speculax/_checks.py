"""The checks of bad input (`docs/specification.md`, "Bad input"): structure at
trace time, values at run time."""

from collections.abc import Sequence
from typing import TypeAlias

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PyTree

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


# Where a value check fails (any true entry), and the message it raises.
Failure: TypeAlias = tuple[Bool[Array, "..."], str]


def input_failures(
    draft_tokens: Int[Array, "batch draft"],
    draft_probs: Float[Array, "batch draft vocab"] | None,
    target_probs: Float[Array, "batch draft+1 vocab"],
    accept_uniforms: Float[Array, "batch draft"],
    sample_uniforms: Float[Array, " batch"],
    num_draft_tokens: Int[Array, " batch"] | None,
) -> list[Failure]:
    """The checks of the ragged lengths, the tokens, the uniforms and the draft
    tokens' probabilities (which the step reads anyway), at the draft positions in use
    (below `num_draft_tokens`).
    """
    batch, num_draft = draft_tokens.shape
    failures = []
    if num_draft_tokens is None:
        in_use = jnp.ones((batch, num_draft), bool)
    else:
        failures.append(
            (
                (num_draft_tokens < 0) | (num_draft_tokens > num_draft),
                f"num_draft_tokens must lie in [0, G] = [0, {num_draft}]; got a "
                "length outside it",
            )
        )
        in_use = jnp.arange(num_draft)[None, :] < num_draft_tokens[:, None]
    target_at_draft, draft_at_draft = draft_token_probs(
        draft_tokens, draft_probs, target_probs
    )
    return [
        *failures,
        *token_and_uniform_failures(
            draft_tokens,
            accept_uniforms,
            sample_uniforms,
            target_probs.shape[-1],
            in_use,
        ),
        *draft_token_prob_failures(target_at_draft, draft_at_draft, in_use),
    ]


def token_and_uniform_failures(
    draft_tokens: Int[Array, "batch draft"],
    accept_uniforms: Float[Array, "batch draft"],
    sample_uniforms: Float[Array, " batch"],
    vocab: int,
    in_use: Bool[Array, "batch draft"],
) -> list[Failure]:
    """The checks that the draft tokens lie in `[0, vocab)` and the uniforms in
    `[0, 1)`, at the positions in use.
    """
    return [
        (
            in_use & ((draft_tokens < 0) | (draft_tokens >= vocab)),
            f"draft_tokens must lie in [0, V) = [0, {vocab}); got a token outside it",
        ),
        (
            in_use & outside_unit_interval(accept_uniforms),
            "accept_uniforms must lie in [0, 1); got a value outside it or NaN",
        ),
        (
            outside_unit_interval(sample_uniforms),
            "sample_uniforms must lie in [0, 1); got a value outside it or NaN",
        ),
    ]


def draft_token_prob_failures(
    target_at_draft: Float[Array, "batch draft"],
    draft_at_draft: Float[Array, "batch draft"],
    in_use: Bool[Array, "batch draft"],
) -> list[Failure]:
    """The checks of $p_i(x_i)$ and $q_i(x_i)$, as gathered, at the positions in
    use.
    """
    return [
        (
            in_use & not_a_probability(target_at_draft),
            "target_probs must be finite and non-negative; got a negative, NaN or "
            "infinite p_i(x_i) at a draft token",
        ),
        (
            in_use & not_a_probability(draft_at_draft),
            "draft_probs must be finite and non-negative; got a negative, NaN or "
            "infinite q_i(x_i) at a draft token",
        ),
    ]


def stopping_row_failures(row_mass: Float[Array, " batch"]) -> list[Failure]:
    """The checks of the rows $p_n$ and $q_n$ that the step draws from, read from the
    flags that their one-pass summary carries into each row's total mass
    (`RowSummary.row_mass`: NaN for a bad value in $p_n$, $-\\infty$ for one in
    $q_n$): nearly free when the summary serves the sampling too.
    """
    return [
        (
            jnp.isnan(row_mass),
            "target_probs must be finite and non-negative; got a negative, NaN or "
            "infinite value in the row p_n at the stopping position n = num_accepted",
        ),
        (
            row_mass == -jnp.inf,
            "draft_probs must be finite and non-negative; got a negative, NaN or "
            "infinite value in the row q_n at the stopping position n = num_accepted",
        ),
    ]


def overflow_failure(row_mass: Float[Array, " batch"]) -> Failure:
    """The check that the weights drawn from have a total the arithmetic dtype can
    hold, for samplers that normalise them: an unnormalised row $p_n$ of finite
    values can still sum past the largest float32. Only $p_n$ can cause it, since
    the residual $\\max(p_n - q_n, 0)$ never exceeds $p_n$.
    """
    return (
        row_mass == jnp.inf,
        "target_probs must have rows whose total the arithmetic dtype can hold; the "
        "row p_n at the stopping position n = num_accepted sums past the largest "
        "finite number (normalise it)",
    )


def sampled_failure(token: Int[Array, " batch"], vocab: int) -> Failure:
    """The check that the sampler found a token, which fails only when the weights at
    the stopping position have no positive mass.
    """
    return (
        (token < 0) | (token >= vocab),
        "no token can be drawn: the residual at the stopping position n has no "
        "positive mass, even after falling back to target_probs[b, n], which has no "
        "positive entry (values below the smallest normal number count as zero)",
    )


def raise_first_failure(x: PyTree, failures: Sequence[Failure]) -> PyTree:
    """Ties `x` to all the checks at once: one Equinox runtime error (a
    `RuntimeError`), whose message is that of the first failing check in the order
    given, so that a cause is reported before its consequences (a NaN in $p_n$
    before the empty residual it leads to).

    One branched error rather than one per check: each Equinox error is a
    conditional in the compiled program, and a dozen of them cost more, to compile
    and to run, than the checks themselves.
    """
    if not failures:
        return x
    # Check k (counting from 0) is reported as code len - k, so that the largest
    # failing code is the first failing check, and code 0 means no failure; Equinox
    # also takes the largest index across a vmapped batch, so the same order holds
    # under vmap. The checks are merged elementwise into one code per batch row, and
    # the rows reduced once: a reduction per check would be a dozen small kernels,
    # each compiled separately.
    row_code = jnp.zeros((), jnp.int32)
    for k, (where, _) in enumerate(failures):
        code = jnp.where(where, len(failures) - k, 0)
        code = jnp.max(code, axis=tuple(range(1, code.ndim)), initial=0)
        row_code = jnp.maximum(row_code, code)
    if row_code.size == 0:
        return x
    code = jnp.max(row_code)
    messages = ["", *(message for _, message in reversed(failures))]
    return eqx.branched_error_if(x, code > 0, code, messages)


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


def outside_unit_interval(u: Float[Array, "*shape"]) -> Array:
    return ~((u >= 0) & (u < 1))


def not_a_probability(x: Float[Array, "*shape"]) -> Array:
    return ~(jnp.isfinite(x) & (x >= 0))
