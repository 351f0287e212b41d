"""Per-request sampling in the loop: each row's temperature, top-k and top-p, greedy
and sampled rows in one batch, verified by a SpeculativeStep or a LogitsStep;
lossless by exact enumeration and statistically, with a negative control for a
drafter that samples otherwise than the step verifies."""

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
from test_cache import cached
from test_loop import close_pair, markov_pair, pooled


STEPS = {
    "SpeculativeStep": speculax.SpeculativeStep(),
    "LogitsStep": speculax.LogitsStep(),
}
# One request per kind of row: greedy, tempered, top-k, top-p (over a temperature).
REQUESTS = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.7},
    "top-k": {"top_k": 2},
    "top-p": {"temperature": 1.3, "top_p": 0.6},
}


@functools.cache
def models() -> tuple:
    return markov_pair(4, 1, seed=3)


@functools.cache
def sampling_loop(step_name: str, num_draft: int = 2) -> speculax.SpeculativeLoop:
    return speculax.SpeculativeLoop(
        num_draft=num_draft, max_new_tokens=4, end_token=3, step=STEPS[step_name]
    )


# The exact tests compile the enumeration's programs anew for the sampling
# parameters: the extended tier. The default tier samples the jitted loop below.
@pytest.mark.slow
@pytest.mark.parametrize("step_name", list(STEPS))
def test_loop_with_sampling_parameters_is_lossless_exactly(step_name):
    # Every kind of request in one test, so that one compilation serves them all:
    # the parameters are traced.
    draft, target = models()
    loop = sampling_loop(step_name)
    plain = speculax.testing.target_output_distribution(
        target, [1, 0], loop.max_new_tokens, loop.end_token
    )
    for name, request in REQUESTS.items():
        expected = speculax.testing.target_output_distribution(
            target, [1, 0], loop.max_new_tokens, loop.end_token, **request
        )
        # Not vacuous: the parameters change the target's law, truncating it.
        assert expected != pytest.approx(plain, abs=1e-3), name
        assert set(expected) < set(plain) or name == "temperature", name
        assert len(expected) > 10 or name == "greedy", name
        error = speculax.testing.loop_lossless_error(
            loop, draft, target, [1, 0], **request
        )
        assert error < 1e-12, name


@pytest.mark.slow
def test_loop_with_sampling_parameters_is_lossless_exactly_for_bfloat16_logits():
    # Under x64 every row is made in float64 from the half-precision logits, with
    # parameters as without: the target's law is that of their values.
    # The LogitsStep, which makes both models' rows from the logits itself.
    draft, target = close_pair(jnp.bfloat16)
    for name, request in REQUESTS.items():
        error = speculax.testing.loop_lossless_error(
            sampling_loop("LogitsStep"), draft, target, [1, 0], **request
        )
        assert error < 1e-12, name


@functools.cache
def sampling_tree_loop(drafting: str) -> speculax.SpeculativeLoop:
    siblings = (
        speculax.SiblingsWithoutReplacement()
        if drafting == "without replacement"
        else speculax.IndependentSiblings()
    )
    return speculax.SpeculativeLoop(
        draft_tree=speculax.DraftTree((0, 0, 1), drafting=drafting),
        max_new_tokens=4,
        end_token=3,
        step=speculax.TreeStep(siblings=siblings),
    )


# Like the chains' exact tests above, the extended tier, with the drafting whose
# trees vary most (the other modes are enumerated without parameters in
# test_loop_trees.py); the default tier proves trees in the loop without
# parameters.
@pytest.mark.slow
@pytest.mark.parametrize("drafting", ["without replacement"])
def test_tree_loop_with_sampling_parameters_is_lossless_exactly(drafting):
    # The drafter fills each row's tree under the row's parameters, and the tree
    # step is given the rows it drew from and the target's rows under them.
    draft, target = models()
    loop = sampling_tree_loop(drafting)
    for name, request in REQUESTS.items():
        error = speculax.testing.loop_lossless_error(
            loop, draft, target, [1, 0], **request
        )
        assert error < 1e-12, name


@pytest.mark.slow
def test_greedy_row_is_greedy_decoding():
    draft, target = models()
    history = [2]
    for _ in range(4):
        logits = target(jnp.array([history]), jnp.array([[len(history) - 1]]))
        history.append(int(jnp.argmax(logits[0, 0])))
        if history[-1] == 3:
            break
    greedy = tuple(history[1:])
    # The step that reads the temperature itself, and children sampled from the
    # greedy rows (each the argmax); the other pairs are the exact tests' above.
    for loop in (sampling_loop("LogitsStep"), sampling_tree_loop("independent")):
        found = speculax.testing.loop_output_distribution(
            loop, draft, target, [2], temperature=0.0
        )
        assert found == {greedy: pytest.approx(1, abs=1e-12)}


@final
class UntruncatedDrafts(speculax.AbstractDraftSampling):
    """A drafter that applies the row's temperature but not its top-k or top-p: the
    bug the "From logits" page warns of when the verification truncates."""

    def __call__(
        self,
        logits: Float[Array, "batch vocab"],
        temperature: Float[Array, " batch"] | None,
        top_k: Int[Array, " batch"] | None,
        top_p: Float[Array, " batch"] | None,
    ) -> Float[Array, "batch vocab"]:
        return speculax.probs_from_logits(logits, temperature=temperature)


@pytest.mark.slow
@pytest.mark.parametrize("step_name", list(STEPS))
def test_exact_test_catches_drafts_sampled_from_the_untruncated_rows(step_name):
    draft, target = models()
    loop = speculax.SpeculativeLoop(
        num_draft=2,
        max_new_tokens=4,
        end_token=3,
        step=STEPS[step_name],
        draft_sampling=UntruncatedDrafts(),
    )
    error = speculax.testing.loop_lossless_error(
        loop, draft, target, [1, 0], **REQUESTS["top-p"]
    )
    if step_name == "LogitsStep":
        # It makes the draft's rows from the logits under top-p: not those drawn from.
        assert error > 0.01
    else:
        # It is given the rows the drafts were drawn from: lossless, if less apt.
        assert error < 1e-12


def mixed_batch(rows: int) -> dict[str, jax.Array]:
    """The four kinds of request, cycled over `rows` rows, as per-row arrays."""
    kinds = [REQUESTS[name] for name in REQUESTS]
    return {
        "temperature": jnp.array(
            [kinds[b % 4].get("temperature", 1.0) for b in range(rows)]
        ),
        "top_k": jnp.array([kinds[b % 4].get("top_k", 0) for b in range(rows)]),
        "top_p": jnp.array([kinds[b % 4].get("top_p", 1.0) for b in range(rows)]),
    }


NUM_ROWS = 24_000
SLOW_FOR_SPECULATIVE_STEP = pytest.mark.parametrize(
    "step_name",
    ["LogitsStep", pytest.param("SpeculativeStep", marks=pytest.mark.slow)],
)


@functools.cache
def mixed_output(step_name: str, shuffled: bool) -> dict[str, np.ndarray]:
    """The jitted loop on NUM_ROWS rows, the four kinds of request in turn; if
    `shuffled`, with the rows in a random order (and the outputs put back in the
    first): each row's prompt, key and parameters then meet other batch mates at
    another index."""
    draft, target = models()
    loop = sampling_loop(step_name, num_draft=3)
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, 4, size=(NUM_ROWS, 2)))
    # Rows 8m to 8m + 3, one of each kind of request, have the prompt [1, 0].
    in_block = (jnp.arange(NUM_ROWS) // 4 % 2 == 0)[:, None]
    prompt = jnp.where(in_block, jnp.array([1, 0]), prompt)
    inputs = {
        "prompt": prompt,
        "key": jax.random.split(jax.random.key(7), NUM_ROWS),
        **mixed_batch(NUM_ROWS),
    }
    order = np.arange(NUM_ROWS)
    if shuffled:
        order = np.random.default_rng(1).permutation(NUM_ROWS)
    out = loop(draft, target, **{name: value[order] for name, value in inputs.items()})
    return {
        name: np.asarray(value)[np.argsort(order)]
        for name, value in out.items()
        if name != "num_target_calls"
    }


@SLOW_FOR_SPECULATIVE_STEP
def test_jitted_loop_samples_each_row_under_its_parameters(step_name):
    # The real jitted loop, one batch of the four kinds of request: each kind's
    # sequences after the prompt [1, 0] against the target's law under its
    # parameters.
    out = mixed_output(step_name, False)
    # Rows 8m to 8m + 3, one of each kind, have the prompt [1, 0].
    assert_each_kind_samples_the_target(out["tokens"], out["num_tokens"], every=8)


def assert_each_kind_samples_the_target(
    tokens: np.ndarray, num_tokens: np.ndarray, every: int
) -> None:
    """Rows `kind`, `kind + every`, ... hold the requests of `REQUESTS` in turn, each
    after the prompt [1, 0]: each kind's sequences against the target's law under
    its parameters, by a chi-square test (a greedy kind, one sequence)."""
    _, target = models()
    tokens, num_tokens = np.asarray(tokens), np.asarray(num_tokens)
    for kind, (name, request) in enumerate(REQUESTS.items()):
        exact = speculax.testing.target_output_distribution(
            target, [1, 0], 4, 3, **request
        )
        seen: dict[tuple[int, ...], int] = {}
        rows = slice(kind, None, every)
        for row, length in zip(tokens[rows], num_tokens[rows], strict=True):
            sequence = tuple(row[:length].tolist())
            seen[sequence] = seen.get(sequence, 0) + 1
        assert set(seen) <= set(exact), name
        if name == "greedy":
            assert len(seen) == 1
            continue
        observed, expected = pooled(
            [seen.get(sequence, 0) for sequence in exact],
            [probability * sum(seen.values()) for probability in exact.values()],
        )
        assert len(observed) > 10, name
        assert stats.chisquare(observed, expected).pvalue > 1e-3, name


@SLOW_FOR_SPECULATIVE_STEP
def test_row_is_batch_invariant_bit_for_bit_under_its_parameters(step_name):
    # The same rows among other batch mates, at other indices: the same tokens.
    batched, shuffled = mixed_output(step_name, False), mixed_output(step_name, True)
    for name in batched:
        np.testing.assert_array_equal(shuffled[name], batched[name], err_msg=name)


@pytest.mark.slow
def test_jitted_tree_loop_samples_each_row_under_its_parameters():
    draft, target = models()
    loop = sampling_tree_loop("independent")
    rows = NUM_ROWS // 2
    prompt = jnp.broadcast_to(jnp.array([1, 0]), (rows, 2))
    out = loop(
        draft,
        target,
        prompt,
        key=jax.random.split(jax.random.key(8), rows),
        **mixed_batch(rows),
    )
    assert_each_kind_samples_the_target(out["tokens"], out["num_tokens"], every=4)


@pytest.mark.slow
def test_cached_loop_gives_the_cacheless_tokens_under_parameters():
    draft, target = models()
    loop = sampling_loop("LogitsStep")
    rows = 32
    prompt = jnp.asarray(np.random.default_rng(2).integers(0, 4, size=(rows, 2)))
    keys = jax.random.split(jax.random.key(2), rows)
    parameters = mixed_batch(rows)
    plain = loop(draft, target, prompt, key=keys, **parameters)
    out = loop(cached(draft), cached(target), prompt, key=keys, **parameters)
    for name in plain:
        np.testing.assert_array_equal(out[name], plain[name], err_msg=name)


@pytest.mark.parametrize(
    ("parameters", "error", "match"),
    [
        ({"temperature": -1.0}, ValueError, "temperature must be finite"),
        ({"top_k": 1.5}, TypeError, "top_k"),
        ({"top_p": 0.0}, ValueError, "top_p must lie in"),
        ({"temperature": jnp.ones(3)}, ValueError, "temperature must be a scalar"),
        ({"temperature": jnp.array([0.5, -1.0])}, RuntimeError, "temperature"),
        ({"top_p": jnp.array([0.5, 2.0])}, RuntimeError, "top_p"),
    ],
)
def test_bad_sampling_parameters(parameters, error, match):
    draft, target = models()
    with pytest.raises(error, match=match):
        sampling_loop("SpeculativeStep")(
            draft,
            target,
            jnp.zeros((2, 1), jnp.int32),
            key=jax.random.key(0),
            **parameters,
        )


def test_loop_refuses_a_step_on_a_split_vocabulary():
    with pytest.raises(ValueError, match=r"step\.axis_name must be None"):
        speculax.SpeculativeLoop(
            num_draft=2, max_new_tokens=4, step=speculax.LogitsStep(axis_name="x")
        )


# Two loop programs compiled for this test alone: the extended tier.
@pytest.mark.slow
@pytest.mark.parametrize("step_name", list(STEPS))
def test_parameters_that_keep_all_leave_the_searches_out_of_the_loop(step_name):
    """No top-k and no top-p, as the loop knows before tracing: the same tokens as
    the same values given as arrays, from a smaller program without the threshold
    searches."""
    draft, target = models()
    loop = sampling_loop(step_name)
    prompts = jnp.asarray([[1, 0], [2, 1], [0, 3]])
    temperature = jnp.asarray([0.7, 0.0, 1.3])
    keeping_all = {"top_k": jnp.zeros(3, jnp.int32), "top_p": jnp.ones(3)}

    def run(**parameters):
        return loop(
            draft,
            target,
            prompts,
            key=jax.random.key(4),
            temperature=temperature,
            **parameters,
        )

    known, traced = run(), run(**keeping_all)
    for name in known:
        np.testing.assert_array_equal(known[name], traced[name], err_msg=name)
    known_program, traced_program = (
        str(jax.make_jaxpr(lambda p=p: run(**p))()) for p in ({}, keeping_all)
    )
    # The threshold searches are while loops.
    assert known_program.count("while[") < traced_program.count("while[")
    assert len(known_program) < len(traced_program)
