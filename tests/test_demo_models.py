"""The demo's byte-level draft and target models: the shipped weights, causality,
the held-out loss, the training code, saving and loading, the byte tokens."""

import io
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from speculax._cli._demo import (
    CORPUS_MODULES,
    WindowModel,
    corpus,
    decode,
    encode,
    held_out_loss,
    load_demo_models,
    load_model,
    save_model,
    sequence_loss,
    split_corpus,
    train,
)


@pytest.fixture(scope="module")
def models():
    return load_demo_models()


@pytest.fixture(scope="module")
def text():
    return split_corpus(corpus())


@eqx.filter_jit
def _logits(model, tokens, positions):
    return model(jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32))


def _tiny_model(key=0):
    return WindowModel(
        window=3, embed_size=4, hidden_size=16, depth=1, key=jax.random.key(key)
    )


def test_shipped_models_load_and_give_finite_logits(models):
    draft, target = models
    assert (draft.window, target.window) == (4, 16)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (3, 40)), jnp.int32)
    positions = jnp.array([[0, 5, 39], [1, 2, 3], [20, 30, 39]], jnp.int32)
    for model in models:
        logits = _logits(model, tokens, positions)
        assert logits.shape == (3, 3, 256)
        assert logits.dtype == jnp.float32
        assert jnp.all(jnp.isfinite(logits))


@pytest.mark.parametrize("which", ["draft", "target", "tiny"])
def test_logits_read_only_the_window_up_to_the_position(models, which):
    model = {"draft": models[0], "target": models[1], "tiny": _tiny_model()}[which]
    rng = np.random.default_rng(1)
    batch, time = 2, 40
    tokens = rng.integers(0, 256, (batch, time))
    # Positions near the start (the window runs off the buffer), and further in.
    positions = np.array([[0, 2, 17, 30], [1, 16, 25, 39]])
    logits = _logits(model, tokens, positions)
    for k in range(positions.shape[1]):
        position = positions[:, k : k + 1]
        index = np.arange(time)
        after = index > position
        changed = np.where(after, rng.integers(0, 256, (batch, time)), tokens)
        new = _logits(model, changed, positions)
        np.testing.assert_array_equal(new[:, k], logits[:, k])
        # The token at the position itself, and the oldest in the window, are read.
        for offset in (0, model.window - 1):
            read = index == position - offset
            flipped = np.where(read, (tokens + 1) % 256, tokens)
            new = _logits(model, flipped, positions)
            moved = np.abs(np.asarray(new[:, k] - logits[:, k])).max(axis=-1)
            inside = position[:, 0] >= offset
            assert np.all((moved > 0) == inside)


def test_logits_are_the_mlp_of_the_window_embeddings():
    # The reference: the embeddings of the last `window` tokens, the slots before
    # the start of the buffer given the embedding of id 256, concatenated.
    model = _tiny_model()
    tokens = np.array([[7, 200, 3, 255, 0, 9], [1, 2, 3, 4, 5, 6]])
    positions = np.array([[0, 1, 5], [2, 3, 4]])
    logits = _logits(model, tokens, positions)
    for b in range(2):
        for k in range(3):
            position = positions[b, k]
            ids = [
                tokens[b, i] if i >= 0 else 256
                for i in range(position - model.window + 1, position + 1)
            ]
            features = model.embedding.weight[jnp.array(ids)].reshape(-1)
            np.testing.assert_allclose(
                logits[b, k], model.mlp(features), rtol=1e-5, atol=1e-5
            )


def test_the_target_beats_the_draft_on_held_out_text(models, text):
    _, held_out = text
    draft_loss, target_loss = (held_out_loss(m, held_out[:2048]) for m in models)
    # About 1.6 and 1.4 nats per byte on the whole held-out text; uniform is 5.5.
    assert target_loss < draft_loss - 0.1
    assert draft_loss < 2.0


def test_held_out_loss_is_the_mean_of_every_prediction():
    model = _tiny_model()
    tokens = encode("import numpy as np\nprint(np.arange(3))\n")
    expected = eqx.filter_jit(sequence_loss)(model, jnp.asarray(tokens)[None, :])
    for chunk in (7, 100):
        loss = held_out_loss(model, tokens, chunk=chunk)
        np.testing.assert_allclose(loss, expected, rtol=1e-5)


def test_a_short_training_run_lowers_the_loss(text):
    train_tokens, held_out = text
    model = _tiny_model()
    before = held_out_loss(model, held_out[:1024])
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
    assert held_out_loss(trained, held_out[:1024]) < before - 1.0


def test_weights_survive_saving_and_loading():
    model = _tiny_model()
    file = io.BytesIO()
    save_model(model, file)
    file.seek(0)
    loaded = load_model(
        file, {"window": 3, "embed_size": 4, "hidden_size": 16, "depth": 1}
    )
    old_leaves = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    new_leaves = jax.tree.leaves(eqx.filter(loaded, eqx.is_array))
    assert len(old_leaves) == 5
    for old, new in zip(old_leaves, new_leaves, strict=True):
        assert new.dtype == jnp.float32
        np.testing.assert_allclose(new, old, rtol=1e-3, atol=1e-4)


def test_corpus_is_the_modules_sources_in_order():
    import argparse
    import textwrap

    tokens = corpus(("textwrap", "argparse"))
    assert tokens.dtype == np.uint8
    first = Path(textwrap.__file__).read_bytes() + b"\n"
    second = Path(argparse.__file__).read_bytes() + b"\n"
    assert tokens.tobytes() == first + second
    assert len(corpus()) > 1_000_000
    assert CORPUS_MODULES[0] == "argparse"
    train_tokens, held_out = split_corpus(tokens, 0.25)
    np.testing.assert_array_equal(np.concatenate([train_tokens, held_out]), tokens)
    assert len(held_out) == round(0.25 * len(tokens))


def test_encode_and_decode_are_utf8_bytes():
    tokens = encode("déjà vu ✓")
    assert tokens.dtype == np.int32
    assert tokens.tolist() == list("déjà vu ✓".encode())
    assert decode(tokens) == "déjà vu ✓"
    assert decode([0xE2, 0x9C]) == "\ufffd"
    assert decode(jnp.asarray(tokens)) == "déjà vu ✓"
    with pytest.raises(ValueError, match="must lie in"):
        decode([256])
