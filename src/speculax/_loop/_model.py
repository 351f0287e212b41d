"""The models the loop runs: the interface it calls them by, and the one rule by which
their logits become probabilities."""

from collections.abc import Callable
from typing import TypeAlias

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


LanguageModel: TypeAlias = Callable[
    [Int[Array, "batch time"], Int[Array, "batch positions"]],
    Float[Array, "batch positions vocab"],
]
"""A model as the loop calls it: `model(tokens, positions)`, where `tokens` is an
int32 `(B, T)` buffer of token histories and `positions` an int32 `(B, K)` array of
positions in it, returns float `(B, K, V)` logits, entry `[b, k]` those of the token
that follows `tokens[b, :positions[b, k] + 1]`. It must read only the tokens at or
before each position: the buffer holds anything past them."""


def probs_dtype(logits_dtype: jnp.dtype) -> jnp.dtype:
    """The dtype the loop computes a model's probabilities in: JAX's default float
    (float32, float64 under x64), or the logits' own dtype if wider.

    Never half precision: a softmax computed in bfloat16 has rows that miss 1 by a
    few parts in a thousand (in float16, a few in ten thousand), and the draft
    would be drawn from the normalised row while the step reads the row as it is,
    which moves the output's distribution. Under x64 it is float64 whatever the
    logits' dtype, so that [`speculax.testing.loop_output_distribution`][] finds
    the loop exact to float64 rounding for any model.
    """
    return jnp.promote_types(logits_dtype, jnp.result_type(float))


def widened(logits: Float[Array, "*rows vocab"]) -> Float[Array, "*rows vocab"]:
    """A model's logits in `probs_dtype`, the dtype every rule of the loop reads them
    in: so that under x64 the enumeration sees float64 arithmetic whatever the
    models return, and both models' rows are made in one precision."""
    return logits.astype(probs_dtype(logits.dtype))


def model_probs(logits: Float[Array, "*rows vocab"]) -> Float[Array, "*rows vocab"]:
    """The softmax of a model's logits along the last axis, computed in
    `probs_dtype`: $q_i$ for the draft model, $p_i$ for the target, the one rule
    shared by the loop and its exact enumeration."""
    return jax.nn.softmax(widened(logits), axis=-1)
