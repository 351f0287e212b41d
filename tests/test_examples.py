"""The worked examples of the specification, through every entry point."""

import functools

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
    # The problem statement's output: a dict with exactly two keys.
    assert type(out) is dict
    assert list(out) == ["num_accepted", "tokens"]
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


# The first worked example in the default tier; `speculax demo` runs every one.
@pytest.mark.parametrize(
    "inputs, expected",
    [
        WORKED_EXAMPLES[0],
        *(pytest.param(*case, marks=pytest.mark.slow) for case in WORKED_EXAMPLES[1:]),
    ],
)
def test_module_eager_and_under_jit(inputs, expected):
    import speculax

    arrays = {name: jnp.asarray(value) for name, value in inputs.items()}
    step = speculax.SpeculativeStep()
    _check_output(step(**arrays), expected)
    _check_output(jax.jit(step)(**arrays), expected)
    _check_output(eqx.filter_jit(step)(**arrays), expected)


@pytest.mark.slow
@pytest.mark.parametrize("inputs, expected", WORKED_EXAMPLES)
def test_vmap_over_an_extra_leading_axis(inputs, expected):
    import speculax

    stacked = {name: jnp.stack([jnp.asarray(v)] * 3) for name, v in inputs.items()}
    out = jax.vmap(speculax.SpeculativeStep())(**stacked)
    assert out["tokens"].shape[0] == 3
    for copy in range(3):
        _check_output(jax.tree.map(lambda x, c=copy: x[c], out), expected)


@pytest.mark.slow
@pytest.mark.parametrize("inputs, expected", WORKED_EXAMPLES)
def test_each_example_in_float64_under_x64(inputs, expected):
    import speculax

    with jax.enable_x64(True):
        arrays = {name: jnp.asarray(value) for name, value in inputs.items()}
        assert arrays["draft_probs"].dtype == jnp.float64
        _check_output(speculax.SpeculativeStep()(**arrays), expected)


@functools.cache
def _chain_steps():
    """Every chain entry point, by name, as a function of the problem's five inputs;
    each compiled once for the file."""
    import jax.sharding

    import speculax

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("batch",))
    logits = eqx.filter_jit(speculax.LogitsStep())
    return {
        "speculative_step": speculax.speculative_step,
        "SpeculativeStep": eqx.filter_jit(speculax.SpeculativeStep()),
        "throw=False": eqx.filter_jit(speculax.SpeculativeStep(throw=False)),
        "greedy_step": eqx.filter_jit(speculax.greedy_step()),
        "block_step": eqx.filter_jit(speculax.block_step()),
        "LogitsStep": lambda draft_probs, target_probs, **kw: logits(
            draft_logits=jnp.log(jnp.asarray(draft_probs)),
            target_logits=jnp.log(jnp.asarray(target_probs)),
            **kw,
        ),
        "sharded_step": speculax.sharded_step(
            speculax.SpeculativeStep(), mesh, batch_axis="batch"
        ),
    }


@pytest.mark.parametrize(
    "name",
    [
        "speculative_step",
        "SpeculativeStep",
        "throw=False",
        "greedy_step",
        "block_step",
        "LogitsStep",
        "sharded_step",
    ],
)
def test_every_chain_step_returns_exactly_two_keys(name):
    """The problem statement's output, "a dict with two keys", from every chain step
    and flag; the per-row codes come only from `with_result`."""
    inputs, _ = WORKED_EXAMPLES[1]
    out = _chain_steps()[name](**{k: np.asarray(v) for k, v in inputs.items()})
    assert type(out) is dict
    assert list(out) == ["num_accepted", "tokens"]


def test_with_result_returns_the_codes_beside_the_two_keys():
    import speculax

    inputs, expected = WORKED_EXAMPLES[1]
    step = speculax.SpeculativeStep(throw=False)
    out, result = eqx.filter_jit(step.with_result)(**inputs)
    _check_output(out, expected)
    assert isinstance(result, speculax.RESULTS)
    assert speculax.failure_messages(result) == ["", ""]
    bad = dict(inputs, draft_tokens=[[1, 0, 2], [2, 9, 1]])
    out, result = eqx.filter_jit(step.with_result)(**bad)
    assert list(out) == ["num_accepted", "tokens"]
    assert (result == speculax.RESULTS.draft_token_out_of_range).tolist() == [
        False,
        True,
    ]
    assert out["tokens"].tolist()[1] == [-1] * 4


def test_tree_steps_return_exactly_three_keys():
    import speculax

    inputs = {
        "parents": [[0, 0, 1]],
        "tree_tokens": [[1, 2, 0]],
        "draft_probs": np.full((1, 4, 3), 1 / 3),
        "target_probs": np.full((1, 4, 3), 1 / 3),
        "accept_uniforms": [[0.5, 0.5, 0.5]],
        "sample_uniforms": [0.5],
    }
    for step in (speculax.TreeStep(throw=False), speculax.TraversalStep()):
        # Compiled: eagerly, the walk's loops compile at each call.
        out = eqx.filter_jit(step)(**inputs)
        assert type(out) is dict
        assert sorted(out) == ["accepted_nodes", "num_accepted", "tokens"]
        same, result = eqx.filter_jit(step.with_result)(**inputs)
        assert sorted(same) == sorted(out)
        assert speculax.failure_messages(result) == [""]
