"""The check of the inputs' structure (`docs/specification.md`, "Bad input"), at
trace time; the values are checked at run time (`_failures.py`)."""

from collections.abc import Mapping
from typing import TypeAlias

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ._numerics import static_integer


def check_structure(
    draft_tokens: Array,
    draft_probs: Array | None,
    target_probs: Array,
    accept_uniforms: Array | None,
    sample_uniforms: Array | None,
    num_draft_tokens: Array | None,
    *,
    given_as: str = "probs",
) -> None:
    """Raises `ValueError` for a wrong rank or disagreeing sizes and `TypeError` for a
    wrong kind of dtype, naming the argument, the expected and the actual. Arguments
    given as `None` (deterministic drafts, uniforms to be drawn or not needed, no
    ragged lengths) are skipped. `given_as` names the distributions' arguments:
    `draft_probs` and `target_probs`, or `draft_logits` and `target_logits`.

    Works on shapes and dtypes only, so it runs at trace time under `jit` and `vmap`.
    """
    draft, target = f"draft_{given_as}", f"target_{given_as}"
    patterns = {
        "draft_tokens": (draft_tokens, "(B, G)", jnp.integer),
        draft: (draft_probs, "(B, G, V)", jnp.floating),
        target: (target_probs, "(B, G + 1, V)", jnp.floating),
        "accept_uniforms": (accept_uniforms, "(B, G)", jnp.floating),
        "sample_uniforms": (sample_uniforms, "(B,)", jnp.floating),
        "num_draft_tokens": (num_draft_tokens, "(B,)", jnp.integer),
    }
    check_ranks_and_dtypes(patterns)
    batch, num_draft = draft_tokens.shape
    vocab = checked_vocab(target_probs, target)
    check_sizes(
        patterns,
        {
            draft: (batch, num_draft, vocab),
            target: (batch, num_draft + 1, vocab),
            "accept_uniforms": (batch, num_draft),
            "sample_uniforms": (batch,),
            "num_draft_tokens": (batch,),
        },
        f"with B and G from draft_tokens {tuple(draft_tokens.shape)} and V from "
        f"{target}",
    )


def check_tree_structure(
    parents: Array,
    tree_tokens: Array,
    draft_probs: Array | None,
    target_probs: Array,
    accept_uniforms: Array | None,
    sample_uniforms: Array | None,
) -> None:
    """The tree step's `check_structure`: raises `ValueError` for a wrong rank or
    disagreeing sizes and `TypeError` for a wrong kind of dtype, naming the argument;
    `None` (deterministic drafts, uniforms not given) is skipped."""
    patterns = {
        "parents": (parents, "(B, N)", jnp.integer),
        "tree_tokens": (tree_tokens, "(B, N)", jnp.integer),
        "draft_probs": (draft_probs, "(B, N + 1, V)", jnp.floating),
        "target_probs": (target_probs, "(B, N + 1, V)", jnp.floating),
        "accept_uniforms": (accept_uniforms, "(B, N)", jnp.floating),
        "sample_uniforms": (sample_uniforms, "(B,)", jnp.floating),
    }
    check_ranks_and_dtypes(patterns)
    batch, num_nodes = parents.shape
    vocab = checked_vocab(target_probs)
    check_sizes(
        patterns,
        {
            "tree_tokens": (batch, num_nodes),
            "target_probs": (batch, num_nodes + 1, vocab),
            "draft_probs": (batch, num_nodes + 1, vocab),
            "accept_uniforms": (batch, num_nodes),
            "sample_uniforms": (batch,),
        },
        f"with B and N from parents {tuple(parents.shape)} and V from target_probs",
    )


# Each argument's array (None when not given), its shape as a pattern such as
# "(B, G + 1, V)", and the kind of dtype it must have.
Patterns: TypeAlias = Mapping[str, tuple[Array | None, str, type[np.generic]]]


def check_ranks_and_dtypes(patterns: Patterns) -> None:
    """Raises `ValueError` for an argument whose rank is not its pattern's and
    `TypeError` for one of the wrong kind of dtype, naming it; `None` is skipped."""
    for name, (x, pattern, kind) in patterns.items():
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


def checked_vocab(target_probs: Array, name: str = "target_probs") -> int:
    """The vocabulary size $V$, the last axis of `target_probs` (the argument `name`);
    a `ValueError` if it is empty."""
    vocab = target_probs.shape[-1]
    if vocab < 1:
        raise ValueError(
            f"{name} must have a vocabulary axis of size at least 1; got shape "
            f"{target_probs.shape}"
        )
    return vocab


def check_sizes(
    patterns: Patterns, expected: Mapping[str, tuple[int, ...]], origin: str
) -> None:
    """Raises `ValueError` for a given argument whose shape is not `expected`, with
    its pattern and where the sizes come from (`origin`)."""
    for name, want in expected.items():
        x, pattern, _ = patterns[name]
        if x is not None and tuple(x.shape) != want:
            raise ValueError(
                f"{name} must have shape {pattern} = {want}, {origin}; got "
                f"{tuple(x.shape)}"
            )


def check_static_int(name: str, value: object, minimum: int) -> None:
    """Raises `TypeError` for a static integer hyperparameter that is not an integer
    (a float, a bool; see `static_integer`) and `ValueError` for one below `minimum`
    (0 or 1), naming it. NumPy integers are read by value."""
    if static_integer(value, name) < minimum:
        bound = "non-negative" if minimum == 0 else "positive"
        raise ValueError(f"{name} must be {bound}; got {value}")
