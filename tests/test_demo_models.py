"""The demo's byte-level draft and target transformers: the shipped weights,
causality, the cache read as the whole history, the held-out loss, the training
code, saving and loading, the byte tokens; the draft heads on the target's
features."""

import io

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import speculax
from speculax._cli._demo import (
    CausalTransformer,
    corpus,
    encode,
    held_out_loss,
    load_demo_models,
    load_model,
    save_model,
    sequence_loss,
    split_corpus,
    train,
)
from speculax._cli._demo._heads import heads_loss, initial_weights, load_demo_heads
from speculax._cli._demo._models import FeatureKeeping


@pytest.fixture(scope="module")
def models():
    return load_demo_models()


@pytest.fixture(scope="module")
def text():
    return split_corpus(corpus())


@eqx.filter_jit
def _read(model, tokens, positions):
    return model.read(jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32))


@eqx.filter_jit
def _call(model, tokens, positions, mask, cache, cache_length):
    return model(tokens, positions, mask, cache, cache_length)


TINY = {"width": 8, "depth": 2, "heads": 2, "window": 16}


def _tiny_model(key=0):
    model = CausalTransformer(**TINY, key=jax.random.key(key))
    # Its residual branches start at zero: make them read something.
    return jax.tree.map(
        lambda x, k: x + 0.3 * jax.random.normal(k, x.shape) if x.ndim == 2 else x,
        model,
        jax.tree.unflatten(
            jax.tree.structure(model),
            list(
                jax.random.split(jax.random.key(key + 1), len(jax.tree.leaves(model)))
            ),
        ),
    )


def test_shipped_models_load_and_give_finite_logits(models):
    draft, target = models
    assert (len(draft.blocks), len(target.blocks)) == (1, 4)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (3, 40)), jnp.int32)
    positions = jnp.array([[0, 5, 39], [1, 2, 3], [20, 30, 39]], jnp.int32)
    for model in models:
        logits = _read(model, tokens, positions)
        assert logits.shape == (3, 3, 256)
        assert logits.dtype == jnp.float32
        assert jnp.all(jnp.isfinite(logits))


@pytest.mark.parametrize("which", ["draft", "tiny"])
def test_logits_read_only_the_tokens_up_to_the_position(request, which):
    model = request.getfixturevalue("models")[0] if which == "draft" else _tiny_model()
    rng = np.random.default_rng(1)
    batch, time = 2, 40
    tokens = rng.integers(0, 256, (batch, time))
    positions = np.array([[0, 2, 17, 30], [1, 16, 25, 39]])
    logits = _read(model, tokens, positions)
    for k in range(positions.shape[1]):
        position = positions[:, k : k + 1]
        index = np.arange(time)
        changed = np.where(
            index > position, rng.integers(0, 256, (batch, time)), tokens
        )
        np.testing.assert_array_equal(
            _read(model, changed, positions)[:, k], logits[:, k]
        )
        # The token at the position and the first of its window are both read.
        first = np.maximum(position - model.window + 1, 0)
        for read in (index == first, index == position):
            flipped = np.where(read, (tokens + 1) % 256, tokens)
            moved = np.asarray(_read(model, flipped, positions)[:, k] - logits[:, k])
            assert np.all(np.abs(moved).max(axis=-1) > 0)


def test_a_call_after_the_cache_gives_the_logits_of_reading_the_whole_history():
    # A chain of three new tokens after a cached history of five, and a tree of a
    # token and its two children: each node's logits those of its own path.
    model = _tiny_model()
    rng = np.random.default_rng(2)
    history = jnp.asarray(rng.integers(0, 256, (2, 5)), jnp.int32)
    new = jnp.asarray(rng.integers(0, 256, (2, 3)), jnp.int32)
    start = jnp.full((2,), 5)
    cache = model.init_cache(2, 12)
    chain = jnp.broadcast_to(jnp.tril(jnp.ones((3, 3), bool)), (2, 3, 3))
    _, cache = _call(
        model,
        history,
        jnp.broadcast_to(jnp.arange(5), (2, 5)),
        jnp.broadcast_to(jnp.tril(jnp.ones((5, 5), bool)), (2, 5, 5)),
        cache,
        jnp.zeros(2, jnp.int32),
    )
    logits, _ = _call(
        model, new, 5 + jnp.broadcast_to(jnp.arange(3), (2, 3)), chain, cache, start
    )
    whole = _read(
        model,
        jnp.concatenate([history, new], 1),
        jnp.broadcast_to(5 + jnp.arange(3), (2, 3)),
    )
    np.testing.assert_allclose(logits, whole, rtol=1e-5, atol=1e-5)
    tree = jnp.broadcast_to(
        jnp.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool), (2, 3, 3)
    )
    positions = jnp.broadcast_to(jnp.array([5, 6, 6]), (2, 3))
    logits, _ = _call(model, new, positions, tree, cache, start)
    for k, path in enumerate(([0], [0, 1], [0, 2])):
        sequence = jnp.concatenate([history, new[:, path]], 1)
        expected = _read(model, sequence, jnp.full((2, 1), 4 + len(path)))[:, 0]
        np.testing.assert_allclose(logits[:, k], expected, rtol=1e-5, atol=1e-5)


def test_the_target_beats_the_draft_on_held_out_text(models, text):
    _, held_out = text
    draft_loss, target_loss = (held_out_loss(m, held_out[:4096]) for m in models)
    # See docs/loop.md for the whole held-out text; uniform is 5.5.
    assert target_loss < draft_loss - 0.1
    assert draft_loss < 2.0


def test_held_out_loss_is_the_mean_of_every_prediction():
    model = _tiny_model()
    tokens = encode("import numpy as np\nprint(np.arange(3))\n")[:32]
    rows = jnp.asarray(tokens).reshape(2, 16)
    expected = eqx.filter_jit(sequence_loss)(model, rows)
    for rows_per_call in (1, 2):
        loss = held_out_loss(model, tokens, length=16, rows_per_call=rows_per_call)
        np.testing.assert_allclose(loss, expected, rtol=1e-5)


@pytest.mark.slow
def test_a_short_training_run_lowers_the_loss(text):
    train_tokens, held_out = text
    model = CausalTransformer(**TINY, key=jax.random.key(0))
    before = held_out_loss(model, held_out[:1024], length=32)
    trained, losses = train(
        model,
        train_tokens[:50_000],
        steps=40,
        key=jax.random.key(0),
        batch_size=16,
        length=32,
        learning_rate=3e-2,
        steps_per_call=20,
    )
    assert losses.shape == (40,)
    assert losses[-5:].mean() < losses[:5].mean() - 1.0
    assert held_out_loss(trained, held_out[:1024], length=32) < before - 1.0


def test_weights_survive_saving_and_loading():
    model = _tiny_model()
    file = io.BytesIO()
    save_model(model, file)
    file.seek(0)
    loaded = load_model(file, TINY)
    old_leaves = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    new_leaves = jax.tree.leaves(eqx.filter(loaded, eqx.is_array))
    assert len(old_leaves) == len(new_leaves) > 10
    for old, new in zip(old_leaves, new_leaves, strict=True):
        assert new.dtype == jnp.float32
        np.testing.assert_allclose(new, old, rtol=1e-3, atol=1e-3)


def test_a_token_reads_the_window_up_to_its_own():
    model = _tiny_model()
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 256, (1, 60))
    positions = np.array([[40]])
    logits = _read(model, tokens, positions)
    # Each block reads 15 positions back: two read 30, position 40 positions 10 to
    # 40 and nothing before.
    for at, read in ((9, False), (10, True), (40, True)):
        flipped = tokens.copy()
        flipped[0, at] = (flipped[0, at] + 1) % 256
        moved = np.abs(np.asarray(_read(model, flipped, positions) - logits)).max()
        assert (moved > 0) == read, at
    # Distances alone matter: the same tokens later in the buffer, the same logits.
    shifted = np.concatenate([rng.integers(0, 256, (1, 7)), tokens], axis=1)
    np.testing.assert_allclose(
        _read(model, shifted, positions + 7), logits, rtol=1e-4, atol=1e-4
    )
    with pytest.raises(ValueError, match="heads a divisor of width"):
        CausalTransformer(width=8, depth=1, heads=3, window=4, key=jax.random.key(0))


def test_the_target_keeping_its_features_gives_the_same_logits(models):
    target = models[1]
    keeping = FeatureKeeping(target)
    tokens = jnp.asarray(encode("def read(self, ")[None, :], jnp.int32)
    width = tokens.shape[1]
    mask = jnp.tril(jnp.ones((1, width, width), bool))
    positions = jnp.arange(width)[None]
    start = jnp.zeros((1,), jnp.int32)
    logits, (_, features) = keeping(
        tokens, positions, mask, keeping.init_cache(1, width), start
    )
    plain, _ = target(tokens, positions, mask, target.init_cache(1, width), start)
    np.testing.assert_array_equal(logits, plain)
    np.testing.assert_allclose(features, target.features_all(tokens), atol=1e-5)


def test_the_shipped_heads_beat_untrained_ones_on_held_out_text(models, text):
    target = models[1]
    rows = np.asarray(text[1][: 4 * 129], np.int32).reshape(4, 129)
    rows = jnp.asarray(rows)
    features = target.features_all(rows)
    untrained = heads_loss(target, *initial_weights(target), rows, features)
    medusa, eagle = load_demo_heads(target)
    shipped = heads_loss(
        target,
        {"weight": medusa.weight, "bias": medusa.bias},
        {"fuse": eagle.fuse, "weight": eagle.weight, "bias": eagle.bias},
        rows,
        features,
    )
    for after, before in zip(shipped, untrained, strict=True):
        assert after < before - 0.1


@pytest.mark.parametrize("batch", [1, 3])
def test_the_shipped_heads_draft_their_definition_under_jit(models, batch):
    """At the demo's shapes, compiled: XLA on CPU once summed these rows wrongly
    for a batch of one (see `rows_times`)."""
    target = models[1]
    medusa, eagle = load_demo_heads(target)
    prompt = jnp.tile(jnp.asarray(encode("    def read(self, "))[None], (batch, 1))
    loop = speculax.SpeculativeLoop(num_draft=4, max_new_tokens=2)
    state = loop.start(
        medusa, FeatureKeeping(target), prompt, jnp.full((batch,), prompt.shape[1])
    )
    uniforms = jnp.full((batch, 4), 0.5)
    feature = np.asarray(state.target_cache[1][:, prompt.shape[1] - 2], np.float64)
    weight, bias = np.asarray(medusa.weight), np.asarray(medusa.bias)
    hidden = feature[:, None] + jax.nn.silu(
        np.einsum("bf,kfg->bkg", feature, weight) + bias
    )
    expected = np.asarray(hidden) @ np.asarray(medusa.lm_head, np.float64)
    drafts = eqx.filter_jit(medusa.draft)(state, uniforms, 4, speculax.SameAsTarget())
    np.testing.assert_allclose(drafts.rows.logits, expected, atol=1e-3)
    fused = np.concatenate([feature, np.asarray(target.embedding)[prompt[:, -1]]], -1)
    fused = fused @ np.asarray(eagle.fuse, np.float64)
    predicted = fused + jax.nn.silu(fused @ np.asarray(eagle.weight) + eagle.bias)
    expected = np.asarray(predicted) @ np.asarray(eagle.lm_head, np.float64)
    drafts = eqx.filter_jit(eagle.draft)(state, uniforms, 4, speculax.SameAsTarget())
    np.testing.assert_allclose(drafts.rows.logits[:, 0], expected, atol=1e-3)
