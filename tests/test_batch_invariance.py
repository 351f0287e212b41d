"""SPEC 2, batch invariance: row b's output depends on row b's inputs alone, bit for
bit, whatever batch it is computed in and wherever it sits there.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import speculax


VOCAB = 32_000
NUM_DRAFT = 4
BATCH = 64


# Cached: drawing the inputs costs more than running the step on them.
@functools.cache
def random_batch(seed: int, batch: int, dtype: jnp.dtype) -> dict[str, jax.Array]:
    """Realistic rows: p and q are softmaxes of random logits (peaked, like a
    language model's), and the draft tokens are sampled from q.
    """
    # NumPy, not jax.random: eager JAX takes seconds to draw ten million normals.
    rng = np.random.default_rng(seed)
    q_logits = 3 * rng.standard_normal((batch, NUM_DRAFT, VOCAB), dtype=np.float32)
    p_logits = 3 * rng.standard_normal((batch, NUM_DRAFT + 1, VOCAB), dtype=np.float32)
    # The target agrees with the draft in part, so that some rows accept drafts.
    p_logits[:, :NUM_DRAFT] += q_logits
    # Gumbel-max: argmax(logits + Gumbel noise) is a draw from softmax(logits).
    gumbel = rng.gumbel(size=q_logits.shape).astype(np.float32)
    return {
        "draft_tokens": jnp.asarray(np.argmax(q_logits + gumbel, axis=-1)),
        "draft_probs": jax.nn.softmax(jnp.asarray(q_logits)).astype(dtype),
        "target_probs": jax.nn.softmax(jnp.asarray(p_logits)).astype(dtype),
        "accept_uniforms": jnp.asarray(rng.random((batch, NUM_DRAFT), np.float32)),
        "sample_uniforms": jnp.asarray(rng.random(batch, np.float32)),
    }


def run(inputs: dict[str, jax.Array]) -> dict[str, np.ndarray]:
    out = speculax.speculative_step(**inputs)
    return {name: np.asarray(value) for name, value in out.items()}


def take(inputs: dict[str, jax.Array], rows) -> dict[str, jax.Array]:
    return {name: value[jnp.asarray(rows)] for name, value in inputs.items()}


def assert_rows_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]):
    for name in ("num_accepted", "tokens"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_row_alone_equals_row_in_batch(dtype):
    inputs = random_batch(0, BATCH, dtype)
    batched = run(inputs)
    # The inputs must exercise both outcomes, or invariance is shown for half a step.
    assert 0 < batched["num_accepted"].mean() < NUM_DRAFT
    for b in range(BATCH):
        alone = run(take(inputs, [b]))
        assert_rows_equal(alone, {k: v[b : b + 1] for k, v in batched.items()})


@pytest.mark.parametrize("order", ["reversed", "permuted"])
def test_row_order_does_not_matter(order):
    inputs = random_batch(0, BATCH, jnp.float32)
    batched = run(inputs)
    if order == "reversed":
        rows = np.arange(BATCH)[::-1]
    else:
        rows = np.random.default_rng(1).permutation(BATCH)
    assert_rows_equal(run(take(inputs, rows)), {k: v[rows] for k, v in batched.items()})


def test_row_among_other_rows():
    # Half the rows, moved to other positions of a batch of unrelated rows.
    inputs = random_batch(0, BATCH, jnp.float32)
    batched = run(inputs)
    others = random_batch(1, BATCH, jnp.float32)
    rng = np.random.default_rng(2)
    rows = rng.choice(BATCH, size=BATCH // 2, replace=False)
    slots = rng.choice(BATCH, size=BATCH // 2, replace=False)
    mixed = {
        name: others[name].at[jnp.asarray(slots)].set(inputs[name][jnp.asarray(rows)])
        for name in inputs
    }
    out = run(mixed)
    assert_rows_equal(
        {k: v[slots] for k, v in out.items()}, {k: v[rows] for k, v in batched.items()}
    )
