"""The specification's "Bad input": every bad input gets the right error, every
odd-but-valid input the right answer, eagerly, under `jit` and under `vmap`.

`CASES` is the library's documented behaviour on bad input, kept in one table.
"""

import dataclasses
import functools
import re
from collections.abc import Callable

import equinox as eqx
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inputs import ALL_INTEGER_DTYPES, random_inputs
from oracle import judge


BATCH, DRAFT, VOCAB = 2, 3, 5
Inputs = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    change: Callable[[Inputs], None]
    error: type[Exception] | None = None  # None: a valid input, judged by the oracle
    match: str = ""


def _set(name, value):
    def change(inputs):
        inputs[name] = np.asarray(value)

    return change


def _put(name, index, value):
    def change(inputs):
        inputs[name] = inputs[name].copy()
        inputs[name][index] = value

    return change


def _cast(name, dtype):
    def change(inputs):
        inputs[name] = inputs[name].astype(dtype)

    return change


def _reshape(name, shape):
    def change(inputs):
        inputs[name] = np.resize(inputs[name], shape)

    return change


def _stop_at_zero(inputs):
    """Makes every row reject its first draft token (p_0(x_0) = 0), so n = 0 and only
    the rows p_0 and q_0 are read."""
    inputs["target_probs"] = inputs["target_probs"].copy()
    first = inputs["draft_tokens"][:, 0]
    inputs["target_probs"][np.arange(BATCH), 0, first] = 0.0


def _subnormal_residual(inputs):
    """Row 0 stops at n = 0 with q_0 = p_0 except at one token, where p_0 - q_0 is
    1e-39, below float32's smallest normal: the residual counts as empty."""
    p, q = inputs["target_probs"].copy(), inputs["draft_probs"].copy()
    first = inputs["draft_tokens"][0, 0]
    p[0, 0, first] = 0.0
    q[0, 0] = p[0, 0]
    other = (first + 1) % VOCAB
    p[0, 0, other], q[0, 0, other] = 1.5e-38, 1.4e-38
    inputs["target_probs"], inputs["draft_probs"] = p, q


def _subnormal_at_draft_token(inputs):
    """p_0(x_0) = q_0(x_0) = 1e-39 in row 0: both count as zero, so x_0 fails."""
    for name in ("target_probs", "draft_probs"):
        inputs[name] = inputs[name].copy()
        inputs[name][0, 0, inputs["draft_tokens"][0, 0]] = 1e-39
    inputs["accept_uniforms"] = inputs["accept_uniforms"].copy()
    inputs["accept_uniforms"][0, 0] = 0.4


def _then(*changes):
    def change(inputs):
        for step in changes:
            step(inputs)

    return change


def _empty_batch(inputs):
    for name, value in inputs.items():
        inputs[name] = value[:0]


def _no_drafts(inputs):
    inputs["draft_tokens"] = inputs["draft_tokens"][:, :0]
    inputs["draft_probs"] = inputs["draft_probs"][:, :0]
    inputs["target_probs"] = inputs["target_probs"][:, :1]
    inputs["accept_uniforms"] = inputs["accept_uniforms"][:, :0]


def _one_token_vocabulary(inputs):
    inputs["draft_tokens"] = np.zeros_like(inputs["draft_tokens"])
    inputs["draft_probs"] = np.ones((BATCH, DRAFT, 1), np.float32)
    inputs["target_probs"] = np.ones((BATCH, DRAFT + 1, 1), np.float32)


LARGEST_BELOW_ONE = np.nextafter(np.float32(1), np.float32(0))
CASES = [
    # Structure: at trace time, always.
    Case(
        "tokens rank 1",
        _reshape("draft_tokens", (BATCH * DRAFT,)),
        ValueError,
        r"draft_tokens must have rank 2, shape \(B, G\); got shape \(6,\)",
    ),
    Case(
        "draft_probs rank 2",
        _reshape("draft_probs", (BATCH, DRAFT * VOCAB)),
        ValueError,
        r"draft_probs must have rank 3",
    ),
    Case(
        "target_probs rank 4",
        _reshape("target_probs", (BATCH, DRAFT + 1, VOCAB, 1)),
        ValueError,
        r"target_probs must have rank 3",
    ),
    Case(
        "accept_uniforms rank 1",
        _reshape("accept_uniforms", (BATCH * DRAFT,)),
        ValueError,
        r"accept_uniforms must have rank 2",
    ),
    Case(
        "sample_uniforms rank 2",
        _reshape("sample_uniforms", (BATCH, 1)),
        ValueError,
        r"sample_uniforms must have rank 1",
    ),
    Case(
        "draft_probs batch",
        _reshape("draft_probs", (BATCH + 1, DRAFT, VOCAB)),
        ValueError,
        r"draft_probs must have shape \(B, G, V\) = \(2, 3, 5\).*"
        r"got \(3, 3, 5\)",
    ),
    Case(
        "draft_probs draft",
        _reshape("draft_probs", (BATCH, DRAFT - 1, VOCAB)),
        ValueError,
        r"draft_probs must have shape \(B, G, V\) = \(2, 3, 5\)",
    ),
    Case(
        "draft_probs vocab",
        _reshape("draft_probs", (BATCH, DRAFT, VOCAB + 1)),
        ValueError,
        r"draft_probs must have shape \(B, G, V\) = \(2, 3, 5\)",
    ),
    Case(
        "target_probs without the extra position",
        _reshape("target_probs", (BATCH, DRAFT, VOCAB)),
        ValueError,
        r"target_probs must have shape \(B, G \+ 1, V\) = \(2, 4, 5\).*got \(2, 3, 5\)",
    ),
    Case(
        "target_probs batch",
        _reshape("target_probs", (1, DRAFT + 1, VOCAB)),
        ValueError,
        r"target_probs must have shape \(B, G \+ 1, V\) = \(2, 4, 5\)",
    ),
    Case(
        "accept_uniforms shape",
        _reshape("accept_uniforms", (BATCH, DRAFT + 1)),
        ValueError,
        r"accept_uniforms must have shape \(B, G\) = \(2, 3\)",
    ),
    Case(
        "sample_uniforms shape",
        _reshape("sample_uniforms", (BATCH + 1,)),
        ValueError,
        r"sample_uniforms must have shape \(B,\) = \(2,\)",
    ),
    Case(
        "empty vocabulary",
        _then(
            _reshape("draft_probs", (BATCH, DRAFT, 0)),
            _reshape("target_probs", (BATCH, DRAFT + 1, 0)),
        ),
        ValueError,
        r"target_probs must have a vocabulary axis of size at least 1",
    ),
    Case(
        "float tokens",
        _cast("draft_tokens", np.float32),
        TypeError,
        r"draft_tokens must have an integer dtype; got float32",
    ),
    Case(
        "bool tokens",
        _cast("draft_tokens", bool),
        TypeError,
        r"draft_tokens must have an integer dtype; got bool",
    ),
    Case(
        "integer draft_probs",
        _cast("draft_probs", np.int32),
        TypeError,
        r"draft_probs must have a floating-point dtype; got int32",
    ),
    Case(
        "integer target_probs",
        _cast("target_probs", np.int32),
        TypeError,
        r"target_probs must have a floating-point dtype; got int32",
    ),
    Case(
        "integer accept_uniforms",
        _cast("accept_uniforms", np.int32),
        TypeError,
        r"accept_uniforms must have a floating-point dtype",
    ),
    Case(
        "integer sample_uniforms",
        _cast("sample_uniforms", np.int32),
        TypeError,
        r"sample_uniforms must have a floating-point dtype",
    ),
    Case(
        "accept_uniforms missing for the ratio test",
        lambda inputs: inputs.pop("accept_uniforms"),
        ValueError,
        r"accept_uniforms is required: RatioAcceptance reads it",
    ),
    Case(
        "sample_uniforms missing for inverse-CDF sampling",
        lambda inputs: inputs.pop("sample_uniforms"),
        ValueError,
        r"sample_uniforms is required: InverseCDF reads it",
    ),
    # Values: at run time, through Equinox's runtime errors.
    Case(
        "token -1",
        _put("draft_tokens", (1, 2), -1),
        RuntimeError,
        r"draft_tokens must lie in \[0, V\)",
    ),
    Case(
        "token V",
        _put("draft_tokens", (0, 0), VOCAB),
        RuntimeError,
        r"draft_tokens must lie in \[0, V\)",
    ),
    Case(
        "accept uniform 1.0",
        _put("accept_uniforms", (0, 1), 1.0),
        RuntimeError,
        r"accept_uniforms must lie in \[0, 1\)",
    ),
    Case(
        "accept uniform -0.1",
        _put("accept_uniforms", (1, 0), -0.1),
        RuntimeError,
        r"accept_uniforms must lie in \[0, 1\)",
    ),
    Case(
        "accept uniform NaN",
        _put("accept_uniforms", (1, 2), np.nan),
        RuntimeError,
        r"accept_uniforms must lie in \[0, 1\)",
    ),
    Case(
        "sample uniform 1.0",
        _put("sample_uniforms", 0, 1.0),
        RuntimeError,
        r"sample_uniforms must lie in \[0, 1\)",
    ),
    Case(
        "sample uniform NaN",
        _put("sample_uniforms", 1, np.nan),
        RuntimeError,
        r"sample_uniforms must lie in \[0, 1\)",
    ),
    Case(
        "NaN p at a draft token",
        lambda i: _put("target_probs", (0, 0, i["draft_tokens"][0, 0]), np.nan)(i),
        RuntimeError,
        r"target_probs must be finite and non-negative.*p_i\(x_i\)",
    ),
    Case(
        "inf q at a draft token",
        lambda i: _put("draft_probs", (1, 1, i["draft_tokens"][1, 1]), np.inf)(i),
        RuntimeError,
        r"draft_probs must be finite and non-negative.*q_i\(x_i\)",
    ),
    Case(
        "negative p at a draft token",
        lambda i: _put("target_probs", (1, 2, i["draft_tokens"][1, 2]), -0.2)(i),
        RuntimeError,
        r"target_probs must be finite and non-negative.*p_i\(x_i\)",
    ),
    Case(
        "NaN in the stopping row p_n",
        _then(
            _stop_at_zero,
            lambda i: _put(
                "target_probs", (0, 0, (i["draft_tokens"][0, 0] + 1) % VOCAB), np.nan
            )(i),
        ),
        RuntimeError,
        r"target_probs.* must be finite and non-negative.*row p_n",
    ),
    Case(
        "negative value in the stopping row q_n",
        _then(
            _stop_at_zero,
            lambda i: _put(
                "draft_probs", (1, 0, (i["draft_tokens"][1, 0] + 1) % VOCAB), -0.1
            )(i),
        ),
        RuntimeError,
        r"draft_probs.* must be finite and non-negative.*q_n",
    ),
    Case(
        "ragged length above G",
        _set("num_draft_tokens", np.array([1, DRAFT + 1], np.int32)),
        RuntimeError,
        r"num_draft_tokens must lie in \[0, G\]",
    ),
    Case(
        "ragged lengths of the wrong shape",
        _set("num_draft_tokens", np.array([1, 2, 3], np.int32)),
        ValueError,
        r"num_draft_tokens must have shape \(B,\) = \(2,\)",
    ),
    Case(
        "all-zero target row at the stop",
        _put("target_probs", (1, 0), 0.0),
        RuntimeError,
        r"no token can be drawn.*no positive mass",
    ),
    Case(
        "only subnormal mass in the target row at the stop",
        _put("target_probs", (1, 0), 3e-39),
        RuntimeError,
        r"no token can be drawn.*values below the smallest normal number count as zero",
    ),
    Case(
        "finite p_n whose total overflows",
        _then(
            _set("accept_uniforms", np.zeros((BATCH, DRAFT), np.float32)),
            _put("target_probs", (1, DRAFT), 2e38),
        ),
        RuntimeError,
        r"target_probs must have rows whose total.*sums past the largest",
    ),
    # Odd but valid: the right answer.
    Case(
        "NaN in a row the step does not read",
        _then(_stop_at_zero, _put("target_probs", (slice(None), DRAFT), np.nan)),
    ),
    Case("empty batch", _empty_batch),
    Case("no draft positions", _no_drafts),
    Case("one-token vocabulary", _one_token_vocabulary),
    Case(
        "uniforms at 0 and just below 1",
        _then(
            _put("accept_uniforms", (0,), 0.0),
            _put("accept_uniforms", (1,), LARGEST_BELOW_ONE),
            _set("sample_uniforms", np.array([0.0, LARGEST_BELOW_ONE], np.float32)),
        ),
    ),
    Case(
        "q = 0 at a draft token",
        lambda i: _put("draft_probs", (0, 0, i["draft_tokens"][0, 0]), 0.0)(i),
    ),
    Case(
        "unnormalised probabilities",
        _then(
            _set("target_probs", np.ones((BATCH, DRAFT + 1, VOCAB), np.float32) * 3),
            _set("draft_probs", np.ones((BATCH, DRAFT, VOCAB), np.float32) * 0.5),
        ),
    ),
    Case(
        "float16 probabilities",
        _then(_cast("draft_probs", np.float16), _cast("target_probs", np.float16)),
    ),
    Case(
        "bfloat16 probabilities",
        _then(_cast("draft_probs", jnp.bfloat16), _cast("target_probs", jnp.bfloat16)),
    ),
    Case("int64 tokens", _cast("draft_tokens", np.int64)),
    Case("subnormal p and q at a draft token", _subnormal_at_draft_token),
    Case("residual below the smallest normal falls back to p_n", _subnormal_residual),
]


def _inputs(case: Case) -> Inputs:
    inputs = random_inputs(11, BATCH, DRAFT, VOCAB)
    case.change(inputs)
    return inputs


# Eager and vmapped runs of the table are the extended tier: jitted, it covers every
# case in the default run.
MODES = [
    pytest.param("eager", marks=pytest.mark.slow),
    "jit",
    pytest.param("vmap", marks=pytest.mark.slow),
]


@functools.cache
def _runner(mode: str, throw: bool = True):
    """The step eagerly, jitted, or vmapped over two copies of the inputs (which
    must give the same tokens); with `throw=False`, `with_result`, returning the
    output and the per-row codes."""
    import speculax

    step = speculax.SpeculativeStep(throw=throw)
    call = step if throw else step.with_result
    if mode == "eager":
        return call
    if mode == "jit":
        return eqx.filter_jit(call)

    def vmapped(**inputs):
        stacked = {name: jnp.stack([value, value]) for name, value in inputs.items()}
        both = jax.vmap(call)(**stacked)
        out = both if throw else both[0]
        np.testing.assert_array_equal(out["tokens"][0], out["tokens"][1])
        return jax.tree.map(lambda x: x[0], both)

    return vmapped


def _as_float64(inputs: Inputs) -> Inputs:
    return {
        name: np.asarray(value, np.float64) if name != "draft_tokens" else value
        for name, value in inputs.items()
    }


def test_the_table_is_long_enough():
    assert len(CASES) >= 25
    assert len({case.name for case in CASES}) == len(CASES)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_bad_input(case, mode):
    inputs = _inputs(case)
    if case.error is None:
        out = _runner(mode)(**inputs)
        assert judge(_as_float64(inputs), out) == []
    else:
        with pytest.raises(case.error, match=case.match):
            jax.block_until_ready(_runner(mode)(**inputs))


RUNTIME_CASES = [case for case in CASES if case.error is RuntimeError]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", RUNTIME_CASES, ids=lambda case: case.name)
def test_throw_false_reports_each_row(case, mode):
    """Every failure kind, as a per-row code instead of an error: a failed row gets
    n = 0 and tokens all -1, and every other row its answer alone, bit for bit."""
    import speculax

    inputs = _inputs(case)
    out, result = _runner(mode, throw=False)(**inputs)
    messages = speculax.failure_messages(result)
    assert any(re.search(case.match, message) for message in messages), messages
    for b, message in enumerate(messages):
        if message:
            assert out["num_accepted"][b] == 0
            assert out["tokens"][b].tolist() == [-1] * (DRAFT + 1)
            continue
        alone = _runner("jit")(
            **{name: value[b : b + 1] for name, value in inputs.items()}
        )
        np.testing.assert_array_equal(out["num_accepted"][b], alone["num_accepted"][0])
        np.testing.assert_array_equal(out["tokens"][b], alone["tokens"][0])


def test_runtime_cases_cover_every_failure():
    """Each failure of the chain step in `speculax.RESULTS` is raised by some case of
    the table."""
    import speculax

    raised = {
        message
        for case in RUNTIME_CASES
        for message in speculax.failure_messages(
            _runner("jit", throw=False)(**_inputs(case))[1]
        )
    }
    # The full scan's failures, from values no other check reads.
    scan = next(c for c in CASES if c.name == "NaN in a row the step does not read")
    unread_draft = _inputs(scan)
    unread_draft["target_probs"] = random_inputs(11, BATCH, DRAFT, VOCAB)[
        "target_probs"
    ]
    unread_draft["draft_probs"][0, 0, unread_draft["draft_tokens"][0, 0] - 1] = np.nan
    step = speculax.SpeculativeStep(check_all_probs=True, throw=False)
    with_result = eqx.filter_jit(step.with_result)
    for inputs in (_inputs(scan), unread_draft):
        raised |= set(speculax.failure_messages(with_result(**inputs)[1]))
    results = speculax.RESULTS
    chain_failures = (
        results.num_draft_tokens_out_of_range,
        results.draft_token_out_of_range,
        results.accept_uniform_out_of_range,
        results.sample_uniform_out_of_range,
        results.bad_target_probs,
        results.bad_draft_probs,
        results.bad_target_prob_at_draft_token,
        results.bad_draft_prob_at_draft_token,
        results.bad_target_row,
        results.bad_draft_row,
        results.target_row_overflows,
        results.no_mass,
    )
    missing = {results[failure] for failure in chain_failures} - raised
    assert not missing, missing


def test_float64_under_x64_is_valid():
    import speculax

    with jax.enable_x64(True):
        inputs = _as_float64(random_inputs(11, BATCH, DRAFT, VOCAB))
        out = eqx.filter_jit(speculax.SpeculativeStep())(**inputs)
        assert judge(inputs, out) == []


@pytest.mark.slow
def test_full_scan_catches_what_the_cheap_checks_do_not_read():
    import speculax

    case = next(c for c in CASES if c.name == "NaN in a row the step does not read")
    inputs = _inputs(case)
    with pytest.raises(RuntimeError, match="target_probs must be finite"):
        jax.block_until_ready(speculax.SpeculativeStep(check_all_probs=True)(**inputs))


def test_structure_errors_need_no_runtime_type_checker():
    """The structure checks are the library's own, not jaxtyping's: the public entry
    points take array-likes, and the same ValueError comes out of plain jit."""
    import speculax

    case = next(c for c in CASES if c.name == "target_probs without the extra position")
    with pytest.raises(ValueError, match=case.match):
        jax.jit(speculax.SpeculativeStep())(**_inputs(case))
    with pytest.raises(ValueError, match=case.match):
        speculax.speculative_step(**_inputs(case))


@pytest.mark.parametrize(
    "mode", ["one batch", pytest.param("vmap", marks=pytest.mark.slow)]
)
def test_the_first_failing_check_is_reported(mode):
    """Every check runs, and the one reported is the first in the order of the
    specification's table (a token before a uniform), whichever row or vmapped
    example fails it."""
    import speculax

    bad_uniform = random_inputs(11, BATCH, DRAFT, VOCAB)
    bad_uniform["accept_uniforms"][0, 0] = np.nan
    bad_token = random_inputs(11, BATCH, DRAFT, VOCAB)
    bad_token["draft_tokens"][1, 0] = VOCAB
    step = speculax.SpeculativeStep()
    if mode == "one batch":
        both = {name: value.copy() for name, value in bad_uniform.items()}
        both["draft_tokens"][1, 0] = VOCAB
        run = functools.partial(eqx.filter_jit(step), **both)
    else:
        stacked = {
            name: jnp.stack([bad_uniform[name], bad_token[name]])
            for name in bad_uniform
        }
        run = functools.partial(jax.vmap(step), **stacked)
    with pytest.raises(RuntimeError, match=r"draft_tokens must lie in \[0, V\)"):
        jax.block_until_ready(run())


# Integer inputs: every dtype is read by value, never wrapped or overflowed.
INTEGER_DTYPES = ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64"]


def _integer_inputs(vocab: int, dtype: str) -> Inputs:
    inputs = random_inputs(5, BATCH, DRAFT, vocab)
    largest = min(vocab - 1, np.iinfo(dtype).max)
    inputs["draft_tokens"] = np.array([[0, largest, 7], [largest, 1, 2]], dtype)
    return inputs


# The default tier reads the narrowest signed and a 16-bit unsigned dtype (a V of
# 70,000 is beyond both), int64 narrowed under x32 and the widest unsigned under x64;
# the extended tier every dtype in both modes.
DEFAULT_TIER_INTEGERS = {
    ("int8", False),
    ("uint16", False),
    ("int64", False),
    ("uint64", True),
}


@pytest.mark.parametrize(
    "dtype, x64",
    [
        pytest.param(
            dtype,
            x64,
            id=f"{dtype}-{'x64' if x64 else 'x32'}",
            marks=[] if (dtype, x64) in DEFAULT_TIER_INTEGERS else [pytest.mark.slow],
        )
        for dtype in [*INTEGER_DTYPES, "uint64"]
        for x64 in (False, True)
    ],
)
def test_every_integer_dtype_is_read_by_value(dtype, x64):
    import speculax

    # V beyond the largest value of every 8- and 16-bit dtype: comparing tokens with
    # it must not overflow theirs.
    with jax.enable_x64(x64):
        inputs = _integer_inputs(70_000, dtype)
        lengths = np.array([DRAFT, 1], dtype)
        as_int32 = {**inputs, "draft_tokens": inputs["draft_tokens"].astype(np.int32)}
        want = speculax.speculative_step(
            **as_int32, num_draft_tokens=lengths.astype(int)
        )
        for tokens in (inputs["draft_tokens"], jnp.asarray(inputs["draft_tokens"])):
            got = speculax.speculative_step(
                **{**inputs, "draft_tokens": tokens}, num_draft_tokens=lengths
            )
            for name in ("num_accepted", "tokens"):
                np.testing.assert_array_equal(got[name], want[name])


@pytest.mark.slow
@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
@pytest.mark.parametrize(
    "dtype, value",
    [
        ("int8", -1),
        ("uint8", 200),
        ("int16", -3),
        ("uint16", 65_535),
        ("uint32", 2**31),
        ("int64", 2**32 + 3),
        ("int64", -(2**32) + 3),
        ("uint64", 2**63 + 3),
    ],
)
def test_a_token_out_of_range_is_rejected_in_every_dtype(dtype, value, x64):
    """Checked before any narrowing: 2**32 + 3 is not token 3."""
    import speculax

    with jax.enable_x64(x64):
        inputs = random_inputs(5, BATCH, DRAFT, 100)
        inputs["draft_tokens"] = inputs["draft_tokens"].astype(dtype)
        inputs["draft_tokens"][1, 0] = value
        with pytest.raises(RuntimeError, match=r"draft_tokens must lie in \[0, V\)"):
            jax.block_until_ready(speculax.speculative_step(**inputs))
        with pytest.raises(RuntimeError, match=r"draft_tokens must lie in \[0, V\)"):
            speculax.diagnose(speculax.SpeculativeStep(), **inputs)
        lengths = np.array([1, value], dtype)
        inputs["draft_tokens"][1, 0] = 0
        with pytest.raises(
            RuntimeError, match=r"num_draft_tokens must lie in \[0, G\]"
        ):
            jax.block_until_ready(
                speculax.speculative_step(**inputs, num_draft_tokens=lengths)
            )


def test_the_full_scan_ignores_ragged_padding():
    """Positions at and past a row's draft length may hold anything, NaN included:
    the full scan reads the positions in use, p_{g_b} among them."""
    import speculax

    step = speculax.SpeculativeStep(check_all_probs=True, throw=False)
    with_result = eqx.filter_jit(step.with_result)
    inputs = random_inputs(4, BATCH, DRAFT, VOCAB)
    lengths = np.array([1, DRAFT])
    inputs["draft_probs"][0, 1:] = np.nan
    inputs["target_probs"][0, 2:] = np.nan
    _, result = with_result(**inputs, num_draft_tokens=lengths)
    assert speculax.failure_messages(result) == ["", ""]
    inputs["target_probs"][0, 1, 0] = np.nan
    _, result = with_result(**inputs, num_draft_tokens=lengths)
    assert speculax.failure_messages(result)[0].startswith("target_probs")


def test_failure_messages_need_concrete_codes():
    import speculax

    step = speculax.SpeculativeStep(throw=False)
    # Compiled: eagerly, each of the step's operations would compile on its own.
    _, result = eqx.filter_jit(step.with_result)(
        **random_inputs(4, BATCH, DRAFT, VOCAB)
    )
    with pytest.raises(ValueError, match="outside jit"):
        jax.jit(lambda result: len(speculax.failure_messages(result)))(result)


# Every other entry point that takes an integer, fuzzed over every dtype, NumPy and
# JAX arrays and Python ints, with and without x64: read by value, never wrapped.
# The oracle is the same call on int32 values where the value is valid, and the
# documented error where it is not.
INT32 = np.iinfo(np.int32)
# Values either side of every width's limits, and the wrapping traps: 2**32 + 2 is 2
# in int32, 2**32 - 1 (uint32) is -1.
SPECIAL_VALUES = [
    *range(-1, 4),
    7,
    127,
    255,
    INT32.max,
    INT32.max + 1,
    2**32 - 1,
    2**32 + 2,
    -(2**32) + 2,
    2**63 - 1,
    2**64 - 1,
    2**70,
    -(2**70),
]


@functools.cache
def _bigram_loop():
    import speculax

    table = jnp.log(jnp.array([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3], [0.3, 0.3, 0.4]]))

    def bigram(tokens, positions):
        return table[jnp.take_along_axis(tokens, positions, axis=1)]

    loop = speculax.SpeculativeLoop(num_draft=1, max_new_tokens=2)
    prompt = jnp.array([[0, 1, 2], [2, 1, 0], [1, 1, 1]])
    return lambda lengths: loop(
        bigram, bigram, prompt, key=jax.random.key(0), prompt_lengths=lengths
    )


@dataclasses.dataclass(frozen=True)
class IntegerEntry:
    """An entry point taking an integer argument `name`, given as
    `[value, *companions]` (a row of positions around the value for linked lists,
    the value alone for a rank)."""

    name: str
    call: Callable
    companions: tuple[int, ...]
    # The error type(s) and message for an invalid value, None for a valid one.
    error: Callable[[int], tuple | None]
    # An int32 value that must give the same answer as a valid value.
    equivalent: Callable[[int], int] = lambda v: v


def _integer_entries() -> dict[str, IntegerEntry]:
    import speculax

    logits = jnp.log(jnp.array([[7.0, 1, 6, 2, 5, 3, 4]]))

    def outside(low, high, error, pattern):
        return lambda v: None if low <= v <= high else (error, pattern)

    def link_error(v):
        if not -1 <= v < 3:
            return ValueError, rf"next_sibling must lie in \[-1, 3\); got {v} at"
        # Position 1's next sibling: itself (a cycle) or the root (reached twice).
        return (ValueError, "cycle|reached twice") if v in (0, 1) else None

    def rank_error(v):
        if v < 0:
            return ValueError, r"paths\[1\] must be non-empty and non-negative"
        if v == 0:
            return ValueError, "repeats the path"
        return (ValueError, "not the next rank") if v > 1 else None

    entries = [
        IntegerEntry(
            "top_k",
            # One request: a Python int, or an array of shape (1,).
            lambda k: speculax.probs_from_logits(
                logits, top_k=k[0] if isinstance(k, list) else k
            ),
            (),
            # A Python int is checked at once, an array at run time.
            outside(0, np.inf, (ValueError, RuntimeError), "top_k must be non-neg"),
            # A count int32 cannot hold keeps all, as V does.
            lambda v: min(v, 7),
        ),
        IntegerEntry(
            "num_draft_tokens",
            lambda g: speculax.from_token_major(jnp.arange(8.0), g, num_draft=2),
            (2, 1),
            outside(0, 2, RuntimeError, r"num_draft_tokens must lie in \[0, 2\]"),
        ),
        IntegerEntry(
            "num_draft_tokens",
            lambda g: speculax.to_token_major(
                jnp.arange(9.0).reshape(3, 3), g, num_tokens=8, bonus=True
            ),
            (2, 1),
            outside(0, 2, RuntimeError, r"num_draft_tokens must lie in \[0, 2\]"),
        ),
        IntegerEntry(
            "next_sibling",
            lambda links: speculax.tree_from_linked_lists(
                np.array([[1, -1, -1]]), links
            ),
            (),
            link_error,
        ),
        IntegerEntry(
            r"paths\[1\]\[0\]",
            lambda ranks: speculax.parents_from_paths([(0,), (ranks[0],)]),
            (),
            rank_error,
        ),
        IntegerEntry(
            "prompt_lengths",
            _bigram_loop(),
            (3, 2),
            outside(1, 3, RuntimeError, r"prompt_lengths must lie in \[1, P\]"),
        ),
    ]
    return dict(zip(INTEGER_ENTRIES, entries, strict=True))


INTEGER_ENTRIES = [
    "top_k",
    "from_token_major",
    "to_token_major",
    "tree_from_linked_lists",
    "parents_from_paths",
    "loop",
]


def _in(dtype: str, container: str, values: list[int], entry: str):
    """`values` in the given dtype and container: a NumPy array, a JAX array or
    nested Python numbers."""
    if entry == "tree_from_linked_lists":
        values = [[-1, values[0], -1]]
    if container == "python":
        return np.array(values, dtype).tolist() if dtype in NOT_INTEGERS else values
    if entry == "parents_from_paths":
        rank = np.dtype(dtype).type(values[0])
        return [jnp.asarray(rank) if container == "jax" else rank]
    array = np.array(values, dtype)
    return jnp.asarray(array) if container == "jax" else array


def _containers(dtype: str, entry: str, value: int):
    """The containers that hold `value` in `dtype` (with the entry's -1s), JAX
    without 64-bit numbers unless x64 is on."""
    info = np.iinfo(dtype)
    if not info.min <= value <= info.max:
        return []
    if entry == "tree_from_linked_lists" and info.min == 0:
        return []  # the lists hold -1, which no unsigned dtype does
    with_jax = jax.config.jax_enable_x64 or info.bits < 64
    return ["numpy", "jax"] if with_jax else ["numpy"]


# Each mode compiles every entry point once (half a minute): the extended tier.
@pytest.mark.slow
@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
@hypothesis.settings(max_examples=40)
@hypothesis.given(
    entry_name=st.sampled_from(INTEGER_ENTRIES),
    value=st.sampled_from(SPECIAL_VALUES) | st.integers(-(2**72), 2**72),
)
def test_fuzz_every_integer_entry_point_reads_by_value(x64, entry_name, value):
    """The value in every integer dtype that holds it, as a NumPy array, a JAX
    array and a Python int: the answer of the same call on an int32 value where it
    is valid, the documented error where it is not."""
    entry = _integer_entries()[entry_name]
    with jax.enable_x64(x64):
        given = [
            _in(dtype, container, [value, *entry.companions], entry_name)
            for dtype in ALL_INTEGER_DTYPES
            for container in _containers(dtype, entry_name, value)
        ]
        given.append(_in("int64", "python", [value, *entry.companions], entry_name))
        error = entry.error(value)
        want = None
        if error is None:
            same = [entry.equivalent(value), *entry.companions]
            want = entry.call(_in("int32", "numpy", same, entry_name))
        for values in given:
            if error is not None:
                with pytest.raises(error[0], match=error[1]):
                    jax.block_until_ready(entry.call(values))
                continue
            for got_leaf, want_leaf in zip(
                jax.tree.leaves(entry.call(values)), jax.tree.leaves(want), strict=True
            ):
                np.testing.assert_array_equal(got_leaf, want_leaf)


# Not integers: refused, naming the argument, whatever the values.
NOT_INTEGERS = ["float32", "float64", "bool"]


@pytest.mark.parametrize("container", ["numpy", "jax", "python"])
@pytest.mark.parametrize("dtype", NOT_INTEGERS)
@pytest.mark.parametrize("entry_name", INTEGER_ENTRIES)
def test_no_integer_entry_point_takes_a_float_or_a_bool(entry_name, dtype, container):
    entry = _integer_entries()[entry_name]
    given = _in(dtype, container, [1, *entry.companions], entry_name)
    with pytest.raises(TypeError, match=entry.name):
        jax.block_until_ready(entry.call(given))
