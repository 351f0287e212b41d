"""Exact output distributions of the chain step, by enumeration."""

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from .._acceptance import AbstractAcceptance
from .._residual import AbstractResidual
from .._step import SpeculativeStep


# Enumeration costs V^G calls' worth of rows; past this it is no longer a quick check.
_MAX_SEQUENCES = 1_000_000
_ONE_BITS = int(np.float64(1.0).view(np.int64))
# Enough halvings to shrink [-1, _ONE_BITS] to adjacent integers.
_HALVINGS = (_ONE_BITS + 1).bit_length()
_PROBES = 16
# Shifts by multiples of it spread the probes of different positions apart.
_GOLDEN_FRACTION = 0.6180339887498949


class OutputDistribution(NamedTuple):
    """The exact distribution of one row's output, from
    [`speculax.testing.output_distribution`][]. All arrays are float64; $G$ is the
    number of draft positions and $V$ the vocabulary size.

    - `token_probs`: shape `(G + 1, V)`; entry $[k, v]$ is
        $P(\\text{token } k = v \\text{ and } n \\ge k)$.
    - `reach_probs`: shape `(G + 1,)`; entry $k$ is $P(n \\ge k)$, the probability
        that position $k$ holds a token at all. Row $k$ of `token_probs` sums to it.
    - `num_accepted_probs`: shape `(G + 1,)`; entry $m$ is $P(n = m)$.

    The distribution of token $k$ given $n \\ge k$ is
    `token_probs[k] / reach_probs[k]`; the step is lossless when it equals $p_k$ for
    every $k$ with `reach_probs[k] > 0`.
    """

    token_probs: Float[np.ndarray, "draft+1 vocab"]
    reach_probs: Float[np.ndarray, " draft+1"]
    num_accepted_probs: Float[np.ndarray, " draft+1"]


def output_distribution(
    step: SpeculativeStep,
    draft_probs: Float[Array | np.ndarray, "draft vocab"] | Sequence[Sequence[float]],
    target_probs: Float[Array | np.ndarray, "draft+1 vocab"]
    | Sequence[Sequence[float]],
) -> OutputDistribution:
    """Computes exactly, in float64, the distribution of one row's output of `step`
    when each draft token $x_i$ is drawn from $q_i$ independently and the uniforms
    $u_i$ and $s$ are independent and uniform on $[0, 1)$.

    Every draft sequence $x$ is enumerated, with probability $\\prod_i q_i(x_i)$, and
    the uniforms are integrated out analytically, each piece of `step` being called
    on all $V^G$ sequences at once under `jax.enable_x64(True)`:

    - **Acceptance.** For each sequence and position, `step.acceptance` is evaluated
        at many values of $u_i$ to find, by bisection over the float64 numbers in
        $[0, 1)$, the smallest $u_i$ at which the test fails; that threshold $t_i(x)$
        is the probability that position $i$ passes. This assumes each position's
        verdict depends on its own $u_i$ alone and is monotone in it (the test passes
        exactly for $u_i < t_i(x)$), which holds for
        [`speculax.RatioAcceptance`][], where $t_i(x) = \\min(1, p_i(x_i)/q_i(x_i))$.
    - **Prefix count.** `step.prefix` is called on all $2^G$ patterns of verdicts,
        each weighted by the product of its positions' pass or fail probabilities.
    - **Residual and sampler.** For each sequence and each stopping position $n$,
        the token drawn is distributed as the weights of `step.residual`, normalised.
        This assumes the sampler is an exact inverse CDF, so that a uniform $s$ picks
        $v$ with probability $w(v) / \\sum w$; `step.sampler` is not called (test it
        statistically instead).

    The cost grows as $V^G$: this is meant for small cases, say $V \\le 8$ and
    $G \\le 3$. The theorem it checks is about normalised $p_i$ and $q_i$.

    **Arguments:**

    - `step`: the step whose `acceptance`, `prefix` and `residual` pieces to use.
    - `draft_probs`: $q_i$, float of shape `(G, V)`, one row's draft distributions:
        a JAX or NumPy array, or nested lists of floats.
    - `target_probs`: $p_i$, float of shape `(G + 1, V)`, one row's target
        distributions, likewise.

    **Returns:**

    An [`speculax.testing.OutputDistribution`][] of float64 NumPy arrays:
    `token_probs` `(G + 1, V)`, `reach_probs` `(G + 1,)` and `num_accepted_probs`
    `(G + 1,)`.

    **Raises:**

    `ValueError` for shapes that disagree, a negative or non-finite probability, more
    than a million draft sequences, an acceptance test seen not to be monotone in
    $u_i$ (checked at 16 values of $u_i$), a prefix count outside $[0, G]$, or residual
    weights, at a stopping position reached with positive probability, that are
    negative, not finite or without positive mass.
    """
    q = np.asarray(draft_probs, dtype=np.float64)
    p = np.asarray(target_probs, dtype=np.float64)
    if q.ndim != 2 or p.ndim != 2 or p.shape != (q.shape[0] + 1, q.shape[1]):
        raise ValueError(
            "draft_probs must have shape (G, V) and target_probs shape (G + 1, V); "
            f"got {q.shape} and {p.shape}"
        )
    for name, x in (("draft_probs", q), ("target_probs", p)):
        if not np.all(np.isfinite(x) & (x >= 0)):
            raise ValueError(f"{name} must be finite and non-negative")
    num_draft, vocab = q.shape
    if vocab**num_draft > _MAX_SEQUENCES:
        raise ValueError(
            f"V^G = {vocab}^{num_draft} draft sequences is too many to enumerate; "
            f"at most {_MAX_SEQUENCES}"
        )

    # Every draft sequence x, one per row: shape (V^G, G).
    sequences = np.array(
        list(itertools.product(range(vocab), repeat=num_draft)), dtype=np.int64
    ).reshape(vocab**num_draft, num_draft)
    positions = np.arange(num_draft)
    sequence_probs = np.prod(q[positions, sequences], axis=-1)

    patterns = np.array(
        list(itertools.product([False, True], repeat=num_draft)), dtype=bool
    ).reshape(2**num_draft, num_draft)
    with jax.enable_x64(True):
        pass_probs, monotone, counts, weights = _run_pieces(
            step,
            jnp.asarray(sequences),
            jnp.asarray(q),
            jnp.asarray(p),
            jnp.asarray(patterns),
        )
    if not np.all(np.asarray(monotone)[sequence_probs > 0]):
        raise ValueError(
            "step.acceptance is not monotone in the uniform: a position passes at some "
            "u above the threshold found by bisection or fails at some u below it"
        )
    pass_probs, counts, weights = (
        np.asarray(pass_probs),
        np.asarray(counts).astype(np.int64),
        np.asarray(weights, dtype=np.float64),
    )
    if np.any((counts < 0) | (counts > num_draft)):
        raise ValueError(
            f"step.prefix returned a count outside [0, G] = [0, {num_draft}]: {counts}"
        )
    # Verdicts at different positions are independent given x: each reads its own u_i.
    pattern_probs = np.prod(
        np.where(patterns[None], pass_probs[:, None], 1 - pass_probs[:, None]), axis=-1
    )
    stop_probs = pattern_probs @ np.eye(num_draft + 1)[counts]  # P(n = m | x)
    residual = _normalise(
        weights,
        sequence_probs[:, None] * stop_probs,
        sequences,
    )

    # Token k is the draft token x_k when n > k and the drawn token when n = k.
    token_probs = np.zeros((num_draft + 1, vocab))
    beyond = np.cumsum(stop_probs[:, ::-1], axis=-1)[:, ::-1]  # P(n >= m | x)
    for k in range(num_draft + 1):
        drawn_weight = sequence_probs * stop_probs[:, k]
        token_probs[k] = drawn_weight @ residual[:, k]
        if k < num_draft:
            kept_weight = sequence_probs * beyond[:, k + 1]
            token_probs[k] += np.bincount(
                sequences[:, k], weights=kept_weight, minlength=vocab
            )
    num_accepted_probs = sequence_probs @ stop_probs
    reach_probs = sequence_probs @ beyond
    return OutputDistribution(token_probs, reach_probs, num_accepted_probs)


def lossless_error(
    step: SpeculativeStep,
    draft_probs: Float[Array | np.ndarray, "draft vocab"] | Sequence[Sequence[float]],
    target_probs: Float[Array | np.ndarray, "draft+1 vocab"]
    | Sequence[Sequence[float]],
) -> float:
    """How far `step` is from lossless on one row: the largest absolute difference
    between the exact distribution of token $k$ given $n \\ge k$ and $p_k$,
    $\\max_{k, v} |P(\\text{token } k = v \\mid n \\ge k) - p_k(v)|$, over the
    positions $k$ with $P(n \\ge k) > 0$.

    Computed by [`speculax.testing.output_distribution`][], under the same
    assumptions. A lossless composition gives rounding error only, about $10^{-15}$.

    **Arguments:**

    - `step`: the step to check.
    - `draft_probs`: $q_i$, float of shape `(G, V)`, normalised: an array or nested
        lists of floats.
    - `target_probs`: $p_i$, float of shape `(G + 1, V)`, normalised, likewise.

    **Returns:**

    The largest absolute deviation, a Python float.
    """
    dist = output_distribution(step, draft_probs, target_probs)
    p = np.asarray(target_probs, dtype=np.float64)
    reached = dist.reach_probs > 0
    conditional = dist.token_probs[reached] / dist.reach_probs[reached, None]
    return float(np.max(np.abs(conditional - p[reached]), initial=0.0))


@eqx.filter_jit
def _run_pieces(
    step: SpeculativeStep,
    sequences: Int[Array, "sequences draft"],
    q: Float[Array, "draft vocab"],
    p: Float[Array, "draft+1 vocab"],
    patterns: Bool[Array, "patterns draft"],
) -> tuple[
    Float[Array, "sequences draft"],
    Bool[Array, "sequences draft"],
    Int[Array, " patterns"],
    Float[Array, "sequences draft+1 vocab"],
]:
    """Calls each piece once on everything it is needed for, compiled once per shape.

    Returns $t_i(x)$ for every sequence and position, whether the verdicts at a grid
    of uniforms agree with $u_i < t_i(x)$ there, the prefix count of every
    pattern of verdicts, and the residual weights for every sequence and stopping
    position.
    """
    num_sequences = sequences.shape[0]
    q_batch = jnp.broadcast_to(q, (num_sequences, *q.shape))
    p_batch = jnp.broadcast_to(p, (num_sequences, *p.shape))

    pass_probs, monotone = acceptance_thresholds(
        step.acceptance, sequences, q_batch, p_batch
    )

    counts = step.prefix(patterns)
    weights = residual_weights(step.residual, sequences, q_batch, p_batch)
    return pass_probs, monotone, counts, weights


def residual_weights(
    residual: AbstractResidual,
    draft_tokens: Int[Array, "rows draft"],
    draft_probs: Float[Array, "rows draft vocab"],
    target_probs: Float[Array, "rows draft+1 vocab"],
) -> Float[Array, "rows draft+1 vocab"]:
    """The weights `residual` gives each row at every stopping position.

    **Arguments:**

    - `residual`: the residual piece.
    - `draft_tokens`: integer `(rows, G)`.
    - `draft_probs`: float `(rows, G, V)`, $q_i$.
    - `target_probs`: float `(rows, G + 1, V)`, $p_i$.

    **Returns:**

    Float `(rows, G + 1, V)`: entry $[r, n]$ holds the weights with $n$ drafts
    accepted.
    """
    rows, num_draft = draft_tokens.shape
    stops = num_draft + 1
    weights = residual(
        jnp.tile(jnp.arange(stops), rows),
        jnp.repeat(draft_tokens, stops, axis=0),
        jnp.repeat(draft_probs, stops, axis=0),
        jnp.repeat(target_probs, stops, axis=0),
        num_draft_tokens=None,
    )
    return weights.reshape(rows, stops, -1)


@eqx.filter_jit
def acceptance_thresholds(
    acceptance: AbstractAcceptance,
    draft_tokens: Int[Array, "rows draft"],
    draft_probs: Float[Array, "rows draft vocab"],
    target_probs: Float[Array, "rows draft+1 vocab"],
) -> tuple[Float[Array, "rows draft"], Bool[Array, "rows draft"]]:
    """The threshold $t_i$ below which each position's test passes, so that
    $P(\\text{pass}) = t_i$ for a uniform $u_i$, and whether probes agree with
    "passes exactly when $u_i < t_i$" (a test that is not monotone in its own $u_i$
    has no such threshold).

    **Arguments:**

    - `acceptance`: the acceptance piece.
    - `draft_tokens`: integer `(rows, G)`.
    - `draft_probs`: float `(rows, G, V)`, $q_i$.
    - `target_probs`: float `(rows, G + 1, V)`, $p_i$.

    **Returns:**

    `(thresholds, monotone)`, float64 and bool `(rows, G)`.
    """

    # Bisects on the bit patterns of the float64 numbers in [0, 1), which order like
    # the numbers themselves, so the threshold is found to the last bit (keeping its
    # relative precision even when tiny) in 62 halvings of [-1, bits(1.0)]. `passing`
    # is known to pass (-1 stands for "below 0") and `failing` known to fail (1.0
    # stands for the end of the interval and is never evaluated).
    def halve(_, bounds):
        passing, failing = bounds
        middle = jnp.maximum(passing + (failing - passing) // 2, 0)
        u = jax.lax.bitcast_convert_type(middle, jnp.float64)
        passed = acceptance(
            draft_tokens, draft_probs, target_probs, u, num_draft_tokens=None
        )
        still_open = failing - passing > 1
        passing = jnp.where(still_open & passed, middle, passing)
        failing = jnp.where(still_open & ~passed, middle, failing)
        return passing, failing

    start = (
        jnp.full(draft_tokens.shape, -1, jnp.int64),
        jnp.full(draft_tokens.shape, _ONE_BITS, jnp.int64),
    )
    _, failing = jax.lax.fori_loop(0, _HALVINGS, halve, start)
    thresholds = jax.lax.bitcast_convert_type(failing, jnp.float64)

    # Bisection silently finds a wrong threshold for a non-monotone test; a grid of
    # probes catches the gross cases. Each position's probe is shifted by its own
    # amount, so that a test reading another position's uniform is seen too.
    shifts = jnp.arange(draft_tokens.shape[1]) * _GOLDEN_FRACTION

    def probe(j, consistent):
        u = jnp.broadcast_to(
            ((j + 0.5) / _PROBES + shifts) % 1.0, draft_tokens.shape
        ).astype(jnp.float64)
        passed = acceptance(
            draft_tokens, draft_probs, target_probs, u, num_draft_tokens=None
        )
        return consistent & (passed == (u < thresholds))

    monotone = jax.lax.fori_loop(
        0, _PROBES, probe, jnp.ones(draft_tokens.shape, jnp.bool_)
    )
    return thresholds, monotone


def _normalise(
    weights: np.ndarray, state_probs: np.ndarray, sequences: np.ndarray
) -> np.ndarray:
    """The residual $r = w / \\sum w$ for every sequence and stopping position.

    `state_probs[x, m]` is the probability of reaching that state; weights are
    validated only where it is positive, since an unreachable state draws no token.
    """
    total = np.sum(weights, axis=-1, keepdims=True)
    valid = np.all(np.isfinite(weights) & (weights >= 0), axis=-1) & (total[..., 0] > 0)
    bad = (state_probs > 0) & ~valid
    if np.any(bad):
        sequence, stop = np.argwhere(bad)[0]
        raise ValueError(
            "step.residual returned weights that are negative, not finite or without "
            f"positive mass for draft sequence {sequences[sequence].tolist()} and "
            f"num_accepted = {stop}, a state reached with positive probability"
        )
    return np.where(valid[..., None], weights / np.where(total > 0, total, 1), 0)
