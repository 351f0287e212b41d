"""Each piece alone, against values computed by hand."""

import re
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest


def _acceptance(draft_token_p, draft_token_q, u):
    """Runs RatioAcceptance on one position whose draft token is 0."""
    import speculax

    vocab = 2
    target = jnp.zeros((1, 2, vocab)).at[0, 0, 0].set(draft_token_p)
    draft = jnp.zeros((1, 1, vocab)).at[0, 0, 0].set(draft_token_q)
    passed = speculax.RatioAcceptance()(
        jnp.zeros((1, 1), jnp.int32), draft, target, jnp.array([[u]])
    )
    return bool(passed[0, 0])


@pytest.mark.parametrize(
    "p, q, u, expected",
    [
        (0.28, 0.17, 0.27, True),  # ratio 1.647: passes
        (0.23, 0.42, 0.79, False),  # ratio 0.548
        (0.23, 0.42, 0.5, True),
        (0.5, 1.0, 0.5, False),  # u == p / q exactly: the test is strict
        (0.3, 0.0, 0.99, True),  # q = 0, p > 0: passes whatever u
        (0.0, 0.0, 0.0, False),  # q = 0, p = 0: fails
        (0.0, 0.4, 0.0, False),  # p = 0 never passes, even with u = 0
        (1e-30, 1e-30, 0.999, True),
    ],
)
def test_ratio_acceptance_by_hand(p, q, u, expected):
    assert _acceptance(p, q, u) is expected


@pytest.mark.parametrize(
    "passed, expected",
    [
        ([[True, False, True]], [1]),
        ([[True, True, True]], [3]),
        ([[False, True, True]], [0]),
        ([[True, True, False], [False, False, False]], [2, 0]),
        (np.zeros((2, 0), bool), [0, 0]),
    ],
)
def test_prefix_count_stops_at_the_first_failure(passed, expected):
    import speculax

    count = speculax.PrefixCount()(jnp.asarray(passed))
    assert count.dtype == jnp.int32
    assert count.tolist() == expected


# One row, G = 2, V = 4; the draft rows and target rows are distinct so that reading the
# wrong row shows.
DRAFT = [[[0.2, 0.59, 0.04, 0.17], [0.12, 0.43, 0.42, 0.03]]]
TARGET = [[[0.04, 0.44, 0.24, 0.28], [0.27, 0.36, 0.23, 0.14], [0.19, 0.34, 0.07, 0.4]]]


@pytest.mark.parametrize(
    "n, expected",
    [
        (0, [0.0, 0.0, 0.2, 0.11]),  # max(p_0 - q_0, 0)
        (1, [0.15, 0.0, 0.0, 0.11]),  # max(p_1 - q_1, 0), the first worked example
        (2, [0.19, 0.34, 0.07, 0.4]),  # n = G: the bonus distribution p_G
    ],
)
def test_residual_reads_row_n(n, expected):
    import speculax

    weights = speculax.Residual()(
        jnp.array([n]), jnp.array([[3, 2]]), jnp.array(DRAFT), jnp.array(TARGET)
    )
    np.testing.assert_allclose(weights[0], expected, atol=1e-7)


def test_residual_falls_back_to_p_n_when_nothing_is_left():
    import speculax

    target = jnp.array([[[0.1, 0.6, 0.3], [0.5, 0.25, 0.25]]])
    weights = speculax.Residual()(
        jnp.array([0]), jnp.array([[1]]), target[:, :1], target
    )
    np.testing.assert_array_equal(weights, target[:, 0])


def test_residual_without_draft_positions_is_p_0():
    import speculax

    target = jnp.array([[[0.1, 0.6, 0.3]]])
    weights = speculax.Residual()(
        jnp.array([0]), jnp.zeros((1, 0), jnp.int32), jnp.zeros((1, 0, 3)), target
    )
    np.testing.assert_array_equal(weights, target[:, 0])


@pytest.mark.parametrize(
    "weights, s, expected",
    [
        ([0.15, 0.0, 0.0, 0.11], 0.92, 3),  # the first worked example
        ([0.15, 0.0, 0.0, 0.11], 0.5, 0),
        ([0.15, 0.0, 0.0, 0.11], 0.0, 0),
        ([0.0, 0.0, 2.0, 0.0], 0.0, 2),  # never a zero-weight token, even at s = 0
        ([0.5, 0.5, 0.0, 0.0], 0.999, 1),
        ([1.0], 0.3, 0),
        ([0.0, 0.0, 0.0], 0.3, -1),  # no positive weight: no token
    ],
)
def test_inverse_cdf_by_hand(weights, s, expected):
    import speculax

    token = speculax.InverseCDF()(jnp.array([weights]), jnp.array([s]))
    assert token.dtype == jnp.int32
    assert token.tolist() == [expected]


@pytest.mark.parametrize("block_size", [1, 3, 256])
@pytest.mark.parametrize("trailing_zeros", [0, 1, 700])
def test_inverse_cdf_near_one_never_runs_off_the_end(block_size, trailing_zeros):
    """With $s$ the largest float32 below 1, rounding can leave no cumulative sum above
    $s \\sum w$; the token is then the last one with positive weight, never a trailing
    zero."""
    import speculax

    rng = np.random.default_rng(trailing_zeros + block_size)
    positive = rng.random(1000).astype(np.float32) + 0.01
    weights = np.concatenate([positive, np.zeros(trailing_zeros, np.float32)])
    s = np.nextafter(np.float32(1), np.float32(0))
    token = eqx.filter_jit(speculax.InverseCDF(block_size=block_size))(
        jnp.array([weights]), jnp.array([s])
    )
    assert token.tolist() == [999]


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [1, 2, 5, 7, 64])
def test_inverse_cdf_block_size_does_not_change_the_answer(block_size):
    import speculax

    rng = np.random.default_rng(block_size)
    weights = rng.random((16, 37)) * (rng.random((16, 37)) < 0.5)
    weights[:, 5] += 0.01
    s = rng.random(16)
    cdf = np.cumsum(weights, -1) / weights.sum(-1, keepdims=True)
    expected = (cdf <= s[:, None]).sum(-1)
    token = speculax.InverseCDF(block_size=block_size)(
        jnp.asarray(weights, jnp.float32), jnp.asarray(s, jnp.float32)
    )
    np.testing.assert_array_equal(token, expected)


def test_inverse_cdf_rejects_a_non_positive_block_size():
    import speculax

    with pytest.raises(ValueError, match="block_size"):
        speculax.InverseCDF(block_size=0)


def test_swapping_a_custom_acceptance_changes_the_count():
    import speculax

    class AcceptEverything(speculax.AbstractAcceptance):
        reads_uniforms: ClassVar[bool] = False
        reads_draft_probs: ClassVar[bool] = False
        axis_name: ClassVar[None] = None

        def __call__(
            self,
            draft_tokens,
            draft_probs,
            target_probs,
            accept_uniforms,
            *,
            num_draft_tokens=None,
        ):
            return jnp.ones(draft_tokens.shape, bool)

    inputs = {
        "draft_tokens": jnp.array([[3, 2]]),
        "draft_probs": jnp.array(DRAFT),
        "target_probs": jnp.array(TARGET),
        "accept_uniforms": jnp.array([[0.27, 0.79]]),
        "sample_uniforms": jnp.array([0.92]),
    }
    default = speculax.SpeculativeStep()
    assert eqx.filter_jit(default)(**inputs)["num_accepted"].tolist() == [1]

    by_constructor = speculax.SpeculativeStep(acceptance=AcceptEverything())
    by_tree_at = eqx.tree_at(lambda step: step.acceptance, default, AcceptEverything())
    for step in (by_constructor, by_tree_at):
        out = eqx.filter_jit(step)(**inputs)
        # All accepted, so y is drawn from p_G = [0.19, 0.34, 0.07, 0.4] at s = 0.92.
        assert out["num_accepted"].tolist() == [2]
        assert out["tokens"].tolist() == [[3, 2, 3]]


def test_abstract_pieces_cannot_be_instantiated():
    import speculax

    for abstract in (
        speculax.AbstractAcceptance,
        speculax.AbstractPrefixCount,
        speculax.AbstractResidual,
        speculax.AbstractSampler,
    ):
        with pytest.raises(TypeError):
            abstract()


@pytest.mark.parametrize(
    "abstract, missing",
    [
        ("AbstractAcceptance", "reads_uniforms"),
        ("AbstractResidual", "reads_draft_probs"),
        ("AbstractSampler", "reads_uniforms"),
    ],
)
def test_a_piece_must_state_what_it_reads(abstract, missing):
    """What the step needs to know of a piece is declared abstractly: a piece that
    does not state it cannot be built, rather than inheriting a silent default."""
    import speculax

    class Forgetful(getattr(speculax, abstract)):
        def __call__(self, *args, **kwargs):
            raise NotImplementedError

    with pytest.raises(TypeError, match=missing):
        Forgetful()


@pytest.mark.parametrize(
    "abstract", ["AbstractAcceptance", "AbstractResidual", "AbstractSampler"]
)
def test_a_piece_must_state_its_vocabulary_axis(abstract):
    """Whether a piece can split the vocabulary is declared too, even by a piece
    that states everything it reads."""
    import speculax

    class ReadsNothing(getattr(speculax, abstract)):
        reads_uniforms: ClassVar[bool] = False
        reads_draft_probs: ClassVar[bool] = False

        def __call__(self, *args, **kwargs):
            raise NotImplementedError

    with pytest.raises(TypeError, match="axis_name"):
        ReadsNothing()


def test_the_pieces_must_agree_on_the_vocabulary_axis():
    import speculax

    with pytest.raises(ValueError, match="acceptance 'vocab', residual 'model'"):
        speculax.SpeculativeStep(
            speculax.RatioAcceptance(axis_name="vocab"),
            residual=speculax.Residual(axis_name="model"),
            sampler=speculax.InverseCDF(axis_name="vocab"),
        )
    with pytest.raises(ValueError, match="sampler None"):
        speculax.SpeculativeStep(
            speculax.RatioAcceptance(axis_name="vocab"),
            residual=speculax.Residual(axis_name="vocab"),
        )


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"throw": False}, "throw=False needs check_values=True"),
        ({"check_all_probs": True}, "check_all_probs=True needs check_values=True"),
    ],
)
def test_flags_that_need_the_value_checks(flags, message):
    """Returning codes, or scanning every probability, without checking anything
    would be a silent no-op: refused when the step is built."""
    import speculax

    with pytest.raises(ValueError, match=re.escape(message)):
        speculax.SpeculativeStep(check_values=False, **flags)


@pytest.mark.parametrize("vocab", [1, 5, 256, 300, 1000])
def test_first_argmax_is_jnp_argmax(vocab):
    """The blocked argmax that greedy verification uses gives `jnp.argmax`'s answer,
    ties and infinities included, whether or not the blocks divide the vocabulary;
    a row with a NaN gets an index inside it."""
    import jax

    from speculax._core._numerics import first_argmax

    rng = np.random.default_rng(vocab)
    values = [0.0, -0.0, 0.5, 1.0, -np.inf, np.inf]
    rows = rng.choice(values, size=(200, vocab), p=[0.25, 0.1, 0.3, 0.2, 0.1, 0.05])
    rows = jnp.asarray(rows, jnp.float32)
    np.testing.assert_array_equal(
        jax.jit(first_argmax)(rows), jnp.argmax(rows, axis=-1)
    )
    with_nan = rows.at[:, vocab // 2].set(jnp.nan)
    index = np.asarray(jax.jit(first_argmax)(with_nan))
    assert ((index >= 0) & (index < vocab)).all()


@pytest.mark.slow
def test_new_pieces_join_the_fused_draw():
    """How a residual and a sampler run as one pass is stated by the pieces: a
    residual of your own that subclasses `AbstractFusedResidual` is drawn by its
    `fused_draw`, falling back to its weights where that returns `None`; a sampler
    that subclasses `AbstractBlockSumSampler` is drawn from block sums by the fused
    residuals and the tree steps, never from the weights; a residual the step does
    not know as fused is drawn from its weights."""
    import speculax
    from doubles import BlockSumsOnly, DelegatingResidual
    from inputs import random_inputs
    from speculax import AbstractFusedResidual

    weights_calls = []

    class ResidualOfMyOwn(AbstractFusedResidual):
        reads_draft_probs: ClassVar[bool] = True
        axis_name: None = eqx.field(static=True, default=None, init=False)

        def __call__(self, *args, **kwargs):
            weights_calls.append(None)
            return speculax.Residual()(*args, **kwargs)

        def fused_draw(self, sampler, *args, **kwargs):
            return speculax.Residual().fused_draw(sampler, *args, **kwargs)

    def same(first, second):
        for key in ("num_accepted", "tokens"):
            np.testing.assert_array_equal(first[key], second[key])

    def run(step, inputs):
        # Compiled: eagerly, every loop of the tree steps compiles at each call.
        return eqx.filter_jit(step)(**inputs)

    inputs = random_inputs(3, 6, 3, 20)
    ours = speculax.SpeculativeStep(residual=ResidualOfMyOwn())
    same(run(ours, inputs), run(speculax.SpeculativeStep(), inputs))
    assert not weights_calls
    with_argmax = eqx.tree_at(lambda step: step.sampler, ours, speculax.Argmax())
    same(
        run(with_argmax, inputs),
        run(speculax.SpeculativeStep(sampler=speculax.Argmax()), inputs),
    )
    assert len(weights_calls) == 1

    default_block_size = speculax.SpeculativeStep(sampler=speculax.InverseCDF(8))
    same(
        run(speculax.SpeculativeStep(sampler=BlockSumsOnly()), inputs),
        run(default_block_size, inputs),
    )
    block = speculax.block_step()
    same(
        run(eqx.tree_at(lambda step: step.sampler, block, BlockSumsOnly()), inputs),
        run(
            eqx.tree_at(lambda step: step.sampler, block, speculax.InverseCDF(8)),
            inputs,
        ),
    )
    with pytest.raises(AssertionError, match="drawn from the weights"):
        speculax.SpeculativeStep(
            residual=DelegatingResidual(), sampler=BlockSumsOnly()
        )(**inputs)


@pytest.mark.slow
def test_tree_steps_draw_from_a_new_block_sum_sampler():
    """The tree steps draw their final token from the block sums of any sampler
    that subclasses `AbstractBlockSumSampler`, never from its weights."""
    import speculax
    from doubles import BlockSumsOnly
    from inputs import random_inputs

    inputs = random_inputs(3, 6, 3, 20)
    # The same drafts as a tree, each node the only child of the one before.
    batch, num_draft = inputs["draft_tokens"].shape
    tree = {
        "parents": np.tile(np.arange(num_draft), (batch, 1)),
        "tree_tokens": inputs["draft_tokens"],
        "draft_probs": np.concatenate(
            [inputs["draft_probs"], inputs["draft_probs"][:, -1:]], axis=1
        ),
        "target_probs": inputs["target_probs"],
        "accept_uniforms": inputs["accept_uniforms"],
        "sample_uniforms": inputs["sample_uniforms"],
    }
    for tree_step in (speculax.TreeStep, speculax.TraversalStep):
        out = eqx.filter_jit(tree_step(sampler=BlockSumsOnly()))(**tree)
        expected = eqx.filter_jit(tree_step(sampler=speculax.InverseCDF(8)))(**tree)
        np.testing.assert_array_equal(out["tokens"], expected["tokens"])
