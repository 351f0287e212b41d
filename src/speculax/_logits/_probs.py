import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from .._core._failures import first_failure, raise_first_failure
from .._core._numerics import arithmetic_dtype
from ._parameters import sampling_parameters
from ._truncation import probability, request_statistics


def probs_from_logits(
    logits: Float[Array, "*batch vocab"],
    *,
    temperature: ArrayLike = 1.0,
    top_k: ArrayLike | None = None,
    top_p: ArrayLike | None = None,
) -> Float[Array, "*batch vocab"]:
    """Turns logits into the distributions the step expects, in float32 whatever the
    logits' dtype (float64 for float64 logits under x64), with one set of sampling
    parameters per request.

    Applies, in this order, temperature, top-$k$ and top-$p$ (nucleus) truncation, as
    Hugging Face transformers and vLLM's main sampler do, then renormalises; ties at
    a threshold are kept. The thresholds are found without sorting the vocabulary.
    The same definition serves [`speculax.LogitsStep`][], which verifies from logits
    without making this array; `docs/from_logits.md` states it in full.

    !!! warning

        `draft_probs` must be the distribution each draft token was *really* sampled
        from, after the same temperature, top-$k$ and top-$p$ as the draft model's
        sampler used. Passing the untruncated draft softmax while sampling from a
        truncated one is the most common bug reported against serving engines: the
        step is then no longer lossless. Use this one function for both the sampling
        and the verification.

    **Arguments:**

    Each parameter is a Python number, a scalar array or an array of shape `(B,)`,
    one value per request, where $B$ is the first axis of `logits` (and applies to
    every row of that request); arrays may be traced, so that one compilation serves
    every mix of parameters.

    - `logits`: unnormalised log-probabilities, shape `(..., V)`.
    - `temperature`: divides the logits, finite and non-negative; `0` means
        greedy, a one-hot of the argmax (ties go to the smallest token id). As it
        tends to 0 the distribution tends to the uniform one over the largest logits,
        and so it is at every positive temperature too small to tell them apart;
        `inf` is refused rather than read as the uniform limit.
    - `top_k`: keep the `top_k` largest logits (and any tied with the smallest of
        them); `None`, `0` or at least $V$ keeps all. Any integer dtype, read by
        value: a count beyond what `int32` holds keeps all.
    - `top_p`: keep the smallest set of most likely tokens whose probability sums to
        at least `top_p`, in `(0, 1]` (and any tied with the least likely of them);
        `None` or `1` keeps all.

    **Returns:**

    Probabilities of the same shape as `logits`, summing to 1 along the last axis.

    **Raises:**

    `ValueError` for a Python number out of range (a negative or infinite
    temperature, a negative `top_k`, a `top_p` outside `(0, 1]`) or a parameter of
    the wrong shape; `TypeError` for a parameter of the wrong dtype (a float or
    bool `top_k`); for arrays, an Equinox runtime error (a `RuntimeError`) naming
    the parameter.
    """
    logits = jnp.asarray(logits)
    if logits.ndim == 0 or logits.shape[-1] == 0:
        raise ValueError(
            f"logits must have a vocabulary axis of size at least 1; got shape "
            f"{logits.shape}"
        )
    *lead, vocab = logits.shape
    requests = lead[0] if lead else 1
    parameters = sampling_parameters(
        temperature, top_k, top_p, requests, arithmetic_dtype(logits)
    )
    by_request = logits.reshape(requests, math.prod(lead[1:]), vocab)
    statistics = request_statistics(by_request, parameters)
    probs = probability(
        by_request,
        jnp.arange(vocab),
        jax.tree.map(lambda x: x[..., None], statistics),
        parameters.temperature[:, None, None],
    ).reshape(logits.shape)
    if requests == 0:
        return probs
    return raise_first_failure(probs, first_failure(parameters.failures(), requests))
