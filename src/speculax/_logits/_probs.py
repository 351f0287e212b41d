import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, ArrayLike, Float

from .._core._failures import first_failure, raise_first_failure
from .._core._numerics import arithmetic_dtype
from .._core._vocab_axis import vocab_offset
from ._parameters import SamplingParameters, sampling_parameters
from ._truncation import probability, request_statistics


def probs_from_logits(
    logits: Float[Array | np.ndarray, "*batch vocab"],
    *,
    temperature: ArrayLike = 1.0,
    top_k: ArrayLike | None = None,
    top_p: ArrayLike | None = None,
    axis_name: str | None = None,
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
    - `axis_name`: keyword only, inside `jax.shard_map` the mesh axis the
        vocabulary is split over, `logits` being this device's slice of each row;
        or `None` (the default). The statistics of each row (its largest logit, the
        thresholds, the normaliser) are gathered over the axis, so that each device
        returns its slice of the probabilities, the same bits as on one device.

    **Returns:**

    Probabilities of the same shape as `logits`, summing to 1 along the last axis.
    An array whose vocabulary axis is split over one axis of a mesh (a
    `NamedSharding`) keeps its sharding, as `jax.nn.softmax` does: the rows are
    computed where they lie, only their statistics crossing devices, never the
    `(..., V)` array. Inside `jax.jit` the sharding of a traced array is not known:
    call it there under `jax.shard_map` with `axis_name`.

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
    lead = logits.shape[:-1]
    requests = lead[0] if lead else 1
    parameters = sampling_parameters(
        temperature, top_k, top_p, requests, arithmetic_dtype(logits)
    )
    if requests > 0:
        # Checked before the rows are computed, so that the probabilities keep the
        # sharding they are computed in.
        parameters = raise_first_failure(
            parameters, first_failure(parameters.failures(), requests)
        )
    split = None if axis_name is not None else _vocabulary_split(logits)
    if split is None:
        return _probs(logits, parameters, axis_name)
    mesh, spec = split
    return jax.shard_map(
        functools.partial(_probs, axis_name=spec[-1]),
        mesh=mesh,
        in_specs=(spec, PartitionSpec(spec[0] if lead else None)),
        out_specs=spec,
        # The statistics gathered over the vocabulary are the same on every device
        # of a row, which the replication check cannot tell.
        check_vma=False,
    )(logits, parameters)


# Compiled whether or not the vocabulary is split, so that both compute a row the
# same way: op by op, a division may round as a product with the reciprocal does not.
@functools.partial(jax.jit, static_argnames="axis_name")
def _probs(
    logits: Float[Array, "*batch shard_vocab"],
    parameters: SamplingParameters,
    axis_name: str | None,
) -> Float[Array, "*batch shard_vocab"]:
    """The probabilities of `logits`, this device's slice of the vocabulary where
    `axis_name` names the axis it is split over, each request under its own
    parameters."""
    *lead, shard_vocab = logits.shape
    requests = lead[0] if lead else 1
    by_request = logits.reshape(requests, math.prod(lead[1:]), shard_vocab)
    (statistics,) = request_statistics((by_request,), parameters, axis_name)
    tokens = jnp.arange(shard_vocab) + vocab_offset(shard_vocab, axis_name)
    return probability(
        by_request,
        tokens,
        jax.tree.map(lambda x: x[..., None], statistics),
        parameters.temperature[:, None, None],
    ).reshape(logits.shape)


def _vocabulary_split(logits: Array) -> tuple[Mesh, PartitionSpec] | None:
    """The mesh and the full partition spec of an array whose last axis is split
    over one mesh axis of more than one device; `None` for any other array, a
    traced one included (its sharding is not known)."""
    if not isinstance(logits, jax.Array) or isinstance(logits, Tracer):
        return None
    sharding = getattr(logits, "sharding", None)
    if not isinstance(sharding, NamedSharding) or not isinstance(sharding.mesh, Mesh):
        return None
    spec = tuple(sharding.spec) + (None,) * (logits.ndim - len(sharding.spec))
    axis = spec[-1]
    if not isinstance(axis, str) or sharding.mesh.shape[axis] == 1:
        return None
    return sharding.mesh, PartitionSpec(*spec)
