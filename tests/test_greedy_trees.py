"""Greedy tree verification (`speculax.greedy_tree_step`): SGLang's and sglang-jax's
own cases of `verify_tree_greedy`, the target-only step on one-hot rows, both row
strategies, and the enumeration of its child test."""

import equinox as eqx
import jax
import numpy as np
import pytest


def _peaked_logits(target_predict, vocab: int) -> np.ndarray:
    """Target rows as the engines' tests make them: logits of 1 with 10 at each
    position's most likely token, `(B, M, V)` probabilities."""
    logits = np.ones((*np.shape(target_predict), vocab))
    np.put_along_axis(logits, np.asarray(target_predict)[..., None], 10.0, axis=-1)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    return (probs / probs.sum(-1, keepdims=True)).astype(np.float32)


def _verify_in_engine_format(
    candidates, next_token, next_sibling, target_predict, vocab, num_spec_step
):
    """`greedy_tree_step` on a batch given as SGLang gives it (position 0 the root,
    first-child / next-sibling lists, `target_predict` by position), with SGLang's
    depth limit. Returns `(accept_token_num, accept_index, emitted)`: the tokens
    kept, the flat positions of the root and of each node kept (`b * M + i`, -1
    after), and the emitted tokens of each row."""
    import speculax

    candidates = np.asarray(candidates)
    batch, positions = candidates.shape
    parents, order = speculax.tree_from_linked_lists(next_token, next_sibling)
    rows = np.arange(batch)[:, None]
    step = speculax.greedy_tree_step(max_depth=num_spec_step - 1)
    out = eqx.filter_jit(step)(
        parents,
        candidates[rows, order[:, 1:]],
        None,
        _peaked_logits(target_predict, vocab)[rows, order],
    )
    accepted = np.asarray(out["num_accepted"])
    nodes = np.asarray(out["accepted_nodes"])[:, : num_spec_step - 1]
    flat = np.take_along_axis(order, np.maximum(nodes, 0), axis=1) + positions * rows
    accept_index = np.concatenate(
        [positions * rows, np.where(nodes >= 0, flat, -1)], axis=1
    )
    emitted = [row[row >= 0].tolist() for row in np.asarray(out["tokens"])]
    return accepted.tolist(), accept_index.tolist(), emitted


def test_sglangs_tree_case():
    """The tree case of SGLang's sgl-kernel test, of its JIT kernel's and of
    sglang-jax's (`test_eagle_utils.py`): row 0's root tries position 1 (token 1),
    which fails, then 3 (token 3), then goes down to 4 and 5; row 1's root tries 4
    first, then 5."""
    got = _verify_in_engine_format(
        candidates=[[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]],
        next_token=[[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]],
        next_sibling=[[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]],
        target_predict=[[3, 18, 18, 4, 5, 18], [11, 18, 18, 18, 12, 18]],
        vocab=20,
        num_spec_step=4,
    )
    assert got == (
        [3, 2],
        [[0, 3, 4, 5], [6, 10, 11, -1]],
        [[3, 4, 5, 18], [11, 12, 18]],
    )


@pytest.mark.parametrize(
    "case",
    [
        # SGLang's CPU test of verify_tree_greedy_func with topk=1.
        dict(
            candidates=[[7, 11, 12], [9, 21, 22]],
            target_predict=[[11, 99, 0], [21, 22, 23]],
            num_spec_step=3,
            want=([1, 2], [[0, 1, -1], [3, 4, 5]], [[11, 99], [21, 22, 23]]),
        ),
        # SGLang's JIT kernel tests: every draft accepted, then none.
        pytest.param(
            dict(
                candidates=[[0, 1, 2, 3], [0, 1, 2, 3]],
                target_predict=[[1, 2, 3, 3], [1, 2, 3, 3]],
                num_spec_step=4,
                want=([3, 3], [[0, 1, 2, 3], [4, 5, 6, 7]], [[1, 2, 3, 3]] * 2),
            ),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            dict(
                candidates=[[0, 1, 2, 3], [0, 1, 2, 3]],
                target_predict=[[0, 0, 0, 0], [0, 0, 0, 0]],
                num_spec_step=4,
                want=([0, 0], [[0, -1, -1, -1], [4, -1, -1, -1]], [[0], [0]]),
            ),
            marks=pytest.mark.slow,
        ),
        # sglang-jax's fused chain verification: 0 to 3 drafts kept.
        dict(
            candidates=[
                [10, 11, 12, 13],
                [20, 21, 22, 23],
                [30, 31, 32, 33],
                [40, 41, 42, 43],
            ],
            target_predict=[
                [99, 12, 13, 14],
                [21, 99, 23, 24],
                [31, 32, 99, 34],
                [41, 42, 43, 44],
            ],
            num_spec_step=4,
            want=(
                [0, 1, 2, 3],
                [[0, -1, -1, -1], [4, 5, -1, -1], [8, 9, 10, -1], [12, 13, 14, 15]],
                [[99], [21, 99], [31, 32, 99], [41, 42, 43, 44]],
            ),
        ),
    ],
    ids=["sglang cpu chain", "accept all", "accept none", "sglang-jax chain"],
)
# Each case is a new shape, compiled anew: one from each suite runs in the default
# tier, SGLang's JIT kernel cases in the extended tier.
def test_sglangs_chain_cases(case):
    batch, positions = np.shape(case["candidates"])
    chain = [[*range(1, positions), -1]] * batch
    got = _verify_in_engine_format(
        case["candidates"],
        chain,
        [[-1] * positions] * batch,
        case["target_predict"],
        100,
        case["num_spec_step"],
    )
    assert got == case["want"]


PARENTS = [0, 0, 0, 1, 1, 2, 4, 4, -1]


def _greedy_inputs(seed: int, batch: int, vocab: int) -> dict:
    """Trees of `PARENTS` over peaked target rows whose tokens are their parent's
    most likely token six times in ten, so that paths are kept and cut."""
    rng = np.random.default_rng(seed)
    num_nodes = len(PARENTS)
    logits = 3 * rng.standard_normal((batch, num_nodes + 1, vocab))
    target = np.exp(logits - logits.max(-1, keepdims=True))
    target /= target.sum(-1, keepdims=True)
    most_likely = np.argmax(target[:, np.maximum(PARENTS, 0)], axis=-1)
    other = rng.integers(0, vocab, (batch, num_nodes))
    tokens = np.where(rng.random((batch, num_nodes)) < 0.6, most_likely, other)
    return {
        "parents": np.tile(PARENTS, (batch, 1)),
        "tree_tokens": tokens,
        "target_probs": target.astype(np.float32),
    }


def test_greedy_trees_are_the_target_only_step_on_one_hot_rows():
    """The same answers as `TreeStep` with `draft_probs=None` on the one-hot rows of
    the most likely tokens, whatever the coins; draft probabilities given are not
    read."""
    import speculax

    inputs = _greedy_inputs(5, 64, 30)
    target = inputs["target_probs"]
    one_hot = np.eye(30, dtype=np.float32)[np.argmax(target, axis=-1)]
    rng = np.random.default_rng(6)
    coins = rng.random((64, len(PARENTS))).astype(np.float32)
    uniforms = rng.random(64).astype(np.float32)
    want = eqx.filter_jit(speculax.TreeStep())(
        inputs["parents"], inputs["tree_tokens"], None, one_hot, coins, uniforms
    )
    greedy = eqx.filter_jit(speculax.greedy_tree_step())
    for draft in (None, target[:, ::-1]):
        got = greedy(inputs["parents"], inputs["tree_tokens"], draft, target)
        for name in ("num_accepted", "tokens", "accepted_nodes"):
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    accepted = np.asarray(want["num_accepted"])
    assert 0 in accepted and accepted.max() >= 3


def test_both_row_strategies_verify_greedy_trees_alike():
    import speculax

    inputs = _greedy_inputs(7, 24, 30)
    answers = []
    for strategy in ("one at a time", "all at once"):
        with speculax.row_strategy(strategy):
            step = eqx.filter_jit(speculax.greedy_tree_step())
            answers.append(step(draft_probs=None, **inputs))
    for name in ("num_accepted", "tokens", "accepted_nodes"):
        np.testing.assert_array_equal(answers[0][name], answers[1][name])


@pytest.mark.parametrize("strategy", ["one at a time", "all at once"])
def test_greedy_trees_take_logits_unchecked_and_refuse_them_checked(strategy):
    """Greedy verification reads only which token of a row is most likely, so
    logits (every value negative, the final rows' included) give the tokens of
    their probabilities once the value checks, which read probabilities, are off;
    with the checks on, the logits are refused by name."""
    import speculax

    inputs = _greedy_inputs(7, 24, 30)
    logits = np.log(inputs["target_probs"]) - 3.0
    assert logits.max() < 0
    with speculax.row_strategy(strategy):
        unchecked = eqx.filter_jit(speculax.greedy_tree_step(check_values=False))
        want = unchecked(draft_probs=None, **inputs)
        got = unchecked(
            inputs["parents"], inputs["tree_tokens"], None, logits.astype(np.float32)
        )
        for name in ("num_accepted", "tokens", "accepted_nodes"):
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        assert np.all(np.asarray(got["tokens"])[:, 0] >= 0)
        with pytest.raises(Exception, match="target_probs"):
            speculax.greedy_tree_step()(
                inputs["parents"], inputs["tree_tokens"], None, logits
            )


def _most_likely_model(prefix):
    """A model over 4 tokens whose most likely token depends on the prefix."""
    rng = np.random.default_rng([3, len(prefix), *prefix])
    weights = rng.gamma(1.0, size=4) + 0.05
    return weights / weights.sum()


def test_the_enumeration_walks_the_greedy_test():
    """The enumeration of the greedy step is the target-only step's on the model's
    one-hot rows: the greedy decoding, token by token, with probability 1."""
    import speculax
    import speculax.testing

    parents, tokens = [0, 0, 1, 1, 2, 2], [0, 1, 2, 3, 1, 0]

    def one_hot(prefix):
        return np.eye(4)[np.argmax(_most_likely_model(prefix))]

    greedy = speculax.testing.tree_output_distribution(
        speculax.greedy_tree_step(),
        parents,
        _most_likely_model,
        _most_likely_model,
        4,
        drafting="deterministic",
        tree_tokens=tokens,
    )
    want = speculax.testing.tree_output_distribution(
        speculax.TreeStep(),
        parents,
        one_hot,
        one_hot,
        4,
        drafting="deterministic",
        tree_tokens=tokens,
    )
    assert greedy == want
    assert list(greedy.values()) == [1.0]


def test_the_enumeration_refuses_a_child_test_it_does_not_know():
    import speculax
    import speculax.testing

    class AlwaysPasses(speculax.AbstractChildTest):
        reads_uniforms = False
        reads_draft_probs = False
        reads_most_likely = False

        def __call__(self, target_at, draft_at, uniform, most_likely):
            return jax.numpy.array(True)

    with pytest.raises(ValueError, match="child_test must be RatioChildTest"):
        speculax.testing.tree_output_distribution(
            speculax.TreeStep(child_test=AlwaysPasses()),
            [0, 0],
            _most_likely_model,
            _most_likely_model,
            4,
            drafting="deterministic",
            tree_tokens=[0, 1],
        )
