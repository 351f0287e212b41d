"""Drafting without a draft model: prompt lookup's proposals against a reference
written from its definition, what it reads, its refusals, and the loop with it
lossless, exactly (by enumeration) and statistically (the jitted loop)."""

import functools
from typing import final

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, Float, Int
from scipy import stats

import speculax
import speculax.testing
from test_loop import STAT_TOKENS, MarkovModel, markov_pair, sequence_counts


def reference_proposal(history: list[int], lowest: int, highest: int) -> int:
    """The definition, read literally: for $n$ from the longest down, the latest
    earlier run equal to the last $n$ tokens; the token after it, or the last token
    when there is none."""
    last = len(history) - 1
    for n in range(min(highest, last), lowest - 1, -1):
        suffix = history[last - n + 1 :]
        for end in range(last - 1, n - 2, -1):
            if history[end - n + 1 : end + 1] == suffix:
                return history[end + 1]
    return history[last]


@functools.cache
def proposals_of(lookup: speculax.PromptLookup):
    return jax.jit(lookup.proposals)


@pytest.mark.parametrize(("lowest", "highest"), [(1, 3), (2, 2), (1, 1), (2, 4)])
def test_proposals_follow_the_latest_longest_earlier_match(lowest, highest):
    rng = np.random.default_rng(lowest * 10 + highest)
    # Three tokens: repeats of every length up to four are common.
    tokens = rng.integers(0, 3, size=(16, 14))
    positions = np.broadcast_to(np.arange(14), tokens.shape)
    lookup = speculax.PromptLookup(3, min_ngram=lowest, max_ngram=highest)
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
    lookup = speculax.PromptLookup(4)
    before = proposals_of(lookup)(jnp.asarray(tokens), jnp.asarray(positions))
    # Anything past each row's last position read: the buffer's stale drafts.
    past = np.arange(20)[None, :] > positions.max(axis=1, keepdims=True)
    scrambled = np.where(past, rng.integers(0, 4, size=tokens.shape), tokens)
    after = proposals_of(lookup)(jnp.asarray(scrambled), jnp.asarray(positions))
    np.testing.assert_array_equal(before, after)


def test_the_drafts_are_deterministic_under_any_sampling_parameters():
    tokens = jnp.array([[2, 0, 1, 2, 0], [1, 1, 1, 1, 1]])
    positions = jnp.array([[4, 3], [0, 4]])
    lookup = speculax.PromptLookup(5)
    logits = lookup(tokens, positions)
    assert logits.shape == (2, 2, 5)
    proposed = lookup.proposals(tokens, positions)
    assert proposed.tolist() == [[1, 0], [1, 1]]
    one_hot = jax.nn.one_hot(proposed, 5)
    for parameters in ({}, {"temperature": 0.3, "top_k": 2}, {"top_p": 0.5}):
        q = speculax.probs_from_logits(logits, **parameters)
        np.testing.assert_array_equal(q, one_hot)


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"vocab_size": 0}, ValueError, "vocab_size must be positive; got 0"),
        ({"vocab_size": 4, "min_ngram": 0}, ValueError, "min_ngram must be positive"),
        (
            {"vocab_size": 4, "min_ngram": 3, "max_ngram": 2},
            ValueError,
            "min_ngram must be at most max_ngram; got min_ngram=3 and max_ngram=2",
        ),
        ({"vocab_size": 4.0}, TypeError, "vocab_size must be an integer"),
        ({"vocab_size": 4, "max_ngram": True}, TypeError, "max_ngram must be an"),
    ],
)
def test_bad_construction(arguments, error, match, without_runtime_type_checks):
    with pytest.raises(error, match=match):
        speculax.PromptLookup(**arguments)


def test_numpy_integers_are_read_by_value(without_runtime_type_checks):
    """NumPy integers, which runtime type checking refuses for an `int`, are read
    by value without it."""
    lookup = speculax.PromptLookup(np.int64(6), max_ngram=np.uint8(2))
    assert (lookup.vocab_size, lookup.max_ngram) == (6, 2)
    assert type(lookup.vocab_size) is int


def exact_error(
    step: speculax.SpeculativeStep | speculax.LogitsStep,
    draft_sampling: speculax.AbstractDraftSampling,
    parameters: dict,
) -> float:
    """The loop's exact total variation with prompt lookup drafting, on a Markov
    target of four tokens over four tokens after a prompt that repeats itself: one
    setting for the tests and their negative control."""
    _, target = markov_pair(4, 1, seed=5)
    loop = speculax.SpeculativeLoop(
        num_draft=2,
        max_new_tokens=4,
        end_token=3,
        step=step,
        draft_sampling=draft_sampling,
    )
    lookup = speculax.PromptLookup(4, max_ngram=2)
    return speculax.testing.loop_lossless_error(
        loop, lookup, target, [1, 0, 2, 1], **parameters
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
    assert exact_error(step, speculax.SameAsTarget(), parameters) < 1e-12


@final
class SmoothedDrafts(speculax.AbstractDraftSampling):
    """A wrong drafter: half the drafts from the draft's row under the parameters,
    half from the uniform row, so that prompt lookup's drafts are sampled, while a
    `LogitsStep` verifies them as the deterministic one-hot rows of the logits."""

    def __call__(
        self,
        logits: Float[Array, "batch vocab"],
        temperature: Float[Array, " batch"] | None,
        top_k: Int[Array, " batch"] | None,
        top_p: Float[Array, " batch"] | None,
    ) -> Float[Array, "batch vocab"]:
        rows = speculax.SameAsTarget()(logits, temperature, top_k, top_p)
        return 0.5 * rows + 0.5 / logits.shape[-1]


# The exact test of a LogitsStep compiles the enumeration's programs anew: the
# extended tier, beside its positive twin above.
@pytest.mark.slow
def test_the_exact_test_catches_sampled_drafts_verified_as_deterministic_ones():
    parameters = {"temperature": 0.8, "top_k": 3}
    assert exact_error(speculax.LogitsStep(), SmoothedDrafts(), parameters) > 0.01


def test_jitted_loop_with_prompt_lookup_samples_the_target():
    _, target = markov_pair(3, 1, seed=11)
    loop = speculax.SpeculativeLoop(num_draft=3, max_new_tokens=STAT_TOKENS)
    observed, expected = sequence_counts(loop, speculax.PromptLookup(3), target)
    assert len(observed) > 15
    assert stats.chisquare(observed, expected).pvalue > 1e-3


def test_prompt_lookup_keeps_drafts_of_text_that_repeats_itself():
    # A target that mostly cycles 0, 1, 2: the history holds its continuation.
    cycle = [[0.05, 0.9, 0.05], [0.05, 0.05, 0.9], [0.9, 0.05, 0.05]]
    target = MarkovModel(np.log(np.array(cycle)), 1)
    loop = speculax.SpeculativeLoop(num_draft=4, max_new_tokens=40)
    prompt = jnp.tile(jnp.array([0, 1, 2]), (64, 2))
    keys = jax.random.split(jax.random.key(0), 64)
    out = loop(speculax.PromptLookup(3), target, prompt, key=keys)
    # Each call keeps on average more than one draft, where wrong drafts (the last
    # token again, say) would keep about one in twenty.
    tokens_per_call = np.mean(out["num_tokens"] / out["num_steps"])
    assert tokens_per_call > 2
