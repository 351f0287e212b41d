"""The worked examples of the specification, through every entry point."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest


WORKED_EXAMPLES = [
    (
        {
            "draft_tokens": [[3, 2]],
            "draft_probs": [[[0.2, 0.59, 0.04, 0.17], [0.12, 0.43, 0.42, 0.03]]],
            "target_probs": [
                [
                    [0.04, 0.44, 0.24, 0.28],
                    [0.27, 0.36, 0.23, 0.14],
                    [0.19, 0.34, 0.07, 0.4],
                ]
            ],
            "accept_uniforms": [[0.27, 0.79]],
            "sample_uniforms": [0.92],
        },
        {"num_accepted": [1], "tokens": [[3, 3, -1]]},
    ),
    (
        {
            "draft_tokens": [[1, 0, 2], [2, 1, 1]],
            "draft_probs": [
                [
                    [0.38, 0.31, 0.2, 0.11],
                    [0.16, 0.01, 0.55, 0.28],
                    [0.26, 0.33, 0.06, 0.35],
                ],
                [
                    [0.01, 0.13, 0.49, 0.37],
                    [0.26, 0.12, 0.37, 0.25],
                    [0.05, 0.25, 0.67, 0.03],
                ],
            ],
            "target_probs": [
                [
                    [0.3, 0.4, 0.05, 0.25],
                    [0.63, 0.1, 0.2, 0.07],
                    [0.16, 0.05, 0.46, 0.33],
                    [0.14, 0.55, 0.18, 0.13],
                ],
                [
                    [0.11, 0.71, 0.08, 0.1],
                    [0.21, 0.45, 0.01, 0.33],
                    [0.07, 0.02, 0.49, 0.42],
                    [0.22, 0.25, 0.28, 0.25],
                ],
            ],
            "accept_uniforms": [[0.83, 0.99, 0.77], [0.6, 0.08, 0.03]],
            "sample_uniforms": [0.59, 0.73],
        },
        {"num_accepted": [3, 0], "tokens": [[1, 0, 2, 1], [1, -1, -1, -1]]},
    ),
    (
        {
            "draft_tokens": [[2]],
            "draft_probs": [[[0.01, 0.25, 0.49, 0.01, 0.24]]],
            "target_probs": [
                [[0.24, 0.31, 0.06, 0.05, 0.34], [0.04, 0.17, 0.1, 0.14, 0.55]]
            ],
            "accept_uniforms": [[0.66]],
            "sample_uniforms": [0.38],
        },
        {"num_accepted": [0], "tokens": [[0, -1]]},
    ),
]


def _as_lists(out) -> dict:
    return {name: np.asarray(out[name]).tolist() for name in ("num_accepted", "tokens")}


def _check_output(out, expected) -> None:
    import speculax

    assert set(out) == {"num_accepted", "tokens", "result"}
    assert bool(jnp.all(out["result"] == speculax.RESULTS.successful))
    assert out["num_accepted"].dtype == jnp.int32
    assert out["tokens"].dtype == jnp.int32
    assert _as_lists(out) == expected


@pytest.mark.parametrize("inputs, expected", WORKED_EXAMPLES)
def test_speculative_step_on_lists(inputs, expected):
    import speculax

    _check_output(speculax.speculative_step(**inputs), expected)


@pytest.mark.parametrize("inputs, expected", WORKED_EXAMPLES)
def test_speculative_step_on_numpy_float32(inputs, expected):
    import speculax

    arrays = {
        name: np.asarray(value, np.int32 if name == "draft_tokens" else np.float32)
        for name, value in inputs.items()
    }
    _check_output(speculax.speculative_step(**arrays), expected)


@pytest.mark.parametrize("inputs, expected", WORKED_EXAMPLES)
def test_module_eager_and_under_jit(inputs, expected):
    import speculax

    arrays = {name: jnp.asarray(value) for name, value in inputs.items()}
    step = speculax.SpeculativeStep()
    _check_output(step(**arrays), expected)
    _check_output(jax.jit(step)(**arrays), expected)
    _check_output(eqx.filter_jit(step)(**arrays), expected)


@pytest.mark.parametrize("inputs, expected", WORKED_EXAMPLES)
def test_vmap_over_an_extra_leading_axis(inputs, expected):
    import speculax

    stacked = {name: jnp.stack([jnp.asarray(v)] * 3) for name, v in inputs.items()}
    out = jax.vmap(speculax.SpeculativeStep())(**stacked)
    assert out["tokens"].shape[0] == 3
    for copy in range(3):
        _check_output(jax.tree.map(lambda x, c=copy: x[c], out), expected)


@pytest.mark.parametrize("inputs, expected", WORKED_EXAMPLES)
def test_each_example_in_float64_under_x64(inputs, expected):
    import speculax

    with jax.enable_x64(True):
        arrays = {name: jnp.asarray(value) for name, value in inputs.items()}
        assert arrays["draft_probs"].dtype == jnp.float64
        _check_output(speculax.SpeculativeStep()(**arrays), expected)
