"""What a feature drafter reads of the target: its feature at the history's last
verified position, from the target's cache."""

from collections.abc import Callable
from typing import TypeAlias

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, PyTree


TargetFeatures: TypeAlias = Callable[[PyTree], Float[Array, "batch time feature"]]
"""Where a target keeps its features: a function of the target model's cache (see
[`speculax.AbstractCachedModel`][]) that returns its features, float `(B, T, F)`,
one per slot, as the target wrote them (a transformer's last hidden state, say)."""


def verified_feature(
    features: TargetFeatures,
    target_cache: PyTree,
    length: Int[Array, " batch"],
) -> Float[Array, "batch feature"]:
    """The target's feature at position `length - 2`, the last whose logits the
    target has given (the history's last token was drawn from them), read from its
    cache; zeros for a history of one token, which has none."""
    all_features = features(target_cache)
    slot = length - 2
    feature = all_features[jnp.arange(length.shape[0]), jnp.maximum(slot, 0)]
    return jnp.where((slot >= 0)[:, None], feature, 0)


def check_float_array(name: str, value: ArrayLike, ndim: int) -> None:
    """Raises a `ValueError` naming a weight that is not a float array of `ndim`
    dimensions (a JAX or a NumPy array: NumPy weights are traced in JAX's default
    float dtype, float64 under x64)."""
    shape = jnp.shape(value)
    if len(shape) != ndim or not jnp.issubdtype(jnp.result_type(value), jnp.floating):
        raise ValueError(
            f"{name} must be a float array of {ndim} dimensions; got "
            f"{jnp.result_type(value)} of shape {shape}"
        )


def rows_times(
    rows: Float[Array, "*batch inner"], matrix: Float[Array, "inner outer"]
) -> Float[Array, "*batch outer"]:
    """`rows @ matrix`, each row summed on its own: a dot product of a batch may
    sum a row in another order than the row alone, and a drafter's rows must not
    depend on the batch, bit for bit."""
    # Not `jnp.sum(rows[..., None, :] * matrix.T, axis=-1)`, faster on CPU but
    # miscompiled by XLA on CPU (jax 0.10.2) for rows of shape (1, 4, 192) and a
    # (192, 256) matrix: tests/test_demo_models.py checks the shipped heads' shapes.
    return jnp.sum(rows[..., :, None] * matrix, axis=-2)
