"""Batch invariance: row b's output depends on row b's inputs alone, bit for
bit, whatever batch it is computed in and wherever it sits there.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import speculax
from doubles import DelegatingResidual


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
    return {name: np.asarray(out[name]) for name in ("num_accepted", "tokens")}


def take(inputs: dict[str, jax.Array], rows) -> dict[str, jax.Array]:
    return {name: value[jnp.asarray(rows)] for name, value in inputs.items()}


def assert_rows_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]):
    for name in ("num_accepted", "tokens"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize(
    "dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)]
)
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


# Both row strategies, every dtype, vocabularies that are and are not multiples of the
# block size 256, and uniforms on float64 cumulative-sum boundaries: a row's sums must
# be the same to the last bit alone and in a batch, or a uniform at a boundary draws
# another token.
EDGE_BATCH = 24
EDGE_DRAFT = 2


def _edge_inputs(vocab: int, dtype) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(vocab)
    shape = (EDGE_BATCH, EDGE_DRAFT + 1, vocab)
    # Flat rows (every block holds mass) beside peaked ones.
    logits = np.where(
        rng.random((EDGE_BATCH, 1, 1)) < 0.5, 0.1, 3.0
    ) * rng.standard_normal(shape)
    target = np.exp(logits)
    draft = target[:, :EDGE_DRAFT] * np.exp(0.5 * rng.standard_normal(shape)[:, :-1])
    target /= target.sum(-1, keepdims=True)
    draft /= draft.sum(-1, keepdims=True)
    tokens = np.array(
        [[rng.choice(vocab, p=row) for row in rows] for rows in draft], np.int32
    )
    return {
        "draft_tokens": tokens,
        "draft_probs": np.asarray(jnp.asarray(draft, dtype)),
        "target_probs": np.asarray(jnp.asarray(target, dtype)),
        "accept_uniforms": rng.random((EDGE_BATCH, EDGE_DRAFT)).astype(np.float32),
        "sample_uniforms": rng.random(EDGE_BATCH).astype(np.float32),
    }


def _boundary_uniforms(inputs, num_accepted) -> np.ndarray:
    """For each row, s on a float64 cumulative-sum boundary of its residual: the end
    of a block (every other row) or of a random token, rounded to float32 (rounding
    to nearest leaves s on either side of the boundary).
    """
    rng = np.random.default_rng(0)
    s = np.empty(EDGE_BATCH, np.float32)
    for b, n in enumerate(num_accepted):
        p = np.asarray(inputs["target_probs"][b, n], np.float64)
        w = p
        if n < EDGE_DRAFT:
            w = np.maximum(p - np.asarray(inputs["draft_probs"][b, n], np.float64), 0)
        cdf = np.cumsum(w) / w.sum()
        vocab = cdf.size
        ends = np.arange(255, vocab - 1, 256)
        edge = rng.choice(ends) if b % 2 and ends.size else rng.integers(vocab - 1)
        s[b] = min(np.float32(cdf[edge]), np.nextafter(np.float32(1), np.float32(0)))
    return s


def _assert_invariant_at_boundaries(step, vocab, dtype):
    with jax.enable_x64(dtype == "float64"):
        # A fresh jit per test: the row strategy is chosen at trace time.
        run_step = jax.jit(lambda *args: step(*args))
        inputs = _edge_inputs(vocab, jnp.dtype(dtype))
        first = run_step(*inputs.values())
        inputs["sample_uniforms"] = _boundary_uniforms(
            inputs, np.asarray(first["num_accepted"])
        )
        out = run_step(*inputs.values())
        batched = {k: np.asarray(out[k]) for k in ("num_accepted", "tokens")}
        assert 0 < batched["num_accepted"].mean() < EDGE_DRAFT
        for b in range(EDGE_BATCH):
            alone = run_step(*(value[b : b + 1] for value in inputs.values()))
            for name in ("num_accepted", "tokens"):
                np.testing.assert_array_equal(
                    np.asarray(alone[name])[0], batched[name][b], err_msg=name
                )
        reversed_rows = run_step(*(value[::-1] for value in inputs.values()))
        for name in ("num_accepted", "tokens"):
            np.testing.assert_array_equal(
                np.asarray(reversed_rows[name])[::-1], batched[name], err_msg=name
            )


@pytest.mark.slow
@pytest.mark.parametrize("vocab", [512, 1000])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_row_alone_equals_row_in_batch_at_cumulative_sum_boundaries(
    vocab, dtype, row_access
):
    _assert_invariant_at_boundaries(speculax.SpeculativeStep(), vocab, dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_sampler_on_weights_is_batch_invariant_at_boundaries(dtype):
    """`InverseCDF` on a `(batch, vocab)` array, as any other residual feeds it."""
    step = speculax.SpeculativeStep(residual=DelegatingResidual())
    _assert_invariant_at_boundaries(step, 1000, dtype)
