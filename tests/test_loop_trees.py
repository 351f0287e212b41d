"""The loop with a draft tree: lossless over many steps by exact enumeration for every
drafting mode and both tree steps, negative controls (a sibling rule that does not
match the drafting, a drafter that fills the tree otherwise than it says), a
chi-square test of the jitted loop, both row strategies and batch invariance bit for
bit, and the checks of its arguments."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import speculax
import speculax.testing
from test_loop import markov_pair, pooled


SLOW = pytest.mark.slow
# Each sibling rule with the drafting it is lossless for; "top-k" drafts are
# deterministic, verified with the target-only rule.
RULES = {
    "independent": speculax.IndependentSiblings(),
    "without replacement": speculax.SiblingsWithoutReplacement(),
    "top-k": speculax.IndependentSiblings(),
}
# A root with two children, the first of which has a child.
SMALL = (0, 0, 1)
# Two children of the root with two children each.
TWO_BY_TWO = (0, 0, 1, 1, 2, 2)


@functools.cache
def tree_loop(
    drafting: str,
    walk: str,
    parents: tuple[int, ...] = SMALL,
    max_new_tokens: int = 4,
    rule: speculax.AbstractSiblingRule | None = None,
) -> speculax.SpeculativeLoop:
    siblings = RULES[drafting] if rule is None else rule
    step = {
        "recursive": speculax.TreeStep(siblings=siblings),
        "traversal": speculax.TraversalStep(siblings=siblings),
    }[walk]
    return speculax.SpeculativeLoop(
        draft_tree=speculax.DraftTree(parents, drafting=drafting),
        max_new_tokens=max_new_tokens,
        end_token=2,
        step=step,
        # A rule other than the drafting's: the negative control below.
        allow_lossy=rule is not None,
    )


@pytest.mark.parametrize(
    ("drafting", "walk", "parents", "context", "max_new_tokens"),
    [
        ("without replacement", "recursive", SMALL, 1, 4),
        # The extended tier: each other drafting mode and the other walk once (the
        # tree steps' own enumerations in test_trees.py pair every walk with every
        # drafting), the 2 x 2 tree in its most demanding pair (minutes alone) and
        # a longer context.
        pytest.param("independent", "traversal", SMALL, 1, 4, marks=SLOW),
        pytest.param("top-k", "recursive", SMALL, 1, 4, marks=SLOW),
        pytest.param("without replacement", "traversal", TWO_BY_TWO, 1, 4, marks=SLOW),
        pytest.param("without replacement", "recursive", SMALL, 2, 4, marks=SLOW),
    ],
)
def test_tree_loop_is_lossless_exactly(
    drafting, walk, parents, context, max_new_tokens
):
    draft, target = markov_pair(3, context, seed=len(parents) + context)
    loop = tree_loop(drafting, walk, parents, max_new_tokens)
    expected = speculax.testing.target_output_distribution(
        target, [1], max_new_tokens, loop.end_token
    )
    # Not vacuous: many sequences (twelve for the 2 x 2 tree, whose Markov pair rules
    # out some transitions), some ended early by the end token.
    assert len(expected) > 10
    assert any(len(tokens) < loop.max_new_tokens for tokens in expected)
    assert speculax.testing.loop_lossless_error(loop, draft, target, [1]) < 1e-12


# Traversal, whose walk differs most from the recursive one of the tree steps' own
# negative controls in test_trees.py.
@SLOW
@pytest.mark.parametrize("walk", ["traversal"])
def test_exact_test_catches_siblings_verified_with_the_wrong_rule(walk):
    # Children drawn without replacement, verified as if drawn independently.
    draft, target = markov_pair(3, 1, seed=0)
    wrong = tree_loop("without replacement", walk, rule=speculax.IndependentSiblings())
    assert speculax.testing.loop_lossless_error(wrong, draft, target, [1]) > 0.01


@SLOW
def test_exact_test_catches_a_drafter_that_fills_the_tree_otherwise(monkeypatch):
    import speculax._loop._tree_round as tree_round

    honest = tree_round._children_drawn

    def same_uniform_for_every_child(drafted, tree, node, probs, draft_uniforms):
        # Every child of a node drawn with its first child's uniform.
        first = draft_uniforms[:, tree.children(node)[0] - 1]
        return honest(
            drafted,
            tree,
            node,
            probs,
            jnp.broadcast_to(first[:, None], draft_uniforms.shape),
        )

    monkeypatch.setattr(tree_round, "_children_drawn", same_uniform_for_every_child)
    draft, target = markov_pair(3, 1, seed=4)
    # Three tokens: a program of its own, traced with the wrong drafter.
    loop = tree_loop("independent", "recursive", max_new_tokens=3)
    with pytest.raises(ValueError, match="drafter fills the draft tree"):
        speculax.testing.loop_output_distribution(loop, draft, target, [1])


# The jitted loop on many rows: even rows after the prompt [1, 0], for the
# chi-square test; odd rows after random prompts of 1 to 3 tokens. The extended
# tier: the default tier samples the loop with chains (tests/test_loop.py).
NUM_ROWS = 20_000
CHI_SQUARE = [
    ("without replacement", "recursive"),
    ("independent", "traversal"),
    ("top-k", "recursive"),
]


@functools.cache
def many_rows(drafting: str, walk: str, strategy: str) -> dict[str, np.ndarray]:
    draft, target = markov_pair(3, 1, seed=11)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 3, size=(NUM_ROWS, 3))
    prompt[::2, :2] = [1, 0]
    lengths = rng.integers(1, 4, size=NUM_ROWS)
    lengths[::2] = 2
    keys = jax.random.split(jax.random.key(5), NUM_ROWS)
    with speculax.row_strategy(strategy):
        out = tree_loop(drafting, walk)(
            draft, target, prompt, key=keys, prompt_lengths=lengths
        )
    return {name: np.asarray(value) for name, value in out.items()}


@SLOW
@pytest.mark.parametrize(("drafting", "walk"), CHI_SQUARE)
def test_jitted_tree_loop_samples_the_target(drafting, walk):
    _, target = markov_pair(3, 1, seed=11)
    out = many_rows(drafting, walk, "one at a time")
    exact = speculax.testing.target_output_distribution(target, [1, 0], 4, 2)
    seen: dict[tuple[int, ...], int] = {}
    for row, length in zip(out["tokens"][::2], out["num_tokens"][::2], strict=True):
        sequence = tuple(row[:length].tolist())
        seen[sequence] = seen.get(sequence, 0) + 1
    assert set(seen) <= set(exact)
    observed, expected = pooled(
        [seen.get(sequence, 0) for sequence in exact],
        [probability * NUM_ROWS / 2 for probability in exact.values()],
    )
    assert len(observed) > 15
    assert stats.chisquare(observed, expected).pvalue > 1e-3


@SLOW
@pytest.mark.parametrize(("drafting", "walk"), CHI_SQUARE)
def test_both_row_strategies_give_the_same_tree_loop(drafting, walk):
    one, every = (
        many_rows(drafting, walk, strategy)
        for strategy in ("one at a time", "all at once")
    )
    for name in one:
        np.testing.assert_array_equal(every[name], one[name], name)
    # Not vacuous: every draft rejected in some rounds, a whole path kept in others.
    accepted = one["num_accepted"]
    assert {0, 1, 2} <= set(accepted[accepted >= 0].tolist())


def random_batch(rows: int, seed: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    prompt = jnp.asarray(rng.integers(0, 3, size=(rows, 3)))
    lengths = jnp.asarray(rng.integers(1, 4, size=rows))
    return prompt, lengths, jax.random.split(jax.random.key(seed), rows)


@SLOW
def test_tree_loop_row_alone_equals_row_in_batch():
    draft, target = markov_pair(3, 1, seed=2)
    loop = tree_loop("independent", "recursive", TWO_BY_TWO, max_new_tokens=8)
    prompt, lengths, keys = random_batch(16, seed=3)
    batch = loop(draft, target, prompt, key=keys, prompt_lengths=lengths)
    for row in (0, 7, 15):
        alone = loop(
            draft,
            target,
            prompt[row : row + 1],
            key=keys[row : row + 1],
            prompt_lengths=lengths[row : row + 1],
        )
        for name in ("tokens", "num_tokens", "num_steps", "num_accepted"):
            np.testing.assert_array_equal(alone[name][0], batch[name][row], name)


def test_a_tree_needs_a_tree_step_and_a_chain_a_chain_step():
    tree = speculax.DraftTree(SMALL, drafting="independent")
    with pytest.raises(TypeError, match="with a draft_tree, step must be a tree step"):
        speculax.SpeculativeLoop(draft_tree=tree, max_new_tokens=2)
    with pytest.raises(TypeError, match="A tree step verifies a draft_tree"):
        speculax.SpeculativeLoop(
            num_draft=2, max_new_tokens=2, step=speculax.TreeStep()
        )
    with pytest.raises(ValueError, match="exactly one of num_draft"):
        speculax.SpeculativeLoop(
            num_draft=2, draft_tree=tree, max_new_tokens=2, step=speculax.TreeStep()
        )
    with pytest.raises(ValueError, match="exactly one of num_draft"):
        speculax.SpeculativeLoop(max_new_tokens=2)
    with pytest.raises(ValueError, match="throw=True"):
        speculax.SpeculativeLoop(
            draft_tree=tree,
            max_new_tokens=2,
            step=speculax.TreeStep(throw=False),
        )


@pytest.mark.parametrize(
    ("drafting", "rule", "expected"),
    [
        ("without replacement", speculax.IndependentSiblings(), "SiblingsWithout"),
        ("independent", speculax.SiblingsWithoutReplacement(), "IndependentSiblings"),
    ],
)
@pytest.mark.parametrize("walk", [speculax.TreeStep, speculax.TraversalStep])
def test_a_sibling_rule_lossy_for_the_drafting_is_refused(
    drafting, rule, expected, walk
):
    tree = speculax.DraftTree(SMALL, drafting=drafting)
    step = walk(siblings=rule)
    with pytest.raises(ValueError, match=f"lossy for that drafting: use {expected}"):
        speculax.SpeculativeLoop(draft_tree=tree, max_new_tokens=2, step=step)
    # Opted into, for a negative control; and top-k drafts take either rule.
    speculax.SpeculativeLoop(
        draft_tree=tree, max_new_tokens=2, step=step, allow_lossy=True
    )
    top_k = speculax.DraftTree(SMALL, drafting="top-k")
    speculax.SpeculativeLoop(draft_tree=top_k, max_new_tokens=2, step=step)


@pytest.mark.parametrize(
    ("parents", "drafting", "match"),
    [
        ((0, 2), "independent", r"parents\[1\] must lie in \[0, 2\)"),
        ((0, -1), "independent", r"parents\[1\] must lie in \[0, 2\)"),
        ((), "independent", "at least one draft node"),
        # Runtime type checking names the argument before the checks do.
        ([[0]], "independent", "parents"),
        ((0, 0), "greedy", "drafting"),
        ((0, 0.5), "independent", "parents"),
    ],
)
def test_draft_tree_refuses_bad_arguments(parents, drafting, match):
    with pytest.raises((ValueError, TypeError), match=match):
        speculax.DraftTree(parents, drafting=drafting)


def test_draft_tree_reads_integers_by_value():
    wide = np.array([0, 0, 1], np.uint64)
    assert speculax.DraftTree(wide, drafting="top-k").parents == SMALL
    with pytest.raises(ValueError, match="must lie in"):
        speculax.DraftTree(np.array([0, 2**32], np.int64), drafting="top-k")


def test_a_top_k_tree_has_no_more_children_than_tokens():
    draft, target = markov_pair(3, 1, seed=0)
    loop = speculax.SpeculativeLoop(
        draft_tree=speculax.DraftTree((0, 0, 0, 0), drafting="top-k"),
        max_new_tokens=2,
        step=speculax.TreeStep(),
    )
    with pytest.raises(ValueError, match="4 children, more than the V = 3 tokens"):
        loop(draft, target, jnp.zeros((1, 1), jnp.int32), key=jax.random.key(0))
