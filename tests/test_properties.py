"""Every answer is right by the float64 judge of the specification, over many shapes
and inputs."""

import functools

import equinox as eqx
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
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


@pytest.mark.slow
@pytest.mark.parametrize("style", ["peaked", "flat", "equal"])
def test_float64_under_x64_is_judged_and_computed_in_float64(style):
    import jax.numpy as jnp

    import speculax

    with jax.enable_x64(True):
        inputs = random_inputs(3, 3, 2, 50, style=style, dtype=np.float64)
        out = speculax.SpeculativeStep()(**inputs)
        assert judge(inputs, out, np.finfo(np.float64).smallest_normal) == []
        weights = speculax.Residual()(
            out["num_accepted"],
            jnp.asarray(inputs["draft_tokens"]),
            jnp.asarray(inputs["draft_probs"]),
            jnp.asarray(inputs["target_probs"]),
        )
        assert weights.dtype == jnp.float64


# The fuzz test of the edges: dtypes, subnormal and huge values, unnormalised rows,
# uniforms on block edges, both row strategies, all against the float64 judge.
FUZZ_SHAPES = [(1, 0, 3), (2, 1, 300), (3, 2, 37), (2, 3, 600)]
FLOAT32_MAX = float(np.finfo(np.float32).max)


@functools.cache
def _fuzz_step():
    import speculax

    step = speculax.SpeculativeStep()
    return eqx.filter_jit(lambda **inputs: step(**inputs))


def _scaled(rng, probs, magnitude, dtype):
    """Rows of `probs` scaled per row: by 1, or into the subnormal range, or up to
    the largest float32 (a row of entries near 2e38 that overflows its sum)."""
    rows = probs.shape[:-1]
    if magnitude == "normalised":
        scale = np.ones(rows)
    elif magnitude == "tiny":
        scale = rng.choice([1.0, 1e-36, 1e-38, 1e-40], rows)
    elif magnitude == "unnormalised":
        scale = rng.choice([1.0, 3.0, 1e-3, 1e4], rows)
    else:  # huge: a few rows of equal entries near 2e38
        probs = np.where(
            rng.random(rows)[..., None] < 0.3, 2e38 / probs.shape[-1], probs
        )
        probs = np.where(rng.random(rows)[..., None] < 0.2, 2e38, probs)
        scale = np.ones(rows)
    return np.asarray(jnp.asarray(probs * scale[..., None], dtype))


def _block_edge_uniforms(rng, inputs):
    s = rng.random(len(inputs["sample_uniforms"]))
    for b in range(len(s)):
        n = oracle.possible_counts(inputs, b)[0]
        w = oracle.stopping_row_weights(inputs, b, n)
        if not 0 < w.sum() < np.inf:
            continue
        cdf = np.cumsum(w) / w.sum()
        edges = np.arange(255, cdf.size - 1, 256)
        edge = rng.choice(edges) if edges.size else rng.integers(cdf.size)
        s[b] = cdf[edge]
    return np.minimum(s.astype(np.float32), np.nextafter(np.float32(1), 0))


@pytest.mark.slow
# Each row strategy runs every example: `row_access` holds one strategy for the whole
# test, as intended, so that the programs compiled for it serve all the examples (a
# change of strategy clears JAX's caches).
@hypothesis.settings(
    max_examples=120,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
)
@hypothesis.given(
    shape=st.sampled_from(FUZZ_SHAPES),
    dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
    magnitude=st.sampled_from(["normalised", "tiny", "unnormalised", "huge"]),
    uniforms=st.sampled_from(["random", "ties", "edges", "block edges"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_fuzz_the_edges_against_the_float64_judge(
    row_access, shape, dtype, magnitude, uniforms, seed
):
    """A result must satisfy the judge, and an error must be one the judge
    foresees: the weights at a possible stopping position overflow float32 or have
    no mass (values below the smallest normal count as zero)."""
    if dtype == "float16" and magnitude == "huge":
        dtype = "float32"  # float16 cannot hold the values; inf is a bad input
    rng = np.random.default_rng(seed)
    inputs = random_inputs(
        seed, *shape, uniforms="random" if uniforms == "block edges" else uniforms
    )
    for name in ("draft_probs", "target_probs"):
        inputs[name] = _scaled(rng, inputs[name], magnitude, jnp.dtype(dtype))
    if uniforms == "block edges":
        inputs["sample_uniforms"] = _block_edge_uniforms(rng, inputs)
    try:
        out = jax.block_until_ready(_fuzz_step()(**inputs))
    except RuntimeError as error:
        out, message = None, str(error)
    as_given = {
        name: np.asarray(value, np.float64) if value.dtype.kind == "f" else value
        for name, value in inputs.items()
    }

    def outcome(b, n):
        total = oracle.stopping_row_weights(as_given, b, n).sum()
        return "overflow" if total > FLOAT32_MAX else "ok" if total > 0 else "empty"

    if out is None:
        foreseen = {
            outcome(b, n)
            for b in range(shape[0])
            for n in oracle.possible_counts(as_given, b)
        }
        if "sums past the largest finite number" in message:
            assert "overflow" in foreseen
        else:
            assert "no token can be drawn" in message and "empty" in foreseen
        return
    assert oracle.judge(as_given, out) == []
    for b, n in enumerate(np.asarray(out["num_accepted"])):
        assert outcome(b, n) == "ok"
