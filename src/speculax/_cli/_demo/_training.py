import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Integer, PRNGKeyArray, PyTree

from ._models import CausalTransformer


def sequence_loss(
    model: CausalTransformer, rows: Int[Array, "batch length"]
) -> Float[Array, ""]:
    """The mean cross entropy, in nats, of every next token of some rows of tokens.

    **Arguments:**

    - `model`: the model.
    - `rows`: integer `(B, L)`, byte tokens; token $i + 1$ of each row is predicted
        from tokens $0, \\ldots, i$, for $i < L - 1$.

    **Returns:**

    A float32 scalar, the mean over the $B (L - 1)$ predictions.
    """
    logits = model.read_all(rows[:, :-1])
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(log_probs, rows[:, 1:, None], axis=-1)
    return -jnp.mean(picked)


def held_out_loss(
    model: CausalTransformer,
    tokens: Integer[np.ndarray, " size"],
    *,
    length: int = 256,
    rows_per_call: int = 16,
) -> float:
    """The loss of a model on a text, in nats per byte: the mean cross entropy of
    every byte after the first of each chunk of `length` bytes, given the bytes
    before it in its chunk.

    **Arguments:**

    - `model`: the model.
    - `tokens`: integer `(size,)` with `size >= length`, byte tokens in
        `[0, 256)`; the bytes past the last whole chunk are left out.
    - `length`: keyword only, the bytes of a chunk, at least 2.
    - `rows_per_call`: keyword only, how many chunks one call of the model reads.

    **Returns:**

    The mean over the predictions, a Python float.
    """
    if length < 2 or len(tokens) < length:
        raise ValueError(
            f"length must be at least 2 and tokens hold at least length = {length} "
            f"tokens; got {len(tokens)}"
        )
    count = len(tokens) // length
    rows = np.asarray(tokens[: count * length], np.int32).reshape(count, length)
    total = 0.0
    for start in range(0, count, rows_per_call):
        chunk = rows[start : start + rows_per_call]
        total += float(_summed_loss(model, jnp.asarray(chunk)))
    return total / (count * (length - 1))


@eqx.filter_jit
def _summed_loss(
    model: CausalTransformer, rows: Int[Array, "batch length"]
) -> Float[Array, ""]:
    return sequence_loss(model, rows) * rows.shape[0] * (rows.shape[1] - 1)


def _learning_rate(
    step: Int[Array, ""], steps: int, peak: int | float
) -> Float[Array, ""]:
    # Linear warmup over the first twentieth, then a cosine decay to a tenth.
    warmup = max(1, steps // 20)
    fraction = jnp.clip((step - warmup) / max(1, steps - warmup), 0.0, 1.0)
    decay = 0.1 + 0.45 * (1.0 + jnp.cos(math.pi * fraction))
    return peak * jnp.minimum((step + 1) / warmup, 1.0) * decay


def train(
    model: PyTree,
    tokens: Integer[np.ndarray, " size"],
    *,
    steps: int,
    key: PRNGKeyArray,
    batch_size: int = 64,
    length: int = 64,
    learning_rate: int | float = 1e-2,
    steps_per_call: int = 50,
    callback: Callable[[int, float], None] | None = None,
    loss: Callable[[PyTree, Int[Array, "batch length"]], Float[Array, ""]] = (
        sequence_loss
    ),
) -> tuple[PyTree, Float[np.ndarray, " steps"]]:
    """Trains a model with Adam on random rows of a text.

    Each step draws `batch_size` rows of `length + 1` consecutive tokens, at
    uniformly random offsets, and takes one Adam step ($\\beta_1 = 0.9$, $\\beta_2 =
    0.99$, $\\epsilon = 10^{-8}$) on their `loss` (by default `sequence_loss`).
    The learning rate rises linearly over the first twentieth of the steps to
    `learning_rate`, then decays along a cosine to a tenth of it. `steps_per_call`
    steps run in one compiled loop.

    **Arguments:**

    - `model`: the initial model, or any PyTree of the weights `loss` reads: its
        float arrays are trained.
    - `tokens`: integer `(size,)`, the training text as byte tokens, `size > length`.
    - `steps`: keyword only, the number of steps, a multiple of `steps_per_call`
        (or fewer than it: then one loop of `steps`).
    - `key`: keyword only, a PRNG key for the rows drawn.
    - `batch_size`, `length`: keyword only, the rows drawn per step and their
        number of predictions.
    - `learning_rate`: keyword only, the peak learning rate.
    - `steps_per_call`: keyword only, the steps per compiled loop.
    - `callback`: keyword only, called as `callback(steps_done, mean_loss)` after
        each loop.
    - `loss`: keyword only, the loss of the model on rows of tokens.

    **Returns:**

    A tuple `(model, losses)`: the trained model, and the float32 NumPy array of
    shape `(steps,)` of each step's training loss (before its update).
    """
    if len(tokens) <= length:
        raise ValueError(
            f"tokens must be longer than length = {length}; got {len(tokens)}"
        )
    steps_per_call = min(steps_per_call, steps)
    if steps < 1 or steps % steps_per_call:
        raise ValueError(
            f"steps must be a positive multiple of steps_per_call = {steps_per_call}; "
            f"got {steps}"
        )
    data = jnp.asarray(tokens, dtype=jnp.int32)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    zeros = jax.tree.map(jnp.zeros_like, params)
    state = (params, zeros, zeros, jnp.int32(0))
    offsets = jnp.arange(length + 1)

    def one_step(
        state: tuple[PyTree, PyTree, PyTree, Array],
        step_key: PRNGKeyArray,
        data: Int[Array, " size"],
    ):
        params, first, second, step = state
        starts = jax.random.randint(step_key, (batch_size, 1), 0, len(tokens) - length)
        rows = data[starts + offsets]
        value, grads = jax.value_and_grad(lambda p: loss(eqx.combine(p, static), rows))(
            params
        )
        count = step + 1
        first = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, first, grads)
        second = jax.tree.map(lambda v, g: 0.99 * v + 0.01 * g * g, second, grads)
        rate = _learning_rate(step, steps, learning_rate)
        correction1 = 1 - 0.9**count
        correction2 = 1 - 0.99**count

        def update(p, m, v):
            return p - rate * (m / correction1) / (jnp.sqrt(v / correction2) + 1e-8)

        params = jax.tree.map(update, params, first, second)
        return (params, first, second, count), value

    @jax.jit
    def loop(state, loop_key, data):
        return jax.lax.scan(
            lambda state, step_key: one_step(state, step_key, data),
            state,
            jax.random.split(loop_key, steps_per_call),
        )

    losses = []
    for index, loop_key in enumerate(jax.random.split(key, steps // steps_per_call)):
        state, loop_losses = loop(state, loop_key, data)
        losses.append(np.asarray(loop_losses))
        if callback is not None:
            callback((index + 1) * steps_per_call, float(losses[-1].mean()))
    return eqx.combine(state[0], static), np.concatenate(losses)
