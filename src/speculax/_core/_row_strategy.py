"""How the steps read the rows of a batch: one at a time, or all at once. The one
switch every row loop of the library reads, when it is traced. See
`docs/performance.md`."""

import contextlib
import contextvars
from collections.abc import Iterator

import jax


_STRATEGIES = ("one at a time", "all at once")

# The strategy forced by `row_strategy`, or None for the backend's own.
_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "speculax_row_strategy", default=None
)


def rows_one_at_a_time() -> bool:
    """Whether the steps traced now work on one row of the batch at a time (a
    `lax.map` over the row indices: on CPU a row then stays in cache, and XLA CPU's
    batched gathers are slow) rather than on all rows at once (a loop over the rows
    would run serially on a GPU or TPU). The strategy `row_strategy` forces, else
    one at a time on CPU and all at once elsewhere."""
    return _in_force() == "one at a time"


def _in_force() -> str:
    """The strategy forced by `row_strategy`, else the backend's own."""
    forced = _forced.get()
    if forced is not None:
        return forced
    return "one at a time" if jax.default_backend() == "cpu" else "all at once"


@contextlib.contextmanager
def row_strategy(strategy: str) -> Iterator[None]:
    """Forces how the steps traced inside the block read the rows of a batch.

    By default the steps work on one row at a time on CPU, where a row then stays in
    cache (a `lax.map` over the row indices), and on all rows at once on other
    backends, where a loop over the rows would run serially. On CPU this runs the
    accelerators' formulation, to test it or time it. Both give the same answers to
    the last bit: every sum is added in an order fixed by the inputs' shapes and
    dtypes, never by the strategy, so that even a uniform on the edge of a block
    of the inverse-CDF draw draws the same token.
    Some inputs keep their own choice: half-precision rows are gathered all at once
    on CPU too, since XLA CPU would convert the whole array inside a loop.

    The strategy is read when a function is *traced*, so a program compiled under
    one strategy must never serve the other: entering and leaving the block call
    `jax.clear_caches()`, dropping every compiled program, but only when `strategy`
    differs from the one in force, so that forcing the backend's own strategy costs
    nothing. Programs compiled inside the block are compiled again after it.

    **Arguments:**

    - `strategy`: `"one at a time"` or `"all at once"`.

    **Raises:**

    `ValueError` naming `strategy` when it is neither.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    import speculax

    with speculax.row_strategy("all at once"):
        out = jax.jit(speculax.SpeculativeStep())(
            jnp.array([[1]]),
            jnp.array([[[0.5, 0.5]]]),
            jnp.array([[[0.5, 0.5], [0.25, 0.75]]]),
            jnp.array([[0.3]]),
            jnp.array([0.6]),
        )
    print(out["num_accepted"])  # [1]
    ```
    """
    if strategy not in _STRATEGIES:
        raise ValueError(
            f"strategy must be one of {', '.join(map(repr, _STRATEGIES))}; "
            f"got {strategy!r}"
        )
    changes = strategy != _in_force()
    if changes:
        jax.clear_caches()
    token = _forced.set(strategy)
    try:
        yield
    finally:
        _forced.reset(token)
        if changes:
            jax.clear_caches()
