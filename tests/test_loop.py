"""The speculative sampling loop: lossless over many steps, exactly (by enumeration)
and statistically (the jitted loop), with its key discipline, finished rows, batch
invariance and bad input."""

import functools
import itertools
from typing import ClassVar, final

import equinox as eqx
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from jaxtyping import Array, Float, Int
from scipy import stats

import speculax
import speculax.testing
from inputs import ALL_INTEGER_DTYPES


@final
class MarkovModel(eqx.Module):
    """A model whose next token depends on the last `context` tokens only (the first
    token standing in for those before the start), through a table of logits."""

    logits: Float[np.ndarray, "contexts vocab"]
    context: int = eqx.field(static=True)

    def __call__(
        self, tokens: Int[Array, "batch time"], positions: Int[Array, "batch k"]
    ) -> Float[Array, "batch k vocab"]:
        vocab = self.logits.shape[-1]
        row = jnp.zeros(positions.shape, jnp.int32)
        for back in range(self.context):
            earlier = jnp.maximum(positions - back, 0)
            row = row * vocab + jnp.take_along_axis(tokens, earlier, axis=1)
        return jnp.asarray(self.logits)[row]


def markov_pair(vocab: int, context: int, seed: int) -> tuple[MarkovModel, MarkovModel]:
    """A draft and a target model with random tables, in float64 so that the exact
    enumeration sees exact probabilities; some transitions of each are impossible."""
    rng = np.random.default_rng(seed)
    models = []
    for _ in range(2):
        probs = rng.dirichlet(np.ones(vocab), size=vocab**context)
        probs[rng.random(probs.shape) < 0.1] = 0
        probs[:, 0] += 0.05  # no row without mass
        with np.errstate(divide="ignore"):
            models.append(
                MarkovModel(np.log(probs / probs.sum(-1, keepdims=True)), context)
            )
    return models[0], models[1]


def close_pair(dtype: type) -> tuple[MarkovModel, MarkovModel]:
    """A bigram draft close to its bigram target on four tokens, with logits of
    `dtype`. The close draft leaves little residual mass, and so shows any mismatch
    between the rows the draft is drawn from and the rows the step reads. A loop
    that took its softmax in half precision, drawing each draft from the normalised
    row and giving the step the row as it was, moved the law of the first two
    tokens of these models far beyond sampling error: over 200,000 rows, chi-square
    p-values of 1e-45 (bfloat16) and 1e-11 (float16)."""
    rng = np.random.default_rng(3)
    target = 2 * rng.normal(size=(4, 4))
    draft = target + 0.05 * rng.normal(size=(4, 4))
    return MarkovModel(draft.astype(dtype), 1), MarkovModel(target.astype(dtype), 1)


def float64_softmax(logits: np.ndarray) -> np.ndarray:
    """The softmax of the logits' values, in float64: for half-precision logits, the
    target's distribution that the loop must sample."""
    logits = logits.astype(np.float64)
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True)


SLOW = pytest.mark.slow
# float16 is the extended tier: bfloat16, the narrower mantissa, is the default.
HALF_PRECISION = pytest.mark.parametrize(
    "dtype",
    [jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.slow)],
    ids=["bfloat16", "float16"],
)


@final
class ReusedAcrossSteps(speculax.AbstractKeySchedule):
    """A wrong schedule: the same keys in every step."""

    def __call__(self, row_key, step, stream, position):
        fold_in = jax.random.fold_in
        return fold_in(fold_in(row_key, stream), position)


@final
class DraftNoiseIsAcceptNoise(speculax.AbstractKeySchedule):
    """A wrong schedule: draft token i drawn with the uniform of test i."""

    def __call__(self, row_key, step, stream, position):
        stream = jnp.where(stream == speculax.DRAFT, speculax.ACCEPT, stream)
        return speculax.FoldInKeys()(row_key, step, stream, position)


@pytest.mark.parametrize(
    ("vocab", "context", "num_draft", "max_new_tokens", "end_token", "step"),
    [
        # The longest enumerations are the extended tier.
        pytest.param(3, 2, 2, 5, None, speculax.SpeculativeStep(), marks=SLOW),
        # Several end tokens, as serving engines stop at any of several ids: one
        # is a special case.
        (4, 1, 2, 5, (1, 2), speculax.SpeculativeStep()),
        pytest.param(3, 1, 2, 5, 2, speculax.SpeculativeStep(), marks=SLOW),
        pytest.param(3, 1, 2, 6, 2, speculax.SpeculativeStep(), marks=SLOW),
        pytest.param(3, 1, 3, 4, 1, speculax.SpeculativeStep(), marks=SLOW),
        pytest.param(5, 1, 1, 4, None, speculax.SpeculativeStep(), marks=SLOW),
        pytest.param(3, 2, 0, 4, None, speculax.SpeculativeStep(), marks=SLOW),
        pytest.param(3, 1, 2, 5, 0, speculax.block_step(), marks=SLOW),
    ],
    ids=[
        "V3 C2 G2",
        "V4 C1 G2 two ends",
        "V3 C1 G2 end",
        "V3 C1 G2 end 6 tokens",
        "V3 G3 end",
        "V5 G1",
        "G0",
        "block",
    ],
)
def test_loop_is_lossless_exactly(
    vocab, context, num_draft, max_new_tokens, end_token, step
):
    draft, target = markov_pair(vocab, context, seed=vocab + context + num_draft)
    loop = speculax.SpeculativeLoop(
        num_draft=num_draft,
        max_new_tokens=max_new_tokens,
        end_token=end_token,
        step=step,
    )
    expected = speculax.testing.target_output_distribution(
        target, [1, 0], max_new_tokens, end_token
    )
    # Not vacuous: many sequences, some of them ended early.
    assert sum(expected.values()) == pytest.approx(1, abs=1e-12)
    assert len(expected) > vocab**3
    if end_token is not None:
        # Sequences cut short by each end token.
        ends = {tokens[-1] for tokens in expected if len(tokens) < max_new_tokens}
        assert ends == set(np.atleast_1d(end_token).tolist())
    assert speculax.testing.loop_lossless_error(loop, draft, target, [1, 0]) < 1e-12


# The default tier samples half-precision logits with the jitted loop below.
@SLOW
@HALF_PRECISION
def test_loop_is_lossless_exactly_with_half_precision_logits(dtype):
    draft, target = close_pair(dtype)
    # Not vacuous: a softmax in the models' own dtype has rows that miss 1.
    for model in (draft, target):
        rows = jax.nn.softmax(jnp.asarray(model.logits), axis=-1)
        assert np.abs(np.asarray(rows, np.float64).sum(-1) - 1).max() > 1e-4
    # The target's distribution is the softmax of its half-precision logits' values.
    expected = speculax.testing.target_output_distribution(target, [1, 0], 1)
    first = float64_softmax(target.logits)[0]
    assert [expected[(token,)] for token in range(4)] == pytest.approx(first, abs=1e-15)
    loop = speculax.SpeculativeLoop(num_draft=2, max_new_tokens=3, end_token=1)
    assert speculax.testing.loop_lossless_error(loop, draft, target, [1, 0]) < 1e-12


@pytest.mark.slow
@pytest.mark.parametrize(
    "keys", [ReusedAcrossSteps(), DraftNoiseIsAcceptNoise()], ids=["steps", "streams"]
)
def test_exact_test_catches_reused_random_numbers(keys):
    # The models and sizes of the first lossless case, "V3 C2 G2".
    draft, target = markov_pair(3, 2, seed=7)
    wrong = speculax.SpeculativeLoop(num_draft=2, max_new_tokens=5, key_schedule=keys)
    assert speculax.testing.loop_lossless_error(wrong, draft, target, [1, 0]) > 0.01


def test_exact_test_catches_a_lossy_step():
    draft, target = markov_pair(3, 2, seed=7)
    lossy = speculax.SpeculativeLoop(
        num_draft=2,
        max_new_tokens=5,
        step=speculax.SpeculativeStep(speculax.TypicalAcceptance()),
    )
    assert speculax.testing.loop_lossless_error(lossy, draft, target, [1, 0]) > 0.01


@final
class ReversedInverseCDF(speculax.AbstractSampler):
    """Inverse CDF read from the other end, with $1 - s$: as exact as inverse CDF,
    with every token's cell of s elsewhere than in the vocabulary's index order."""

    reads_uniforms: ClassVar[bool] = True
    axis_name: None = None

    def __call__(self, weights, sample_uniforms):
        return speculax.InverseCDF()(weights, jnp.nextafter(1.0, 0.0) - sample_uniforms)


@pytest.mark.slow
def test_exact_test_handles_a_sampler_in_another_order():
    # The enumeration finds the cells of s from the sampler itself, wherever they
    # lie; samplers it cannot evaluate are in tests/test_testing.py.
    draft, target = markov_pair(3, 2, seed=7)
    loop = speculax.SpeculativeLoop(
        num_draft=2,
        max_new_tokens=5,
        step=speculax.SpeculativeStep(sampler=ReversedInverseCDF()),
    )
    assert speculax.testing.loop_lossless_error(loop, draft, target, [1, 0]) < 1e-12


@pytest.mark.slow
def test_greedy_loop_is_greedy_decoding():
    draft, target = markov_pair(4, 1, seed=3)
    loop = speculax.SpeculativeLoop(
        num_draft=2, max_new_tokens=5, step=speculax.greedy_step()
    )
    history = [2]
    for _ in range(5):
        logits = target(jnp.array([history]), jnp.array([[len(history) - 1]]))
        history.append(int(jnp.argmax(logits[0, 0])))
    greedy = tuple(history[1:])
    assert speculax.testing.loop_output_distribution(loop, draft, target, [2]) == {
        greedy: pytest.approx(1, abs=1e-12)
    }
    out = loop(draft, target, jnp.array([[2]]), key=jax.random.key(0))
    assert tuple(out["tokens"][0].tolist()) == greedy


# The statistical test runs the real jitted loop, keys and all, on many rows.
NUM_ROWS = 20_000
STAT_TOKENS = 4


def sequence_counts(loop, draft, target) -> tuple[np.ndarray, np.ndarray]:
    """Observed and exact expected counts of the generated sequences over NUM_ROWS
    rows with the same prompt, `pooled`."""
    prompt = jnp.broadcast_to(jnp.array([1, 0]), (NUM_ROWS, 2))
    out = loop(draft, target, prompt, key=jax.random.split(jax.random.key(5), NUM_ROWS))
    tokens, lengths = np.asarray(out["tokens"]), np.asarray(out["num_tokens"])
    seen: dict[tuple[int, ...], int] = {}
    for row, length in zip(tokens, lengths, strict=True):
        sequence = tuple(row[:length].tolist())
        seen[sequence] = seen.get(sequence, 0) + 1
    exact = speculax.testing.target_output_distribution(
        target, [1, 0], STAT_TOKENS, loop.end_token
    )
    assert set(seen) <= set(exact)
    return pooled(
        [seen.get(sequence, 0) for sequence in exact],
        [probability * NUM_ROWS for probability in exact.values()],
    )


def pooled(observed, expected) -> tuple[np.ndarray, np.ndarray]:
    """The cells of a chi-square test expected at least 5 times, then one cell that
    pools the others, if any."""
    observed, expected = np.asarray(observed), np.asarray(expected)
    rare = expected < 5
    if not rare.any():
        return observed, expected
    return (
        np.append(observed[~rare], observed[rare].sum()),
        np.append(expected[~rare], expected[rare].sum()),
    )


@pytest.mark.parametrize(
    ("keys", "lossless"),
    [
        (speculax.FoldInKeys(), True),
        pytest.param(DraftNoiseIsAcceptNoise(), False, marks=SLOW),
    ],
    ids=["default keys", "draft noise reused"],
)
def test_jitted_loop_samples_the_target(keys, lossless):
    draft, target = markov_pair(3, 1, seed=11)
    loop = speculax.SpeculativeLoop(
        num_draft=3, max_new_tokens=STAT_TOKENS, end_token=2, key_schedule=keys
    )
    observed, expected = sequence_counts(loop, draft, target)
    assert len(observed) > 15
    p_value = stats.chisquare(observed, expected).pvalue
    if lossless:
        assert p_value > 1e-3
    else:
        assert p_value < 1e-6


HALF_PRECISION_ROWS = 200_000


@HALF_PRECISION
def test_jitted_loop_samples_the_target_with_half_precision_logits(dtype):
    # The real jitted loop without x64, in float32: the first two tokens of each
    # row against the target's law, each from the float64 softmax of its table.
    draft, target = close_pair(dtype)
    loop = speculax.SpeculativeLoop(num_draft=3, max_new_tokens=2)
    rows = HALF_PRECISION_ROWS
    prompt = jnp.broadcast_to(jnp.array([1, 0]), (rows, 2))
    out = loop(draft, target, prompt, key=jax.random.split(jax.random.key(5), rows))
    tokens = np.asarray(out["tokens"])
    probs = float64_softmax(target.logits)
    observed, expected = pooled(
        np.bincount(tokens[:, 0] * 4 + tokens[:, 1], minlength=16),
        rows * (probs[0][:, None] * probs).ravel(),
    )
    assert len(observed) > 10
    assert stats.chisquare(observed, expected).pvalue > 1e-3


def test_default_keys_are_never_reused():
    loop = speculax.SpeculativeLoop(num_draft=3, max_new_tokens=6)
    row_keys = jax.random.split(jax.random.key(0), 4)
    seen = set()
    for row_key, step in itertools.product(row_keys, range(6)):
        for stream, count in ((speculax.DRAFT, 3), (speculax.ACCEPT, 3)):
            for position in range(count):
                key = loop.key_schedule(
                    row_key, jnp.int32(step), jnp.int32(stream), jnp.int32(position)
                )
                seen.add(tuple(np.asarray(jax.random.key_data(key)).tolist()))
        key = loop.key_schedule(
            row_key, jnp.int32(step), jnp.int32(speculax.SAMPLE), jnp.int32(0)
        )
        seen.add(tuple(np.asarray(jax.random.key_data(key)).tolist()))
    assert len(seen) == 4 * 6 * 7


# The loop draws all of a step's uniforms in one call of the schedule, and splits
# them by stream: each must still read its own keys, with no drafts too, and for a
# tree one per node.
@pytest.mark.parametrize(
    "loop",
    [
        speculax.SpeculativeLoop(num_draft=0, max_new_tokens=3),
        speculax.SpeculativeLoop(num_draft=2, max_new_tokens=3),
        speculax.SpeculativeLoop(
            draft_tree=speculax.DraftTree((0, 0, 1, 2), drafting="independent"),
            max_new_tokens=3,
            step=speculax.TreeStep(),
        ),
    ],
    ids=["no drafts", "chain", "tree"],
)
def test_uniforms_are_drawn_from_the_schedule(loop):
    row_keys = jax.random.split(jax.random.key(1), 3)
    draft, accept, sample = loop.uniforms(row_keys, jnp.int32(4))
    assert draft.shape == accept.shape == (3, loop.num_nodes)
    assert sample.shape == (3,)
    fold_in = jax.random.fold_in
    for row, row_key in enumerate(row_keys):
        for stream, values in ((speculax.DRAFT, draft), (speculax.ACCEPT, accept)):
            for i in range(loop.num_nodes):
                key = fold_in(fold_in(fold_in(row_key, 4), stream), i)
                assert values[row, i] == jax.random.uniform(key)
        key = fold_in(fold_in(fold_in(row_key, 4), speculax.SAMPLE), 0)
        assert sample[row] == jax.random.uniform(key)


def check_rows(out, loop: speculax.SpeculativeLoop) -> None:
    """What every row of any output satisfies."""
    tokens, num_tokens = np.asarray(out["tokens"]), np.asarray(out["num_tokens"])
    num_steps, accepted = np.asarray(out["num_steps"]), np.asarray(out["num_accepted"])
    assert int(out["num_target_calls"]) == num_steps.max()
    for row in range(tokens.shape[0]):
        n = num_tokens[row]
        assert 1 <= n <= loop.max_new_tokens
        assert (tokens[row, :n] >= 0).all() and (tokens[row, n:] == -1).all()
        if loop.end_token is not None:
            ends = np.flatnonzero(tokens[row, :n] == loop.end_token)
            assert ends.size == 0 or ends.tolist() == [n - 1]
            assert ends.size == 1 or n == loop.max_new_tokens
        steps = num_steps[row]
        assert (accepted[row, :steps] >= 0).all() and (
            accepted[row, steps:] == -1
        ).all()
        # Each step gives its kept drafts and one more token; the last may be cut.
        given = accepted[row, :steps] + 1
        assert given[:-1].sum() < n <= given.sum()


def test_rows_finish_at_different_steps():
    draft, target = markov_pair(5, 1, seed=2)
    loop = speculax.SpeculativeLoop(num_draft=2, max_new_tokens=12, end_token=4)
    prompt = jnp.array([[0, 1, 2], [3, 3, 3], [1, 1, 0], [2, 0, 4], [4, 2, 1]] * 4)
    out = loop(draft, target, prompt, key=jax.random.key(3))
    check_rows(out, loop)
    num_tokens, num_steps = np.asarray(out["num_tokens"]), np.asarray(out["num_steps"])
    assert len(set(num_steps.tolist())) > 2
    assert (num_tokens < 12).any() and (num_tokens == 12).any()


@pytest.mark.slow
def test_row_is_batch_invariant_bit_for_bit():
    draft, target = markov_pair(5, 2, seed=4)
    loop = speculax.SpeculativeLoop(num_draft=3, max_new_tokens=10, end_token=0)
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, 5, (6, 4)), jnp.int32)
    lengths = jnp.array([4, 1, 2, 4, 3, 2])
    keys = jax.random.split(jax.random.key(9), 6)
    together = loop(draft, target, prompt, key=keys, prompt_lengths=lengths)
    check_rows(together, loop)
    for row in (1, 4):
        alone = loop(
            draft,
            target,
            prompt[row : row + 1, : int(lengths[row])],
            key=keys[row : row + 1],
        )
        for name in ("tokens", "num_tokens", "num_steps", "num_accepted"):
            assert (alone[name][0] == together[name][row]).all(), name


def test_draft_equal_to_target_keeps_every_draft():
    _, target = markov_pair(4, 1, seed=5)
    loop = speculax.SpeculativeLoop(num_draft=3, max_new_tokens=12)
    out = loop(target, target, jnp.zeros((8, 1), jnp.int32), key=jax.random.key(0))
    check_rows(out, loop)
    assert (np.asarray(out["num_accepted"])[:, :3] == 3).all()
    assert int(out["num_target_calls"]) == 3


def test_one_compilation_for_new_prompts_and_keys():
    traces = []

    def model(tokens, positions):
        traces.append(None)
        return jnp.zeros((*positions.shape, 3))

    loop = speculax.SpeculativeLoop(num_draft=2, max_new_tokens=4)
    loop(model, model, jnp.zeros((2, 3), jnp.int32), key=jax.random.key(0))
    traced = len(traces)
    assert traced > 0
    for seed in (1, 2):
        loop(model, model, jnp.full((2, 3), seed), key=jax.random.key(seed))
    assert len(traces) == traced


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"num_draft": -1}, ValueError, "num_draft must be non-negative"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be positive"),
        ({"end_token": -2}, ValueError, "end_token must be non-negative"),
        (
            {"step": speculax.SpeculativeStep(throw=False)},
            ValueError,
            r"check_values=True, throw=True",
        ),
        (
            {"step": speculax.SpeculativeStep(check_values=False)},
            ValueError,
            r"check_values=True, throw=True",
        ),
    ],
)
def test_bad_construction(arguments, error, match):
    with pytest.raises(error, match=match):
        speculax.SpeculativeLoop(**{"num_draft": 2, "max_new_tokens": 4, **arguments})


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ({"num_draft": 2.0}, "num_draft must be an integer; got 2.0"),
        ({"max_new_tokens": True}, "max_new_tokens must be an integer; got True"),
        ({"end_token": 1.5}, "end_token must be an integer; got 1.5"),
    ],
)
def test_static_integers_refuse_other_types(arguments, match, monkeypatch):
    """Without runtime type checking (the users' default) a float or a bool would
    run as a number; the loop's own check names it."""
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    with pytest.raises(TypeError, match=match):
        speculax.SpeculativeLoop(**{"num_draft": 2, "max_new_tokens": 4, **arguments})


def test_static_integers_are_read_by_value(monkeypatch):
    """NumPy integers, which runtime type checking refuses for an `int`, run by
    value without it."""
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    draft, target = markov_pair(3, 1, seed=0)
    prompt, key = jnp.array([[0, 1]]), jax.random.key(5)
    plain = speculax.SpeculativeLoop(num_draft=2, max_new_tokens=4, end_token=2)
    numpy = speculax.SpeculativeLoop(
        num_draft=np.int64(2), max_new_tokens=np.uint8(4), end_token=np.int16(2)
    )
    np.testing.assert_array_equal(
        plain(draft, target, prompt, key=key)["tokens"],
        numpy(draft, target, prompt, key=key)["tokens"],
    )


@pytest.mark.parametrize(
    "step",
    [speculax.TreeStep(), speculax.TraversalStep()],
    ids=["TreeStep", "TraversalStep"],
)
def test_loop_refuses_a_step_it_cannot_run(step, monkeypatch):
    # With runtime type checking, as in this suite, jaxtyping's message names step.
    with pytest.raises(TypeError, match="step"):
        speculax.SpeculativeLoop(num_draft=2, max_new_tokens=4, step=step)
    # Without it, a user's default, the loop's own check does, before any call.
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    match = rf"step must be a speculax\.SpeculativeStep.*got a {type(step).__name__}"
    with pytest.raises(TypeError, match=match):
        speculax.SpeculativeLoop(num_draft=2, max_new_tokens=4, step=step)


@pytest.mark.parametrize(
    ("prompt", "kwargs", "error", "match"),
    [
        (np.zeros((2,), np.int32), {}, ValueError, "prompt must have shape"),
        (np.zeros((2, 0), np.int32), {}, ValueError, "prompt must have shape"),
        (np.zeros((2, 3), np.float32), {}, TypeError, "prompt must be an integer"),
        (
            np.zeros((2, 3), np.int32),
            {"prompt_lengths": np.array([1.0, 2.0])},
            TypeError,
            "prompt_lengths must be an integer",
        ),
        (
            np.zeros((2, 3), np.int32),
            {"prompt_lengths": np.array([1, 2, 3])},
            ValueError,
            r"prompt_lengths must have shape \(2,\)",
        ),
        (
            np.zeros((2, 3), np.int32),
            {"prompt_lengths": np.array([1, 4])},
            RuntimeError,
            r"prompt_lengths must lie in \[1, P\]",
        ),
        (
            np.zeros((2, 3), np.int32),
            {"prompt_lengths": np.array([0, 2])},
            RuntimeError,
            r"prompt_lengths must lie in \[1, P\]",
        ),
        (
            np.array([[0, 1, 3], [0, 1, 2]]),
            {},
            RuntimeError,
            r"prompt tokens must lie in \[0, V\) = \[0, 3\)",
        ),
        (
            np.array([[0, 1, 2], [0, -1, 2]]),
            {},
            RuntimeError,
            r"prompt tokens must lie in \[0, V\)",
        ),
        (
            np.array([[0, 1, 2], [0, 1, 2**40]]),
            {},
            RuntimeError,
            r"prompt tokens must lie in \[0, V\)",
        ),
        # The message is jaxtyping's when runtime type checking is on, as here.
        (np.zeros((2, 3), np.int32), {"key": 0}, TypeError, "key"),
        (
            np.zeros((2, 3), np.int32),
            {"key": jax.random.split(jax.random.key(0), 3)},
            ValueError,
            r"one key per row, shape \(\) or \(2,\)",
        ),
    ],
)
def test_bad_input(prompt, kwargs, error, match):
    draft, target = markov_pair(3, 1, seed=0)
    loop = speculax.SpeculativeLoop(num_draft=2, max_new_tokens=3)
    with pytest.raises(error, match=match):
        loop(draft, target, prompt, **{"key": jax.random.key(0), **kwargs})


def test_end_token_outside_the_vocabulary():
    draft, target = markov_pair(3, 1, seed=0)
    loop = speculax.SpeculativeLoop(num_draft=2, max_new_tokens=3, end_token=3)
    with pytest.raises(ValueError, match=r"end_token must lie in \[0, V\) = \[0, 3\)"):
        loop(draft, target, jnp.zeros((1, 2), jnp.int32), key=jax.random.key(0))


def test_wide_prompt_tokens_are_not_wrapped_under_x64():
    draft, target = markov_pair(3, 1, seed=0)
    loop = speculax.SpeculativeLoop(num_draft=2, max_new_tokens=3)
    with jax.enable_x64(True):
        prompt = jnp.array([[0, 2**32 + 1]], jnp.int64)
        with pytest.raises(RuntimeError, match=r"prompt tokens must lie in \[0, V\)"):
            loop(draft, target, prompt, key=jax.random.key(0))
        lengths = jnp.array([2**32 + 2], jnp.int64)
        with pytest.raises(RuntimeError, match=r"prompt_lengths must lie in \[1, P\]"):
            loop(
                draft, target, prompt % 3, key=jax.random.key(0), prompt_lengths=lengths
            )


@pytest.mark.parametrize(
    "shape",
    [
        {"num_draft": 2},
        {"draft_tree": speculax.DraftTree((0, 0, 1), drafting="independent")},
    ],
    ids=["chain", "tree"],
)
def test_end_token_under_x64(shape):
    """x64 is a documented mode of the loop: the position of the end token, which
    JAX's argmax gives as int64 there, must not widen the loop's int32 lengths."""
    draft, target = markov_pair(3, 1, seed=0)
    step = {} if "num_draft" in shape else {"step": speculax.TreeStep()}
    loop = speculax.SpeculativeLoop(max_new_tokens=4, end_token=2, **shape, **step)
    with jax.enable_x64(True):
        out = loop(draft, target, jnp.zeros((2, 2), jnp.int32), key=jax.random.key(1))
    assert out["num_tokens"].dtype == jnp.int32
    for row, count in zip(
        out["tokens"].tolist(), out["num_tokens"].tolist(), strict=True
    ):
        assert 2 not in row[: count - 1], "a row runs on past its end token"
        assert row[count:] == [-1] * (4 - count)


def test_several_end_tokens_each_end_a_row():
    """Serving engines stop at any of several end-of-sequence ids (that the loop
    stays lossless is enumerated in `test_loop_is_lossless_exactly`)."""
    draft, target = markov_pair(3, 1, seed=6)
    loop = speculax.SpeculativeLoop(num_draft=2, max_new_tokens=4, end_token=[1, 2])
    assert loop.end_token == (1, 2) and loop.end_tokens == (1, 2)
    out = loop(draft, target, jnp.zeros((64, 1), jnp.int32), key=jax.random.key(3))
    for row, count in zip(
        out["tokens"].tolist(), out["num_tokens"].tolist(), strict=True
    ):
        assert not {1, 2} & set(row[: count - 1]), "a row runs on past an end token"
        assert count == 4 or row[count - 1] in (1, 2)
    with pytest.raises(ValueError, match="end_token must hold at least one token"):
        speculax.SpeculativeLoop(num_draft=2, max_new_tokens=4, end_token=())
    wide = speculax.SpeculativeLoop(num_draft=2, max_new_tokens=4, end_token=(1, 3))
    with pytest.raises(ValueError, match=r"end_token must lie in \[0, V\) = \[0, 3\)"):
        wide(draft, target, jnp.zeros((1, 1), jnp.int32), key=jax.random.key(0))


@pytest.mark.parametrize(
    "parameters",
    [{"temperature": 0.7}, {"top_k": 2}, {"temperature": jnp.array([0.0, 0.5])}],
    ids=["temperature", "top_k", "array"],
)
def test_a_greedy_step_asked_to_sample_is_refused(parameters):
    """Greedy verification decodes greedily whatever the drafts were sampled under:
    asked for a temperature, the loop would return greedy decoding silently."""
    draft, target = markov_pair(3, 1, seed=0)
    greedy = speculax.SpeculativeLoop(
        num_draft=2, max_new_tokens=2, step=speculax.greedy_step()
    )
    prompt = jnp.zeros((2, 1), jnp.int32)
    with pytest.raises(ValueError, match=r"greedy_step.* but the call gives"):
        greedy(draft, target, prompt, key=jax.random.key(0), **parameters)
    with pytest.raises(ValueError, match=r"greedy_step.* but the call gives"):
        greedy.start(draft, target, prompt, jnp.ones((2,), jnp.int32), **parameters)
    # Greedy parameters are what the step does.
    greedy(draft, target, prompt, key=jax.random.key(0), temperature=0)


def test_a_greedy_step_may_be_asked_to_sample_when_lossy_is_allowed():
    draft, target = markov_pair(3, 1, seed=0)
    lossy = speculax.SpeculativeLoop(
        num_draft=2, max_new_tokens=2, step=speculax.greedy_step(), allow_lossy=True
    )
    prompt = jnp.zeros((2, 1), jnp.int32)
    out = lossy(
        draft, target, prompt, key=jax.random.key(0), temperature=jnp.array([0, 0.5])
    )
    assert out["tokens"].shape == (2, 2)


@functools.cache
def _fuzz_loop() -> tuple:
    draft, target = markov_pair(3, 1, seed=4)
    return draft, target, speculax.SpeculativeLoop(num_draft=2, max_new_tokens=3)


@pytest.mark.slow
@hypothesis.settings(max_examples=40)
@hypothesis.given(
    dtype=st.sampled_from(ALL_INTEGER_DTYPES),
    as_jax=st.booleans(),
    x64=st.booleans(),
    tokens=st.lists(
        st.sampled_from([0, 1, 2, 3, 255, 2**16 + 1, 2**31, 2**32 + 1, -1, -129]),
        min_size=4,
        max_size=4,
    ),
    lengths=st.lists(st.sampled_from([1, 2, 0, 3, 2**32 + 2]), min_size=2, max_size=2),
)
def test_fuzz_integer_inputs_are_read_by_value(dtype, as_jax, x64, tokens, lengths):
    """Prompts and lengths of every integer dtype, NumPy or JAX, with and without
    x64: a value the dtype holds is read as that value, never wrapped, so the loop
    answers as for the same values in int32 or names the argument at fault."""
    info = np.iinfo(dtype)
    tokens = [t for t in tokens if info.min <= t <= info.max]
    lengths = [n for n in lengths if info.min <= n <= info.max]
    hypothesis.assume(len(tokens) == 4 and len(lengths) == 2)
    draft, target, loop = _fuzz_loop()
    prompt = np.array(tokens, dtype).reshape(2, 2)
    prompt_lengths = np.array(lengths, dtype)
    with jax.enable_x64(x64):
        given = (
            (jnp.asarray(prompt), jnp.asarray(prompt_lengths))
            if as_jax
            else (
                prompt,
                prompt_lengths,
            )
        )
        # A JAX array of a dtype JAX cannot hold (64-bit without x64) is narrowed by
        # JAX itself, before the loop sees it: only NumPy arrays reach it whole.
        hypothesis.assume(not as_jax or x64 or info.bits < 64)
        key = jax.random.key(1)
        in_range = [1 <= n <= 2 for n in lengths]
        used = [
            tokens[2 * row + i]
            for row in range(2)
            if in_range[row]
            for i in range(lengths[row])
        ]
        if not all(in_range):
            with pytest.raises(RuntimeError, match="prompt_lengths must lie in"):
                loop(draft, target, given[0], key=key, prompt_lengths=given[1])
        elif not all(0 <= t < 3 for t in used):
            with pytest.raises(RuntimeError, match="prompt tokens must lie in"):
                loop(draft, target, given[0], key=key, prompt_lengths=given[1])
        else:
            out = loop(draft, target, given[0], key=key, prompt_lengths=given[1])
            want = loop(
                draft,
                target,
                np.where(prompt < 3, prompt, 0).astype(np.int32),
                key=key,
                prompt_lengths=prompt_lengths.astype(np.int32),
            )
            np.testing.assert_array_equal(out["tokens"], want["tokens"])
