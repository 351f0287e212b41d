"""Verification from logits (`LogitsStep`, `probs_from_logits` with per-row
parameters, the token-major layout): the same answers as the probability path row by
row, rows that never see each other's parameters, one compilation for every mix, the
bad-input table, the memory bound, and the distribution of the jitted step."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import speculax
import speculax.testing
from oracle import judge, reference_probs_from_logits
from test_lossless import chi_square_sf


VOCAB = 37
NUM_DRAFT = 3
BATCH = 10
# Greedy, plain sampling, top-k, top-p, both; cycled over the rows.
KINDS = ("greedy", "plain", "top_k", "top_p", "both")

_logits_step = eqx.filter_jit(speculax.LogitsStep())
_returning_step = eqx.filter_jit(speculax.LogitsStep(throw=False).with_result)
_probs_step = eqx.filter_jit(speculax.SpeculativeStep())
_greedy_step = eqx.filter_jit(speculax.greedy_step())


def _parameters(rng: np.random.Generator, batch: int, vocab: int) -> dict:
    """One row of each kind in turn, with random values."""
    temperature = rng.uniform(0.4, 1.6, batch)
    top_k = np.zeros(batch, np.int32)
    top_p = np.ones(batch)
    for b in range(batch):
        kind = KINDS[b % len(KINDS)]
        if kind == "greedy":
            temperature[b] = 0.0
        if kind in ("top_k", "both"):
            top_k[b] = rng.integers(1, vocab)
        if kind in ("top_p", "both"):
            top_p[b] = rng.uniform(0.2, 0.95)
    return {
        "temperature": temperature.astype(np.float32),
        "top_k": top_k,
        "top_p": top_p.astype(np.float32),
    }


def _row_parameters(parameters: dict, b: int) -> dict:
    """Row b's parameters as Python numbers, `None` where it keeps all tokens."""
    top_k, top_p = int(parameters["top_k"][b]), float(parameters["top_p"][b])
    return {
        "temperature": float(parameters["temperature"][b]),
        "top_k": top_k or None,
        "top_p": top_p if top_p < 1 else None,
    }


def _mixed_batch(seed: int, dtype: str, drafting: str, ragged: bool) -> dict:
    """Logits with ties (every other row rounded to halves), drafts close to the
    target, draft tokens sampled from each row's truncated draft distribution."""
    rng = np.random.default_rng(seed)
    target = 2 * rng.standard_normal((BATCH, NUM_DRAFT + 1, VOCAB))
    target[::2] = np.round(target[::2] * 2) / 2
    draft = target[:, :NUM_DRAFT] + 0.6 * rng.standard_normal((BATCH, NUM_DRAFT, VOCAB))
    target_logits = jnp.asarray(target, dtype)
    draft_logits = jnp.asarray(draft, dtype)
    parameters = _parameters(rng, BATCH, VOCAB)
    q = np.asarray(speculax.probs_from_logits(draft_logits, **parameters), np.float64)
    tokens = np.array(
        [[rng.choice(VOCAB, p=row / row.sum()) for row in rows] for rows in q],
        np.int32,
    )
    batch = {
        "draft_tokens": jnp.asarray(tokens),
        "draft_logits": None if drafting == "deterministic" else draft_logits,
        "target_logits": target_logits,
        "accept_uniforms": jnp.asarray(rng.random((BATCH, NUM_DRAFT)), jnp.float32),
        "sample_uniforms": jnp.asarray(rng.random(BATCH), jnp.float32),
        **{name: jnp.asarray(value) for name, value in parameters.items()},
    }
    if ragged:
        lengths = rng.integers(0, NUM_DRAFT + 1, BATCH)
        lengths[:2] = 0
        batch["num_draft_tokens"] = jnp.asarray(lengths, jnp.int32)
    return batch


def _probability_path(batch: dict, b: int) -> dict:
    """Row b alone: `probs_from_logits` with its parameters as Python numbers, then
    the default step (the greedy step at temperature 0)."""
    parameters = _row_parameters(
        {k: np.asarray(batch[k]) for k in ("temperature", "top_k", "top_p")}, b
    )
    target_probs = speculax.probs_from_logits(
        batch["target_logits"][b : b + 1], **parameters
    )
    draft_probs = None
    if batch["draft_logits"] is not None:
        draft_probs = speculax.probs_from_logits(
            batch["draft_logits"][b : b + 1], **parameters
        )
    step = _greedy_step if parameters["temperature"] == 0 else _probs_step
    lengths = batch.get("num_draft_tokens")
    return step(
        batch["draft_tokens"][b : b + 1],
        draft_probs,
        target_probs,
        batch["accept_uniforms"][b : b + 1],
        batch["sample_uniforms"][b : b + 1],
        num_draft_tokens=None if lengths is None else lengths[b : b + 1],
    )


def _run(step, batch: dict) -> dict:
    return step(
        batch["draft_tokens"],
        batch["draft_logits"],
        batch["target_logits"],
        batch["accept_uniforms"],
        batch["sample_uniforms"],
        temperature=batch["temperature"],
        top_k=batch["top_k"],
        top_p=batch["top_p"],
        num_draft_tokens=batch.get("num_draft_tokens"),
    )


# Each dtype with each kind of draft once, full and ragged in turn.
@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype, drafting, ragged",
    [
        ("float32", "sampled", False),
        ("float32", "deterministic", True),
        ("bfloat16", "sampled", True),
        ("bfloat16", "deterministic", False),
    ],
)
def test_logits_step_is_the_probability_path_row_by_row(dtype, drafting, ragged):
    batch = _mixed_batch(0, dtype, drafting, ragged)
    out = _run(_logits_step, batch)
    for b in range(BATCH):
        expected = _probability_path(batch, b)
        assert out["num_accepted"][b] == expected["num_accepted"][0], b
        assert out["tokens"][b].tolist() == expected["tokens"][0].tolist(), b
    # The float64 judge of the probability step, on the sampled rows' probabilities.
    if ragged:
        return
    sampled = np.flatnonzero(np.asarray(batch["temperature"]) > 0)
    parameters = {k: batch[k][sampled] for k in ("temperature", "top_k", "top_p")}
    target_probs = speculax.probs_from_logits(
        batch["target_logits"][sampled], **parameters
    )
    if drafting == "deterministic":
        draft_probs = jax.nn.one_hot(batch["draft_tokens"][sampled], VOCAB)
    else:
        draft_probs = speculax.probs_from_logits(
            batch["draft_logits"][sampled], **parameters
        )
    inputs = {
        "draft_tokens": batch["draft_tokens"][sampled],
        "draft_probs": draft_probs,
        "target_probs": target_probs,
        "accept_uniforms": batch["accept_uniforms"][sampled],
        "sample_uniforms": batch["sample_uniforms"][sampled],
    }
    output = {key: np.asarray(out[key])[sampled] for key in ("num_accepted", "tokens")}
    assert judge(inputs, output) == []


def test_the_batch_drafts_and_verifies_something():
    """The agreement above is not vacuous: drafts pass, and every kind of row keeps
    some."""
    accepted = np.zeros(len(KINDS))
    out = _run(_logits_step, _mixed_batch(0, "float32", "sampled", False))
    for b, n in enumerate(np.asarray(out["num_accepted"])):
        accepted[b % len(KINDS)] += n
    assert (accepted > 0).all(), accepted


@pytest.mark.slow
def test_a_row_never_sees_the_other_rows():
    """Bit for bit the answer of the row alone, whatever the other rows' logits and
    parameters, and wherever the row sits in the batch."""
    batch = _mixed_batch(1, "float32", "sampled", True)
    out = _run(_logits_step, batch)
    order = np.random.default_rng(0).permutation(BATCH)
    shuffled = _run(
        _logits_step,
        {k: None if v is None else v[order] for k, v in batch.items()},
    )
    for key in ("num_accepted", "tokens"):
        np.testing.assert_array_equal(shuffled[key], np.asarray(out[key])[order])
    for b in (0, 3, 7):
        alone = _run(
            _logits_step,
            {k: None if v is None else v[b : b + 1] for k, v in batch.items()},
        )
        assert alone["tokens"][0].tolist() == out["tokens"][b].tolist()
        others = dict(batch)
        for name, value in _parameters(np.random.default_rng(b), BATCH, VOCAB).items():
            changed = np.asarray(value).copy()
            changed[b] = np.asarray(batch[name])[b]
            others[name] = jnp.asarray(changed)
        assert (
            _run(_logits_step, others)["tokens"][b].tolist()
            == out["tokens"][b].tolist()
        )


@pytest.mark.slow
def test_the_row_statistics_do_not_depend_on_the_neighbouring_row():
    """The rows are processed two at a time on CPU: a row's largest logit, threshold
    and normaliser are bit for bit the same beside a truncated or an untruncated
    neighbour."""
    from speculax._logits._truncation import row_statistics

    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.standard_normal((4, 300)), jnp.float32)
    temperature = jnp.array([0.8, 0.8, 0.8, 0.8])
    plain = row_statistics(
        logits, temperature, jnp.zeros(4, jnp.int32), jnp.ones(4, jnp.float32)
    )
    # Rows 1 and 3 truncated: rows 0 and 2 now share a chunk with a truncated row.
    truncated = row_statistics(
        logits,
        temperature,
        jnp.array([0, 30, 0, 0], jnp.int32),
        jnp.array([1.0, 1.0, 1.0, 0.5], jnp.float32),
    )
    for field in ("maximum", "argmax", "threshold", "total"):
        np.testing.assert_array_equal(
            getattr(plain, field)[::2], getattr(truncated, field)[::2]
        )


def test_a_row_has_the_same_statistics_in_every_set_of_groups_searched():
    """A row searched among 128 groups (its chunk's neighbour needs few), among 512
    (the neighbour needs more than 128) and whole: the same threshold and
    normaliser, bit for bit. Rows short enough are searched whole from the start
    for this reason. The threshold is one of the row's scaled logits, whatever the
    steps of the search: the same bits under either row strategy."""
    from speculax._logits._truncation import (
        FEW_GROUPS,
        GROUP_SIZE,
        SEARCHED_GROUPS,
        _searched_whole,
        row_statistics,
        scaled_logits,
    )

    vocab = 16384
    assert vocab // GROUP_SIZE > SEARCHED_GROUPS > FEW_GROUPS
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.standard_normal((2, vocab)), jnp.float32)
    temperature = jnp.array([0.9, 0.9])
    top_k, top_p = 40, 0.9
    statistics = jax.jit(row_statistics)
    found = [
        statistics(
            logits,
            temperature,
            jnp.array([top_k, neighbour_k], jnp.int32),
            jnp.array([top_p, 1.0], jnp.float32),
        )
        for neighbour_k in (5, 300)
    ]
    whole = jax.jit(_searched_whole, static_argnums=4)(
        logits[0], temperature[0], jnp.int32(top_k), jnp.float32(top_p), None
    )
    for field in ("threshold", "total"):
        for other in found:
            np.testing.assert_array_equal(
                getattr(other, field)[0], getattr(whole, field)
            )
    scaled = scaled_logits(logits[0], whole.maximum, temperature[0])
    assert whole.threshold in np.asarray(scaled)


def test_one_compilation_serves_every_mix_of_parameters():
    traces = []

    @eqx.filter_jit
    def verify(*args, **kwargs):
        traces.append(None)
        return speculax.LogitsStep()(*args, **kwargs)

    for seed in range(3):
        batch = _mixed_batch(seed, "float32", "sampled", False)
        expected = _run(_logits_step, batch)
        got = _run(verify, batch)
        assert got["tokens"].tolist() == expected["tokens"].tolist()
    assert len(traces) == 1


def _program(step, batch: dict) -> tuple[int, int]:
    """The characters and the while loops of `step`'s jaxpr for `batch`, Python
    numbers kept as they are (the arrays become constants)."""
    jaxpr = str(jax.make_jaxpr(lambda: _run(step, batch))())
    return len(jaxpr), jaxpr.count("while[")


@pytest.mark.parametrize(
    "strategy", ["one at a time", pytest.param("all at once", marks=pytest.mark.slow)]
)
def test_python_parameters_leave_out_what_no_row_needs(strategy):
    """A temperature of 0 given as a Python number traces greedy verification alone
    and reads no uniforms; no top-k and no top-p trace no truncation. Either way
    the answers and result codes are those of the same values given as arrays, bit
    for bit, rows with NaN, +inf or no finite logit included."""
    batch = _mixed_batch(7, "float32", "sampled", True)
    target = np.asarray(batch["target_logits"]).copy()
    target[1, 0, 4], target[3, 1, 0], target[5, 0] = np.nan, np.inf, -np.inf
    batch["target_logits"] = jnp.asarray(target)
    ones, zeros = jnp.ones(BATCH), jnp.zeros(BATCH)
    step = eqx.filter_jit(speculax.LogitsStep(throw=False).with_result)
    with speculax.row_strategy(strategy):
        greedy = {**batch, "temperature": 0, "top_k": None, "top_p": None}
        as_arrays = {**batch, "temperature": zeros, "top_k": None, "top_p": None}
        without_uniforms = {**greedy, "accept_uniforms": None, "sample_uniforms": None}
        untruncated = {**batch, "top_k": None, "top_p": None}
        kept_as_arrays = {**batch, "top_k": jnp.zeros(BATCH, jnp.int32), "top_p": ones}
        for python, arrays in [
            (greedy, as_arrays),
            (without_uniforms, as_arrays),
            (untruncated, kept_as_arrays),
        ]:
            got, expected = _run(step, python), _run(step, arrays)
            same = jax.tree.map(lambda a, b: a.tolist() == b.tolist(), got, expected)
            assert all(jax.tree.leaves(same))
            assert int(jnp.sum(got[1] != speculax.RESULTS.successful)) == 3
            (size, loops), (array_size, array_loops) = map(
                functools.partial(_program, step), (python, arrays)
            )
            assert size < array_size
            # Fewer loops: no threshold search, nor, when greedy, the loop over rows
            # (all at once, untruncated arrays run no loop either).
            if python is untruncated or strategy == "one at a time":
                assert loops < array_loops
            else:
                assert loops == array_loops == 0


def test_greedy_rows_do_not_read_the_draft_logits():
    batch = _mixed_batch(3, "float32", "sampled", False)
    greedy = np.flatnonzero(np.asarray(batch["temperature"]) == 0)
    poisoned = np.asarray(batch["draft_logits"]).copy()
    poisoned[greedy] = np.nan
    out = _run(_logits_step, batch)
    again = _run(_logits_step, {**batch, "draft_logits": jnp.asarray(poisoned)})
    assert again["tokens"].tolist() == out["tokens"].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("num_draft", [0, 2])
def test_edges_of_the_shapes(num_draft):
    """No draft positions: the bonus token from p_0; an empty batch: empty outputs."""
    logits = jnp.asarray(
        np.random.default_rng(4).standard_normal((2, num_draft + 1, 9))
    )
    tokens = jnp.zeros((2, num_draft), jnp.int32)
    out = speculax.LogitsStep()(
        tokens,
        logits[:, :num_draft],
        logits,
        temperature=jnp.array([0.0, 1.0]),
        key=jax.random.key(0),
    )
    assert out["tokens"].shape == (2, num_draft + 1)
    if num_draft == 0:
        assert out["tokens"][0, 0] == jnp.argmax(logits[0, 0])
    empty = speculax.LogitsStep()(
        tokens[:0], logits[:0, :num_draft], logits[:0], key=jax.random.key(0)
    )
    assert empty["tokens"].shape == (0, num_draft + 1)


# --- probs_from_logits with per-row parameters --------------------------------------


@pytest.mark.parametrize(
    "dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)]
)
def test_per_row_parameters_are_each_row_alone(dtype):
    batch = _mixed_batch(5, dtype, "sampled", False)
    parameters = {k: batch[k] for k in ("temperature", "top_k", "top_p")}
    probs = speculax.probs_from_logits(batch["target_logits"], **parameters)
    for b in range(BATCH):
        alone = speculax.probs_from_logits(
            batch["target_logits"][b],
            **_row_parameters({k: np.asarray(v) for k, v in parameters.items()}, b),
        )
        np.testing.assert_array_equal(probs[b], alone)


@pytest.mark.parametrize(
    "seed", [0, *(pytest.param(seed, marks=pytest.mark.slow) for seed in range(1, 4))]
)
def test_truncation_without_sorting_is_truncation_by_sorting(seed):
    """The same kept tokens as the NumPy definition by sorting, ties and -inf
    included, and the same probabilities."""
    rng = np.random.default_rng(seed)
    logits = np.round(rng.standard_normal((6, 50)) * 3) / 3
    logits[0, :10] = -np.inf
    logits[1, :] = 1.0
    parameters = _parameters(rng, 6, 50)
    _assert_truncation_by_sorting(logits, parameters)


@pytest.mark.slow
@pytest.mark.parametrize("spread", [0.3, 3.0], ids=["flat", "peaked"])
def test_the_searches_read_few_groups_or_the_whole_row_alike(spread):
    """At V = 10240 (640 groups of 16 tokens): rows whose kept tokens lie in a few
    groups are searched there, flat ones (and a top-k above the number of groups)
    whole; both agree with truncation by sorting."""
    from speculax._logits._truncation import GROUP_SIZE, SEARCHED_GROUPS

    vocab = 10240
    assert vocab // GROUP_SIZE > SEARCHED_GROUPS
    rng = np.random.default_rng(12)
    logits = spread * rng.standard_normal((5, vocab))
    parameters = {
        "temperature": np.array([1.0, 0.8, 1.2, 0.9, 1.0], np.float32),
        "top_k": np.array([5, 0, 30, 100, 2000], np.int32),
        "top_p": np.array([1.0, 0.9, 0.95, 0.5, 1.0], np.float32),
    }
    _assert_truncation_by_sorting(logits, parameters)


@pytest.mark.parametrize("vocab", [2064, pytest.param(4096, marks=pytest.mark.slow)])
def test_the_last_group_is_read_once(vocab):
    """The top tokens in the last group of 16, the case where empty slots of the
    pruned search once read that group again: kept sets and probabilities still
    those of truncation by sorting. Rows of more than `FEW_GROUPS` groups, which
    are searched among their groups (shorter ones are searched whole); 2064 tokens
    end in a block of 16 padded to 256."""
    from speculax._logits._truncation import FEW_GROUPS, GROUP_SIZE

    assert vocab > FEW_GROUPS * GROUP_SIZE
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((6, vocab))
    logits[:, -1] += 6
    logits[:, -3] += 5.5
    logits[:, 0] += 5
    parameters = {
        "temperature": np.array([1.0, 0.7, 1.0, 1.3, 0.9, 1.0], np.float32),
        "top_k": np.array([2, 0, 3, 1, 0, 5], np.int32),
        "top_p": np.array([1.0, 0.9, 0.8, 1.0, 0.99, 0.5], np.float32),
    }
    _assert_truncation_by_sorting(logits, parameters)
    probs = speculax.probs_from_logits(jnp.asarray(logits, jnp.float32), **parameters)
    np.testing.assert_allclose(np.asarray(probs).sum(-1), 1, rtol=1e-5)


@pytest.mark.slow
def test_under_x64():
    """Float32 and float64 logits, under x64: the same answers as the probability
    path, and float64 parameters for float64 logits."""
    with jax.enable_x64(True):
        for dtype in ("float32", "float64"):
            batch = _mixed_batch(9, dtype, "sampled", True)
            out = _run(_logits_step, batch)
            for b in range(BATCH):
                expected = _probability_path(batch, b)
                assert out["tokens"][b].tolist() == expected["tokens"][0].tolist()
            probs = speculax.probs_from_logits(
                batch["target_logits"], temperature=0.7, top_k=5, top_p=0.9
            )
            assert probs.dtype == jnp.dtype(dtype)


def test_parameters_at_the_edges_of_their_dtypes():
    """A top-k past int32 keeps all, never wrapped; a subnormal top-p keeps the top
    token, a subnormal temperature samples rather than turning greedy."""
    logits = jnp.asarray(np.random.default_rng(13).standard_normal((2, 30)))
    everything = speculax.probs_from_logits(logits)
    for huge in (2**40, np.int64(2**32 + 3), np.array([2**33, 2**31], np.int64)):
        np.testing.assert_array_equal(
            speculax.probs_from_logits(logits, top_k=huge), everything
        )
    top = speculax.probs_from_logits(logits, top_p=1e-45)
    assert (
        np.asarray(top).tolist()
        == np.asarray(jax.nn.one_hot(jnp.argmax(logits, -1), 30)).tolist()
    )
    with pytest.raises(ValueError, match="logits must have a vocabulary axis"):
        speculax.probs_from_logits(jnp.zeros((2, 0)))


def _assert_truncation_by_sorting(logits: np.ndarray, parameters: dict) -> None:
    """`probs_from_logits` keeps, row by row, the tokens the NumPy definition by
    sorting keeps, with the same probabilities."""
    probs = np.asarray(
        speculax.probs_from_logits(jnp.asarray(logits, jnp.float32), **parameters)
    )
    for b in range(len(logits)):
        expected = reference_probs_from_logits(
            logits[b].astype(np.float32), **_row_parameters(parameters, b)
        )
        np.testing.assert_array_equal(probs[b] > 0, expected > 0)
        np.testing.assert_allclose(probs[b], expected, atol=2e-6)


# --- Bad input -----------------------------------------------------------------------


def _bad(batch: dict, name: str, b: int, value, index=None) -> dict:
    array = np.asarray(batch[name]).copy()
    if index is None:
        array[b] = value
    else:
        array[(b, *index)] = value
    return {**batch, name: jnp.asarray(array)}


# Row 1 samples plainly (KINDS[1]), row 2 with a top-k; row 0 is greedy.
BAD_VALUES = [
    ("temperature", "temperature", 1, -0.5, None),
    ("temperature NaN", "temperature", 1, np.nan, None),
    ("temperature inf", "temperature", 1, np.inf, None),
    ("top_k", "top_k", 1, -3, None),
    ("top_p zero", "top_p", 1, 0.0, None),
    ("top_p above one", "top_p", 1, 1.5, None),
    ("target NaN", "target_logits", 1, np.nan, (2, 5)),
    ("target +inf", "target_logits", 1, np.inf, (0, 5)),
    ("target all -inf", "target_logits", 1, -np.inf, (3,)),
    ("draft NaN", "draft_logits", 1, np.nan, (1, 0)),
    ("draft all -inf", "draft_logits", 1, -np.inf, (0,)),
    ("greedy target NaN", "target_logits", 0, np.nan, (1, 2)),
    ("truncated target +inf", "target_logits", 2, np.inf, (0, 5)),
    ("truncated draft NaN", "draft_logits", 2, np.nan, (0, 7)),
]
MESSAGES = {
    "temperature": "temperature must be finite and non-negative",
    "top_k": "top_k must be non-negative",
    "top_p": "top_p must lie in",
    "target_logits": "target_logits must",
    "draft_logits": "draft_logits must",
}
RESULTS_OF = {
    "temperature": "temperature_out_of_range",
    "temperature NaN": "temperature_out_of_range",
    "temperature inf": "temperature_out_of_range",
    "top_k": "top_k_out_of_range",
    "top_p zero": "top_p_out_of_range",
    "top_p above one": "top_p_out_of_range",
    "target NaN": "bad_target_logits",
    "target +inf": "bad_target_logits",
    "target all -inf": "no_finite_target_logit",
    "draft NaN": "bad_draft_logits",
    "draft all -inf": "no_finite_draft_logit",
    "greedy target NaN": "bad_target_logits",
    "truncated target +inf": "bad_target_logits",
    "truncated draft NaN": "bad_draft_logits",
}


@pytest.mark.parametrize(
    "case, name, b, value, index", BAD_VALUES, ids=[c[0] for c in BAD_VALUES]
)
def test_bad_values_raise_or_empty_their_row(case, name, b, value, index):
    batch = _bad(_mixed_batch(6, "float32", "sampled", False), name, b, value, index)
    with pytest.raises(RuntimeError, match=MESSAGES[name]):
        jax.block_until_ready(_run(_logits_step, batch))
    out, result = _run(_returning_step, batch)
    assert (result == getattr(speculax.RESULTS, RESULTS_OF[case]))[b]
    assert out["tokens"][b].tolist() == [-1] * (NUM_DRAFT + 1)
    good = _run(_logits_step, _mixed_batch(6, "float32", "sampled", False))
    others = [row for row in range(BATCH) if row != b]
    assert np.asarray(result == speculax.RESULTS.successful)[others].all()
    np.testing.assert_array_equal(
        np.asarray(out["tokens"])[others], np.asarray(good["tokens"])[others]
    )


def test_every_failure_from_logits_has_a_case():
    logits_failures = {
        "temperature_out_of_range",
        "top_k_out_of_range",
        "top_p_out_of_range",
        "bad_target_logits",
        "bad_draft_logits",
        "no_finite_target_logit",
        "no_finite_draft_logit",
    }
    assert set(RESULTS_OF.values()) == logits_failures
    for name in logits_failures:
        assert getattr(speculax.RESULTS, name) != speculax.RESULTS.successful


def test_a_row_reports_its_first_failure_in_the_order_of_the_table():
    """A parameter before the logits, target before draft, NaN before all -inf,
    and the shared checks (tokens, uniforms) before all of them."""
    batch = _mixed_batch(6, "float32", "sampled", False)
    steps = [
        ("target_logits", 1, -np.inf, (3,), "no_finite_target_logit"),
        ("draft_logits", 1, np.nan, (0, 1), "bad_draft_logits"),
        ("target_logits", 1, np.nan, (0, 1), "bad_target_logits"),
        ("top_p", 1, 2.0, None, "top_p_out_of_range"),
        ("top_k", 1, -1, None, "top_k_out_of_range"),
        ("temperature", 1, -1.0, None, "temperature_out_of_range"),
        ("sample_uniforms", 1, 1.5, None, "sample_uniform_out_of_range"),
        ("draft_tokens", 1, VOCAB, (0,), "draft_token_out_of_range"),
    ]
    for name, b, value, index, expected in steps:
        batch = _bad(batch, name, b, value, index)
        _, result = _run(_returning_step, batch)
        assert (result == getattr(speculax.RESULTS, expected))[b], expected


def test_logits_the_step_does_not_read_may_hold_anything():
    """Past a row's length, and a greedy row's draft logits."""
    batch = _mixed_batch(7, "float32", "sampled", True)
    lengths = np.asarray(batch["num_draft_tokens"])
    target = np.asarray(batch["target_logits"]).copy()
    draft = np.asarray(batch["draft_logits"]).copy()
    for b, g in enumerate(lengths):
        target[b, g + 1 :] = np.nan
        draft[b, g:] = np.inf
    out = _run(_logits_step, batch)
    again = _run(
        _logits_step,
        {
            **batch,
            "target_logits": jnp.asarray(target),
            "draft_logits": jnp.asarray(draft),
        },
    )
    assert again["tokens"].tolist() == out["tokens"].tolist()


@pytest.mark.slow
def test_a_row_the_step_never_draws_from_may_hold_no_finite_logit():
    """The bonus row p_G all -inf, or NaN, where a draft fails before G: the step
    never reads it, as the probability step never reads the all-zero (or NaN) p_G
    it becomes, and the answer is the probability path's; where every draft
    passes, p_G is drawn from and refused."""
    batch = _mixed_batch(6, "float32", "sampled", False)
    good = _run(_logits_step, batch)
    stopped = np.asarray(good["num_accepted"]) < NUM_DRAFT
    assert stopped.any() and not stopped.all()
    for value in (-np.inf, np.nan):
        target = np.asarray(batch["target_logits"]).copy()
        target[stopped, NUM_DRAFT] = value
        unread = {**batch, "target_logits": jnp.asarray(target)}
        out = _run(_logits_step, unread)
        assert out["tokens"].tolist() == good["tokens"].tolist()
        for b in np.flatnonzero(stopped)[:3]:
            alone = _probability_path(unread, b)
            assert out["tokens"][b].tolist() == alone["tokens"][0].tolist()
    target[np.flatnonzero(~stopped)[0], NUM_DRAFT] = -np.inf
    with pytest.raises(RuntimeError, match="target_logits must hold a finite value"):
        jax.block_until_ready(
            _run(_logits_step, {**batch, "target_logits": jnp.asarray(target)})
        )


@pytest.mark.slow
def test_the_largest_finite_temperature_is_uniform_over_the_finite_logits():
    """The limit an infinite temperature (refused) would have, reached by every
    finite one too large to tell the logits apart: masked (-inf) tokens keep
    probability 0, never NaN (XLA CPU divides by a subnormal reciprocal there),
    and both entry points agree."""
    largest = float(np.finfo(np.float32).max)
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((2, 3, VOCAB)).astype(np.float32)
    logits[..., ::3] = -np.inf
    finite = np.isfinite(logits)
    probs = speculax.probs_from_logits(jnp.asarray(logits), temperature=largest)
    np.testing.assert_allclose(probs, finite / finite.sum(-1, keepdims=True), 1e-6)
    tokens = jnp.array([[1, 2], [4, 5]])
    u, s = speculax.uniforms(jax.random.key(1), 2, 2)
    out = _logits_step(
        tokens, logits[:, :2], logits, u, s, temperature=jnp.full(2, largest)
    )
    expected = _probs_step(tokens, probs[:, :2], probs, u, s)
    assert out["tokens"].tolist() == expected["tokens"].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
def test_a_top_k_int32_cannot_hold_keeps_all_in_both_entry_points(x64):
    """Read by value: a JAX uint32 or int64 count beyond int32 keeps every token,
    as any count from V up does, never wrapped to a negative count (refused) or a
    small one (truncating the row)."""
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.standard_normal((2, 2, VOCAB)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, VOCAB, (2, 1)))
    expected = jnp.array([0, 3], jnp.int32)
    with jax.enable_x64(x64):
        huge = [("uint32", 2**32 - 1), ("uint32", 2**31)]
        if x64:
            huge += [("int64", 2**32 + 2), ("uint64", 2**64 - 1)]
        for dtype, value in huge:
            top_k = jnp.array([value, 3], dtype)
            np.testing.assert_array_equal(
                speculax.probs_from_logits(logits, top_k=top_k),
                speculax.probs_from_logits(logits, top_k=expected),
            )
            if x64:
                continue  # the step reads top_k through the same parameters
            step = [
                speculax.LogitsStep()(
                    tokens, logits[:, :1], logits, top_k=k, key=jax.random.key(0)
                )["tokens"]
                for k in (top_k, expected)
            ]
            np.testing.assert_array_equal(*step)


@pytest.mark.parametrize(
    "keywords, error, message",
    [
        ({"temperature": -1.0}, ValueError, "temperature must be finite and non"),
        ({"temperature": np.inf}, ValueError, "temperature must be finite and non"),
        ({"top_k": -1}, ValueError, "top_k must be non-negative"),
        ({"top_p": 0.0}, ValueError, r"top_p must lie in \(0, 1\]"),
        ({"temperature": jnp.ones(3)}, ValueError, r"temperature must be a scalar or"),
        ({"top_k": jnp.ones(2)}, TypeError, "top_k must have an integer dtype"),
        ({"top_k": 2.0}, TypeError, "top_k must have an integer dtype"),
        ({"top_k": True}, TypeError, "top_k must have an integer dtype; got bool"),
        ({"top_p": jnp.ones(2, jnp.int32)}, TypeError, "top_p must have a floating"),
        # Neither read as 1 nor 0, nor failing inside JAX without the name.
        ({"temperature": False}, TypeError, "temperature must be a number; got F"),
        ({"top_p": True}, TypeError, "top_p must be a number; got True"),
        ({"temperature": np.True_}, TypeError, "temperature must be a number"),
        ({"temperature": jnp.ones(2, bool)}, TypeError, "temperature must have a fl"),
        # Not an ArrayLike: runtime type checking names the parameter first, and
        # the library's own message is tested below.
        ({"temperature": "1"}, TypeError, "parameter 'temperature'"),
        ({"top_p": [0.5, None]}, TypeError, "parameter 'top_p'"),
    ],
)
def test_parameters_of_the_wrong_value_or_structure_raise_at_once(
    keywords, error, message
):
    logits = jnp.zeros((2, 2, 5))
    with pytest.raises(error, match=message):
        speculax.LogitsStep()(
            jnp.zeros((2, 1), jnp.int32),
            logits[:, :1],
            logits,
            key=jax.random.key(0),
            **keywords,
        )
    with pytest.raises(error, match=message):
        speculax.probs_from_logits(logits, **keywords)


@pytest.mark.parametrize(
    "keywords, message",
    [
        ({"temperature": "1"}, "temperature must be a number; got '1'"),
        ({"top_p": "0.9"}, "top_p must be a number; got '0.9'"),
        ({"top_p": [0.5, None]}, "top_p must be a number or an array of numbers"),
    ],
)
def test_parameters_that_are_not_numbers_are_named(
    keywords, message, without_runtime_type_checks
):
    logits = jnp.zeros((2, 2, 5))
    with pytest.raises(TypeError, match=message):
        speculax.probs_from_logits(logits, **keywords)


def test_logits_of_the_wrong_structure_are_named():
    with pytest.raises(
        ValueError, match=r"target_logits must have shape \(B, G \+ 1, V\)"
    ):
        speculax.LogitsStep()(
            jnp.zeros((2, 1), jnp.int32),
            jnp.zeros((2, 1, 5)),
            jnp.zeros((2, 1, 5)),
            key=jax.random.key(0),
        )
    with pytest.raises(TypeError, match="draft_logits must have a floating-point"):
        speculax.LogitsStep()(
            jnp.zeros((2, 1), jnp.int32),
            jnp.zeros((2, 1, 5), jnp.int32),
            jnp.zeros((2, 2, 5)),
            key=jax.random.key(0),
        )


# --- Memory ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_no_probability_array_is_made(dtype):
    """Compiled from shapes alone at a real vocabulary, the parameters traced (one
    program for every mix): the temporaries stay within four (B, V) float32 rows,
    less than one (B, G, V) array of probabilities."""
    batch, num_draft, vocab = 8, 5, 128256
    step = jax.jit(
        lambda tokens, draft, target, u, s, t, k, p: speculax.LogitsStep()(
            tokens, draft, target, u, s, temperature=t, top_k=k, top_p=p
        )
    )
    shapes = (
        jax.ShapeDtypeStruct((batch, num_draft), jnp.int32),
        jax.ShapeDtypeStruct((batch, num_draft, vocab), dtype),
        jax.ShapeDtypeStruct((batch, num_draft + 1, vocab), dtype),
        jax.ShapeDtypeStruct((batch, num_draft), jnp.float32),
        jax.ShapeDtypeStruct((batch,), jnp.float32),
        jax.ShapeDtypeStruct((batch,), jnp.float32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.float32),
    )
    memory = step.lower(*shapes).compile().memory_analysis()
    row = batch * vocab * 4
    assert memory.temp_size_in_bytes <= 4 * row + 2**20
    assert memory.temp_size_in_bytes < batch * num_draft * vocab * 4


# --- The distribution of the jitted step --------------------------------------------

STAT_SAMPLES = 40_000
STAT_VOCAB = 8
STAT_PARAMETERS = {"temperature": 0.8, "top_k": 6, "top_p": 0.9}


def _stat_logits() -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(11)
    target = jnp.asarray(rng.standard_normal((3, STAT_VOCAB)), jnp.float32)
    draft = jnp.asarray(
        target[:2] + 0.8 * rng.standard_normal((2, STAT_VOCAB)), jnp.float32
    )
    return draft, target


@eqx.filter_jit
def _sample_steps(key, draft_logits, target_logits, drafting):
    """The jitted step on STAT_SAMPLES rows, the drafts drawn from `drafting`."""
    token_key, step_key = jax.random.split(key)
    tokens = jax.random.categorical(
        token_key, jnp.log(drafting), shape=(STAT_SAMPLES, 2)
    )
    shape = (STAT_SAMPLES, *target_logits.shape)
    return speculax.LogitsStep()(
        tokens,
        jnp.broadcast_to(draft_logits, (STAT_SAMPLES, *draft_logits.shape)),
        jnp.broadcast_to(target_logits, shape),
        temperature=jnp.full((STAT_SAMPLES,), STAT_PARAMETERS["temperature"]),
        top_k=jnp.full((STAT_SAMPLES,), STAT_PARAMETERS["top_k"]),
        top_p=jnp.full((STAT_SAMPLES,), STAT_PARAMETERS["top_p"]),
        key=step_key,
    )


def _first_token_statistic(out, target_probs) -> float:
    first = np.asarray(out["tokens"])[:, 0]
    observed = np.bincount(first, minlength=STAT_VOCAB)
    expected = STAT_SAMPLES * np.asarray(target_probs[0], np.float64)
    kept = expected > 0
    assert observed[~kept].sum() == 0
    return float(np.sum((observed[kept] - expected[kept]) ** 2 / expected[kept]))


@pytest.mark.slow
def test_the_jitted_step_samples_the_truncated_target():
    """Chi-square of the first output token against p_0 under the parameters; the
    drafts drawn from the truncated drafts, as they must be."""
    draft, target = _stat_logits()
    target_probs = speculax.probs_from_logits(target, **STAT_PARAMETERS)
    drafting = speculax.probs_from_logits(draft, **STAT_PARAMETERS)
    out = _sample_steps(jax.random.key(0), draft, target, drafting)
    first = np.asarray(out["tokens"])[:, 0]
    assert np.all(np.asarray(target_probs[0])[first] > 0)
    kept = int(np.sum(np.asarray(target_probs[0]) > 0))
    statistic = _first_token_statistic(out, target_probs)
    assert chi_square_sf(statistic, kept - 1) > 1e-3
    assert np.asarray(out["num_accepted"]).mean() > 0.3


@pytest.mark.slow
def test_drafting_from_the_untruncated_softmax_is_caught():
    """The negative control, and the bug the docs warn about: drafts sampled at the
    temperature alone, verified against truncated drafts."""
    draft, target = _stat_logits()
    target_probs = speculax.probs_from_logits(target, **STAT_PARAMETERS)
    untruncated = speculax.probs_from_logits(
        draft, temperature=STAT_PARAMETERS["temperature"]
    )
    out = _sample_steps(jax.random.key(0), draft, target, untruncated)
    kept = int(np.sum(np.asarray(target_probs[0]) > 0))
    assert chi_square_sf(_first_token_statistic(out, target_probs), kept - 1) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_probabilities_from_logits_compose_losslessly(seed):
    """Exactly: drafts from the truncated q, the default step, the truncated p."""
    rng = np.random.default_rng(seed)
    parameters = {"temperature": 0.7, "top_k": 4, "top_p": 0.85}
    q, p = (
        np.asarray(speculax.probs_from_logits(jnp.asarray(logits), **parameters))
        for logits in (rng.standard_normal((2, 5)), rng.standard_normal((3, 5)))
    )
    # Renormalised in float64: the float32 rows sum to 1 only within rounding.
    q, p = (x / x.sum(-1, keepdims=True, dtype=np.float64) for x in (q, p))
    assert (q == 0).any() and (p == 0).any()
    error = speculax.testing.lossless_error(speculax.SpeculativeStep(), q, p)
    assert error < 1e-12


# --- The token-major layout ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("bonus", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_token_major_round_trip_with_empty_requests(bonus, seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 4, 6)
    lengths[rng.integers(0, 6)] = 0
    rows = int(lengths.sum()) + bonus * 6
    flat = jnp.asarray(rng.standard_normal((rows + 2, 3)), jnp.float32)
    convert = jax.jit(
        lambda values, lengths: speculax.from_token_major(
            values, lengths, num_draft=3, bonus=bonus, fill=-7.0
        )
    )
    padded = convert(flat, jnp.asarray(lengths, jnp.int32))
    assert padded.shape == (6, 3 + bonus, 3)
    start = 0
    for b, g in enumerate(lengths + bonus):
        np.testing.assert_array_equal(padded[b, :g], flat[start : start + g])
        assert (padded[b, g:] == -7.0).all()
        start += g
    back = speculax.to_token_major(
        padded, jnp.asarray(lengths), num_tokens=rows + 2, bonus=bonus, fill=0.0
    )
    np.testing.assert_array_equal(back[:rows], flat[:rows])
    assert (back[rows:] == 0).all()


def test_token_major_feeds_the_step():
    """Engines' flattened drafts and logits, converted, give the padded answer."""
    batch = _mixed_batch(8, "float32", "sampled", True)
    lengths = batch["num_draft_tokens"]
    flat_tokens = speculax.to_token_major(batch["draft_tokens"], lengths, num_tokens=30)
    flat_draft = speculax.to_token_major(batch["draft_logits"], lengths, num_tokens=30)
    flat_target = speculax.to_token_major(
        batch["target_logits"], lengths, num_tokens=40, bonus=True
    )
    converted = {
        **batch,
        "draft_tokens": speculax.from_token_major(flat_tokens, lengths, num_draft=3),
        "draft_logits": speculax.from_token_major(flat_draft, lengths, num_draft=3),
        "target_logits": speculax.from_token_major(
            flat_target, lengths, num_draft=3, bonus=True
        ),
    }
    out = _run(_logits_step, batch)
    assert _run(_logits_step, converted)["tokens"].tolist() == out["tokens"].tolist()


@pytest.mark.parametrize("bonus", [False, True])
def test_token_major_round_trip_without_draft_positions(bonus):
    """G = 0: every length is 0, and each request has its bonus row or nothing;
    under jit the checks on the lengths stay, with nothing to gather."""
    lengths = jnp.zeros(3, jnp.int32)
    flat = jnp.arange(3.0 * bonus + 2)
    padded = speculax.from_token_major(flat, lengths, num_draft=0, bonus=bonus)
    assert padded.shape == (3, int(bonus))
    back = eqx.filter_jit(
        lambda padded, lengths: speculax.to_token_major(
            padded, lengths, num_tokens=5, bonus=bonus, fill=-1.0
        )
    )
    expected = [0.0, 1.0, 2.0] * bonus + [-1.0] * (5 - 3 * bonus)
    assert back(padded, lengths).tolist() == expected
    with pytest.raises(RuntimeError, match=r"num_draft_tokens must lie in \[0, 0\]"):
        jax.block_until_ready(back(padded, jnp.array([0, 1, 0])))


def test_token_major_checks_lengths_with_no_values_under_jit():
    convert = eqx.filter_jit(
        lambda values, lengths: speculax.from_token_major(values, lengths, num_draft=2)
    )
    assert convert(jnp.zeros(0), jnp.array([0, 0])).tolist() == [[0, 0], [0, 0]]
    with pytest.raises(RuntimeError, match=r"num_draft_tokens must lie in \[0, 2\]"):
        jax.block_until_ready(convert(jnp.zeros(0), jnp.array([3, 0])))
    with pytest.raises(RuntimeError, match="needs more rows than values has"):
        jax.block_until_ready(convert(jnp.zeros(0), jnp.array([1, 0])))


def test_token_major_reads_lengths_and_sizes_by_value():
    """A NumPy int64 length beyond int32 is out of range, not wrapped to a small
    one; sizes may be NumPy integers, never floats."""
    flat = jnp.arange(5.0)
    with pytest.raises(RuntimeError, match=r"num_draft_tokens must lie in \[0, 2\]"):
        speculax.from_token_major(flat, np.array([2**32 + 1, 0]), num_draft=2)
    with pytest.raises(RuntimeError, match=r"num_draft_tokens must lie in \[0, 2\]"):
        speculax.to_token_major(
            jnp.zeros((2, 2)), np.array([0, 2**32]), num_tokens=np.int64(4)
        )
    padded = speculax.from_token_major(flat, [2, 1], num_draft=np.uint8(2))
    assert padded.tolist() == [[0.0, 1.0], [2.0, 0.0]]
    for keywords in ({"num_draft": 2.0}, {"num_draft": True}):
        with pytest.raises(TypeError, match="num_draft"):
            speculax.from_token_major(flat, [2, 1], **keywords)
    with pytest.raises(ValueError, match="num_tokens must be non-negative"):
        speculax.to_token_major(jnp.zeros((2, 2)), [0, 0], num_tokens=-1)


def test_token_major_rejects_lengths_that_do_not_fit():
    with pytest.raises(RuntimeError, match=r"num_draft_tokens must lie in \[0, 2\]"):
        speculax.from_token_major(jnp.zeros(5), jnp.array([3, 0]), num_draft=2)
    with pytest.raises(RuntimeError, match="needs more rows than values has"):
        speculax.from_token_major(jnp.zeros(3), jnp.array([2, 2]), num_draft=2)
    with pytest.raises(RuntimeError, match="needs more rows than num_tokens"):
        speculax.to_token_major(jnp.zeros((2, 2)), jnp.array([2, 2]), num_tokens=3)
    with pytest.raises(TypeError, match="num_draft_tokens must have an integer dtype"):
        speculax.from_token_major(jnp.zeros(3), jnp.array([1.0]), num_draft=2)
    with pytest.raises(ValueError, match=r"num_draft_tokens must have shape \(B,\)"):
        speculax.from_token_major(jnp.zeros(3), jnp.array([[1]]), num_draft=2)


def test_both_row_strategies_sum_the_groups_kept_as_the_whole_blocks():
    """One row at a time, a row of more than 2048 tokens sums its masses over the
    groups of 16 tokens that can hold a kept token, each placed where it lies in its
    block; all at once, over whole blocks. Where a block keeps many of its groups
    (a loose top-$p$ on flat rows), the two must still agree bit for bit."""
    logits = 1.3 * jax.random.normal(jax.random.key(1), (4, 4133))
    parameters = {
        "temperature": jnp.array([1.0, 0.7, 1.3, 1.0]),
        "top_k": jnp.array([0, 3000, 0, 50], jnp.int32),
        "top_p": jnp.array([0.97, 0.99, 0.999, 1.0]),
    }
    rows = {}
    for strategy in ("one at a time", "all at once"):
        with speculax.row_strategy(strategy):
            rows[strategy] = jax.jit(speculax.probs_from_logits)(logits, **parameters)
    np.testing.assert_array_equal(rows["one at a time"], rows["all at once"])
