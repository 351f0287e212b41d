"""Lossless (the specification's theorem): token k of the output, given n >= k, is
distributed as p_k.

Proved two ways: exactly, by enumeration with `speculax.testing`, and statistically,
by a chi-square test of the real compiled step; each way is shown to catch a lossy
piece.
"""

import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, Bool, Float, Int

import speculax
import speculax.testing
from inputs import random_row


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("zeros", ["none", "draft", "target", "both"])
@pytest.mark.parametrize("num_draft", [0, 1, 2, 3])
@pytest.mark.parametrize("vocab", [2, 3, 5])
def test_exact_output_distribution_is_target(vocab, num_draft, zeros, seed):
    q, p = random_row(seed, vocab, num_draft, zeros)
    dist = speculax.testing.output_distribution(speculax.SpeculativeStep(), q, p)
    assert dist.token_probs.dtype == np.float64
    assert dist.token_probs.shape == (num_draft + 1, vocab)
    assert dist.reach_probs.shape == dist.num_accepted_probs.shape == (num_draft + 1,)
    np.testing.assert_allclose(dist.num_accepted_probs.sum(), 1, rtol=0, atol=1e-12)
    np.testing.assert_allclose(
        dist.token_probs.sum(axis=-1), dist.reach_probs, rtol=0, atol=1e-12
    )
    # Independent of the enumeration: position i passes with probability
    # sum_x min(p_i(x), q_i(x)), so P(n >= k) is the product over i < k.
    overlap = np.minimum(p[:num_draft], q).sum(axis=-1)
    reach = np.concatenate([[1.0], np.cumprod(overlap)])
    np.testing.assert_allclose(dist.reach_probs, reach, rtol=1e-12, atol=1e-15)
    for k in range(num_draft + 1):
        if dist.reach_probs[k] > 0:
            conditional = dist.token_probs[k] / dist.reach_probs[k]
            np.testing.assert_allclose(conditional, p[k], rtol=0, atol=1e-12)
    error = speculax.testing.lossless_error(speculax.SpeculativeStep(), q, p)
    assert error < 1e-12


@pytest.mark.parametrize(
    ("draft", "target", "reach"),
    [
        # q = p: every draft token passes.
        ([[0.25, 0.75]], [[0.25, 0.75], [0.5, 0.5]], [1.0, 1.0]),
        # Disjoint supports: every draft token fails.
        ([[1.0, 0.0, 0.0]], [[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]], [1.0, 0.0]),
        # V = 1.
        ([[1.0], [1.0]], [[1.0], [1.0], [1.0]], [1.0, 1.0, 1.0]),
    ],
)
def test_exact_output_distribution_corners(draft, target, reach):
    dist = speculax.testing.output_distribution(
        speculax.SpeculativeStep(), jnp.asarray(draft), jnp.asarray(target)
    )
    np.testing.assert_allclose(dist.reach_probs, reach, rtol=0, atol=1e-15)
    assert (
        speculax.testing.lossless_error(
            speculax.SpeculativeStep(), np.asarray(draft), np.asarray(target)
        )
        < 1e-15
    )


class NoSubtractionResidual(speculax.AbstractResidual):
    """Draws the correction from p_n, forgetting what the draft already proposed."""

    reads_draft_probs: ClassVar[bool] = False

    axis_name: ClassVar[None] = None

    def __call__(
        self,
        num_accepted: Int[Array, " batch"],
        draft_tokens: Int[Array, "batch draft"],
        draft_probs: Float[Array, "batch draft vocab"],
        target_probs: Float[Array, "batch draft+1 vocab"],
        *,
        num_draft_tokens: Int[Array, " batch"] | None = None,
    ) -> Float[Array, "batch vocab"]:
        return target_probs[jnp.arange(num_accepted.shape[0]), num_accepted]


class AbsoluteResidual(speculax.AbstractResidual):
    """|p_n - q_n| instead of max(p_n - q_n, 0): over-proposed tokens come back."""

    reads_draft_probs: ClassVar[bool] = True

    axis_name: ClassVar[None] = None

    def __call__(
        self,
        num_accepted: Int[Array, " batch"],
        draft_tokens: Int[Array, "batch draft"],
        draft_probs: Float[Array, "batch draft vocab"],
        target_probs: Float[Array, "batch draft+1 vocab"],
        *,
        num_draft_tokens: Int[Array, " batch"] | None = None,
    ) -> Float[Array, "batch vocab"]:
        batch = jnp.arange(num_accepted.shape[0])
        target_row = target_probs[batch, num_accepted]
        last = draft_probs.shape[1] - 1
        draft_row = draft_probs[batch, jnp.minimum(num_accepted, last)]
        drafting = (num_accepted <= last)[:, None]
        return jnp.where(drafting, jnp.abs(target_row - draft_row), target_row)


class AlwaysAccept(speculax.AbstractAcceptance):
    reads_uniforms: ClassVar[bool] = False
    reads_draft_probs: ClassVar[bool] = False
    axis_name: ClassVar[None] = None

    def __call__(
        self,
        draft_tokens: Int[Array, "batch draft"],
        draft_probs: Float[Array, "batch draft vocab"],
        target_probs: Float[Array, "batch draft+1 vocab"],
        accept_uniforms: Float[Array, "batch draft"],
        *,
        num_draft_tokens: Int[Array, " batch"] | None = None,
    ) -> Bool[Array, "batch draft"]:
        return jnp.ones(draft_tokens.shape, bool)


class CountAllPasses(speculax.AbstractPrefixCount):
    """Counts every pass, not just the leading run: keeps tokens after a failure."""

    def __call__(self, passed: Bool[Array, "batch draft"]) -> Int[Array, " batch"]:
        return jnp.sum(passed, axis=-1, dtype=jnp.int32)


LOSSY_STEPS = {
    "no subtraction": speculax.SpeculativeStep(residual=NoSubtractionResidual()),
    "absolute residual": speculax.SpeculativeStep(residual=AbsoluteResidual()),
    "always accept": speculax.SpeculativeStep(acceptance=AlwaysAccept()),
    "count all passes": speculax.SpeculativeStep(prefix=CountAllPasses()),
}


@pytest.mark.parametrize("name", list(LOSSY_STEPS))
def test_exact_check_flags_lossy_piece(name):
    q, p = random_row(seed=0, vocab=4, num_draft=2, zeros="none")
    assert speculax.testing.lossless_error(speculax.SpeculativeStep(), q, p) < 1e-12
    assert speculax.testing.lossless_error(LOSSY_STEPS[name], q, p) > 1e-3


class UpperHalfAccept(speculax.AbstractAcceptance):
    """Passes for large u: not of the form "passes below a threshold"."""

    reads_uniforms: ClassVar[bool] = True
    reads_draft_probs: ClassVar[bool] = False
    axis_name: ClassVar[None] = None

    def __call__(
        self,
        draft_tokens: Int[Array, "batch draft"],
        draft_probs: Float[Array, "batch draft vocab"],
        target_probs: Float[Array, "batch draft+1 vocab"],
        accept_uniforms: Float[Array, "batch draft"],
        *,
        num_draft_tokens: Int[Array, " batch"] | None = None,
    ) -> Bool[Array, "batch draft"]:
        return accept_uniforms >= 0.5


class UnclippedResidual(speculax.AbstractResidual):
    """p_n - q_n without the clip: negative weights, which no sampler can use."""

    reads_draft_probs: ClassVar[bool] = True

    axis_name: ClassVar[None] = None

    def __call__(
        self,
        num_accepted: Int[Array, " batch"],
        draft_tokens: Int[Array, "batch draft"],
        draft_probs: Float[Array, "batch draft vocab"],
        target_probs: Float[Array, "batch draft+1 vocab"],
        *,
        num_draft_tokens: Int[Array, " batch"] | None = None,
    ) -> Float[Array, "batch vocab"]:
        batch = jnp.arange(num_accepted.shape[0])
        last = draft_probs.shape[1] - 1
        draft_row = draft_probs[batch, jnp.minimum(num_accepted, last)]
        return target_probs[batch, num_accepted] - draft_row


@pytest.mark.parametrize(
    ("step", "match"),
    [
        (speculax.SpeculativeStep(acceptance=UpperHalfAccept()), "monotone"),
        (speculax.SpeculativeStep(residual=UnclippedResidual()), "negative"),
    ],
)
def test_exact_check_refuses_what_it_cannot_integrate(step, match):
    q, p = random_row(seed=0, vocab=3, num_draft=2, zeros="none")
    with pytest.raises(ValueError, match=match):
        speculax.testing.output_distribution(step, q, p)


def test_exact_check_rejects_bad_input():
    q, p = random_row(seed=0, vocab=3, num_draft=1, zeros="none")
    step = speculax.SpeculativeStep()
    # Under the test suite's runtime type checking the annotations catch the shapes
    # first, as a TypeError; without it, the function's own check raises ValueError.
    with pytest.raises((ValueError, TypeError)):
        speculax.testing.output_distribution(step, q, p[:1])
    with pytest.raises(ValueError, match="non-negative"):
        speculax.testing.output_distribution(step, -q, p)


def test_exact_check_takes_nested_lists():
    """Nested lists of floats are what their annotation admits too, under the
    suite's runtime type checking, and give what the arrays give."""
    q, p = random_row(seed=0, vocab=3, num_draft=2, zeros="none")
    step = speculax.SpeculativeStep()
    from_lists = speculax.testing.output_distribution(step, q.tolist(), p.tolist())
    from_arrays = speculax.testing.output_distribution(step, q, p)
    for got, want in zip(from_lists, from_arrays, strict=True):
        np.testing.assert_array_equal(got, want)
    assert speculax.testing.lossless_error(step, q.tolist(), p.tolist()) < 1e-12


# The statistical proof runs the real compiled step, sampler included, on NUM_SAMPLES
# independent rows of one fixed (p, q).
NUM_SAMPLES = 200_000
STAT_VOCAB = 8
STAT_DRAFT = 3
# A fixed seed makes the test deterministic; at this level a correct step fails one
# position's test about once in a thousand seeds.
SIGNIFICANCE = 1e-3


def chi_square_sf(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X chi-square with `dof` degrees of freedom, by the
    Wilson-Hilferty normal approximation (scipy is not a dependency).
    """
    scale = 2 / (9 * dof)
    z = ((statistic / dof) ** (1 / 3) - (1 - scale)) / math.sqrt(scale)
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize(("critical", "dof"), [(24.322, 7), (16.266, 3), (29.588, 10)])
def test_chi_square_sf_matches_table(critical, dof):
    # Tabulated 0.001 critical values; the approximation is good to about 10%.
    assert chi_square_sf(critical, dof) == pytest.approx(1e-3, rel=0.15)


def stat_row() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1234)
    q = rng.dirichlet(np.ones(STAT_VOCAB), size=STAT_DRAFT)
    p = rng.dirichlet(np.ones(STAT_VOCAB), size=STAT_DRAFT + 1)
    return q.astype(np.float32), p.astype(np.float32)


@eqx.filter_jit
def sample_outputs(
    step: speculax.SpeculativeStep, key: Array, q: Array, p: Array
) -> speculax.StepOutput:
    """One step on NUM_SAMPLES rows, each with its own draft tokens and uniforms."""
    token_key, accept_key, sample_key = jax.random.split(key, 3)
    draft_tokens = jax.random.categorical(
        token_key, jnp.log(q), shape=(NUM_SAMPLES, STAT_DRAFT)
    )
    return step(
        draft_tokens,
        jnp.broadcast_to(q, (NUM_SAMPLES, *q.shape)),
        jnp.broadcast_to(p, (NUM_SAMPLES, *p.shape)),
        jax.random.uniform(accept_key, (NUM_SAMPLES, STAT_DRAFT)),
        jax.random.uniform(sample_key, (NUM_SAMPLES,)),
    )


def chi_square_per_position(
    step: speculax.SpeculativeStep,
) -> tuple[list[float], float, list[int]]:
    """The chi-square statistic of token k among rows with n >= k against p_k, for
    each k; the statistic of n against the exact P(n = m); and the count of rows
    reaching each k.
    """
    q, p = stat_row()
    out = sample_outputs(step, jax.random.key(0), jnp.asarray(q), jnp.asarray(p))
    tokens = np.asarray(out["tokens"])
    num_accepted = np.asarray(out["num_accepted"])
    statistics, reached = [], []
    for k in range(STAT_DRAFT + 1):
        at_k = tokens[num_accepted >= k, k]
        observed = np.bincount(at_k, minlength=STAT_VOCAB)
        expected = len(at_k) * p[k].astype(np.float64)
        statistics.append(float(np.sum((observed - expected) ** 2 / expected)))
        reached.append(len(at_k))
    exact = speculax.testing.output_distribution(step, q, p)
    observed = np.bincount(num_accepted, minlength=STAT_DRAFT + 1)
    expected = NUM_SAMPLES * exact.num_accepted_probs
    count_statistic = float(np.sum((observed - expected) ** 2 / expected))
    return statistics, count_statistic, reached


@pytest.mark.parametrize(
    "step",
    [
        speculax.SpeculativeStep(),
        # Block verification's default test is its exact enumeration (test_block.py).
        pytest.param(speculax.block_step(), marks=pytest.mark.slow),
    ],
    ids=["token by token", "block"],
)
def test_statistical_output_distribution_is_target(step):
    statistics, count_statistic, reached = chi_square_per_position(step)
    # Every cell must expect plenty of samples for the chi-square approximation.
    _, p = stat_row()
    assert min(reached[k] * p[k].min() for k in range(STAT_DRAFT + 1)) > 50
    for k, statistic in enumerate(statistics):
        p_value = chi_square_sf(statistic, STAT_VOCAB - 1)
        assert p_value > SIGNIFICANCE, (k, statistic, p_value)
    # The real step's n matches the exact enumeration's P(n = m) too, tying the
    # two proofs together.
    p_value = chi_square_sf(count_statistic, STAT_DRAFT)
    assert p_value > SIGNIFICANCE, (count_statistic, p_value)


def test_statistical_test_flags_lossy_residual():
    statistics, _, _ = chi_square_per_position(
        speculax.SpeculativeStep(residual=AbsoluteResidual())
    )
    # 24.32 is the 0.001 critical value at 7 degrees of freedom; a lossy residual
    # is rejected by orders of magnitude, not by luck of the seed.
    assert max(statistics) > 100 * 24.32, statistics
