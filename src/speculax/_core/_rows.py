"""Reading one row of a large array in place, inside a loop over the rows: the one
reader the probability pieces, the tree walks and the logits statistics share."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ._numerics import upcast


def read_row(
    array: Float[Array, "*lead vocab"], *index: Int[Array, ""]
) -> Float[Array, " vocab"]:
    """`array[index]`, one row in the array's own dtype, read in place by
    `dynamic_slice`; the caller converts it (`upcast` for probabilities, the
    arithmetic dtype for logits).

    The optimisation barrier ties the array to the loop's index: without it XLA CPU
    hoists the conversion of a half-precision array out of a loop over the rows,
    converting the whole array to float32 first (twice its size, and an extra
    pass).

    **Arguments:**

    - `array`: the rows, of any leading shape.
    - `index`: one scalar integer per leading axis.

    **Returns:**

    The row, of shape `(vocab,)`.
    """
    # One index type for dynamic_slice, whatever x64 makes of the callers' indices.
    index = tuple(jnp.asarray(i, jnp.int32) for i in index)
    array, index = jax.lax.optimization_barrier((array, index))
    vocab = array.shape[-1]
    start = (*index, jnp.zeros((), jnp.int32))
    row = jax.lax.dynamic_slice(array, start, (1,) * len(index) + (vocab,))
    return row.reshape(vocab)


def read_probs_row(
    probs: Float[Array, "*lead vocab"], *index: Int[Array, ""]
) -> Float[Array, " vocab"]:
    """`probs[index]` by `read_row`, upcast (subnormals flushed), `(vocab,)`."""
    return upcast(read_row(probs, *index))
