"""Target-only trees (deterministic drafts, `draft_probs=None`): a rejected child
takes its token out of the target row, and only the final draw reads a whole row.
Against the same rule called on whole rows, a token drafted twice, both row
strategies, and the enumeration's refusal of a rule that misstates taking out."""

import equinox as eqx
import jax
import numpy as np
import pytest


PARENTS = [0, 0, 0, 1, 1, 2, 4, -1]


def _target_only_inputs(seed: int, batch: int, vocab: int, dtype=np.float32) -> dict:
    """Trees of `PARENTS` whose tokens are drawn from their parent's target row, so
    that children pass and fail, with peaked target rows."""
    rng = np.random.default_rng(seed)
    num_nodes = len(PARENTS)
    logits = 3 * rng.standard_normal((batch, num_nodes + 1, vocab))
    target = np.exp(logits - logits.max(-1, keepdims=True))
    target /= target.sum(-1, keepdims=True)
    parent_rows = target[:, np.maximum(PARENTS, 0)]
    tokens = np.array(
        [[rng.choice(vocab, p=row / row.sum()) for row in rows] for rows in parent_rows]
    )
    return {
        "parents": np.tile(PARENTS, (batch, 1)),
        "tree_tokens": tokens,
        "draft_probs": None,
        "target_probs": target.astype(dtype),
        "accept_uniforms": rng.random((batch, num_nodes)).astype(dtype),
        "sample_uniforms": rng.random(batch).astype(dtype),
    }


@pytest.mark.parametrize(
    "dtype", ["float32", pytest.param("float64", marks=pytest.mark.slow)]
)
def test_taking_tokens_out_agrees_with_the_rule_on_rows(dtype):
    """The mass left is one less the probabilities taken out, where the rule on rows
    sums what is left: the answers agree, every row, on peaked trees of several
    rejections per node."""
    import speculax

    class OnRows(speculax.AbstractSiblingRule):
        """`IndependentSiblings` called on whole rows."""

        takes_out_one_hot_drafts = False
        subtracts_a_kept_draft = True
        elementwise = True

        def __call__(self, target, draft, rejected):
            return speculax.IndependentSiblings()(target, draft, rejected)

    with jax.enable_x64(dtype == "float64"):
        inputs = _target_only_inputs(3, 200, 50, np.dtype(dtype).type)
        taken_out = eqx.filter_jit(speculax.TreeStep())(**inputs)
        on_rows = eqx.filter_jit(speculax.TreeStep(OnRows()))(**inputs)
    for name in ("num_accepted", "tokens", "accepted_nodes"):
        np.testing.assert_array_equal(taken_out[name], on_rows[name], err_msg=name)
    accepted = np.asarray(taken_out["num_accepted"])
    assert 0 in accepted and np.max(accepted) >= 3


def test_a_token_taken_out_cannot_pass_again():
    """Two children of the root with the same token: once the first fails, the token
    is out of the target row, and the second fails whatever its coin; the third
    child is then tested against the row without it."""
    import speculax

    target = np.full((1, 4, 5), 0.1, np.float32)
    target[0, 0] = [0.5, 0.3, 0.1, 0.05, 0.05]
    run = eqx.filter_jit(speculax.TreeStep())
    out = run(
        parents=np.array([[0, 0, 0]]),
        tree_tokens=np.array([[0, 0, 1]]),
        draft_probs=None,
        target_probs=target,
        # 0.9 >= p(0) fails the first; 0 < anything positive would pass the second;
        # 0.5 < 0.3 / (1 - 0.5) passes the third.
        accept_uniforms=np.array([[0.9, 0.0, 0.5]], np.float32),
        sample_uniforms=np.array([0.5], np.float32),
    )
    assert out["accepted_nodes"].tolist() == [[3, -1, -1, -1]]
    assert out["tokens"][0, 0] == 1


def test_the_final_draw_takes_the_rejected_tokens_out():
    """Every child of the root fails: the token is drawn from the root's row without
    their tokens, and a uniform that would land on one lands past it."""
    import speculax

    target = np.full((1, 3, 4), 0.25, np.float32)
    run = eqx.filter_jit(speculax.TreeStep())
    out = run(
        parents=np.array([[0, 0]]),
        tree_tokens=np.array([[0, 1]]),
        draft_probs=None,
        target_probs=target,
        accept_uniforms=np.array([[0.5, 0.9]], np.float32),
        # Tokens 2 and 3 are left, each of weight 0.25: 0.4 of their mass is in 2.
        sample_uniforms=np.array([0.4], np.float32),
    )
    assert out["tokens"].tolist() == [[2, -1, -1]]


def test_both_row_strategies_take_tokens_out_alike():
    """The recursive walk on target-only trees, one tree at a time and all at once:
    the same answers to the last bit."""
    import speculax

    inputs = _target_only_inputs(4, 24, 40)
    answers = []
    for strategy in ("one at a time", "all at once"):
        with speculax.row_strategy(strategy):
            answers.append(eqx.filter_jit(speculax.TreeStep())(**inputs))
    for name in ("num_accepted", "tokens", "accepted_nodes"):
        np.testing.assert_array_equal(answers[0][name], answers[1][name])


def test_the_enumeration_refuses_a_rule_that_misstates_taking_out():
    """A rule that states `takes_out_one_hot_drafts` but leaves the target as it
    was: the step would take the token out, so the enumeration cannot call the
    rule's own law the step's, and refuses it by name."""
    import speculax
    import speculax.testing

    class KeepsTarget(speculax.AbstractSiblingRule):
        takes_out_one_hot_drafts = True
        subtracts_a_kept_draft = False
        elementwise = True

        def __call__(self, target, draft, rejected):
            return target, draft

    def model(prefix):
        return np.array([0.5, 0.3, 0.2])

    with pytest.raises(ValueError, match="states takes_out_one_hot_drafts"):
        speculax.testing.tree_output_distribution(
            speculax.TreeStep(KeepsTarget()),
            [0, 0],
            model,
            model,
            3,
            drafting="deterministic",
            tree_tokens=[0, 1],
        )


def test_a_row_left_without_mass_draws_from_the_nodes_row():
    """Row 0's target row holds 0.6 in all: once both children fail, the mass left
    (0.4) rounds nothing of what the row holds, and the token is drawn from the row
    as given, as the residual of the rule on rows falls back to it. Row 1, drawn in
    the same batch, keeps its tokens taken out."""
    import speculax

    target = np.zeros((2, 3, 4), np.float32)
    target[:, 1:] = 0.25
    target[0, 0] = [0.3, 0.3, 0, 0]
    target[1, 0] = [0.25, 0.25, 0.25, 0.25]
    out = eqx.filter_jit(speculax.TreeStep())(
        parents=np.array([[0, 0], [0, 0]]),
        tree_tokens=np.array([[0, 1], [0, 1]]),
        draft_probs=None,
        target_probs=target,
        accept_uniforms=np.array([[0.5, 0.9], [0.5, 0.9]], np.float32),
        sample_uniforms=np.array([0.6, 0.4], np.float32),
    )
    assert out["tokens"].tolist() == [[1, -1, -1], [2, -1, -1]]


# A negative value, which no total shows, where no test reads it; and a NaN at a
# token taken out. The other four cases are the extended tier.
@pytest.mark.parametrize(
    "bad, where",
    [
        (-0.25, "untested"),
        (np.nan, "taken out"),
        pytest.param(np.nan, "untested", marks=pytest.mark.slow),
        pytest.param(np.inf, "untested", marks=pytest.mark.slow),
        pytest.param(-0.25, "taken out", marks=pytest.mark.slow),
        pytest.param(np.inf, "taken out", marks=pytest.mark.slow),
    ],
)
def test_a_bad_value_in_the_row_drawn_from_is_named(bad, where):
    """The walk reads no row whole, so the row the token is drawn from is checked
    as it is drawn from: a bad value anywhere in it, at a token taken out too, names
    `target_probs`; the other rows' outputs are untouched."""
    import speculax

    target = np.full((2, 3, 4), 0.25, np.float32)
    # Both children of the root fail (coins of 0.9 against 0.25): row 0 draws
    # from the root's row, tokens 0 and 1 taken out.
    target[0, 0, 3 if where == "untested" else 0] = bad
    inputs = dict(
        parents=np.array([[0, 0], [0, 0]]),
        tree_tokens=np.array([[0, 1], [0, 1]]),
        draft_probs=None,
        target_probs=target,
        accept_uniforms=np.full((2, 2), 0.9, np.float32),
        sample_uniforms=np.array([0.5, 0.5], np.float32),
    )
    step = speculax.TreeStep(throw=False)
    out, result = eqx.filter_jit(step.with_result)(**inputs)
    messages = speculax.failure_messages(result)
    assert messages[0].startswith("target_probs must be finite"), messages
    assert messages[1] == ""
    assert out["tokens"].tolist()[1] == [3, -1, -1]
