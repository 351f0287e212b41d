"""Every answer is right by SPEC 2's float64 judge, over many shapes and inputs."""

import functools

import equinox as eqx
import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest

from inputs import STYLES, UNIFORMS, random_inputs
from oracle import judge


# A few fixed shapes, so that each is compiled once, spanning G = 0, B = 0, V = 1, and
# vocabularies from tiny to tens of thousands.
SHAPES = [
    (1, 0, 1),
    (3, 0, 7),
    (2, 1, 1),
    (0, 2, 5),
    (2, 3, 4),
    (4, 2, 37),
    (3, 4, 1000),
    (2, 2, 40000),
]


@functools.cache
def _step(check_values: bool = True, check_all_probs: bool = False):
    import speculax

    return eqx.filter_jit(
        speculax.SpeculativeStep(
            check_values=check_values, check_all_probs=check_all_probs
        )
    )


@hypothesis.settings(max_examples=80)
@hypothesis.given(
    shape=st.sampled_from(SHAPES),
    style=st.sampled_from(STYLES),
    uniforms=st.sampled_from(UNIFORMS),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_answer_satisfies_the_float64_judge(shape, style, uniforms, seed):
    inputs = random_inputs(seed, *shape, style=style, uniforms=uniforms)
    out = _step()(**inputs)
    assert judge(inputs, out) == []


@pytest.mark.parametrize("shape", [(2, 3, 4), (3, 4, 1000)])
@pytest.mark.parametrize("seed", range(4))
def test_checks_never_change_a_valid_answer(shape, seed):
    inputs = random_inputs(seed, *shape, style=STYLES[seed % len(STYLES)])
    answers = [
        _step(check_values, check_all_probs)(**inputs)
        for check_values, check_all_probs in [
            (True, False),
            (False, False),
            (True, True),
        ]
    ]
    for answer in answers[1:]:
        for name in ("num_accepted", "tokens"):
            np.testing.assert_array_equal(answer[name], answers[0][name])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("style", ["peaked", "sparse", "equal"])
def test_half_precision_inputs_are_judged_on_their_own_values(dtype, style):
    """Half-precision inputs are computed in float32; the judge reads the half values
    exactly as given, upcast to float64."""
    import jax.numpy as jnp

    import speculax

    inputs = random_inputs(7, 4, 3, 300, style=style)
    half = {
        name: jnp.asarray(value, dtype) if value.dtype.kind == "f" else value
        for name, value in inputs.items()
    }
    out = speculax.speculative_step(**half)
    as_given = {
        name: np.asarray(value, np.float64)
        if name != "draft_tokens"
        else np.asarray(value)
        for name, value in half.items()
    }
    assert judge(as_given, out) == []


@pytest.mark.parametrize("style", ["peaked", "flat", "equal"])
def test_float64_under_x64_is_judged_and_computed_in_float64(style):
    import jax.numpy as jnp

    import speculax

    with jax.enable_x64(True):
        inputs = random_inputs(3, 3, 2, 50, style=style, dtype=np.float64)
        out = speculax.SpeculativeStep()(**inputs)
        assert judge(inputs, out) == []
        weights = speculax.Residual()(
            out["num_accepted"],
            jnp.asarray(inputs["draft_tokens"]),
            jnp.asarray(inputs["draft_probs"]),
            jnp.asarray(inputs["target_probs"]),
        )
        assert weights.dtype == jnp.float64
