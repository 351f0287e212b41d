"""The verification variants serving engines offer, each against NumPy."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inputs import random_inputs
from oracle import judge, reference_probs_from_logits


# --- Probabilities from logits -----------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [
        (1.0, None, None),
        (0.7, None, None),
        (1.3, 5, None),
        (1.0, None, 0.8),
        (0.5, 10, 0.9),
        (2.0, 1, None),
        (1.0, None, 1e-6),
        (0.0, None, None),
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_probs_from_logits_matches_numpy(temperature, top_k, top_p, dtype):
    import speculax

    logits = jnp.asarray(np.random.default_rng(0).standard_normal((3, 2, 40)), dtype)
    probs = speculax.probs_from_logits(
        logits, temperature=temperature, top_k=top_k, top_p=top_p
    )
    assert probs.dtype == jnp.float32
    expected = reference_probs_from_logits(
        np.asarray(logits, np.float32), temperature, top_k, top_p
    )
    np.testing.assert_allclose(probs, expected, atol=2e-6)


def test_probs_from_logits_greedy_breaks_ties_toward_the_smallest_id():
    import speculax

    probs = speculax.probs_from_logits(jnp.array([[1.0, 3.0, 3.0]]), temperature=0.0)
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


@pytest.mark.parametrize(
    "keywords, message",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_probs_from_logits_rejects_bad_parameters(keywords, message):
    import speculax

    with pytest.raises(ValueError, match=message):
        speculax.probs_from_logits(jnp.zeros((2, 5)), **keywords)


def test_probs_from_logits_takes_a_traced_temperature():
    """One compilation serves every temperature, 0 (greedy) included."""
    import speculax

    logits = jnp.asarray(np.random.default_rng(1).standard_normal((2, 30)))
    traced = eqx.filter_jit(lambda t: speculax.probs_from_logits(logits, temperature=t))
    for temperature in (0.0, 0.3, 1.0, 2.5):
        expected = reference_probs_from_logits(np.asarray(logits), temperature)
        np.testing.assert_allclose(
            traced(jnp.float32(temperature)), expected, atol=2e-6
        )
    for bad in (-1.0, np.inf):
        with pytest.raises(
            RuntimeError, match="temperature must be finite and non-negative"
        ):
            jax.block_until_ready(traced(jnp.float32(bad)))


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-30])
def test_probs_from_logits_at_a_tiny_temperature_shares_the_largest_logits(
    temperature,
):
    """The limit of temperature -> 0 with ties shared, never NaN."""
    import speculax

    logits = jnp.array([[1.0, 2.0, 2.0, -3.0], [5.0, 0.0, 0.0, 4.0]])
    probs = speculax.probs_from_logits(logits, temperature=temperature)
    assert probs.tolist() == [[0.0, 0.5, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0]]


# --- Randomness from keys ----------------------------------------------------------


def test_uniforms_lie_in_the_unit_interval_with_the_right_shapes():
    import speculax

    accept, sample = speculax.uniforms(jax.random.key(0), 50, 4)
    assert accept.shape == (50, 4) and sample.shape == (50,)
    assert accept.dtype == sample.dtype == jnp.float32
    for draws in (accept, sample):
        assert bool(jnp.all((draws >= 0) & (draws < 1)))
    # Distinct rows and positions get distinct draws.
    assert len(np.unique(np.asarray(accept))) == accept.size


def test_uniforms_accept_legacy_keys():
    import speculax

    accept, sample = speculax.uniforms(jax.random.PRNGKey(3), 2, 3)
    assert accept.shape == (2, 3) and sample.shape == (2,)


def test_uniforms_are_float32_under_x64():
    import speculax

    with jax.enable_x64(True):
        accept, sample = speculax.uniforms(jax.random.key(0), 2, 3)
    assert accept.dtype == sample.dtype == jnp.float32


@pytest.mark.parametrize("key", [0, 1.5, np.zeros(2, np.int32), "key"])
def test_a_key_that_is_not_a_key_is_refused_by_name(key):
    import speculax

    with pytest.raises(TypeError, match="key"):
        speculax.uniforms(key, 2, 3)
    inputs = random_inputs(0, 2, 3, 5)
    del inputs["accept_uniforms"], inputs["sample_uniforms"]
    with pytest.raises(TypeError, match="key"):
        speculax.SpeculativeStep()(**inputs, key=key)


def test_uniforms_reject_a_key_array_of_the_wrong_length():
    import speculax

    with pytest.raises(
        ValueError, match=r"key must be a single key or one key per row"
    ):
        speculax.uniforms(jax.random.split(jax.random.key(0), 3), 4, 2)


# --- Typical acceptance ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("epsilon, alpha", [(0.09, 0.3), (0.3, 0.1), (1.0, 1.0)])
def test_typical_acceptance_matches_numpy(epsilon, alpha):
    import speculax

    inputs = random_inputs(5, 4, 3, 20, style="peaked")
    passed = speculax.TypicalAcceptance(epsilon=epsilon, alpha=alpha)(
        *(
            jnp.asarray(inputs[name])
            for name in (
                "draft_tokens",
                "draft_probs",
                "target_probs",
                "accept_uniforms",
            )
        )
    )
    p = inputs["target_probs"][:, :3].astype(np.float64)
    entropy = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0), -1)
    threshold = np.minimum(epsilon, alpha * np.exp(-entropy))
    at_draft = np.take_along_axis(p, inputs["draft_tokens"][..., None], -1)[..., 0]
    np.testing.assert_array_equal(passed, at_draft > threshold)


@pytest.mark.parametrize("epsilon, alpha", [(0.0, 0.3), (1.5, 0.3), (0.1, -1.0)])
def test_typical_acceptance_rejects_bad_parameters(epsilon, alpha):
    import speculax

    with pytest.raises(ValueError):
        speculax.TypicalAcceptance(epsilon=epsilon, alpha=alpha)


def test_typical_acceptance_is_reported_lossy():
    import speculax
    import speculax.testing

    inputs = random_inputs(2, 1, 2, 4, style="peaked", dtype=np.float64)
    step = speculax.SpeculativeStep(acceptance=speculax.TypicalAcceptance())
    error = speculax.testing.lossless_error(
        step, inputs["draft_probs"][0], inputs["target_probs"][0]
    )
    assert error > 1e-3
    exact = speculax.testing.lossless_error(
        speculax.SpeculativeStep(), inputs["draft_probs"][0], inputs["target_probs"][0]
    )
    assert exact < 1e-12


# --- Greedy verification -----------------------------------------------------------


@functools.cache
def _greedy():
    import speculax

    return eqx.filter_jit(speculax.greedy_step())


def _reference_greedy(inputs):
    target = inputs["target_probs"]
    argmax = np.argmax(target, axis=-1)
    batch, num_draft = inputs["draft_tokens"].shape
    tokens = np.full((batch, num_draft + 1), -1)
    counts = np.zeros(batch, int)
    for row in range(batch):
        n = 0
        while n < num_draft and inputs["draft_tokens"][row, n] == argmax[row, n]:
            n += 1
        counts[row] = n
        tokens[row, :n] = inputs["draft_tokens"][row, :n]
        tokens[row, n] = argmax[row, n]
    return counts, tokens


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("shape", [(5, 3, 6), (2, 0, 4)])
def test_greedy_step_matches_numpy_without_uniforms(seed, shape):
    inputs = random_inputs(seed, *shape, style="peaked")
    # Make some drafts the target's argmax so that runs of acceptances happen.
    argmax = np.argmax(inputs["target_probs"][:, : shape[1]], axis=-1)
    keep = np.random.default_rng(seed).random(argmax.shape) < 0.7
    inputs["draft_tokens"] = np.where(keep, argmax, inputs["draft_tokens"])
    out = _greedy()(
        inputs["draft_tokens"], inputs["draft_probs"], inputs["target_probs"]
    )
    counts, tokens = _reference_greedy(inputs)
    np.testing.assert_array_equal(out["num_accepted"], counts)
    np.testing.assert_array_equal(out["tokens"], tokens)


def test_greedy_ties_go_to_the_smallest_token_id():
    import speculax

    target = jnp.array([[[0.4, 0.4, 0.2], [0.1, 0.45, 0.45]]])
    greedy = eqx.filter_jit(speculax.greedy_step())
    out = greedy(jnp.array([[1]]), jnp.zeros((1, 1, 3)), target)
    # Token 1 ties with token 0 for p_0's maximum and loses; y = 0.
    assert out["tokens"].tolist() == [[0, -1]]
    out = greedy(jnp.array([[0]]), jnp.zeros((1, 1, 3)), target)
    assert out["tokens"].tolist() == [[0, 1]]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0])
def test_greedy_step_never_reads_draft_probs(bad):
    """Greedy verification documents `draft_probs` as unread, so no check reads it
    either: any values give the answer of deterministic drafts."""
    inputs = random_inputs(2, 3, 2, 6)
    bad_draft = np.full_like(inputs["draft_probs"], bad)
    out = _greedy()(inputs["draft_tokens"], bad_draft, inputs["target_probs"])
    want = _greedy()(inputs["draft_tokens"], None, inputs["target_probs"])
    np.testing.assert_array_equal(out["tokens"], want["tokens"])


def test_greedy_step_takes_logits_unchecked_and_refuses_them_checked():
    """Greedy verification reads only which token of a row is most likely: logits
    whose every value is negative give the tokens of their probabilities once the
    value checks are off, and are refused by name with the checks on."""
    import speculax

    inputs = random_inputs(4, 16, 3, 6)
    logits = np.log(inputs["target_probs"]) - 3.0
    assert logits.max() < 0
    unchecked = eqx.filter_jit(speculax.greedy_step(check_values=False))
    want = unchecked(inputs["draft_tokens"], None, inputs["target_probs"])
    got = unchecked(inputs["draft_tokens"], None, logits)
    np.testing.assert_array_equal(got["tokens"], want["tokens"])
    assert np.all(np.asarray(got["tokens"])[:, 0] >= 0)
    with pytest.raises(Exception, match="target_probs"):
        _greedy()(inputs["draft_tokens"], None, logits)


def test_argmax_sampler_and_target_row_by_hand():
    import speculax

    weights = jnp.array([[0.1, 0.7, 0.2], [0.0, 0.0, 0.0]])
    assert speculax.Argmax()(weights, jnp.zeros(2)).tolist() == [1, -1]
    target = jnp.array([[[0.1, 0.6, 0.3], [0.5, 0.25, 0.25]]])
    row = speculax.TargetRow()(
        jnp.array([1]), jnp.array([[2]]), jnp.zeros((1, 1, 3)), target
    )
    np.testing.assert_array_equal(row, target[:, 1])


# --- Uniforms from a key -----------------------------------------------------------


def test_a_row_keyed_step_is_reproducible_whatever_its_batch_mates():
    import speculax

    inputs = random_inputs(3, 6, 3, 300, style="peaked")
    del inputs["accept_uniforms"], inputs["sample_uniforms"]
    keys = jax.random.split(jax.random.key(42), 6)
    whole = speculax.speculative_step(**inputs, key=keys)
    others = random_inputs(4, 6, 3, 300, style="flat")
    del others["accept_uniforms"], others["sample_uniforms"]
    # Row 2 among different batch mates, with different keys for them.
    mixed = {name: value.copy() for name, value in others.items()}
    for name in mixed:
        mixed[name][0] = inputs[name][2]
    mixed_keys = jax.random.split(jax.random.key(7), 6).at[0].set(keys[2])
    alone = speculax.speculative_step(**mixed, key=mixed_keys)
    np.testing.assert_array_equal(alone["tokens"][0], whole["tokens"][2])
    # And the key is the same as passing the uniforms it draws.
    accept, sample = speculax.uniforms(keys, 6, 3)
    explicit = speculax.speculative_step(
        **inputs, accept_uniforms=accept, sample_uniforms=sample
    )
    np.testing.assert_array_equal(explicit["tokens"], whole["tokens"])


def test_key_and_uniforms_together_are_refused():
    import speculax

    inputs = random_inputs(0, 2, 2, 5)
    with pytest.raises(ValueError, match="either key or accept_uniforms"):
        speculax.SpeculativeStep()(**inputs, key=jax.random.key(0))


# --- Diagnostics -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("style", ["peaked", "sparse"])
def test_diagnostics_match_numpy(style):
    import speculax

    inputs = random_inputs(9, 4, 3, 30, style=style)
    stats = speculax.diagnose(speculax.SpeculativeStep(), **inputs)
    out = speculax.speculative_step(**inputs)
    np.testing.assert_array_equal(stats["tokens"], out["tokens"])
    np.testing.assert_array_equal(stats["num_accepted"], out["num_accepted"])
    p = inputs["target_probs"][:, :3].astype(np.float64)
    q = inputs["draft_probs"].astype(np.float64)
    tokens = inputs["draft_tokens"][..., None]
    p_x = np.take_along_axis(p, tokens, -1)[..., 0]
    q_x = np.take_along_axis(q, tokens, -1)[..., 0]
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = np.where(q_x > 0, np.minimum(1, p_x / q_x), (p_x > 0) * 1.0)
    np.testing.assert_allclose(stats["acceptance_probs"], expected, rtol=1e-6)
    np.testing.assert_allclose(
        stats["expected_acceptance_rate"], np.minimum(p, q).sum(-1), rtol=1e-5
    )
    accepted = np.arange(3)[None, :] < np.asarray(out["num_accepted"])[:, None]
    np.testing.assert_array_equal(stats["accepted"], accepted)


# --- Deterministic drafts ----------------------------------------------------------


def _one_hot(tokens, vocab):
    return np.eye(vocab, dtype=np.float32)[tokens]


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("shape", [(4, 3, 7), (3, 2, 600), (2, 0, 5)])
def test_deterministic_drafts_are_one_hot_draft_distributions(seed, shape):
    import speculax

    inputs = random_inputs(seed, *shape, style="peaked")
    inputs["draft_probs"] = _one_hot(inputs["draft_tokens"], shape[2])
    with_none = dict(inputs, draft_probs=None)
    out = speculax.speculative_step(**with_none)
    # Judged against the one-hot distributions they stand for.
    assert judge(inputs, out) == []
    dense = speculax.speculative_step(**inputs)
    np.testing.assert_array_equal(out["tokens"], dense["tokens"])


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [1, 256])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deterministic_drafts_take_the_fused_path_on_both_strategies(
    dtype, block_size, row_access
):
    """With the default pieces, draft_probs=None makes q_n a one-hot in the row pass:
    bit for bit the answer of the explicit one-hot draft_probs, reading only p_n.
    With blocks of one token every weight is a block sum, so a wrong one shows."""
    import speculax

    inputs = random_inputs(4, 64, 3, 40, style="peaked")
    inputs["draft_probs"] = _one_hot(inputs["draft_tokens"], 40)
    inputs = {
        name: value.astype(dtype)
        if value.dtype.kind == "f" and "probs" in name
        else value
        for name, value in inputs.items()
    }
    step = speculax.SpeculativeStep(sampler=speculax.InverseCDF(block_size))
    run = jax.jit(lambda *args: step(*args))  # fresh: the strategy is traced in
    dense = run(*inputs.values())
    deterministic = run(*dict(inputs, draft_probs=None).values())
    for name in ("num_accepted", "tokens"):
        np.testing.assert_array_equal(deterministic[name], dense[name])
    assert 0 < np.asarray(dense["num_accepted"]).mean() < 3


def test_deterministic_residual_takes_the_rejected_token_out():
    import speculax

    target = jnp.array([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]])
    weights = speculax.Residual()(jnp.array([0]), jnp.array([[0]]), None, target)
    np.testing.assert_allclose(weights, [[0.0, 0.3, 0.2]])
    ratio = speculax.RatioAcceptance()(
        jnp.array([[0]]), None, target, jnp.array([[0.49]])
    )
    assert ratio.tolist() == [[True]]  # accepted with probability p_0(x_0) = 0.5


def test_deterministic_drafts_are_lossless():
    import speculax.testing

    q = np.eye(4)[[2, 0]]  # the drafts 2 then 0, with certainty
    p = np.random.default_rng(0).dirichlet(np.ones(4), 3)
    assert speculax.testing.lossless_error(speculax.SpeculativeStep(), q, p) < 1e-12


# --- Ragged batches ----------------------------------------------------------------


@functools.cache
def _ragged_steps():
    import speculax
    from doubles import DelegatingResidual

    return {
        "default": eqx.filter_jit(speculax.SpeculativeStep()),
        "generic": eqx.filter_jit(
            speculax.SpeculativeStep(residual=DelegatingResidual())
        ),
    }


@pytest.mark.slow
@pytest.mark.parametrize("path", ["default", "generic"])
@pytest.mark.parametrize("seed", range(3))
def test_a_ragged_batch_is_each_row_run_alone(path, seed):
    batch, num_draft, vocab = 6, 4, 300
    inputs = random_inputs(seed, batch, num_draft, vocab, style="peaked")
    lengths = np.random.default_rng(seed).integers(0, num_draft + 1, batch)
    lengths[0], lengths[1] = 0, num_draft
    # Unused positions may hold anything: padding tokens and garbage probabilities.
    unused = np.arange(num_draft)[None, :] >= lengths[:, None]
    padded = dict(inputs)
    padded["draft_tokens"] = np.where(unused, -1, inputs["draft_tokens"])
    padded["accept_uniforms"] = np.where(unused, 7.0, inputs["accept_uniforms"])
    step = _ragged_steps()[path]
    out = step(**padded, num_draft_tokens=lengths)
    for row, length in enumerate(lengths):
        alone = {
            "draft_tokens": inputs["draft_tokens"][row : row + 1, :length],
            "draft_probs": inputs["draft_probs"][row : row + 1, :length],
            "target_probs": inputs["target_probs"][row : row + 1, : length + 1],
            "accept_uniforms": inputs["accept_uniforms"][row : row + 1, :length],
            "sample_uniforms": inputs["sample_uniforms"][row : row + 1],
        }
        expected = step(**alone)
        tokens = np.asarray(out["tokens"][row])
        np.testing.assert_array_equal(tokens[: length + 1], expected["tokens"][0])
        assert (tokens[length + 1 :] == -1).all()
        assert int(out["num_accepted"][row]) == int(expected["num_accepted"][0])


@pytest.mark.slow
def test_ragged_lengths_outside_the_draft_are_refused():
    import speculax

    inputs = random_inputs(0, 2, 3, 5)
    with pytest.raises(RuntimeError, match=r"num_draft_tokens must lie in \[0, G\]"):
        jax.block_until_ready(
            speculax.SpeculativeStep()(**inputs, num_draft_tokens=np.array([1, 4]))
        )
    with pytest.raises(ValueError, match=r"num_draft_tokens must have shape \(B,\)"):
        speculax.SpeculativeStep()(**inputs, num_draft_tokens=np.array([1, 2, 3]))
    with pytest.raises(TypeError, match="num_draft_tokens must have an integer"):
        speculax.SpeculativeStep()(**inputs, num_draft_tokens=np.array([1.0, 2.0]))


@pytest.mark.slow
def test_diagnostics_with_deterministic_drafts():
    import speculax

    inputs = random_inputs(1, 3, 2, 9, style="peaked")
    stats = speculax.diagnose(
        speculax.SpeculativeStep(), **dict(inputs, draft_probs=None)
    )
    p_x = np.take_along_axis(
        inputs["target_probs"][:, :2], inputs["draft_tokens"][..., None], -1
    )[..., 0]
    np.testing.assert_allclose(stats["acceptance_probs"], p_x, rtol=1e-6)
    np.testing.assert_allclose(stats["expected_acceptance_rate"], p_x, rtol=1e-6)


# --- Every variant under vmap ------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["greedy", "deterministic", "ragged", "key"])
def test_variants_under_vmap_match_each_copy_alone(variant):
    import speculax

    inputs = random_inputs(5, 3, 3, 40, style="peaked")
    arguments = dict(inputs)
    step = speculax.SpeculativeStep()
    if variant == "greedy":
        step = speculax.greedy_step()
        del arguments["accept_uniforms"], arguments["sample_uniforms"]
    elif variant == "deterministic":
        arguments["draft_probs"] = None
    elif variant == "ragged":
        arguments["num_draft_tokens"] = np.array([0, 2, 3], np.int32)
    else:
        del arguments["accept_uniforms"], arguments["sample_uniforms"]
        arguments["key"] = jax.random.split(jax.random.key(3), 3)
    copies = [arguments, {**arguments}]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *copies)
    out = jax.vmap(lambda args: step(**args))(stacked)
    alone = step(**arguments)
    for copy in range(2):
        np.testing.assert_array_equal(out["tokens"][copy], alone["tokens"])
