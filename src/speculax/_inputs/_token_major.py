"""The token-major ragged layout serving engines pass speculative batches in, and the
padded layout of the steps.

vLLM and its TPU backend flatten a batch request by request: request $b$'s $g_b$
draft tokens follow those of requests $0, \\ldots, b - 1$, with no padding, and its
target rows likewise, $g_b + 1$ of them when the bonus position is included. The
steps take rectangular arrays with `num_draft_tokens`; these two functions convert
between the two, under `jit`, the lengths traced.
"""

from typing import SupportsIndex

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Int, Shaped

from .._core._numerics import integer_input, static_integer
from ._input_array import InputArray


def from_token_major(
    values: Shaped[Array, "tokens *rest"],
    num_draft_tokens: InputArray,
    *,
    num_draft: SupportsIndex,
    bonus: bool = False,
    fill: int | float = 0,
) -> Shaped[Array, "batch positions *rest"]:
    """The padded layout of token-major `values`: request $b$'s rows, consecutive in
    `values`, become row $b$, padded with `fill`.

    **Arguments:**

    - `values`: the rows of every request, request by request, along the first axis
        (draft tokens `(T,)`, draft logits `(T, V)`, ...). Rows past the last
        request's are ignored, so engines' buffers padded to a fixed size may be
        passed whole.
    - `num_draft_tokens`: integer `(B,)`, $g_b$, each in `[0, num_draft]`, in any
        integer dtype, read by value.
    - `num_draft`: keyword only, $G \\ge 0$, the padded number of draft positions.
    - `bonus`: keyword only, whether each request holds one more row than it has
        drafts, $g_b + 1$ (the target's rows, the last following its last draft);
        then the output has $G + 1$ positions.
    - `fill`: keyword only, the value of the padding; `-1` suits tokens. The steps
        do not read the padding, whatever it holds.

    **Returns:**

    An array of shape `(B, G, *rest)` (`(B, G + 1, *rest)` with `bonus`), the dtype
    of `values`.

    **Raises:**

    `TypeError` for lengths or a `num_draft` that are not integers (floats and
    bools included); `ValueError` for lengths not of shape `(B,)` or a negative
    `num_draft`; an Equinox runtime error (a `RuntimeError`) when a length lies
    outside `[0, num_draft]` (a value `int32` cannot hold included) or the requests
    need more rows than `values` has.

    **Example:**

    ```python
    import jax.numpy as jnp
    import speculax

    # Three requests with 2, 0 and 3 draft tokens, flattened.
    flat = jnp.array([11, 12, 31, 32, 33])
    padded = speculax.from_token_major(flat, jnp.array([2, 0, 3]), num_draft=3, fill=-1)
    assert padded.tolist() == [[11, 12, -1], [-1, -1, -1], [31, 32, 33]]
    ```
    """
    values = jnp.asarray(values)
    num_draft = _size(num_draft, "num_draft")
    lengths, starts = _checked_layout(num_draft_tokens, num_draft, bonus)
    positions = num_draft + int(bonus)
    used = jnp.arange(positions)[None, :] < lengths[:, None]
    used = eqx.error_if(
        used,
        jnp.sum(lengths) > values.shape[0],
        "num_draft_tokens needs more rows than values has",
    )
    if values.shape[0] == 0:
        # Nothing to read: one row of `fill` stands in for the gather, which keeps
        # the checks on the lengths in the program (under `jit` a check whose
        # output is unused is dropped).
        values = jnp.full((1, *values.shape[1:]), fill, values.dtype)
    index = jnp.where(used, starts[:, None] + jnp.arange(positions)[None, :], 0)
    used = used.reshape(used.shape + (1,) * (values.ndim - 1))
    return jnp.where(used, values[index], jnp.asarray(fill, values.dtype))


def to_token_major(
    padded: Shaped[Array, "batch positions *rest"],
    num_draft_tokens: InputArray,
    *,
    num_tokens: SupportsIndex,
    bonus: bool = False,
    fill: int | float = 0,
) -> Shaped[Array, "tokens *rest"]:
    """The token-major layout of `padded`, the inverse of
    [`speculax.from_token_major`][]: row $b$'s first $g_b$ positions ($g_b + 1$ with
    `bonus`), request after request, then `fill` up to `num_tokens` rows.

    **Arguments:**

    - `padded`: shape `(B, G, *rest)`, or `(B, G + 1, *rest)` with `bonus`;
        $G = 0$ is valid.
    - `num_draft_tokens`: integer `(B,)`, $g_b$, each in `[0, G]`, in any integer
        dtype, read by value.
    - `num_tokens`: keyword only, the number of rows of the output, at least the
        total used (a static size, as engines' buffers are).
    - `bonus`: keyword only, as for [`speculax.from_token_major`][].
    - `fill`: keyword only, the value of the rows past the last request's.

    **Returns:**

    An array of shape `(num_tokens, *rest)`, the dtype of `padded`.

    **Raises:**

    `TypeError` for lengths or a `num_tokens` that are not integers; `ValueError`
    for lengths not of shape `(B,)`, a negative `num_tokens` or a `padded` without
    its positions; an Equinox runtime error (a `RuntimeError`) when a length lies
    outside `[0, G]` or the rows used number more than `num_tokens`.

    **Example:**

    ```python
    import jax.numpy as jnp
    import speculax

    padded = jnp.array([[11, 12, -1], [-1, -1, -1], [31, 32, 33]])
    flat = speculax.to_token_major(padded, jnp.array([2, 0, 3]), num_tokens=6)
    assert flat.tolist() == [11, 12, 31, 32, 33, 0]
    ```
    """
    padded = jnp.asarray(padded)
    num_tokens = _size(num_tokens, "num_tokens")
    if padded.ndim < 2 or padded.shape[1] < int(bonus):
        raise ValueError(
            f"padded must have shape (B, G{' + 1' if bonus else ''}, ...); got shape "
            f"{tuple(padded.shape)}"
        )
    batch, positions = padded.shape[:2]
    lengths, starts = _checked_layout(num_draft_tokens, positions - int(bonus), bonus)
    flat = jnp.arange(num_tokens)
    used = flat < jnp.sum(lengths)
    used = eqx.error_if(
        used,
        jnp.sum(lengths) > num_tokens,
        "num_draft_tokens needs more rows than num_tokens",
    )
    if batch == 0:
        # No lengths, so no check can fail.
        return jnp.full((num_tokens, *padded.shape[2:]), fill, padded.dtype)
    if positions == 0:
        # G = 0 without the bonus row: every length is 0, so nothing is read, but a
        # gather needs a position; one of `fill` stands in, keeping the checks.
        padded = jnp.full((batch, 1, *padded.shape[2:]), fill, padded.dtype)
        positions = 1
    # The request each flat row belongs to: the number of requests ending at or
    # before it.
    request = jnp.minimum(
        jnp.searchsorted(starts + lengths, flat, side="right"), batch - 1
    )
    position = jnp.clip(flat - starts[request], 0, positions - 1)
    used = used.reshape(used.shape + (1,) * (padded.ndim - 2))
    return jnp.where(used, padded[request, position], jnp.asarray(fill, padded.dtype))


def _checked_layout(
    num_draft_tokens: InputArray, num_draft: int, bonus: bool
) -> tuple[Int[Array, " batch"], Int[Array, " batch"]]:
    """Each request's number of rows and the index of its first, after checking the
    lengths lie in `[0, num_draft]`, read by value in any integer dtype (a length
    `int32` cannot hold is out of range, never wrapped)."""
    lengths = integer_input(num_draft_tokens, "num_draft_tokens")
    if lengths.ndim != 1:
        raise ValueError(
            f"num_draft_tokens must have shape (B,); got shape {tuple(lengths.shape)}"
        )
    lengths = eqx.error_if(
        lengths,
        (lengths < 0) | (lengths > num_draft),
        f"num_draft_tokens must lie in [0, {num_draft}]; got a length outside it",
    )
    rows = lengths + int(bonus)
    return rows, jnp.cumsum(rows) - rows


def _size(value: SupportsIndex, name: str) -> int:
    """A static size, a non-negative integer by value."""
    size = static_integer(value, name)
    if size < 0:
        raise ValueError(f"{name} must be non-negative; got {size}")
    return size
