"""The check of the inputs' structure (`docs/specification.md`, "Bad input"), at
trace time; the values are checked at run time (`_failures.py`)."""

import jax.numpy as jnp
from jaxtyping import Array


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
