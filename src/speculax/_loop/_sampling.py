"""Per-request sampling in the loop: each row's temperature, top-$k$ and top-$p$, the
distributions they make of a model's logits, and the one the draft is drawn from."""

import abc
from typing import NamedTuple, final

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int

from .._logits._parameters import sampling_parameters
from .._logits._probs import probs_from_logits
from ._model import model_probs, widened


class RowParameters(NamedTuple):
    """Each row's sampling parameters, `(B,)` arrays, or `None` each where the loop
    was given none and a SpeculativeStep verifies: the softmax of the logits as they
    are. `top_k` and `top_p` are also `None` where no row is truncated, as is known
    before tracing (neither given, or each a Python number that keeps all)."""

    temperature: Float[Array, " batch"] | None
    top_k: Int[Array, " batch"] | None
    top_p: Float[Array, " batch"] | None


def row_parameters(
    temperature: ArrayLike | None,
    top_k: ArrayLike | None,
    top_p: ArrayLike | None,
    batch: int,
    *,
    from_logits: bool,
) -> RowParameters:
    """The parameters as the loop carries them: `None` each when none is given and
    the step verifies probabilities (not `from_logits`, as a LogitsStep does), else
    one value per row, each checked as [`speculax.LogitsStep`][] checks it (a Python
    number out of range raises now, naming it; an array's values at run time) and
    kept in JAX's default float dtype, so that the enumeration reads the values it
    was given under x64; `top_k` and `top_p` `None` when no row can be truncated,
    which leaves the threshold searches out of the loop's program."""
    if temperature is None and top_k is None and top_p is None and not from_logits:
        return RowParameters(None, None, None)
    parameters = sampling_parameters(
        1.0 if temperature is None else temperature,
        top_k,
        top_p,
        batch,
        jnp.result_type(float),
    )
    if not parameters.may_truncate:
        # Known before tracing: without them the loop's program holds no search.
        return RowParameters(parameters.temperature, None, None)
    return RowParameters(parameters.temperature, parameters.top_k, parameters.top_p)


def row_probs(
    logits: Float[Array, "batch *positions vocab"], parameters: RowParameters
) -> Float[Array, "batch *positions vocab"]:
    """The distributions row $b$'s logits define under its parameters:
    [`speculax.probs_from_logits`][], the rule [`speculax.LogitsStep`][] verifies
    by; without parameters, the softmax of the logits as they are. Computed in
    `probs_dtype` either way."""
    if parameters.temperature is None:
        return model_probs(logits)
    return probs_from_logits(
        widened(logits),
        temperature=parameters.temperature,
        top_k=parameters.top_k,
        top_p=parameters.top_p,
    )


class AbstractDraftSampling(eqx.Module):
    """Which distribution the loop draws each draft token from, by inverse CDF, given
    the draft model's logits and the row's sampling parameters.

    The verification must read the rows the drafts were really drawn from. A
    [`speculax.SpeculativeStep`][] in the loop is given these rows, so with a
    lossless step any draft sampling whose rows sum to 1, in float32 or wider, is
    lossless (a draft at a higher temperature, say). A [`speculax.LogitsStep`][]
    makes the draft's rows itself, from its logits under the row's parameters: only
    [`speculax.SameAsTarget`][] is lossless with it.

    Subclass it to try an engine's drafter, and check it with
    [`speculax.testing.loop_output_distribution`][].
    """

    @abc.abstractmethod
    def __call__(
        self,
        logits: Float[Array, "batch vocab"],
        temperature: Float[Array, " batch"] | None,
        top_k: Int[Array, " batch"] | None,
        top_p: Float[Array, " batch"] | None,
    ) -> Float[Array, "batch vocab"]:
        """**Arguments:**

        - `logits`: float `(B, V)`, the draft model's logits for one draft position.
        - `temperature`, `top_k`, `top_p`: each row's parameters, `(B,)` each, as
            [`speculax.LogitsStep`][] reads them; `None` each when the loop was
            given none (and a [`speculax.SpeculativeStep`][] verifies). `top_k`
            and `top_p` are also `None` when no row is truncated, as the loop
            knows before tracing (neither given, or each a Python number that
            keeps all tokens).

        **Returns:**

        `(B, V)` probabilities, each row summing to 1, float32 or wider (the loop
        computes its own rows in `probs_dtype`: float32, or float64 under x64).
        """


@final
class SameAsTarget(AbstractDraftSampling):
    """The default: each draft token drawn from the draft model's logits under the
    row's own temperature, top-$k$ and top-$p$, by
    [`speculax.probs_from_logits`][] (the softmax of the logits as they are, when
    the loop is given no parameters), the rule the target's rows are made by.
    A greedy row (temperature 0) drafts the argmax."""

    def __call__(
        self,
        logits: Float[Array, "batch vocab"],
        temperature: Float[Array, " batch"] | None,
        top_k: Int[Array, " batch"] | None,
        top_p: Float[Array, " batch"] | None,
    ) -> Float[Array, "batch vocab"]:
        return row_probs(logits, RowParameters(temperature, top_k, top_p))
