"""`speculax.testing` evaluates every piece it is given, the sampler included: a lossy
sampler is measured, a lossless one reading the vocabulary in another order is
handled, and one whose law it cannot find is refused with a message that names it.
Its chi-square test of the compiled step covers what the enumeration refuses."""

from typing import ClassVar, final

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, Float, Int
from scipy import stats

import speculax
import speculax.testing
from inputs import random_row
from test_loop import markov_pair
from test_trees import DRAFTS, TARGET, VOCAB


@final
class DropsToken(speculax.AbstractSampler):
    """Inverse CDF over the weights with token 1 taken out (unless it holds all the
    mass): its probability goes to the others, a lossy sampler."""

    reads_uniforms: ClassVar[bool] = True
    axis_name: None = None

    def __call__(
        self,
        weights: Float[Array, "batch vocab"],
        sample_uniforms: Float[Array, " batch"],
    ) -> Int[Array, " batch"]:
        dropped = weights.at[:, 1].set(0)
        keep = jnp.sum(dropped, axis=-1, keepdims=True) > 0
        return speculax.InverseCDF()(jnp.where(keep, dropped, weights), sample_uniforms)


@final
class ReversedVocabulary(speculax.AbstractSampler):
    """Inverse CDF over the vocabulary read from its last token to its first: as
    exact as inverse CDF, with every token's cell of s in another place."""

    reads_uniforms: ClassVar[bool] = True
    axis_name: None = None

    def __call__(
        self,
        weights: Float[Array, "batch vocab"],
        sample_uniforms: Float[Array, " batch"],
    ) -> Int[Array, " batch"]:
        flipped = speculax.InverseCDF()(weights[:, ::-1], sample_uniforms)
        return jnp.where(flipped >= 0, weights.shape[-1] - 1 - flipped, -1)


@final
class TwoSweeps(speculax.AbstractSampler):
    """Inverse CDF at 2s mod 1: exact too, but every token is drawn on two intervals
    of s, which the exact check cannot integrate."""

    reads_uniforms: ClassVar[bool] = True
    axis_name: None = None

    def __call__(
        self,
        weights: Float[Array, "batch vocab"],
        sample_uniforms: Float[Array, " batch"],
    ) -> Int[Array, " batch"]:
        twice = 2 * sample_uniforms
        return speculax.InverseCDF()(weights, jnp.where(twice >= 1, twice - 1, twice))


def chain(sampler: speculax.AbstractSampler) -> speculax.SpeculativeStep:
    return speculax.SpeculativeStep(sampler=sampler)


def small_loop(sampler: speculax.AbstractSampler) -> speculax.SpeculativeLoop:
    return speculax.SpeculativeLoop(
        num_draft=1, max_new_tokens=3, step=speculax.SpeculativeStep(sampler=sampler)
    )


def tree_error(sampler: speculax.AbstractSampler) -> float:
    return speculax.testing.tree_lossless_error(
        speculax.TreeStep(sampler=sampler),
        [0, 0, 0],
        TARGET,
        DRAFTS["random"],
        VOCAB,
        drafting="independent",
    )


LOOP_MODELS = markov_pair(3, 1, seed=2)


@pytest.mark.slow
def test_exact_check_measures_a_lossy_sampler():
    # With no drafts the output is the drawn token alone: its law is exactly the
    # sampler's on p_0, token 1's mass spread over the others.
    _, p = random_row(seed=0, vocab=3, num_draft=0, zeros="none")
    dist = speculax.testing.output_distribution(
        chain(DropsToken()), np.zeros((0, 3)), p
    )
    expected = p[0] * [1, 0, 1] / (p[0, 0] + p[0, 2])
    np.testing.assert_allclose(dist.token_probs[0], expected, rtol=0, atol=1e-12)

    q, p = random_row(seed=0, vocab=3, num_draft=2, zeros="none")
    assert speculax.testing.lossless_error(chain(speculax.InverseCDF()), q, p) < 1e-12
    assert speculax.testing.lossless_error(chain(DropsToken()), q, p) > 0.01
    assert tree_error(speculax.InverseCDF()) < 1e-12
    assert tree_error(DropsToken()) > 0.01
    draft, target = LOOP_MODELS
    error = speculax.testing.loop_lossless_error(
        small_loop(DropsToken()), draft, target, [1]
    )
    assert error > 0.01


def test_exact_check_evaluates_a_deterministic_sampler():
    # Argmax reads no uniform: it is called once, and its token has probability 1.
    _, p = random_row(seed=3, vocab=4, num_draft=0, zeros="none")
    step = speculax.SpeculativeStep(sampler=speculax.Argmax())
    dist = speculax.testing.output_distribution(step, np.zeros((0, 4)), p)
    np.testing.assert_array_equal(dist.token_probs[0], np.eye(4)[np.argmax(p[0])])


def test_exact_check_handles_a_sampler_in_reverse_vocabulary_order():
    q, p = random_row(seed=1, vocab=4, num_draft=2, zeros="both")
    dist = speculax.testing.output_distribution(chain(ReversedVocabulary()), q, p)
    assert speculax.testing.lossless_error(chain(ReversedVocabulary()), q, p) < 1e-12
    np.testing.assert_allclose(dist.token_probs.sum(-1), dist.reach_probs, atol=1e-12)
    assert tree_error(ReversedVocabulary()) < 1e-12
    # The loop in reverse order is in test_loop.py.


def assert_refused(check, match_piece: str):
    with pytest.raises(ValueError) as caught:
        check()
    message = str(caught.value)
    # It names the piece and says what the check assumes of it, and what to do.
    assert f"{match_piece} (TwoSweeps)" in message
    assert "each token is drawn on one interval of s" in message
    assert "inverse-CDF sampling over the vocabulary in any order" in message
    assert "lossless_chi_square" in message


def test_exact_check_refuses_a_sampler_whose_cells_it_cannot_find():
    q, p = random_row(seed=0, vocab=3, num_draft=2, zeros="none")
    assert_refused(
        lambda: speculax.testing.output_distribution(chain(TwoSweeps()), q, p),
        "step.sampler",
    )
    assert_refused(lambda: tree_error(TwoSweeps()), "step.sampler")
    draft, target = LOOP_MODELS
    assert_refused(
        lambda: speculax.testing.loop_output_distribution(
            small_loop(TwoSweeps()), draft, target, [1]
        ),
        "loop.step.sampler",
    )


# The statistical test: one row with a zero in p_1 (a token the step must never
# emit there), few enough samples to run in seconds. Token 1 is in the residual
# max(p_0 - q_0, 0) and in p_2, but not in p_1.
STAT_Q = np.array([[0.4, 0.1, 0.2, 0.3], [0.1, 0.2, 0.3, 0.4]])
STAT_P = np.array([[0.2, 0.4, 0.3, 0.1], [0.5, 0.0, 0.25, 0.25], [0.1, 0.4, 0.4, 0.1]])
STAT_SAMPLES = 30_000


def stat_test(sampler: speculax.AbstractSampler) -> speculax.testing.ChiSquareTest:
    return speculax.testing.lossless_chi_square(
        chain(sampler),
        STAT_Q,
        STAT_P,
        key=jax.random.key(0),
        num_samples=STAT_SAMPLES,
    )


@pytest.mark.parametrize("sampler", [speculax.InverseCDF(), TwoSweeps()])
def test_chi_square_passes_lossless_steps(sampler):
    # TwoSweeps is refused by the exact check, and lossless: this is its test.
    test = stat_test(sampler)
    assert test.counts.shape == (3, 4) and test.reached.shape == (3,)
    if isinstance(sampler, speculax.InverseCDF):
        # Read by value in any integer dtype: the same rows.
        again = speculax.testing.lossless_chi_square(
            chain(sampler),
            STAT_Q,
            STAT_P,
            key=jax.random.key(0),
            num_samples=np.int32(STAT_SAMPLES),
        )
        np.testing.assert_array_equal(again.counts, test.counts)
    assert test.reached[0] == STAT_SAMPLES
    np.testing.assert_array_equal(test.counts.sum(-1), test.reached)
    assert test.counts[1, 1] == 0
    np.testing.assert_array_equal(test.dof, [3, 2, 3])
    # The p-value is the chi-square tail, as scipy computes it.
    np.testing.assert_allclose(
        test.p_value, stats.chi2.sf(test.statistic, test.dof), rtol=1e-9
    )
    assert np.all(test.p_value > 1e-3), test.p_value
    assert np.all(test.total_variation < 0.02), test.total_variation


def test_chi_square_fails_a_lossy_sampler():
    test = stat_test(DropsToken())
    # Dropping token 1 shows where it should be drawn: at positions 0 and 2, and
    # not at position 1, where p_1 gives it nothing to drop.
    assert test.p_value[0] < 1e-6 and test.p_value[2] < 1e-6, test.p_value
    assert test.p_value[1] > 1e-3, test.p_value
    assert np.all(test.total_variation[[0, 2]] > 0.05), test.total_variation


def test_chi_square_rejects_bad_arguments():
    step = speculax.SpeculativeStep()
    key = jax.random.key(0)
    check = speculax.testing.lossless_chi_square
    with pytest.raises(ValueError, match="num_samples must be positive"):
        check(step, STAT_Q, STAT_P, key=key, num_samples=0)
    for wrong in (2.5, True):
        with pytest.raises(TypeError, match="num_samples"):
            check(step, STAT_Q, STAT_P, key=key, num_samples=wrong)
    # Under the runtime type checking the annotations catch the shapes first.
    with pytest.raises((ValueError, TypeError)):
        check(step, STAT_Q, STAT_P[:2], key=key)
    with pytest.raises(ValueError, match="non-negative"):
        check(step, -STAT_Q, STAT_P, key=key)


Q = [[0.5, 0.3, 0.2]]
P = [[0.2, 0.2, 0.6], [0.3, 0.3, 0.4]]


@pytest.mark.parametrize(
    ("step", "checker", "instead"),
    [
        (speculax.LogitsStep(), "lossless_error", "rows probs_from_logits makes"),
        (speculax.TreeStep(), "lossless_error", "tree_lossless_error"),
        (speculax.TraversalStep(), "output_distribution", "tree_lossless_error"),
        (speculax.LogitsStep(), "lossless_chi_square", "loop_lossless_error"),
    ],
)
def test_a_checker_refuses_a_step_it_cannot_check_by_name(
    step, checker, instead, without_runtime_type_checks
):
    check = getattr(speculax.testing, checker)
    keywords = {"key": jax.random.key(0)} if checker == "lossless_chi_square" else {}
    q, p = np.array(Q), np.array(P)
    with pytest.raises(TypeError, match=rf"{checker} checks a speculax\.Speculative"):
        check(step, q, p, **keywords)
    with pytest.raises(TypeError, match=instead):
        check(step, q, p, **keywords)


@pytest.mark.parametrize(
    ("q", "p", "message"),
    [
        ([[0.5, 0.3, 0.3]], P, r"draft_probs must be normalised.* row 0 sums to 1\.1"),
        (Q, [P[0], [3.0, 3.0, 4.0]], r"target_probs must be normalised.* row 1"),
    ],
)
def test_the_checkers_refuse_rows_that_are_not_distributions(q, p, message):
    step = speculax.SpeculativeStep()
    with pytest.raises(ValueError, match=message):
        speculax.testing.lossless_error(step, q, p)
    with pytest.raises(ValueError, match=message):
        speculax.testing.lossless_chi_square(
            step, np.array(q), np.array(p), key=jax.random.key(0)
        )


@pytest.mark.parametrize(
    ("prompt", "error", "message"),
    [
        ([-1], ValueError, r"prompt\[0\] must lie in \[0, V\) = \[0, 3\); got -1"),
        ([1, 3], ValueError, r"prompt\[1\] must lie in \[0, V\) = \[0, 3\); got 3"),
        ([2.7], TypeError, r"prompt\[0\] must be an integer; got 2\.7"),
        ([True], TypeError, r"prompt\[0\] must be an integer; got True"),
        ([], ValueError, "prompt must hold at least one token"),
    ],
)
def test_the_loop_checkers_refuse_a_bad_prompt_by_name(
    prompt, error, message, without_runtime_type_checks
):
    draft, target = markov_pair(3, 1, seed=0)
    loop = speculax.SpeculativeLoop(num_draft=1, max_new_tokens=2)
    for check in (
        lambda: speculax.testing.loop_output_distribution(loop, draft, target, prompt),
        lambda: speculax.testing.loop_lossless_error(loop, draft, target, prompt),
        lambda: speculax.testing.target_output_distribution(target, prompt, 2),
    ):
        with pytest.raises(error, match=message):
            check()
    # A token read by value in any integer type.
    exact = speculax.testing.target_output_distribution(target, [np.int8(1)], 1)
    assert exact == speculax.testing.target_output_distribution(target, [1], 1)


@final
class PassesInAWindow(speculax.AbstractAcceptance):
    """`RatioAcceptance`, except that every test also passes for `u` in a window:
    lossy by the window's measure wherever the ratio is below it, and fooled a
    check with 16 fixed probes for windows of width 0.03 between them."""

    low: float
    high: float
    reads_uniforms: ClassVar[bool] = True
    reads_draft_probs: ClassVar[bool] = True
    axis_name: None = None

    def __call__(self, draft_tokens, draft_probs, target_probs, accept_uniforms, **kw):
        passed = speculax.RatioAcceptance()(
            draft_tokens, draft_probs, target_probs, accept_uniforms, **kw
        )
        in_window = (self.low <= accept_uniforms) & (accept_uniforms < self.high)
        return passed | in_window


@final
class SkipsAWindow(speculax.AbstractSampler):
    """Inverse CDF, except that on `s` in a window it draws token 0: a second
    interval for token 0 (unless its own is next to the window)."""

    low: float
    high: float
    reads_uniforms: ClassVar[bool] = True
    axis_name: None = None

    def __call__(self, weights, sample_uniforms):
        drawn = speculax.InverseCDF()(weights, sample_uniforms)
        in_window = (self.low <= sample_uniforms) & (sample_uniforms < self.high)
        return jnp.where(in_window, 0, drawn)


# The red team's windows, each of width 0.01 or more, and one of 0.002: every
# interval wider than 1.2e-3 holds a probe, wherever it lies.
WINDOWS = [(0.91, 0.96), (0.72, 0.75), (0.47, 0.50), (0.5005, 0.5105), (0.3, 0.302)]


def test_every_interval_wider_than_the_stated_gap_holds_a_probe():
    """The strength the checkers state: the probes of any shift leave no gap wider
    than 1.2e-3 in [0, 1), the wrap-around included."""
    from speculax.testing._chain import _PROBE_BATCH, PROBES, _probes

    shifts = jnp.asarray(np.random.default_rng(0).random(64))
    with jax.enable_x64(True):
        probes = jnp.concatenate(
            [_probes(shifts, jnp.int32(j)) for j in range(PROBES // _PROBE_BATCH)]
        )
    assert probes.shape == (PROBES, 64)
    spread = np.sort(np.asarray(probes), axis=0)
    gaps = np.diff(np.concatenate([spread, spread[:1] + 1]), axis=0)
    assert gaps.max() < 1.2e-3


@pytest.mark.parametrize(
    "interval",
    [(0.25, 0.5), (1 - 2**-53, 1.0), (0.5, 0.5 + 2**-53), (0.0, 2**-1074)],
    ids=["wide", "one ulp below 1", "one ulp above 1/2", "the least subnormal"],
)
def test_the_uniform_of_a_cell_lies_in_its_interval(interval):
    # A deterministic child whose target probability rounds to 1 - 2**-53 leaves
    # a cell one ulp wide, whose middle rounds to 1: a uniform the step refuses.
    from speculax.testing._cells import Cell, leaf_at_middle

    names = {speculax.DRAFT: [], speculax.ACCEPT: [(0, 0)], speculax.SAMPLE: [(1, 0)]}
    cell = Cell({(0, 0): interval}, 1e-16)
    uniform = leaf_at_middle(0, cell, names, (), (), 0).accept_uniforms[0]
    assert interval[0] <= uniform < interval[1]


@pytest.mark.parametrize("rows", [1, 16, 17, 300, 1500])
def test_the_rows_of_an_enumeration_are_run_in_chunks_of_few_sizes(rows):
    """Each row's output comes back in its place, whatever the chunk it ran in; a
    chunk has one of the sizes given, and fewer padded rows than the smallest."""
    from speculax.testing._chain import in_chunks

    seen = []

    def row_sums(x, y):
        seen.append(len(x))
        return (x.sum(axis=-1) + y,)

    x = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    y = np.arange(rows, dtype=np.float32)
    (sums,) = in_chunks(row_sums, x, y, chunks=(16, 128, 1024))
    np.testing.assert_array_equal(sums, x.sum(axis=-1) + y)
    assert set(seen) <= {16, 128, 1024}
    assert 0 <= sum(seen) - rows < 16


@pytest.mark.parametrize(("low", "high"), WINDOWS)
def test_an_acceptance_test_lossy_in_a_window_is_never_called_lossless(low, high):
    q, p = random_row(seed=3, vocab=3, num_draft=2, zeros="none")
    step = speculax.SpeculativeStep(acceptance=PassesInAWindow(low, high))
    with pytest.raises(ValueError, match=r"step\.acceptance is not monotone"):
        speculax.testing.lossless_error(step, q, p)


@pytest.mark.parametrize(("low", "high"), [(0.40, 0.42), (0.655, 0.665)])
def test_a_sampler_lossy_in_a_window_is_never_called_lossless(low, high):
    q, p = random_row(seed=4, vocab=3, num_draft=2, zeros="none")
    step = speculax.SpeculativeStep(sampler=SkipsAWindow(low, high))
    with pytest.raises(ValueError, match=r"step.sampler \(SkipsAWindow\)"):
        speculax.testing.lossless_error(step, q, p)


def test_a_loop_whose_acceptance_is_lossy_in_a_window_is_refused():
    """The red team's loop: G = 1, V = 3, three tokens, reported lossless at 9e-17
    while the jitted loop's chi-square gave p = 3e-79."""
    draft, target = LOOP_MODELS
    loop = speculax.SpeculativeLoop(
        num_draft=1,
        max_new_tokens=3,
        step=speculax.SpeculativeStep(acceptance=PassesInAWindow(0.91, 0.96)),
    )
    with pytest.raises(ValueError, match="not monotone"):
        speculax.testing.loop_lossless_error(loop, draft, target, [1])
