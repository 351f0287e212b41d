"""A chi-square test of the chain step's output, for pieces that cannot be
enumerated."""

from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._chain._step import SpeculativeStep
from ._chain import check_chain_step, check_normalised, check_row


class ChiSquareTest(NamedTuple):
    """The result of [`speculax.testing.lossless_chi_square`][]: for each output
    position $k$ of a step with $G$ draft positions over a vocabulary of $V$, the
    tokens sampled at $k$ among the rows with $n \\ge k$, tested against $p_k$.

    - `counts`: int64 `(G + 1, V)`; entry $[k, v]$ is the number of rows with
        $n \\ge k$ whose token $k$ is $v$.
    - `reached`: int64 `(G + 1,)`; entry $k$ is the number of rows with $n \\ge k$.
    - `statistic`: float64 `(G + 1,)`, Pearson's
        $\\chi^2_k = \\sum_v (\\text{counts}[k, v] - e_k(v))^2 / e_k(v)$ with
        $e_k = \\text{reached}[k] \\, p_k$, over the tokens with $p_k(v) > 0$;
        infinite when a token with $p_k(v) = 0$ was sampled.
    - `dof`: int64 `(G + 1,)`, its degrees of freedom: the number of tokens with
        $p_k(v) > 0$, less one.
    - `p_value`: float64 `(G + 1,)`, $P(X \\ge \\chi^2_k)$ for $X$ chi-square with
        `dof[k]` degrees of freedom: small when token $k$ is not distributed as
        $p_k$. `NaN` where no row reached $k$.
    - `total_variation`: float64 `(G + 1,)`,
        $\\frac{1}{2} \\sum_v |\\text{counts}[k, v] / \\text{reached}[k] - p_k(v)|$,
        an estimate of the distance (biased up by sampling noise, of order
        $\\sqrt{V / \\text{reached}[k]}$). `NaN` where no row reached $k$.
    """

    counts: Int[np.ndarray, "draft+1 vocab"]
    reached: Int[np.ndarray, " draft+1"]
    statistic: Float[np.ndarray, " draft+1"]
    dof: Int[np.ndarray, " draft+1"]
    p_value: Float[np.ndarray, " draft+1"]
    total_variation: Float[np.ndarray, " draft+1"]


def lossless_chi_square(
    step: SpeculativeStep,
    draft_probs: Float[Array | np.ndarray, "draft vocab"],
    target_probs: Float[Array | np.ndarray, "draft+1 vocab"],
    *,
    key: PRNGKeyArray,
    num_samples: int | np.integer = 100_000,
) -> ChiSquareTest:
    """Tests `step` for losslessness statistically, every piece as it runs: the
    compiled step is called once on `num_samples` independent rows of one $(q, p)$,
    each row's draft tokens $x_i$ drawn from $q_i$ and its uniforms from `key`,
    and for each output position $k$ the tokens of the rows with $n \\ge k$ are
    compared with $p_k$ by Pearson's chi-square test.

    Where [`speculax.testing.output_distribution`][] refuses a piece it cannot
    evaluate exactly (a sampler that draws a token on more than one interval of its
    uniform, an acceptance test that is not monotone in its own uniform), this
    still applies, at the price of being statistical: a lossless step gives
    p-values spread uniformly over $[0, 1]$, so a fixed `key` fails a threshold of
    $10^{-3}$ about once in a thousand keys (per position), while a lossy one gives
    p-values that fall to 0 as `num_samples` grows. The test is sound when every
    expected count $e_k(v) = \\text{reached}[k] \\, p_k(v)$ is at least 5 or so.

    The step runs at the precision of the given arrays (float32 for NumPy float64
    arrays unless JAX's x64 mode is on), as it would in use. The rows take
    `num_samples` $\\times (2G + 1) \\times V$ floats of memory.

    **Arguments:**

    - `step`: the [`speculax.SpeculativeStep`][] to test.
    - `draft_probs`: $q_i$, float `(G, V)`, normalised.
    - `target_probs`: $p_i$, float `(G + 1, V)`, normalised.
    - `key`: keyword only, a JAX PRNG key, from which the draft tokens and the
        uniforms of every row are drawn.
    - `num_samples`: keyword only, the number of rows, a positive integer. Default
        100,000.

    **Returns:**

    A [`speculax.testing.ChiSquareTest`][] of NumPy arrays: `counts` `(G + 1, V)`,
    and `reached`, `statistic`, `dof`, `p_value` and `total_variation` `(G + 1,)`.

    **Raises:**

    `ValueError` for shapes that disagree, a negative or non-finite probability, a
    row that does not sum to 1 within $10^{-6}$, a `num_samples` that is not a
    positive integer, or a step that returns a token outside `[0, V)` at a position
    it reached; `TypeError` for a step that is not a
    [`speculax.SpeculativeStep`][] (a `LogitsStep` would read the probabilities as
    logits), naming the checker that fits it.

    **Example:**

    ```python
    import jax
    import numpy as np
    import speculax
    import speculax.testing

    q = np.array([[0.5, 0.3, 0.2]])
    p = np.array([[0.2, 0.2, 0.6], [0.3, 0.3, 0.4]])
    test = speculax.testing.lossless_chi_square(
        speculax.SpeculativeStep(), q, p, key=jax.random.key(0), num_samples=2_000
    )
    assert test.reached[0] == 2_000
    assert np.all(test.p_value > 1e-4)
    ```
    """
    check_chain_step(step, "lossless_chi_square")
    q, p = check_row(draft_probs, target_probs)
    check_normalised(q, p)
    if isinstance(num_samples, bool) or not isinstance(num_samples, int | np.integer):
        raise TypeError(
            f"num_samples must be an integer; got {type(num_samples).__name__}"
        )
    if num_samples < 1:
        raise ValueError(f"num_samples must be positive; got {num_samples}")
    vocab = q.shape[1]
    counts, reached = (
        np.asarray(x, np.int64)
        for x in _sample_counts(
            step,
            key,
            jnp.asarray(draft_probs),
            jnp.asarray(target_probs),
            int(num_samples),
        )
    )
    if np.any(counts[:, vocab]):
        k = int(np.argmax(counts[:, vocab] > 0))
        raise ValueError(
            f"the step returned a token outside [0, V) = [0, {vocab}) at position "
            f"{k}, in a row with num_accepted >= {k}"
        )
    counts = counts[:, :vocab]
    positive = p > 0
    expected = reached[:, None] * p
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(positive, (counts - expected) ** 2 / expected, 0.0)
        statistic = np.where(
            np.any(~positive & (counts > 0), axis=-1), np.inf, terms.sum(axis=-1)
        )
        frequencies = counts / reached[:, None]
        total_variation = 0.5 * np.abs(frequencies - p).sum(axis=-1)
    dof = positive.sum(axis=-1) - 1
    p_value = np.where(reached > 0, chi_square_sf(statistic, dof), np.nan)
    return ChiSquareTest(
        counts=counts,
        reached=reached,
        statistic=np.where(reached > 0, statistic, 0.0),
        dof=dof,
        p_value=p_value,
        total_variation=np.where(reached > 0, total_variation, np.nan),
    )


def chi_square_sf(
    statistic: Float[np.ndarray, " n"], dof: Int[np.ndarray, " n"]
) -> Float[np.ndarray, " n"]:
    """$P(X \\ge x)$ for $X$ chi-square with `dof` degrees of freedom, the
    regularised upper incomplete gamma function $Q(d/2, x/2)$, in float64. With no
    degree of freedom $X = 0$: 1 for $x = 0$, 0 above."""
    statistic = np.asarray(statistic, np.float64)
    dof = np.asarray(dof, np.int64)
    with jax.enable_x64(True):
        tail = np.asarray(
            jax.scipy.special.gammaincc(
                jnp.asarray(np.maximum(dof, 1) / 2), jnp.asarray(statistic / 2)
            ),
            np.float64,
        )
    return np.where(dof > 0, tail, np.where(statistic > 0, 0.0, 1.0))


@eqx.filter_jit
def _sample_counts(
    step: SpeculativeStep,
    key: PRNGKeyArray,
    q: Float[Array, "draft vocab"],
    p: Float[Array, "draft+1 vocab"],
    num_samples: int,
) -> tuple[Int[Array, "draft+1 vocab+1"], Int[Array, " draft+1"]]:
    """The counts of each token at each position over the rows reaching it, the
    last column counting tokens outside `[0, V)`, and the number of rows reaching
    each position."""
    num_draft, vocab = q.shape
    token_key, uniform_key = jax.random.split(key)
    # Positions are drawn independently, each from its own q_i; log(0) = -inf
    # keeps tokens of zero probability out.
    draft_tokens = jax.random.categorical(
        token_key, jnp.log(q), shape=(num_samples, num_draft)
    )
    out = step(
        draft_tokens,
        jnp.broadcast_to(q, (num_samples, *q.shape)),
        jnp.broadcast_to(p, (num_samples, *p.shape)),
        key=uniform_key,
    )
    tokens, num_accepted = out["tokens"], out["num_accepted"]
    positions = jnp.arange(num_draft + 1)
    at_position = num_accepted[:, None] >= positions
    column = jnp.where((tokens >= 0) & (tokens < vocab), tokens, vocab)
    counts = (
        jnp.zeros((num_draft + 1, vocab + 1), jnp.int32)
        .at[jnp.broadcast_to(positions, tokens.shape), column]
        .add(at_position.astype(jnp.int32))
    )
    return counts, at_position.sum(axis=0, dtype=jnp.int32)
