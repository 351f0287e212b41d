"""Block verification: lossless by exact enumeration (and the enumeration catches the
stop-at-first-failure version), never fewer tokens than token-by-token verification,
exactly as many for deterministic drafts, batch invariance, ragged rows and bad
input. The chi-square test of the jitted step is in `test_lossless.py`."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import speculax
import speculax.testing
from doubles import DelegatingResidual
from inputs import close_drafts, random_row


BLOCK = speculax.block_step()
TOKEN_BY_TOKEN = speculax.SpeculativeStep()


def total_variation(dist: speculax.testing.OutputDistribution, p: np.ndarray) -> float:
    """The largest total variation, over the positions k reached, between token k
    given n >= k and p_k."""
    reached = dist.reach_probs > 0
    conditional = dist.token_probs[reached] / dist.reach_probs[reached, None]
    return float(np.max(0.5 * np.abs(conditional - p[reached]).sum(-1), initial=0))


def expected_accepted(dist: speculax.testing.OutputDistribution) -> float:
    return float(dist.num_accepted_probs @ np.arange(len(dist.num_accepted_probs)))


def adversarial_row(seed: int, vocab: int, num_draft: int):
    """Drafts that put most of their mass where the target puts the least."""
    rng = np.random.default_rng([seed, vocab, num_draft, 7])
    p = rng.dirichlet(np.ones(vocab), size=num_draft + 1)
    q = rng.dirichlet(np.ones(vocab), size=num_draft) * 0.2
    q[np.arange(num_draft), np.argmin(p[:num_draft], axis=-1)] += 0.8
    return q, p


# Each number of drafts with every kind of zeros at V = 3, and without zeros at
# V = 2 and 5, in the default tier; the other sizes and a second seed of each in the
# extended tier.
@pytest.mark.parametrize(
    ("vocab", "num_draft", "zeros", "seed"),
    [
        (vocab, num_draft, zeros, seed)
        if seed == 0 and (vocab == 3 or zeros == "none")
        else pytest.param(vocab, num_draft, zeros, seed, marks=pytest.mark.slow)
        for vocab in (2, 3, 5)
        for num_draft in (0, 1, 2, 3)
        for zeros in ("none", "draft", "target", "both", "adversarial")
        for seed in (0, 1)
    ],
)
def test_lossless_by_exact_enumeration(vocab, num_draft, zeros, seed):
    if zeros == "adversarial":
        q, p = adversarial_row(seed, vocab, num_draft)
    else:
        q, p = random_row(seed, vocab, num_draft, zeros)
    block = speculax.testing.output_distribution(BLOCK, q, p)
    assert total_variation(block, p) < 1e-12
    np.testing.assert_allclose(block.num_accepted_probs.sum(), 1, rtol=0, atol=1e-12)
    # Never fewer tokens than token by token, in expectation.
    token_by_token = speculax.testing.output_distribution(TOKEN_BY_TOKEN, q, p)
    assert expected_accepted(block) >= expected_accepted(token_by_token) - 1e-12


def test_the_enumeration_catches_block_verification_stopping_at_the_first_failure():
    first_failure = speculax.SpeculativeStep(
        speculax.BlockAcceptance(), speculax.PrefixCount(), speculax.BlockResidual()
    )
    for seed in range(3):
        q, p = random_row(seed, vocab=4, num_draft=3, zeros="none")
        assert speculax.testing.lossless_error(BLOCK, q, p) < 1e-12
        dist = speculax.testing.output_distribution(first_failure, q, p)
        assert total_variation(dist, p) > 1e-2


def test_the_enumeration_catches_the_plain_residual_after_a_block():
    """The residual must scale p_n by P_n: the plain one is lossy after a block."""
    plain = speculax.SpeculativeStep(
        speculax.BlockAcceptance(), speculax.LastPassCount(), speculax.Residual()
    )
    q, p = random_row(0, vocab=4, num_draft=3, zeros="none")
    assert speculax.testing.lossless_error(plain, q, p) > 1e-3


def test_block_keeps_the_pair_as_often_as_the_target_allows():
    """Two drafts, the first over-proposed and the second under-proposed. The block
    keeps both with probability E_q[P_2] = 0.58 (P_2 = min(1, P_1 p_1(x_1) / q_1(x_1))
    by hand: 0.25, 0.5625, 0.5 and 1 for the four pairs), the two tests in a row
    with 0.6 * 0.9 = 0.54."""
    q = np.array([[0.8, 0.2], [0.2, 0.8]])
    p = np.array([[0.4, 0.6], [0.1, 0.9], [0.5, 0.5]])
    block = speculax.testing.output_distribution(BLOCK, q, p)
    token_by_token = speculax.testing.output_distribution(TOKEN_BY_TOKEN, q, p)
    assert block.reach_probs[2] == pytest.approx(0.58, abs=1e-15)
    assert token_by_token.reach_probs[2] == pytest.approx(0.54, abs=1e-15)
    assert block.reach_probs[1] == pytest.approx(0.6, abs=1e-15)


def test_the_papers_motivating_example():
    """Sun et al.'s example: over {a, b} the draft model gives a 2/3 and the target
    b 2/3, independently of the context, and G = 2. Token by token keeps 10/9
    tokens in expectation, block verification 11/9."""
    q = np.array([[2 / 3, 1 / 3]] * 2)
    p = np.array([[1 / 3, 2 / 3]] * 3)
    block = speculax.testing.output_distribution(BLOCK, q, p)
    token_by_token = speculax.testing.output_distribution(TOKEN_BY_TOKEN, q, p)
    assert expected_accepted(token_by_token) == pytest.approx(10 / 9, abs=1e-15)
    assert expected_accepted(block) == pytest.approx(11 / 9, abs=1e-15)


@pytest.mark.parametrize("seed", range(3))
def test_deterministic_drafts_keep_exactly_as_many_tokens(seed):
    """With q_i the one-hot of x_i, P(n >= k) is the product of p_i(x_i) both ways:
    the block gains nothing."""
    rng = np.random.default_rng(seed)
    vocab, num_draft = 4, 3
    _, p = random_row(seed, vocab, num_draft, "none")
    draft = rng.integers(vocab, size=num_draft)
    one_hot = np.eye(vocab)[draft]
    block = speculax.testing.output_distribution(BLOCK, one_hot, p)
    token_by_token = speculax.testing.output_distribution(TOKEN_BY_TOKEN, one_hot, p)
    assert total_variation(block, p) < 1e-12
    np.testing.assert_allclose(
        block.num_accepted_probs, token_by_token.num_accepted_probs, atol=1e-15
    )


@functools.cache
def _jitted(step):
    return eqx.filter_jit(step)


def test_deterministic_drafts_are_the_one_hot_drafts():
    inputs = close_drafts(0, 32, 4, 300)
    one_hot = np.eye(300, dtype=np.float32)[inputs["draft_tokens"]]
    with_one_hot = _jitted(BLOCK)(**{**inputs, "draft_probs": one_hot})
    without = _jitted(BLOCK)(**{**inputs, "draft_probs": None})
    for name in ("num_accepted", "tokens"):
        np.testing.assert_array_equal(without[name], with_one_hot[name])


def test_row_alone_equals_row_in_batch():
    inputs = close_drafts(1, 16, 4, 1000)
    batched = _jitted(BLOCK)(**inputs)
    assert 1 < np.mean(batched["num_accepted"]) < 4
    for b in range(16):
        alone = _jitted(BLOCK)(**{name: x[b : b + 1] for name, x in inputs.items()})
        for name in ("num_accepted", "tokens"):
            np.testing.assert_array_equal(alone[name][0], batched[name][b])


@pytest.mark.slow
def test_a_ragged_row_is_the_row_alone_with_its_own_draft_length():
    inputs = close_drafts(2, 8, 4, 300)
    lengths = np.array([0, 1, 2, 3, 4, 2, 1, 3])
    padded = {name: value.copy() for name, value in inputs.items()}
    for b, length in enumerate(lengths):
        # Padding past a row's length may hold anything: the test reads none of it.
        padded["draft_tokens"][b, length:] = -1
        padded["draft_probs"][b, length:] = np.nan
        padded["target_probs"][b, length + 1 :] = np.nan
    ragged = _jitted(BLOCK)(**padded, num_draft_tokens=lengths)
    for length in range(5):
        rows = np.flatnonzero(lengths == length)
        alone = _jitted(BLOCK)(
            draft_tokens=inputs["draft_tokens"][rows, :length],
            draft_probs=inputs["draft_probs"][rows, :length],
            target_probs=inputs["target_probs"][rows, : length + 1],
            accept_uniforms=inputs["accept_uniforms"][rows, :length],
            sample_uniforms=inputs["sample_uniforms"][rows],
        )
        np.testing.assert_array_equal(
            ragged["num_accepted"][rows], alone["num_accepted"]
        )
        np.testing.assert_array_equal(
            ragged["tokens"][rows, : length + 1], alone["tokens"]
        )


@pytest.mark.slow
def test_the_fused_draw_is_the_residual_then_the_sampler():
    """`block_step` draws from BlockResidual's weights through the fused summary;
    the same residual behind a piece the step does not know runs the generic
    path, the weights made whole: the same tokens."""
    inputs = close_drafts(4, 32, 4, 1000)
    generic = speculax.SpeculativeStep(
        speculax.BlockAcceptance(),
        speculax.LastPassCount(),
        DelegatingResidual(speculax.BlockResidual()),
        check_all_probs=True,
    )
    for draft_probs in (inputs["draft_probs"], None):
        both = [
            _jitted(step)(**{**inputs, "draft_probs": draft_probs})
            for step in (BLOCK, generic)
        ]
        for name in ("num_accepted", "tokens"):
            np.testing.assert_array_equal(both[0][name], both[1][name])
        assert np.any(np.asarray(both[0]["num_accepted"]) < 4)


def test_last_pass_count():
    passed = jnp.array(
        [
            [False, False, False],
            [True, False, False],
            [False, True, False],
            [False, False, True],
            [True, True, True],
        ]
    )
    assert speculax.LastPassCount()(passed).tolist() == [0, 1, 2, 3, 3]
    assert speculax.LastPassCount()(jnp.zeros((2, 0), bool)).tolist() == [0, 0]


def test_a_bad_value_in_a_row_the_test_reads_is_reported():
    """Every row is read, so every row is checked: a NaN in a middle draft row,
    which the token-by-token step would never read, raises or comes back."""
    inputs = close_drafts(3, 4, 4, 300)
    inputs["draft_probs"][1, 2, 7] = np.nan
    with pytest.raises(RuntimeError, match="draft_probs must be finite"):
        jax.block_until_ready(_jitted(BLOCK)(**inputs))
    out, result = _jitted(speculax.block_step(throw=False).with_result)(**inputs)
    assert bool((result == speculax.RESULTS.bad_draft_probs)[1])
    messages = speculax.failure_messages(result)
    assert [m for b, m in enumerate(messages) if b != 1] == ["", "", ""]
    assert out["tokens"][1].tolist() == [-1] * 5
