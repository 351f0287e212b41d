import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def probs_from_logits(
    logits: Float[Array, "*batch vocab"],
    *,
    temperature: float | Float[Array, ""] = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> Float[Array, "*batch vocab"]:
    """Turns logits into the distributions the step expects, in float32 whatever the
    logits' dtype (float64 for float64 logits under x64).

    Applies, in this order, temperature, top-$k$ and top-$p$ (nucleus) truncation, as
    Hugging Face transformers and vLLM do, then renormalises.

    !!! warning

        `draft_probs` must be the distribution each draft token was *really* sampled
        from, after the same temperature, top-$k$ and top-$p$ as the draft model's
        sampler used. Passing the untruncated draft softmax while sampling from a
        truncated one is the most common bug reported against serving engines: the
        step is then no longer lossless. Use this one function for both the sampling
        and the verification.

    **Arguments:**

    - `logits`: unnormalised log-probabilities, any leading shape.
    - `temperature`: divides the logits; `0` means greedy, a one-hot of the argmax
        (ties go to the smallest token id). A Python number or a scalar array, which
        may be traced (one compilation then serves every temperature). As it tends
        to 0 the distribution tends to the uniform one over the largest logits,
        and so it is at every positive temperature too small to tell them apart.
    - `top_k`: keep the `top_k` largest logits (and any tied with the smallest of
        them); `None` keeps all.
    - `top_p`: keep the smallest set of most likely tokens whose probability sums to
        at least `top_p`, in `(0, 1]`; `None` keeps all.

    **Returns:**

    Probabilities of the same shape as `logits`, summing to 1 along the last axis.
    """
    if isinstance(temperature, int | float) and temperature < 0:
        raise ValueError(f"temperature must be non-negative; got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1; got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1]; got {top_p}")
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    vocab = logits.shape[-1]
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=logits.dtype)
    if isinstance(temperature, int | float) and temperature == 0:
        return greedy
    # Shifted so that the largest logit is 0 before dividing: at a tiny temperature
    # the others become -inf, never inf or NaN, and the largest keep equal shares.
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    logits = jnp.where(shifted == 0, 0, shifted / temperature)
    if top_k is not None and top_k < vocab:
        kth_largest = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits >= kth_largest, logits, -jnp.inf)
    if top_p is not None and top_p < 1:
        probs = jax.nn.softmax(logits, axis=-1)
        descending = -jnp.sort(-probs, axis=-1)
        mass_before = jnp.cumsum(descending, axis=-1) - descending
        # The smallest probability still needed to reach top_p; ties with it are kept.
        needed = jnp.where(mass_before < top_p, descending, jnp.inf)
        smallest_kept = jnp.min(needed, axis=-1, keepdims=True)
        logits = jnp.where(probs >= smallest_kept, logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    if isinstance(temperature, int | float):
        return probs
    temperature = jnp.asarray(temperature)
    probs = eqx.error_if(
        probs, temperature < 0, "temperature must be non-negative; got a negative one"
    )
    return jnp.where(temperature == 0, greedy, probs)
