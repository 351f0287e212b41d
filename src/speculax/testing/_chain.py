"""Exact output distributions of the chain step, by enumeration."""

import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from .._chain._step import SpeculativeStep
from .._logits._step import LogitsStep
from .._pieces._acceptance import AbstractAcceptance
from .._pieces._residual import AbstractResidual
from .._pieces._sampling import AbstractSampler
from .._tree._abstract import AbstractTreeStep


# Enumeration costs V^G calls' worth of rows; past this it is no longer a quick check.
_MAX_SEQUENCES = 1_000_000
_ONE_BITS = int(np.float64(1.0).view(np.int64))
# Enough halvings to shrink [-1, _ONE_BITS] to adjacent integers.
_HALVINGS = (_ONE_BITS + 1).bit_length()
# The checks that a piece follows the rule the enumeration evaluates probe each row
# and position at this many uniforms, drawn afresh at every call.
PROBES = 1024
# Probes evaluated at once, under `vmap`: the pieces' work that does not read the
# uniform is done once for all of them.
_PROBE_BATCH = 256
_GOLDEN_FRACTION = (5**0.5 - 1) / 2


def _probes(
    shift: Float[Array, "*shape"], batch: Int[Array, ""]
) -> Float[Array, "probes *shape"]:
    """Batch `batch` of the probes: $u_j = (\\text{shift} + j \\varphi) \\bmod 1$
    for $j$ in the batch, $\\varphi$ the fraction of the golden ratio. With a
    uniform `shift` each is uniform on $[0, 1)$, and by the three-gap theorem the
    `PROBES` of them leave no gap wider than $1.2 \\cdot 10^{-3}$ in $[0, 1)$,
    wherever the shift puts them."""
    j = batch * _PROBE_BATCH + jnp.arange(_PROBE_BATCH, dtype=jnp.float64)
    j = j.reshape(-1, *([1] * shift.ndim))
    return (shift + j * _GOLDEN_FRACTION) % 1.0


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
        `step.residual` gives the weights, and `step.sampler` is called on them to
        find the interval of $s$ on which it draws each token: the token's
        probability is the length of its interval. A sampler that reads no uniform
        ([`speculax.Argmax`][]) is called once. The others are scanned from $s = 0$
        up, bisection over the float64 numbers finding, to the last bit, each $s$
        where the token drawn changes. This assumes each token is drawn on one
        interval of $s$, as inverse-CDF sampling over the vocabulary in any order
        does (a lossy sampler of that kind is measured, not refused), and is checked
        at the midpoint of each interval and 16 further values of $s$.

    The cost grows as $V^G$: this is meant for small cases, say $V \\le 8$ and
    $G \\le 3$. The theorem it checks is about normalised $p_i$ and $q_i$.

    **Arguments:**

    - `step`: the step whose `acceptance`, `prefix`, `residual` and `sampler` pieces
        to use.
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
    $u_i$ (checked at 16 values of $u_i$), a prefix count outside $[0, G]$, or, at a
    stopping position reached with positive probability, residual weights that are
    negative, not finite or without positive mass, or a sampler seen to draw a token
    on more than one interval of $s$ or a token outside $[0, V)$. The message names
    the piece; test a piece refused here with
    [`speculax.testing.lossless_chi_square`][]. `TypeError` for a step that is not
    a [`speculax.SpeculativeStep`][], naming the checker that fits it.
    """
    check_chain_step(step, "output_distribution")
    q, p = check_row(draft_probs, target_probs)
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
            jnp.asarray(fresh_probe_shifts(sequences.shape)),
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
    reached = sequence_probs[:, None] * stop_probs > 0
    _check_weights(weights, reached, sequences)
    # The law of the token drawn in each state, from the sampler itself.
    cells = sampler_cells(step.sampler, weights.reshape(-1, vocab))
    refused = reached.reshape(-1) & ~cells.valid
    if np.any(refused):
        raise refuse_sampler(
            "step.sampler", step.sampler, cells, int(np.argmax(refused))
        )
    drawn = cells.probs().reshape(weights.shape)

    # Token k is the draft token x_k when n > k and the drawn token when n = k.
    token_probs = np.zeros((num_draft + 1, vocab))
    beyond = np.cumsum(stop_probs[:, ::-1], axis=-1)[:, ::-1]  # P(n >= m | x)
    for k in range(num_draft + 1):
        drawn_weight = sequence_probs * stop_probs[:, k]
        token_probs[k] = drawn_weight @ drawn[:, k]
        if k < num_draft:
            kept_weight = sequence_probs * beyond[:, k + 1]
            token_probs[k] += np.bincount(
                sequences[:, k], weights=kept_weight, minlength=vocab
            )
    num_accepted_probs = sequence_probs @ stop_probs
    reach_probs = sequence_probs @ beyond
    return OutputDistribution(token_probs, reach_probs, num_accepted_probs)


def check_row(
    draft_probs: Float[Array | np.ndarray, "draft vocab"] | Sequence[Sequence[float]],
    target_probs: Float[Array | np.ndarray, "draft+1 vocab"]
    | Sequence[Sequence[float]],
) -> tuple[Float[np.ndarray, "draft vocab"], Float[np.ndarray, "draft+1 vocab"]]:
    """One row's $q$ and $p$ as float64 NumPy arrays, checked: shapes `(G, V)` and
    `(G + 1, V)`, values finite and non-negative."""
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
    return q, p


def check_chain_step(step: object, checker: str) -> None:
    """Raises a `TypeError` naming the checker unless `step` is a
    [`speculax.SpeculativeStep`][], whose pieces the chain's checkers run, with the
    checker that fits the step given instead."""
    if isinstance(step, SpeculativeStep):
        return
    if isinstance(step, LogitsStep):
        instead = (
            "a LogitsStep verifies the rows probs_from_logits makes from the logits "
            "by the rule of SpeculativeStep(): check that step on those rows, or the "
            "loop with speculax.testing.loop_lossless_error"
        )
    elif isinstance(step, AbstractTreeStep):
        instead = "check a tree step with speculax.testing.tree_lossless_error"
    else:
        instead = "its pieces are what the check runs"
    raise TypeError(
        f"{checker} checks a speculax.SpeculativeStep; got a {type(step).__name__}: "
        f"{instead}"
    )


def check_normalised(q: np.ndarray, p: np.ndarray) -> None:
    """Raises a `ValueError` unless every row of $q$ and $p$ sums to 1 within
    $10^{-6}$: the theorem the checkers test is about distributions, and an
    unnormalised row would give a number that means nothing."""
    for name, rows in (("draft_probs", q), ("target_probs", p)):
        sums = rows.sum(axis=-1)
        if not np.all(np.abs(sums - 1) <= 1e-6):
            worst = int(np.argmax(np.abs(sums - 1)))
            raise ValueError(
                f"{name} must be normalised, each row summing to 1; row {worst} "
                f"sums to {float(sums[worst])!r}"
            )


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

    **Raises:**

    As [`speculax.testing.output_distribution`][], and a `ValueError` for a row of
    $q$ or $p$ that does not sum to 1 within $10^{-6}$.
    """
    check_chain_step(step, "lossless_error")
    check_normalised(*check_row(draft_probs, target_probs))
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
    probe_shift: Float[Array, "sequences draft"],
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
        step.acceptance, sequences, q_batch, p_batch, probe_shift
    )

    counts = step.prefix(patterns)
    weights = residual_weights(step.residual, sequences, q_batch, p_batch)
    return pass_probs, monotone, counts, weights


def residual_weights(
    residual: AbstractResidual,
    draft_tokens: Int[Array, "rows draft"],
    draft_probs: Float[Array, "rows draft vocab"],
    target_probs: Float[Array, "rows draft+1 vocab"],
    num_draft_tokens: Int[Array, " rows"] | None = None,
) -> Float[Array, "rows draft+1 vocab"]:
    """The weights `residual` gives each row at every stopping position.

    **Arguments:**

    - `residual`: the residual piece.
    - `draft_tokens`: integer `(rows, G)`.
    - `draft_probs`: float `(rows, G, V)`, $q_i$.
    - `target_probs`: float `(rows, G + 1, V)`, $p_i$.
    - `num_draft_tokens`: integer `(rows,)`, the drafts in each row's chain, or
        `None` for $G$ each.

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
        num_draft_tokens=(
            None if num_draft_tokens is None else jnp.repeat(num_draft_tokens, stops)
        ),
    )
    return weights.reshape(rows, stops, -1)


def fresh_probe_shifts(shape: tuple[int, ...]) -> Float[np.ndarray, "*shape"]:
    """Uniform shifts of the probes, one per row (and position), drawn from the
    operating system's entropy at every call of a checker: the probes fall
    elsewhere every time, so that no fixed window of a uniform can hide from them."""
    return np.random.default_rng().random(shape)


@eqx.filter_jit
def acceptance_thresholds(
    acceptance: AbstractAcceptance,
    draft_tokens: Int[Array, "rows draft"],
    draft_probs: Float[Array, "rows draft vocab"],
    target_probs: Float[Array, "rows draft+1 vocab"],
    probe_shift: Float[Array, "rows draft"],
    num_draft_tokens: Int[Array, " rows"] | None = None,
) -> tuple[Float[Array, "rows draft"], Bool[Array, "rows draft"]]:
    """The threshold $t_i$ below which each position's test passes, so that
    $P(\\text{pass}) = t_i$ for a uniform $u_i$, and whether probes agree with
    "passes exactly when $u_i < t_i$" (a test that is not monotone in its own $u_i$
    has no such threshold).

    Each row and position is probed at the `PROBES` uniforms `_probes` spreads
    from its `probe_shift`: every interval of $u_i$ wider than $1.2 \\cdot 10^{-3}$
    holds a probe, wherever it lies, so that a test that
    passes or fails otherwise than its threshold says on such an interval (or that
    reads another position's uniform, probed with another shift) is refused; what
    it may still hide moves each pass probability by less than $1.2 \\cdot
    10^{-3}$ per interval.

    **Arguments:**

    - `acceptance`: the acceptance piece.
    - `draft_tokens`: integer `(rows, G)`.
    - `draft_probs`: float `(rows, G, V)`, $q_i$.
    - `target_probs`: float `(rows, G + 1, V)`, $p_i$.
    - `probe_shift`: float64 `(rows, G)` in $[0, 1)$, from `fresh_probe_shifts`.
    - `num_draft_tokens`: integer `(rows,)`, the drafts in each row's chain (a
        test may read where its chain ends, as block verification's does), or
        `None` for $G$ each.

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
            draft_tokens,
            draft_probs,
            target_probs,
            u,
            num_draft_tokens=num_draft_tokens,
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

    # Bisection silently finds a wrong threshold for a non-monotone test: random
    # probes, independent across positions, find where the test disagrees with it.
    def probe(j, consistent):
        u = _probes(probe_shift, j)
        passed = jax.vmap(
            lambda u: acceptance(
                draft_tokens,
                draft_probs,
                target_probs,
                u,
                num_draft_tokens=num_draft_tokens,
            )
        )(u)
        return consistent & jnp.all(passed == (u < thresholds), axis=0)

    monotone = jax.lax.fori_loop(
        0, PROBES // _PROBE_BATCH, probe, jnp.ones(draft_tokens.shape, jnp.bool_)
    )
    return thresholds, monotone


class SamplerCells(NamedTuple):
    """The interval of $s$ on which a sampler draws each token, for many rows of
    weights, from `sampler_cells`: piece $j$ of row $r$ draws `tokens[r, j]` for
    every $s$ in `[lows[r, j], highs[r, j])`. A row has at most $V$ pieces; the
    unused ones are empty (`lows == highs == 1`).

    - `probes_agree[r]`: whether the sampler drew each piece's token where probed.
    - `valid[r]`: whether the pieces of row $r$ are the sampler's exact cells as
        far as can be checked: the probes agree, the pieces cover `[0, 1)`, no token
        is drawn in two pieces and every token lies in `[0, V)`.
    """

    lows: Float[np.ndarray, "rows vocab"]
    highs: Float[np.ndarray, "rows vocab"]
    tokens: Int[np.ndarray, "rows vocab"]
    probes_agree: Bool[np.ndarray, " rows"]
    valid: Bool[np.ndarray, " rows"]

    def probs(self) -> Float[np.ndarray, "rows vocab"]:
        """The law of the drawn token for each row: entry $[r, v]$ is the measure of
        the uniforms for which row $r$ draws $v$. Meaningful where `valid`."""
        rows, vocab = self.tokens.shape
        probs = np.zeros((rows, vocab + 1))
        on_vocab = np.where(
            (self.tokens >= 0) & (self.tokens < vocab), self.tokens, vocab
        )
        np.add.at(probs, (np.arange(rows)[:, None], on_vocab), self.highs - self.lows)
        return probs[:, :vocab]


def sampler_cells(
    sampler: AbstractSampler, weights: Float[np.ndarray, "rows vocab"]
) -> SamplerCells:
    """Finds, by calling `sampler` on `weights` (float64) under
    `jax.enable_x64(True)`, the interval of the uniform $s$ on which it draws each
    token, for every row.

    A sampler that reads no uniform (`reads_uniforms` `False`) is called at
    $s = 0$, the value a step passes it: one piece `[0, 1)`. Any other is scanned
    from $s = 0$ up: the token drawn at the start of a piece is held, and bisection
    over the float64 numbers in $[0, 1)$ finds, to the last bit, the first $s$ where
    the sampler draws another token, which starts the next piece. This finds the
    sampler's exact cells when each token is drawn on one interval of $s$ (as
    inverse-CDF sampling over the vocabulary in any order does), and is wrong
    otherwise, so it is checked: a row is valid only if it needs at most $V$
    pieces, no token comes back in a later piece, every token lies in `[0, V)`, and
    the sampler draws each piece's token at its midpoint and at `PROBES` values of
    $s$ spread from a shift drawn afresh for every row at every call (for a
    sampler that reads no uniform, these check that it does not): every interval
    of $s$ wider than $1.2 \\cdot 10^{-3}$ holds one, so that a
    sampler that draws otherwise than its pieces say on such an interval is
    refused, and what it may still hide moves a token's probability by less than
    $1.2 \\cdot 10^{-3}$ per interval.

    **Arguments:**

    - `sampler`: the sampler piece.
    - `weights`: float64 `(rows, V)`, the weights it is called on, as the step calls
        it.

    **Returns:**

    The `SamplerCells` of the rows, NumPy arrays of shape `(rows, V)` and `(rows,)`.
    """
    weights = np.asarray(weights, np.float64)
    rows, vocab = weights.shape
    if rows == 0:
        empty, none = np.ones((0, vocab)), np.ones(0, bool)
        return SamplerCells(empty, empty, empty.astype(np.int64), none, none)
    with jax.enable_x64(True):
        lows, highs, tokens, probes_agree = in_chunks(
            lambda rows, shift: _scan_sampler(sampler, rows, shift),
            weights,
            fresh_probe_shifts((rows,)),
            chunks=_SCAN_CHUNKS,
        )
    used = highs > lows
    in_vocab = np.all(~used | ((tokens >= 0) & (tokens < vocab)), axis=-1)
    covered = highs.max(axis=-1, initial=0.0) == 1.0
    valid = probes_agree & in_vocab & covered & ~_repeats(tokens, used)
    return SamplerCells(lows, highs, tokens, probes_agree, valid)


def _repeats(
    tokens: Int[np.ndarray, "rows pieces"], used: Bool[np.ndarray, "rows pieces"]
) -> Bool[np.ndarray, " rows"]:
    """Whether a row draws one token in two of its used pieces."""
    same = tokens[:, :, None] == tokens[:, None, :]
    both = used[:, :, None] & used[:, None, :]
    return np.any(np.triu(same & both, k=1), axis=(1, 2))


def refuse_sampler(
    piece: str, sampler: AbstractSampler, cells: SamplerCells, row: int
) -> ValueError:
    """The error for a row of `cells` that is not valid: what the exact checks
    assume of the sampler, and what this one does instead. `piece` says where the
    sampler sits, e.g. `"step.sampler"`."""
    name = f"{piece} ({type(sampler).__name__})"
    tokens, used = cells.tokens[row], cells.highs[row] > cells.lows[row]
    vocab = len(tokens)
    found = ", ".join(
        f"{token} on [{low:.6g}, {high:.6g})"
        for low, high, token, in_use in zip(
            cells.lows[row], cells.highs[row], tokens, used, strict=True
        )
        if in_use
    )
    outside = [int(t) for t, in_use in zip(tokens, used, strict=True) if in_use]
    outside = [t for t in outside if not 0 <= t < vocab]
    if outside:
        what = f"draws {outside[0]}, outside [0, V) = [0, {vocab}), for some s"
    elif not cells.probes_agree[row]:
        what = (
            f"draws, scanned from s = 0, {found}, but another token at some s inside "
            "these intervals"
        )
    else:
        # Past V pieces the scan stops, before s = 1.
        more = "" if cells.highs[row].max() == 1 else ", ..."
        what = f"draws a token on two intervals: scanned from s = 0, {found}{more}"
    return ValueError(
        f"the exact check finds the law of the token that {name} draws from the "
        "interval of the uniform s on which it draws each token, which assumes each "
        "token is drawn on one interval of s (as inverse-CDF sampling over the "
        f"vocabulary in any order is); {name} {what}, from weights reached with "
        "positive probability. Test it statistically instead, with "
        "speculax.testing.lossless_chi_square"
    )


@eqx.filter_jit
def _scan_sampler(
    sampler: AbstractSampler,
    weights: Float[Array, "rows vocab"],
    probe_shift: Float[Array, " rows"],
) -> tuple[
    Float[Array, "rows vocab"],
    Float[Array, "rows vocab"],
    Int[Array, "rows vocab"],
    Bool[Array, " rows"],
]:
    """The pieces of `sampler_cells`, as bit patterns turned back into floats at the
    end, and whether the probes agree with them."""
    rows, vocab = weights.shape

    def draw(bits: Int[Array, " rows"]) -> Int[Array, " rows"]:
        s = jax.lax.bitcast_convert_type(bits, jnp.float64)
        return sampler(weights, s).astype(jnp.int64)

    one = jnp.full((rows,), _ONE_BITS, jnp.int64)

    # Bisects on the bit patterns of the float64 numbers in [0, 1), which order like
    # the numbers themselves. `holding` draws the piece's token; `other` draws
    # another, or is 1.0, the end of the interval, which is never evaluated.
    def piece(j, carry):
        low, lows, highs, tokens = carry
        open_ = low < _ONE_BITS
        token = draw(jnp.minimum(low, _ONE_BITS - 1))

        def halve(_, bounds):
            holding, other = bounds
            middle = holding + (other - holding) // 2
            same = draw(middle) == token
            still_open = other - holding > 1
            holding = jnp.where(still_open & same, middle, holding)
            other = jnp.where(still_open & ~same, middle, other)
            return holding, other

        _, high = jax.lax.fori_loop(0, _HALVINGS, halve, (low, one))
        high = jnp.where(open_, high, one)
        lows = lows.at[:, j].set(jnp.where(open_, low, one))
        highs = highs.at[:, j].set(high)
        tokens = tokens.at[:, j].set(jnp.where(open_, token, -1))
        return high, lows, highs, tokens

    zero = jnp.zeros((rows,), jnp.int64)
    unused = jnp.full((rows, vocab), _ONE_BITS, jnp.int64)
    if sampler.reads_uniforms:
        start = (zero, unused, unused, jnp.full((rows, vocab), -1, jnp.int64))
        _, lows, highs, tokens = jax.lax.fori_loop(0, vocab, piece, start)
    else:
        # Read once, at the zero a step passes when nothing reads s; the probes
        # below check that it does not read s after all.
        lows = unused.at[:, 0].set(0)
        highs = unused
        tokens = jnp.full((rows, vocab), -1, jnp.int64).at[:, 0].set(draw(zero))

    # Each piece's midpoint draws its token, and so do random probes, independent
    # across rows, that can land inside a piece the scan stepped over.
    middles = lows + (highs - lows) // 2
    consistent = jnp.all(
        (highs == lows) | (jax.vmap(draw, in_axes=1, out_axes=1)(middles) == tokens),
        axis=-1,
    )
    lows_f = jax.lax.bitcast_convert_type(lows, jnp.float64)
    highs_f = jax.lax.bitcast_convert_type(highs, jnp.float64)

    def probe(j, consistent):
        s = _probes(probe_shift, j)
        inside = (lows_f <= s[..., None]) & (s[..., None] < highs_f)
        expected = jnp.max(jnp.where(inside, tokens, jnp.iinfo(jnp.int64).min), -1)
        drawn = jax.vmap(draw)(jax.lax.bitcast_convert_type(s, jnp.int64))
        return consistent & jnp.all(drawn == expected, axis=0)

    consistent = jax.lax.fori_loop(0, PROBES // _PROBE_BATCH, probe, consistent)
    return lows_f, highs_f, tokens, consistent


# The compiled functions see batches of this many rows, whatever the step: one shape
# to compile.
_CHUNK = 1024
# The sampler's scan calls the sampler at a thousand probes per row, so that a padded
# row costs as much to run as a real one: its chunks come in two sizes, few padded
# rows (an enumeration of 30 rows ran 1024 before) and one shape fewer to compile
# than with 16 too. Each shape compiles in 0.65 s; 128 rows run in 4 ms at V = 4
# and 24 ms at V = 16 (1024 rows: 25 and 154 ms), so a small enumeration's chunk of
# 128 costs less than another compilation.
_SCAN_CHUNKS = (128, _CHUNK)


def in_chunks(
    function: Callable[..., tuple],
    *arrays: np.ndarray,
    chunks: Sequence[int] = (_CHUNK,),
) -> list[np.ndarray]:
    """`function` applied to the rows of `arrays` in chunks of the sizes of `chunks`
    (ascending), each the largest that the rows left fill, or the smallest for the
    last few, padded with copies of row 0; its outputs concatenated as NumPy
    arrays."""
    size = len(arrays[0])
    outputs, start = [], 0
    while start < size:
        chunk = max((c for c in chunks if c <= size - start), default=chunks[0])
        rows = [array[start : start + chunk] for array in arrays]
        padding = chunk - len(rows[0])
        rows = [
            np.concatenate([part, np.repeat(array[:1], padding, axis=0)])
            for part, array in zip(rows, arrays, strict=True)
        ]
        outputs.append([np.asarray(out) for out in function(*map(jnp.asarray, rows))])
        start += chunk
    return [np.concatenate(parts)[:size] for parts in zip(*outputs, strict=True)]


def _check_weights(
    weights: np.ndarray, reached: np.ndarray, sequences: np.ndarray
) -> None:
    """Raises unless the residual weights are non-negative and finite with positive
    mass in every state reached, `reached[x, m]` saying whether draft sequence $x$
    stopping at $m$ has positive probability: an unreachable state draws no token.
    """
    total = np.sum(weights, axis=-1)
    valid = np.all(np.isfinite(weights) & (weights >= 0), axis=-1) & (total > 0)
    bad = reached & ~valid
    if np.any(bad):
        sequence, stop = np.argwhere(bad)[0]
        raise ValueError(
            "step.residual returned weights that are negative, not finite or without "
            f"positive mass for draft sequence {sequences[sequence].tolist()} and "
            f"num_accepted = {stop}, a state reached with positive probability"
        )
