"""The drafters that read the target's features, Medusa's heads and the EAGLE-style
head: their rows against a NumPy reference written from their definitions, the loop
with each lossless, exactly (by enumeration) and statistically (the jitted loop),
a row alone as in a batch, and their refusals."""

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
            "num_draft must be at most the number of heads, 2",
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
