"""Drafting without a draft model: prompt lookup's proposals against a reference
written from its definition, what it reads, its refusals, and the loop with it
lossless, exactly (by enumeration) and statistically (the jitted loop)."""

import functools
from typing import ClassVar, final

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Float
from scipy import stats

import speculax
import speculax.testing
from test_loop import STAT_TOKENS, MarkovModel, markov_pair, sequence_counts


def reference_proposal(history: list[int], lowest: int, highest: int) -> int:
    """The definition, read literally: for $n$ from the longest down, the latest
    earlier run equal to the last $n$ tokens; the token after it, or -1 when there
    is none."""
    last = len(history) - 1
    for n in range(min(highest, last), lowest - 1, -1):
        suffix = history[last - n + 1 :]
        for end in range(last - 1, n - 2, -1):
            if history[end - n + 1 : end + 1] == suffix:
                return history[end + 1]
    return -1


def reference_chain(history: list[int], num_draft: int, lowest, highest) -> list:
    """A chain of proposals, each after the history and the ones before it, ended
    by the first miss: -1 from there on."""
    chain = []
    for _ in range(num_draft):
        proposal = reference_proposal(history + chain, lowest, highest)
        if proposal < 0:
            return chain + [-1] * (num_draft - len(chain))
        chain.append(proposal)
    return chain


@functools.cache
def proposals_of(lookup: speculax.PromptLookup):
    return jax.jit(lookup.proposals)


@pytest.mark.parametrize(("lowest", "highest"), [(1, 3), (2, 2), (1, 1), (2, 4)])
def test_proposals_follow_the_latest_longest_earlier_match(lowest, highest):
    rng = np.random.default_rng(lowest * 10 + highest)
    # Three tokens: repeats of every length up to four are common.
    tokens = rng.integers(0, 3, size=(16, 14))
    positions = np.broadcast_to(np.arange(14), tokens.shape)
    lookup = speculax.PromptLookup(min_ngram=lowest, max_ngram=highest)
    got = np.asarray(proposals_of(lookup)(jnp.asarray(tokens), jnp.asarray(positions)))
    for b, row in enumerate(tokens.tolist()):
        expected = [
            reference_proposal(row[: t + 1], lowest, highest) for t in range(14)
        ]
        assert got[b].tolist() == expected
    # A row alone proposes what it proposes in the batch.
    alone = proposals_of(lookup)(jnp.asarray(tokens[3:4]), jnp.asarray(positions[3:4]))
    np.testing.assert_array_equal(alone, got[3:4])


def test_proposals_read_only_the_history():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 4, size=(8, 20))
    positions = rng.integers(0, 20, size=(8, 3))
    lookup = speculax.PromptLookup()
    before = proposals_of(lookup)(jnp.asarray(tokens), jnp.asarray(positions))
    # Anything past each row's last position read: the buffer's stale drafts.
    past = np.arange(20)[None, :] > positions.max(axis=1, keepdims=True)
    scrambled = np.where(past, rng.integers(0, 4, size=tokens.shape), tokens)
    after = proposals_of(lookup)(jnp.asarray(scrambled), jnp.asarray(positions))
    np.testing.assert_array_equal(before, after)


@pytest.mark.parametrize("parameters", [{}, {"temperature": 0.3, "top_k": 2}])
def test_a_round_drafts_the_chain_of_proposals_without_rows(parameters):
    """Each draft is the proposal after the history and the drafts before it,
    whatever the uniforms and the sampling parameters, and comes without rows: the
    step verifies deterministic drafts."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 3, size=(6, 9))
    lengths = np.array([9, 4, 1, 7, 9, 2])
    _, target = markov_pair(3, 1, seed=2)
    loop = speculax.SpeculativeLoop(num_draft=4, max_new_tokens=3)
    lookup = speculax.PromptLookup(min_ngram=2, max_ngram=2)
    state = loop.start(
        lookup, target, jnp.asarray(prompt), jnp.asarray(lengths), **parameters
    )
    for seed in range(2):
        uniforms = jax.random.uniform(jax.random.key(seed), (6, 4))
        drafts = lookup.draft(state, uniforms, 4, speculax.SameAsTarget())
        assert drafts.rows is None and drafts.state is None
        for b, length in enumerate(lengths.tolist()):
            history = prompt[b, :length].tolist()
            assert drafts.tokens[b].tolist() == reference_chain(history, 4, 2, 2)
    # A row without a match (a row of one token) drafts nothing.
    assert drafts.tokens[2].tolist() == [-1] * 4


def test_each_row_drafts_at_most_its_maximum():
    rng = np.random.default_rng(1)
    prompt = jnp.asarray(rng.integers(0, 3, size=(6, 9)))
    lengths = jnp.array([9, 4, 1, 7, 9, 2])
    maximum = np.array([0, 1, 4, 2, 3, 4], np.uint8)
    _, target = markov_pair(3, 1, seed=2)
    loop = speculax.SpeculativeLoop(num_draft=4, max_new_tokens=3)
    lookup = speculax.PromptLookup(max_ngram=2, max_draft=maximum)
    uniforms = jnp.zeros((6, 4))
    state = loop.start(lookup, target, prompt, lengths)
    drafts = lookup.draft(state, uniforms, 4, speculax.SameAsTarget())
    for b, length in enumerate(lengths.tolist()):
        chain = reference_chain(prompt[b, :length].tolist(), 4, 1, 2)
        kept = chain[: maximum[b]]
        assert drafts.tokens[b].tolist() == kept + [-1] * (4 - len(kept))
    # Cut at each maximum but the rows without a match (rows 2 and 5).
    assert np.sum(np.asarray(drafts.tokens) >= 0, axis=1).tolist() == [0, 1, 0, 2, 3, 0]
    # A row alone, with its maximum, drafts what it drafts in the batch.
    alone = speculax.PromptLookup(max_ngram=2, max_draft=maximum[3:4])
    state = loop.start(alone, target, prompt[3:4], lengths[3:4])
    one = alone.draft(state, uniforms[3:4], 4, speculax.SameAsTarget())
    np.testing.assert_array_equal(one.tokens, drafts.tokens[3:4])


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"min_ngram": 0}, ValueError, "min_ngram must be positive; got 0"),
        (
            {"min_ngram": 3, "max_ngram": 2},
            ValueError,
            "min_ngram must be at most max_ngram; got min_ngram=3 and max_ngram=2",
        ),
        ({"min_ngram": 2.0}, TypeError, "min_ngram must be an integer"),
        ({"max_ngram": True}, TypeError, "max_ngram must be an"),
        ({"max_draft": 2.0}, TypeError, "max_draft must have an integer dtype"),
        ({"max_draft": [True]}, TypeError, "max_draft must have an integer dtype"),
        ({"max_draft": [1, -1]}, ValueError, r"max_draft must be non-negative"),
        ({"max_draft": [[1]]}, ValueError, r"max_draft must have shape \(\) or"),
    ],
)
def test_bad_construction(arguments, error, match, without_runtime_type_checks):
    with pytest.raises(error, match=match):
        speculax.PromptLookup(**arguments)


def test_a_maximum_per_row_needs_one_entry_per_row():
    _, target = markov_pair(3, 1, seed=2)
    loop = speculax.SpeculativeLoop(num_draft=2, max_new_tokens=2)
    lookup = speculax.PromptLookup(max_draft=jnp.array([1, 2]))
    with pytest.raises(ValueError, match=r"one entry per row, 3; got shape \(2,\)"):
        loop(lookup, target, jnp.zeros((3, 4), jnp.int32), key=jax.random.key(0))


def test_numpy_integers_are_read_by_value(without_runtime_type_checks):
    """NumPy integers, which runtime type checking refuses for an `int`, are read
    by value without it."""
    lookup = speculax.PromptLookup(min_ngram=np.int64(2), max_ngram=np.uint8(2))
    assert (lookup.min_ngram, lookup.max_ngram) == (2, 2)
    assert type(lookup.min_ngram) is int and type(lookup.max_ngram) is int


def exact_error(
    drafter: speculax.AbstractDrafter,
    step: speculax.SpeculativeStep | speculax.LogitsStep | None = None,
    parameters: dict | None = None,
    target: speculax.AbstractCachedModel | speculax.LanguageModel | None = None,
) -> float:
    """The loop's exact total variation with a drafter, by default on a Markov
    target of four tokens, over four tokens after a prompt that repeats itself: one
    setting for the tests and their negative controls."""
    loop = speculax.SpeculativeLoop(
        num_draft=2,
        max_new_tokens=4,
        end_token=3,
        step=step or speculax.SpeculativeStep(),
    )
    return speculax.testing.loop_lossless_error(
        loop,
        drafter,
        target or markov_pair(4, 1, seed=5)[1],
        [1, 0, 2, 1],
        **(parameters or {}),
    )


@pytest.mark.parametrize(
    ("step", "parameters"),
    [
        (speculax.SpeculativeStep(), {}),
        pytest.param(
            speculax.LogitsStep(),
            {"temperature": 0.8, "top_k": 3},
            marks=pytest.mark.slow,
        ),
    ],
    ids=["SpeculativeStep", "LogitsStep top-k"],
)
def test_loop_with_prompt_lookup_is_lossless_exactly(step, parameters):
    lookup = speculax.PromptLookup(max_ngram=2)
    assert exact_error(lookup, step, parameters) < 1e-12


@final
class FullChainResidual(speculax.AbstractResidual):
    """A wrong residual: the step's own, told every chain is whole, so that where a
    chain ends early it corrects the placeholder past the end as a rejected draft
    instead of drawing the bonus token from the target's row."""

    reads_draft_probs: ClassVar[bool] = True
    axis_name: ClassVar[None] = None

    def __call__(
        self, num_accepted, draft_tokens, draft_probs, target_probs, *, num_draft_tokens
    ):
        return speculax.Residual()(
            num_accepted, draft_tokens, draft_probs, target_probs
        )


def test_chains_that_end_early_are_lossless_exactly():
    """Chains of none (no match of two tokens) or one draft (the maximum) of two,
    exactly, token by token and by block verification (whose test at a chain's
    last draft reads where it ends); the residual that ignores where they end is
    refused."""
    lookup = speculax.PromptLookup(min_ngram=2, max_ngram=2, max_draft=1)
    assert exact_error(lookup) < 1e-12
    assert exact_error(lookup, speculax.block_step()) < 1e-12
    wrong = speculax.SpeculativeStep(residual=FullChainResidual())
    assert exact_error(lookup, wrong) > 1e-3


@final
class BigramDrafter(speculax.AbstractDrafter):
    """A drafter of its own, without a state: draft $i$ drawn by inverse CDF from
    the softmax of `table[last token]`. With `misreported`, it reports the rows of
    half the logits, not those it drew from."""

    table: Float[np.ndarray, "vocab vocab"]
    misreported: bool = False

    def init(self, prompt, slots, num_draft, vocab_size):
        return None

    def draft(self, state, uniforms, num_draft, draft_sampling):
        rows = jnp.arange(state.buffer.shape[0])
        last = state.buffer[rows, state.length - 1]
        tokens, logits = [], []
        for i in range(num_draft):
            logits.append(jnp.asarray(self.table)[last])
            last = speculax.InverseCDF()(jax.nn.softmax(logits[-1]), uniforms[:, i])
            tokens.append(last)
        logits = jnp.stack(logits, axis=1)
        reported = logits / 2 if self.misreported else logits
        return speculax.Drafts(
            jnp.stack(tokens, axis=1),
            speculax.DraftRows(reported, jax.nn.softmax(reported)),
            None,
        )

    def drawn_after(
        self, tokens, length, target_cache, num_draft, parameters, draft_sampling
    ):
        positions = (length - 1)[:, None] + jnp.arange(num_draft)
        logits = jnp.asarray(self.table)[jnp.take_along_axis(tokens, positions, 1)]
        return speculax.DraftRows(logits, jax.nn.softmax(logits))


def test_a_drafter_of_ones_own_is_checked_exactly():
    draft, _ = markov_pair(4, 1, seed=3)
    assert exact_error(BigramDrafter(draft.logits)) < 1e-12


@final
class SampledLookup(speculax.AbstractDrafter):
    """A wrong drafter: prompt lookup's proposals, each replaced half the time by a
    uniformly drawn token, reported as deterministic drafts."""

    def init(self, prompt, slots, num_draft, vocab_size):
        return None

    def draft(self, state, uniforms, num_draft, draft_sampling):
        drafts = speculax.PromptLookup(max_ngram=2).draft(
            state, uniforms, num_draft, draft_sampling
        )
        drawn = jnp.floor((uniforms - 0.5) * 8).astype(jnp.int32)
        return drafts._replace(tokens=jnp.where(uniforms < 0.5, drafts.tokens, drawn))

    def drawn_after(
        self, tokens, length, target_cache, num_draft, parameters, draft_sampling
    ):
        return speculax.PromptLookup(max_ngram=2).drawn_after(
            tokens, length, target_cache, num_draft, parameters, draft_sampling
        )


@pytest.mark.parametrize(
    ("drafter", "match"),
    [
        (
            SampledLookup(),
            r"gives the drafts \[\d, \d\], it drew \[\d, \d\] and reported the",
        ),
        (
            BigramDrafter(markov_pair(4, 1, seed=3)[0].logits, misreported=True),
            "reported other rows",
        ),
    ],
    ids=["sampled drafts reported as deterministic", "rows not those drawn from"],
)
def test_the_exact_test_refuses_a_drafter_that_breaks_its_promise(drafter, match):
    with pytest.raises(ValueError, match=match):
        exact_error(drafter)


@final
class FeatureBigram(speculax.AbstractCachedModel):
    """A bigram target that keeps a feature of every token it reads in its cache,
    as a transformer keeps its hidden states there: the feature at a position is
    `embedding[token]`, a known function of the history."""

    logits: Float[np.ndarray, "vocab vocab"]
    embedding: Float[np.ndarray, "vocab feature"]

    def init_cache(self, batch, max_length):
        embedding = jnp.asarray(self.embedding)
        return {"features": jnp.zeros((batch, max_length, embedding.shape[1]))}

    def __call__(self, tokens, positions, mask, cache, cache_length):
        slots = cache_length[:, None] + jnp.arange(tokens.shape[1])
        rows = jnp.arange(tokens.shape[0])[:, None]
        new = jnp.asarray(self.embedding)[tokens]
        features = cache["features"].at[rows, slots].set(new)
        return jnp.asarray(self.logits)[tokens], {"features": features}


@final
class FeatureDrafter(speculax.AbstractDrafter):
    """An EAGLE-like drafter: each draft's logits are `table[token before it]`
    plus a mix of the target's feature `back` slots before the history's end, read
    from the target's cache. With `back=2` the last feature the history has; with
    `back=1` the slot of the history's last token, which holds the entry of a
    rejected draft of the round before (or of an older round)."""

    table: Float[np.ndarray, "vocab vocab"]
    mixing: Float[np.ndarray, "feature vocab"]
    back: int = 2

    def init(self, prompt, slots, num_draft, vocab_size):
        return None

    def _bias(self, target_cache, length):
        slot = length - self.back
        rows = jnp.arange(length.shape[0])
        feature = target_cache["features"][rows, jnp.maximum(slot, 0)]
        feature = jnp.where((slot >= 0)[:, None], feature, 0)
        return feature @ jnp.asarray(self.mixing)

    def draft(self, state, uniforms, num_draft, draft_sampling):
        bias = self._bias(state.target_cache, state.length)
        last = state.buffer[jnp.arange(state.length.shape[0]), state.length - 1]
        tokens, logits = [], []
        for i in range(num_draft):
            logits.append(jnp.asarray(self.table)[last] + bias)
            last = speculax.InverseCDF()(jax.nn.softmax(logits[-1]), uniforms[:, i])
            tokens.append(last)
        logits = jnp.stack(logits, axis=1)
        return speculax.Drafts(
            jnp.stack(tokens, axis=1),
            speculax.DraftRows(logits, jax.nn.softmax(logits)),
            None,
        )

    def drawn_after(
        self, tokens, length, target_cache, num_draft, parameters, draft_sampling
    ):
        positions = (length - 1)[:, None] + jnp.arange(num_draft)
        before = jnp.take_along_axis(tokens, positions, 1)
        bias = self._bias(target_cache, length)
        logits = jnp.asarray(self.table)[before] + bias[:, None]
        return speculax.DraftRows(logits, jax.nn.softmax(logits))


def feature_models(
    vocab: int, back: int, scale: float = 1.0
) -> tuple[FeatureDrafter, FeatureBigram]:
    draft, target = markov_pair(vocab, 1, seed=9)
    rng = np.random.default_rng(9)
    embedding = rng.normal(size=(vocab, 3))
    return (
        FeatureDrafter(draft.logits, scale * rng.normal(size=(3, vocab)), back),
        FeatureBigram(target.logits, embedding),
    )


def test_a_drafter_reading_the_targets_features_is_lossless_exactly():
    drafter, target = feature_models(4, back=2)
    assert exact_error(drafter, target=target) < 1e-12


def test_a_drafter_given_the_features_of_a_rejected_position_samples_the_target():
    """Lossless whatever the drafter reads, since the step is given the rows it drew
    from: only its acceptance moves. The exact test cannot fill the stale entries
    it reads, and refuses it."""
    drafter, target = feature_models(3, back=1)
    loop = speculax.SpeculativeLoop(num_draft=3, max_new_tokens=STAT_TOKENS)
    observed, expected = sequence_counts(loop, drafter, target)
    assert stats.chisquare(observed, expected).pvalue > 1e-3
    with pytest.raises(ValueError, match="at or past cache_length"):
        exact_error(feature_models(4, back=1)[0], target=feature_models(4, 1)[1])
    # Features mixed in so faintly that no step's outcome changes at the cells'
    # middles: the rows the drafter reports from the scrambled entries differ.
    faint, target = feature_models(4, back=1, scale=1e-6)
    with pytest.raises(ValueError, match="reported other rows"):
        exact_error(faint, target=target)


def test_jitted_loop_with_prompt_lookup_samples_the_target():
    _, target = markov_pair(3, 1, seed=11)
    loop = speculax.SpeculativeLoop(num_draft=3, max_new_tokens=STAT_TOKENS)
    # Two drafts of three at most, none without a match: chains that end early.
    lookup = speculax.PromptLookup(max_draft=2)
    observed, expected = sequence_counts(loop, lookup, target)
    assert len(observed) > 15
    assert stats.chisquare(observed, expected).pvalue > 1e-3


def test_prompt_lookup_keeps_drafts_of_text_that_repeats_itself():
    # A target that mostly cycles 0, 1, 2: the history holds its continuation.
    cycle = [[0.05, 0.9, 0.05], [0.05, 0.05, 0.9], [0.9, 0.05, 0.05]]
    target = MarkovModel(np.log(np.array(cycle)), 1)
    loop = speculax.SpeculativeLoop(num_draft=4, max_new_tokens=40)
    prompt = jnp.tile(jnp.array([0, 1, 2]), (64, 2))
    keys = jax.random.split(jax.random.key(0), 64)
    out = loop(speculax.PromptLookup(), target, prompt, key=keys)
    # Each call keeps on average more than one draft, where wrong drafts (the last
    # token again, say) would keep about one in twenty.
    tokens_per_call = np.mean(out["num_tokens"] / out["num_steps"])
    assert tokens_per_call > 2
