"""The drafters that read the target's features, Medusa's heads and the EAGLE-style
head: their rows against a NumPy reference written from their definitions, the loop
with each lossless, exactly (by enumeration) and statistically (the jitted loop),
a row alone as in a batch, and their refusals."""

import dataclasses
from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import speculax
from test_drafters import FeatureBigram, exact_error
from test_loop import STAT_TOKENS, markov_pair, sequence_counts


VOCAB, WIDTH = 4, 3


def features(cache):
    return cache["features"]


def target(vocab: int = VOCAB) -> FeatureBigram:
    """A bigram target whose feature at a position is a row of an embedding of the
    token there, kept in its cache."""
    _, model = markov_pair(vocab, 1, seed=21)
    embedding = np.random.default_rng(21).normal(size=(vocab, WIDTH))
    return FeatureBigram(model.logits, embedding)


def medusa(vocab: int = VOCAB, heads: int = 3) -> speculax.MedusaHeads:
    rng = np.random.default_rng(22)
    return speculax.MedusaHeads(
        rng.normal(size=(heads, WIDTH, WIDTH)),
        rng.normal(size=(heads, WIDTH)),
        rng.normal(size=(WIDTH, vocab)),
        features=features,
    )


def eagle(vocab: int = VOCAB) -> speculax.EagleHead:
    rng = np.random.default_rng(23)
    return speculax.EagleHead(
        rng.normal(size=(vocab, WIDTH)),
        rng.normal(size=(2 * WIDTH, WIDTH)) / 2,
        rng.normal(size=(WIDTH, WIDTH)),
        rng.normal(size=WIDTH),
        rng.normal(size=(WIDTH, vocab)),
        features=features,
    )


def silu(x):
    return x / (1 + np.exp(-x))


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def reference_logits(head, embedding, history: list[int], drafts: list[int]):
    """Each draft's logits, read literally from the head's definition: the feature
    of the token before the history's last one (zeros for a history of one), the
    history's last token, then the drafts."""
    feature = embedding[history[-2]] if len(history) > 1 else np.zeros(WIDTH)
    rows = []
    if isinstance(head, speculax.MedusaHeads):
        for k in range(len(drafts)):
            hidden = feature + silu(feature @ head.weight[k] + head.bias[k])
            rows.append(hidden @ head.lm_head)
        return np.array(rows)
    for token in [history[-1], *drafts[:-1]]:
        fused = np.concatenate([feature, head.embedding[token]]) @ head.fuse
        feature = fused + silu(fused @ head.weight + head.bias)
        rows.append(feature @ head.lm_head)
    return np.array(rows)


@pytest.mark.parametrize("make", [medusa, eagle], ids=["Medusa", "EAGLE"])
def test_a_round_draws_from_the_rows_of_the_definition(make):
    head, model = make(), target()
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, VOCAB, size=(5, 6))
    lengths = np.array([6, 1, 3, 2, 6])
    loop = speculax.SpeculativeLoop(num_draft=3, max_new_tokens=2)
    state = loop.start(head, model, jnp.asarray(prompt), jnp.asarray(lengths))
    uniforms = jax.random.uniform(jax.random.key(0), (5, 3))
    draft = eqx.filter_jit(head.draft)
    drafts = draft(state, uniforms, 3, speculax.SameAsTarget())
    assert drafts.state is None
    for b, length in enumerate(lengths.tolist()):
        history, tokens = prompt[b, :length].tolist(), drafts.tokens[b].tolist()
        expected = reference_logits(head, model.embedding, history, tokens)
        np.testing.assert_allclose(drafts.rows.logits[b], expected, rtol=1e-5)
        np.testing.assert_allclose(drafts.rows.probs[b], softmax(expected), atol=1e-6)
        # Each token by inverse CDF of its row.
        cdf = np.cumsum(drafts.rows.probs[b], axis=-1)
        drawn = (cdf < np.asarray(uniforms[b])[:, None]).sum(-1)
        assert tokens == drawn.tolist()
    # A row alone drafts what it drafts in the batch, bit for bit.
    alone = loop.start(head, model, jnp.asarray(prompt[1:2]), jnp.asarray(lengths[1:2]))
    drafted = draft(alone, uniforms[1:2], 3, speculax.SameAsTarget())
    np.testing.assert_array_equal(drafted.tokens, drafts.tokens[1:2])
    np.testing.assert_array_equal(drafted.rows.probs, drafts.rows.probs[1:2])


@pytest.mark.parametrize("make", [medusa, eagle], ids=["Medusa", "EAGLE"])
def test_loop_with_a_feature_head_is_lossless_exactly(make):
    assert exact_error(make(), target=target()) < 1e-12


@pytest.mark.slow
@pytest.mark.parametrize("make", [medusa, eagle], ids=["Medusa", "EAGLE"])
def test_loop_with_a_feature_head_is_lossless_exactly_under_sampling(make):
    parameters = {"temperature": 0.7, "top_k": 3}
    error = exact_error(make(), speculax.LogitsStep(), parameters, target())
    assert error < 1e-12


@pytest.mark.parametrize("make", [medusa, eagle], ids=["Medusa", "EAGLE"])
def test_jitted_loop_with_a_feature_head_samples_the_target(make):
    loop = speculax.SpeculativeLoop(num_draft=3, max_new_tokens=STAT_TOKENS)
    observed, expected = sequence_counts(loop, make(3), target(3))
    assert stats.chisquare(observed, expected).pvalue > 1e-3


def medusa_of(shapes: list[tuple[int, ...]]) -> speculax.MedusaHeads:
    weight, bias, lm_head = (np.zeros(shape) for shape in shapes)
    return speculax.MedusaHeads(weight, bias, lm_head, features=features)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda: medusa_of([(2, 3, 3), (2, 4), (3, 4)]),
            r"got weight of shape \(2, 3, 3\) and bias of shape \(2, 4\)",
        ),
        (
            lambda: medusa_of([(2, 3, 3), (2, 3), (4, 4)]),
            r"lm_head must have shape \(F, V\) = \(3, V\)",
        ),
        (
            lambda: medusa_of([(3, 3), (2, 3), (3, 4)]),
            "weight must be a float array of 3 dimensions",
        ),
        (
            lambda: speculax.EagleHead(
                *(np.zeros(shape) for shape in [(4, 3), (3, 3), (3, 3), 3, (3, 4)]),
                features=features,
            ),
            r"fuse must have shape \(6, 3\)",
        ),
    ],
    ids=["Medusa bias", "Medusa lm_head", "Medusa weight", "EAGLE fuse"],
)
def test_bad_construction(make, match, without_runtime_type_checks):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    ("head", "num_draft", "match"),
    [
        (
            lambda: medusa(heads=2),
            3,
            r"num_draft \(a draft tree's depth\) must be at most the number of "
            "heads, 2",
        ),
        (lambda: medusa(vocab=5), 2, "lm_head must score the target's vocabulary"),
        (lambda: eagle(vocab=5), 2, "embedding and lm_head must cover"),
    ],
    ids=["too few heads", "Medusa vocabulary", "EAGLE vocabulary"],
)
def test_the_loop_refuses_a_head_that_does_not_fit(head, num_draft, match):
    loop = speculax.SpeculativeLoop(num_draft=num_draft, max_new_tokens=2)
    with pytest.raises(ValueError, match=match):
        loop(head(), target(), jnp.zeros((1, 2), jnp.int32), key=jax.random.key(0))


# Trees of a head's drafts, filled from its rows: Medusa's candidates by rank (each
# depth's head ranks the children, whatever the path), the EAGLE-style head's
# children drawn without replacement from its row after the node's path.
TREES = {
    "Medusa top-k": (medusa, "top-k", speculax.IndependentSiblings()),
    "EAGLE without replacement": (
        eagle,
        "without replacement",
        speculax.SiblingsWithoutReplacement(),
    ),
}


def head_tree_loop(
    drafting: str,
    siblings: speculax.AbstractSiblingRule,
    max_new_tokens: int,
    allow_lossy: bool = False,
) -> speculax.SpeculativeLoop:
    # A root with two children, the first of which has a child: depth 2.
    return speculax.SpeculativeLoop(
        draft_tree=speculax.DraftTree([0, 0, 1], drafting=drafting),
        step=speculax.TreeStep(siblings=siblings),
        max_new_tokens=max_new_tokens,
        end_token=2,
        allow_lossy=allow_lossy,
    )


@pytest.mark.parametrize("tree", list(TREES))
def test_a_tree_of_a_heads_drafts_is_lossless_exactly(tree):
    make, drafting, siblings = TREES[tree]
    loop = head_tree_loop(drafting, siblings, max_new_tokens=4)
    error = speculax.testing.loop_lossless_error(loop, make(3), target(3), [1, 0])
    assert error < 1e-12


def test_the_exact_test_catches_a_heads_tree_verified_by_the_wrong_rule():
    # Children drawn independently, verified as if drawn without replacement.
    loop = head_tree_loop(
        "independent", speculax.SiblingsWithoutReplacement(), 3, allow_lossy=True
    )
    error = speculax.testing.loop_lossless_error(loop, eagle(3), target(3), [1, 0])
    assert error > 0.01


@pytest.mark.slow
def test_the_exact_test_catches_a_tree_filled_from_the_wrong_rows(monkeypatch):
    import speculax._loop._tree_round as tree_round

    honest = tree_round.tree_rows

    def first_row_at_every_depth(*arguments):
        # Every node's children from head 0, whatever its depth.
        rows = honest(*arguments)
        return jnp.broadcast_to(rows[:, :1], rows.shape)

    monkeypatch.setattr(tree_round, "tree_rows", first_row_at_every_depth)
    # Three tokens: a program of its own, traced with the wrong rows.
    loop = head_tree_loop("top-k", speculax.IndependentSiblings(), 3)
    with pytest.raises(ValueError, match="drafter fills the draft tree"):
        speculax.testing.loop_output_distribution(loop, medusa(3), target(3), [1, 0])


# The EAGLE-style head's tree, whose rows depend on the path, in the default tier.
SLOW_MEDUSA_TREE = [
    pytest.param("Medusa top-k", marks=pytest.mark.slow),
    "EAGLE without replacement",
]


@pytest.mark.parametrize("tree", SLOW_MEDUSA_TREE)
def test_jitted_loop_with_a_tree_of_a_heads_drafts_samples_the_target(tree):
    make, drafting, siblings = TREES[tree]
    loop = head_tree_loop(drafting, siblings, max_new_tokens=STAT_TOKENS)
    observed, expected = sequence_counts(loop, make(3), target(3))
    assert stats.chisquare(observed, expected).pvalue > 1e-3


@pytest.mark.parametrize("tree", SLOW_MEDUSA_TREE)
def test_a_row_of_a_heads_tree_loop_is_the_row_alone(tree):
    make, drafting, siblings = TREES[tree]
    loop = head_tree_loop(drafting, siblings, max_new_tokens=6)
    rng = np.random.default_rng(4)
    prompt = jnp.asarray(rng.integers(0, 3, size=(5, 4)))
    keys = jax.random.split(jax.random.key(2), 5)
    batch = loop(make(3), target(3), prompt, key=keys, temperature=0.8)
    alone = loop(make(3), target(3), prompt[3:4], key=keys[3:4], temperature=0.8)
    for name, value in alone.items():
        if name != "num_target_calls":
            np.testing.assert_array_equal(value, batch[name][3:4])


@final
class KeepsAState(speculax.AbstractDrafter):
    """Medusa's heads with a state of their own, which a tree filled from the
    rows would leave as it was."""

    heads: speculax.MedusaHeads

    def init(self, prompt, slots, num_draft, vocab_size):
        return jnp.zeros(prompt.shape[0])

    def draft(self, state, uniforms, num_draft, draft_sampling):
        drafts = self.heads.draft(state, uniforms, num_draft, draft_sampling)
        return drafts._replace(state=state.drafter_state + 1)

    def drawn_after(
        self, tokens, length, target_cache, num_draft, parameters, draft_sampling
    ):
        return self.heads.drawn_after(
            tokens, length, target_cache, num_draft, parameters, draft_sampling
        )


@pytest.mark.parametrize(
    ("drafter", "error", "match"),
    [
        (lambda: KeepsAState(medusa()), TypeError, "KeepsAState keeps one"),
        (
            lambda: speculax.PromptLookup(),
            TypeError,
            "PromptLookup drafts deterministic tokens without rows",
        ),
        (lambda: medusa(heads=1), ValueError, "at most the number of heads, 1"),
    ],
    ids=["a state", "deterministic drafts", "a tree deeper than the heads"],
)
def test_the_loop_refuses_a_tree_it_cannot_fill(drafter, error, match):
    loop = head_tree_loop("top-k", speculax.IndependentSiblings(), 2)
    with pytest.raises(error, match=match):
        loop(drafter(), target(), jnp.zeros((1, 2), jnp.int32), key=jax.random.key(0))


def test_a_head_whose_row_at_a_node_is_no_distribution_is_named():
    # NaN weights: every row of the heads is NaN.
    broken = eqx.tree_at(lambda head: head.lm_head, medusa(3), np.full((3, 3), np.nan))
    loop = head_tree_loop("top-k", speculax.IndependentSiblings(), 2)
    named = r"the drafter \(MedusaHeads\) gives a draft row at a node"
    with pytest.raises(RuntimeError, match=named):
        loop(broken, target(3), jnp.zeros((1, 2), jnp.int32), key=jax.random.key(0))


HALF_EMBEDDING = (
    np.random.default_rng(25).normal(size=(VOCAB, WIDTH)).astype(np.float16)
)


def half_features(buffer):
    """Float16 features of the tokens a cacheless target's buffer holds."""
    return jnp.asarray(HALF_EMBEDDING)[buffer]


def widened_features(buffer):
    """The same features' values, in float32."""
    return jnp.asarray(HALF_EMBEDDING, jnp.float32)[buffer]


def test_the_eagle_style_head_reads_features_narrower_than_its_weights():
    # The head predicts features in its weights' dtype; a target's float16 ones
    # enter its scan widened, as if given so.
    target = speculax.Cacheless(markov_pair(VOCAB, 1, seed=5)[1])
    loop = speculax.SpeculativeLoop(num_draft=3, max_new_tokens=6)
    prompt = jnp.asarray([[1, 0, 2], [3, 3, 1]])
    half, widened = (
        loop(
            dataclasses.replace(eagle(), features=f),
            target,
            prompt,
            key=jax.random.key(0),
        )
        for f in (half_features, widened_features)
    )
    np.testing.assert_array_equal(half["tokens"], widened["tokens"])
