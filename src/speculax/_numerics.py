import jax.numpy as jnp
from jaxtyping import Array, Float


def upcast(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    """Casts half-precision values to float32; float32 and float64 stay as they are.

    SPEC 2: arithmetic is float32 for float16, bfloat16 and float32 inputs, float64 for
    float64 inputs. Pieces call this *after* gathering what they need, so that the cast
    never materialises a converted copy of a whole probability array.
    """
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))
