import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .._core._numerics import as_index, index_array, upcast
from .._inputs._input_array import InputArray
from .._inputs._random import KeyArray
from ._step import SpeculativeStep, StepOutput


class StepDiagnostics(StepOutput):
    """What [`speculax.diagnose`][] returns: the keys of [`speculax.StepOutput`][]
    and three more, for users who track acceptance metrics.

    - `acceptance_probs`: float `(batch, draft)`, the probability that each draft
        token passes the ratio test, $\\min(1, p_i(x_i) / q_i(x_i))$ (1 where
        $q_i(x_i) = 0 < p_i(x_i)$, 0 where $p_i(x_i) = 0$).
    - `accepted`: bool `(batch, draft)`, whether each draft token was kept: position
        $i$ is accepted when $i < n$.
    - `expected_acceptance_rate`: float `(batch, draft)`, the probability that a
        token drawn from $q_i$ passes, $\\sum_v \\min(p_i(v), q_i(v))$.
    """

    acceptance_probs: Float[Array, "batch draft"]
    accepted: Bool[Array, "batch draft"]
    expected_acceptance_rate: Float[Array, "batch draft"]


def diagnose(
    step: SpeculativeStep,
    draft_tokens: InputArray,
    draft_probs: InputArray | None,
    target_probs: InputArray,
    accept_uniforms: InputArray | None = None,
    sample_uniforms: InputArray | None = None,
    *,
    key: KeyArray | None = None,
    num_draft_tokens: InputArray | None = None,
) -> StepDiagnostics:
    """Runs `step` and returns its output together with acceptance statistics.

    The statistics read every draft and target probability (the expected acceptance
    rate is a sum over the vocabulary), so this costs a pass over both arrays that
    `step` alone does not make. With deterministic drafts (`draft_probs=None`) the
    statistics take $q_i$ as the one-hot of $x_i$; in a ragged batch, positions past
    a row's draft length hold statistics of whatever they contain.

    **Arguments:**

    - `step`: the [`speculax.SpeculativeStep`][] to run.
    - the other arguments: as for [`speculax.SpeculativeStep.__call__`][].

    **Returns:**

    A [`speculax.StepDiagnostics`][] dict.

    **Example:**

    ```python
    import speculax

    stats = speculax.diagnose(
        speculax.SpeculativeStep(),
        draft_tokens=[[3, 2]],
        draft_probs=[[[0.2, 0.59, 0.04, 0.17], [0.12, 0.43, 0.42, 0.03]]],
        target_probs=[
            [
                [0.04, 0.44, 0.24, 0.28],
                [0.27, 0.36, 0.23, 0.14],
                [0.19, 0.34, 0.07, 0.4],
            ]
        ],
        accept_uniforms=[[0.27, 0.79]],
        sample_uniforms=[0.92],
    )
    assert stats["accepted"].tolist() == [[True, False]]
    # min(1, 0.28 / 0.17) and min(1, 0.23 / 0.42):
    assert abs(stats["acceptance_probs"][0, 1] - 0.23 / 0.42) < 1e-6
    ```
    """
    out = step(
        draft_tokens,
        draft_probs,
        target_probs,
        accept_uniforms,
        sample_uniforms,
        key=key,
        num_draft_tokens=num_draft_tokens,
    )
    num_draft = out["tokens"].shape[1] - 1
    draft_tokens = as_index(index_array(draft_tokens))
    target = upcast(jnp.asarray(target_probs))[:, :num_draft]
    if draft_probs is None:
        draft = jax.nn.one_hot(draft_tokens, target.shape[-1], dtype=target.dtype)
    else:
        draft = upcast(jnp.asarray(draft_probs))
    index = draft_tokens[..., None]
    target_at_draft = jnp.take_along_axis(target, index, axis=-1)[..., 0]
    draft_at_draft = jnp.take_along_axis(draft, index, axis=-1)[..., 0]
    ratio = target_at_draft / jnp.where(draft_at_draft > 0, draft_at_draft, 1)
    acceptance_probs = jnp.where(
        draft_at_draft > 0, jnp.minimum(1, ratio), target_at_draft > 0
    ).astype(target.dtype)
    position = jnp.arange(num_draft)[None, :]
    return {
        "num_accepted": out["num_accepted"],
        "tokens": out["tokens"],
        "acceptance_probs": acceptance_probs,
        "accepted": position < out["num_accepted"][:, None],
        "expected_acceptance_rate": jnp.sum(jnp.minimum(target, draft), axis=-1),
    }
