"""Each request's sampling parameters: temperature, top-$k$ and top-$p$, as arrays of
one value per row, checked."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from .._core._failures import RESULTS, Failure
from .._core._numerics import integer_input


class SamplingParameters(eqx.Module):
    """The sampling parameters of each row, as arrays of shape `(batch,)`.

    - `temperature`: divides the logits, finite; `0` means greedy for that row.
    - `top_k`: the number of largest logits kept; `0` (or at least $V$) keeps all.
        Read by value in any integer dtype: a count `int32` cannot hold is its
        largest value, which keeps all too.
    - `top_p`: the probability mass kept; `1` keeps all.
    - `all_greedy`: static, every row is greedy, known before tracing (a
        temperature of 0 given as a Python number): nothing sampled is traced.
    - `may_truncate`: static, whether any row may be truncated; `False` when that
        is known before tracing (no top-$k$ and no top-$p$, or each given as a
        Python number that keeps all, or every row greedy): no threshold search is
        traced.
    """

    temperature: Float[Array, " batch"]
    top_k: Int[Array, " batch"]
    top_p: Float[Array, " batch"]
    all_greedy: bool = eqx.field(static=True, default=False)
    may_truncate: bool = eqx.field(static=True, default=True)

    def failures(self) -> list[Failure]:
        """The run-time checks of the values, in the order they are reported."""
        return [
            (
                ~((self.temperature >= 0) & jnp.isfinite(self.temperature)),
                RESULTS.temperature_out_of_range,
            ),
            (self.top_k < 0, RESULTS.top_k_out_of_range),
            (~((self.top_p > 0) & (self.top_p <= 1)), RESULTS.top_p_out_of_range),
        ]

    @property
    def greedy(self) -> Bool[Array, " batch"]:
        return self.temperature == 0


def sampling_parameters(
    temperature: ArrayLike,
    top_k: ArrayLike | None,
    top_p: ArrayLike | None,
    batch: int,
    dtype: jnp.dtype,
) -> SamplingParameters:
    """The parameters as arrays of shape `(batch,)`, each given as a Python number, a
    scalar or an array of shape `(batch,)`; `None` keeps all tokens. A Python number
    out of range raises `ValueError` now, naming it, and a float or bool `top_k` a
    `TypeError`; an array's values are checked at run time
    (`SamplingParameters.failures`).
    """
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        _check_not_bool_or_text(name, value)
    if isinstance(temperature, int | float) and not 0 <= temperature < math.inf:
        raise ValueError(
            f"temperature must be finite and non-negative; got {temperature}"
        )
    if isinstance(top_k, int) and top_k < 0:
        raise ValueError(f"top_k must be non-negative (0 keeps all); got {top_k}")
    if isinstance(top_p, int | float) and not 0 < top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1]; got {top_p}")
    values = {
        "temperature": temperature,
        # By value in every integer dtype: a count above what int32 holds keeps
        # every token, so it saturates, never wraps (to a negative or small count).
        "top_k": integer_input(0 if top_k is None else top_k, "top_k", None),
        "top_p": 1.0 if top_p is None else top_p,
    }
    arrays = {}
    for name, value in values.items():
        try:
            array = jnp.asarray(value)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"{name} must be a number or an array of numbers; got {value!r}"
            ) from error
        # A Python int may stand for a float (temperature=1, top_p=1).
        floats = name != "top_k" and not isinstance(value, int | float)
        if floats and not jnp.issubdtype(array.dtype, jnp.floating):
            raise TypeError(
                f"{name} must have a floating-point dtype; got {array.dtype}"
            )
        if array.shape not in ((), (batch,)):
            raise ValueError(
                f"{name} must be a scalar or have shape (B,) = ({batch},), one value "
                f"per row; got shape {tuple(array.shape)}"
            )
        want = jnp.int32 if name == "top_k" else dtype
        arrays[name] = jnp.broadcast_to(array.astype(want), (batch,))
    arrays["temperature"] = _without_subnormals(arrays["temperature"])
    arrays["top_p"] = _without_subnormals(arrays["top_p"])
    # What Python numbers say before tracing, so that the program leaves out what
    # no row can need: a traced value may be anything, so it keeps every path.
    all_greedy = isinstance(temperature, int | float) and temperature == 0
    keeps_all = (top_k is None or (isinstance(top_k, int) and top_k == 0)) and (
        top_p is None or (isinstance(top_p, int | float) and top_p == 1)
    )
    return SamplingParameters(
        **arrays, all_greedy=all_greedy, may_truncate=not (all_greedy or keeps_all)
    )


def _check_not_bool_or_text(name: str, value: object) -> None:
    """Raises `TypeError` for a bool or a string where a float is read: `True`
    would be read as 1 and `"1"` fail deep inside JAX."""
    if isinstance(value, bool | np.bool_ | str | bytes):
        raise TypeError(f"{name} must be a number; got {value!r}")
    dtype = getattr(value, "dtype", None)
    if dtype is not None and not (
        jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
    ):
        raise TypeError(f"{name} must have a floating-point dtype; got {dtype}")


def _without_subnormals(x: Float[Array, " batch"]) -> Float[Array, " batch"]:
    """`x` with each subnormal value replaced by the smallest normal number of its
    sign. XLA CPU reads subnormal operands as zero, which would make a positive
    temperature below the smallest normal greedy (as the smallest normal it gives the
    same limit as any temperature too small to tell the largest logits apart) and a
    positive top-p out of range. Decided on the bits, which no flushing touches."""
    bits_dtype = jnp.int32 if x.dtype.itemsize == 4 else jnp.int64
    bits = jax.lax.bitcast_convert_type(x, bits_dtype)
    smallest = jnp.finfo(x.dtype).smallest_normal
    magnitude = bits & jnp.iinfo(bits_dtype).max
    smallest_bits = jax.lax.bitcast_convert_type(
        jnp.asarray(smallest, x.dtype), bits_dtype
    )
    subnormal = (magnitude > 0) & (magnitude < smallest_bits)
    replacement = jnp.where(bits > 0, smallest, -smallest).astype(x.dtype)
    return jnp.where(subnormal, replacement, x)
