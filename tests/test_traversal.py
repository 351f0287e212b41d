"""Traversal verification's deletion in two numbers (`docs/keeping_more.md`, "What
it costs"): the answers of the rows it would keep, and the rows it reads."""

import equinox as eqx
import jax
import numpy as np
import pytest


# A root of four children, each of two, and a chain of three under node 5.
PARENTS = [0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 13, 14]


def _peaked_inputs(batch: int, vocab: int, dtype) -> dict:
    """Trees of many deletions per node: drafts close to peaked targets, coins
    mostly high, and target zeros where the draft has mass, so that some nodes'
    alpha falls to 0."""
    rng = np.random.default_rng(3)
    positions = len(PARENTS) + 1
    target = rng.dirichlet(np.full(vocab, 0.3), (batch, positions))
    target[..., : vocab // 4] = 0
    target /= target.sum(-1, keepdims=True)
    draft = target * np.exp(0.7 * rng.standard_normal(target.shape)) + 0.02
    draft /= draft.sum(-1, keepdims=True)
    # Each node's token drawn from its parent's draft row.
    tokens = [[rng.choice(vocab, p=draft[b, k]) for k in PARENTS] for b in range(batch)]
    return {
        "parents": np.tile(PARENTS, (batch, 1)),
        "tree_tokens": tokens,
        "draft_probs": draft.astype(dtype),
        "target_probs": target.astype(dtype),
        "accept_uniforms": rng.uniform(0.3, 1.0, (batch, len(PARENTS))).astype(dtype),
        "sample_uniforms": rng.random(batch).astype(dtype),
    }


def _on_rows():
    """[`speculax.IndependentSiblings`][] walked on rows: a rule that does not state
    `subtracts_a_kept_draft`, so that the traversal keeps rows for it."""
    import speculax

    class OnRows(speculax.AbstractSiblingRule):
        takes_out_one_hot_drafts = False
        subtracts_a_kept_draft = False
        elementwise = True

        def __call__(self, target, draft, rejected):
            return speculax.IndependentSiblings()(target, draft, rejected)

    return OnRows()


@pytest.mark.parametrize(
    "dtype", ["float32", pytest.param("float64", marks=pytest.mark.slow)]
)
def test_two_numbers_give_the_answers_of_the_rows(dtype):
    """On trees of several deletions per node, nodes whose alpha falls to 0
    included, the traversal that keeps two numbers per node gives the answers of
    the same rule walked on rows, every row's."""
    import speculax

    with jax.enable_x64(dtype == "float64"):
        inputs = _peaked_inputs(200, 40, np.dtype(dtype).type)
        numbers = eqx.filter_jit(speculax.TraversalStep())(**inputs)
        on_rows = eqx.filter_jit(speculax.TraversalStep(_on_rows()))(**inputs)
    for name in ("num_accepted", "tokens", "accepted_nodes"):
        np.testing.assert_array_equal(numbers[name], on_rows[name], err_msg=name)
    # Deletions under nodes of alpha 0: a node with children whose token has no
    # target mass at its parent.
    parent_rows = inputs["target_probs"][:, PARENTS]
    tokens = np.asarray(inputs["tree_tokens"])[..., None]
    no_mass = np.take_along_axis(parent_rows, tokens, axis=-1)[..., 0] == 0
    with_children = sorted(set(PARENTS) - {0})
    assert no_mass[:, np.asarray(with_children) - 1].any()
    # Paths cut at every depth, and kept to the deepest node.
    assert set(np.asarray(numbers["num_accepted"]).tolist()) == set(range(6))


@pytest.mark.slow
def test_two_numbers_keep_the_digits_of_a_good_draft():
    """With a draft within about 1e-6 of the target, the first rejection at the
    root leaves a mass of about 1e-6, and the root's next target is that excess
    scaled up a million times: kept as two numbers it keeps the digits the rows
    keep (`_excess` rounds $p - q$ once), and the answers are the rows', every row,
    on roots of three children that fail unless their alpha is 1, the token drawn
    from what they left."""
    import speculax

    rng = np.random.default_rng(5)
    batch, vocab = 1000, 6
    target = rng.dirichlet(np.ones(vocab), (batch, 4))
    draft = target * (1 + 1e-6 * rng.standard_normal(target.shape))
    draft /= draft.sum(-1, keepdims=True)
    target, draft = target.astype(np.float32), draft.astype(np.float32)
    # The first child drafts the token the draft most overstates.
    first = np.argmax(draft[:, 0] - target[:, 0], axis=-1)
    inputs = {
        "parents": np.zeros((batch, 3), np.int32),
        "tree_tokens": np.stack([first, *rng.integers(0, vocab, (2, batch))], -1),
        "draft_probs": draft,
        "target_probs": target,
        "accept_uniforms": np.full((batch, 3), np.nextafter(np.float32(1), 0)),
        "sample_uniforms": rng.random(batch).astype(np.float32),
    }
    numbers = eqx.filter_jit(speculax.TraversalStep())(**inputs)
    on_rows = eqx.filter_jit(speculax.TraversalStep(_on_rows()))(**inputs)
    for name in ("num_accepted", "tokens", "accepted_nodes"):
        np.testing.assert_array_equal(numbers[name], on_rows[name], err_msg=name)
    # Four roots in ten draw from what their three children left.
    assert np.mean(np.asarray(numbers["num_accepted"]) == 0) > 0.4


def _chain_inputs(root_target_at_draft: float, node_target: list[float]) -> dict:
    """A chain, root -> node 1 (token 0) -> node 2 (token 1), whose node 2 fails
    its coin: the root's target gives token 0 `root_target_at_draft`, where its
    draft gives 0.5, and node 1's target row is `node_target`."""
    rest = (1 - root_target_at_draft) / 3
    return {
        "parents": [[0, 1]],
        "tree_tokens": [[0, 1]],
        "draft_probs": np.array(
            [[[0.5, 0.25, 0.25, 0], [0.25, 0.5, 0.25, 0], [0.25] * 4]], np.float32
        ),
        "target_probs": np.array(
            [[[root_target_at_draft, rest, rest, rest], node_target, [0.25] * 4]],
            np.float32,
        ),
        "accept_uniforms": np.array([[0.5, 0.99]], np.float32),
        "sample_uniforms": np.array([0.3], np.float32),
    }


@pytest.mark.parametrize("strategy", ["one at a time", "all at once"])
def test_a_node_that_is_never_kept_reads_no_row(strategy):
    """Where the root's target gives node 1's token no mass, node 1's alpha is 0:
    it is never kept, nor is anything under it, so deleting node 2 reads none of
    node 1's row, and a NaN there, at a token no test reads, is neither reported
    nor changes the answer (`docs/trees.md`, "Bad input"). The control: where the
    root's target gives the token mass, the same NaN is reported."""
    import speculax

    with_nan = [0.25, 0.25, 0.25, np.nan]
    step = eqx.filter_jit(speculax.TraversalStep(throw=False).with_result)
    with speculax.row_strategy(strategy):
        out, result = step(**_chain_inputs(0.0, with_nan))
        valid, valid_result = step(**_chain_inputs(0.0, [0.25] * 4))
        _, control = step(**_chain_inputs(0.5, with_nan))
    assert speculax.failure_messages(result) == [""]
    assert speculax.failure_messages(valid_result) == [""]
    for name in ("num_accepted", "tokens", "accepted_nodes"):
        np.testing.assert_array_equal(out[name], valid[name], err_msg=name)
    assert int(out["num_accepted"][0]) == 0
    (message,) = speculax.failure_messages(control)
    assert message.startswith("target_probs must be finite"), message
