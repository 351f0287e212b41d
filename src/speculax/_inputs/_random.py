import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Key, UInt32


KeyArray = Key[Array, "..."] | UInt32[Array, "... 2"]
"""What the `key` arguments of speculax take: JAX PRNG keys, typed
(`jax.random.key(0)`, one key of shape `()`, or `jax.random.split(key, batch)`, one
per row) or legacy `uint32` ones (`jax.random.PRNGKey(0)`, with a trailing axis of
2). Each function's documentation says which shapes it takes.
"""


def uniforms(
    key: KeyArray, batch: int, draft: int
) -> tuple[Float[Array, "batch draft"], Float[Array, " batch"]]:
    """Draws the uniform noise of one step, `(accept_uniforms, sample_uniforms)`, in
    `[0, 1)`.

    With one key per row (a key array of shape `(batch,)`) each row's draws depend on
    its own key alone, so a request's result is reproducible whatever batch it
    shares. With a single key, the rows' keys are split from it, and a row's draws
    depend on its position in the batch.

    **Arguments:**

    - `key`: a JAX PRNG key, either one (`jax.random.key(0)`) or one per row
        (`jax.random.split(key, batch)`); legacy `uint32` keys are accepted too.
    - `batch`: $B$, the number of rows.
    - `draft`: $G$, the number of draft positions.

    **Returns:**

    `accept_uniforms` of shape `(batch, draft)` and `sample_uniforms` of shape
    `(batch,)`, both float32.
    """
    key = row_keys(key, batch)
    draws = jax.vmap(
        lambda row_key: jax.random.uniform(row_key, (draft + 1,), jnp.float32)
    )(key)
    return draws[:, :draft], draws[:, draft]


def row_keys(key: KeyArray, batch: int) -> Key[Array, " batch"]:
    """One typed key per row: `key` itself when it holds one key per row, else split
    from the single key `key`.

    **Arguments:**

    - `key`: one JAX PRNG key or `batch` of them, typed or legacy `uint32` data.
    - `batch`: $B$, the number of rows.

    **Returns:**

    A typed key array of shape `(batch,)`.

    **Raises:**

    `TypeError` when `key` is not a JAX PRNG key (typed, or legacy `uint32` data), and
    `ValueError` when it holds neither one key nor `batch` of them.
    """
    if not isinstance(key, jax.Array) or not (
        jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
        or (key.dtype == jnp.uint32 and key.shape[-1:] == (2,))
    ):
        raise TypeError(
            "key must be a JAX PRNG key (jax.random.key(0)) or an array of them; got "
            f"{_describe(key)}"
        )
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    if key.shape == ():
        key = jax.random.split(key, batch)
    if key.shape != (batch,):
        raise ValueError(
            f"key must be a single key or one key per row, shape () or ({batch},); got "
            f"shape {key.shape}"
        )
    return key


def _describe(x: object) -> str:
    if isinstance(x, jax.Array):
        return f"an array of dtype {x.dtype} and shape {x.shape}"
    return type(x).__name__
