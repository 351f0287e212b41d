"""What every exact enumeration of random numbers shares: a number named by its key,
the cell of values it is known to lie in, how a use narrows it, and, for the loop,
one cell of a round's numbers with the uniforms at its middle."""

from collections.abc import Sequence
from typing import NamedTuple, TypeAlias

import numpy as np

from .._loop._keys import ACCEPT, DRAFT, SAMPLE


# A random number, named by the data of the key it is drawn from (for the loop) or
# by the node it is the coin of (for one tree step): two uses with equal names read
# the same number.
Name: TypeAlias = tuple[int, ...]
# What is known of the random numbers still to be read again: each lies in an
# interval [lo, hi), independently of the others.
Constraints: TypeAlias = frozenset[tuple[Name, tuple[float, float]]]
# The states a step of the loop starts from: the tokens generated so far and the
# constraints carried, each with its probability.
States: TypeAlias = list[tuple[tuple[tuple[int, ...], Constraints], float]]
# One use of a random number: it is found to lie in [low, high).
Use: TypeAlias = tuple[Name, float, float]


class Cell(NamedTuple):
    """A cell of the random numbers read so far: the interval each lies in, and the
    probability that they all do."""

    intervals: dict[Name, tuple[float, float]]
    probability: float


def narrowed(cell: Cell, uses: list[Use]) -> Cell | None:
    """The cell after each named number is found to lie in `[low, high)`, one use
    after another; `None` when a use leaves no room.

    Each number is uniform on its interval and independent of the others, so
    narrowing one multiplies the probability by the fraction of its interval kept.
    """
    intervals, probability = dict(cell.intervals), cell.probability
    for name, low, high in uses:
        old_low, old_high = intervals.get(name, (0.0, 1.0))
        new_low, new_high = max(old_low, low), min(old_high, high)
        if new_high <= new_low:
            return None
        probability *= (new_high - new_low) / (old_high - old_low)
        intervals[name] = (new_low, new_high)
    return Cell(intervals, probability)


def cdf_edges(weights: np.ndarray) -> np.ndarray:
    """The edges of each token's cell under inverse-CDF sampling: entry $v$ and
    $v + 1$ of the last axis bound the uniforms that draw $v$."""
    total = np.sum(weights, axis=-1, keepdims=True)
    cumulative = np.cumsum(weights, axis=-1) / np.where(total > 0, total, 1)
    return np.concatenate([np.zeros_like(total), cumulative], axis=-1)


class Leaf(NamedTuple):
    """One cell of one round's random numbers: the state it starts from, its
    probability, the interval of each number and the number each use reads, and
    what the round does there: the drafts (a tree's tokens by node, `-1` for a node
    left out), the tokens kept and the token drawn."""

    state: int
    probability: float
    intervals: dict[Name, tuple[float, float]]
    draft_uniforms: list[float]
    accept_uniforms: list[float]
    sample_uniform: float
    drafts: tuple[int, ...]
    kept: tuple[int, ...]
    sampled: int


def leaf_at_middle(
    state: int,
    cell: Cell,
    names: dict[int, list[Name]],
    drafts: tuple[int, ...],
    kept: tuple[int, ...],
    token: int,
) -> Leaf:
    """The leaf of `cell`, its uniforms at the middle of each interval (of `[0, 1)`
    for a number not yet read)."""
    return Leaf(
        state,
        cell.probability,
        cell.intervals,
        [_middle(cell, name) for name in names[DRAFT]],
        [_middle(cell, name) for name in names[ACCEPT]],
        _middle(cell, names[SAMPLE][0]),
        drafts,
        kept,
        token,
    )


# At module level, not inside `leaf_at_middle`: a nested function is decorated anew
# on every call under runtime type checking, a millisecond each over thousands of
# leaves.
def _middle(cell: Cell, name: Name) -> float:
    """The middle of the interval of `name` in `cell` (of `[0, 1)` if not read): a
    number in it, its low end for an interval one ulp wide, whose middle rounds to
    the high end, outside it."""
    low, high = cell.intervals.get(name, (0.0, 1.0))
    middle = (low + high) / 2
    return middle if middle < high else low


def history_buffer(
    histories: Sequence[tuple[int, ...]], width: int
) -> tuple[np.ndarray, np.ndarray]:
    """The histories as the rows of a zero-padded buffer, and their lengths."""
    buffer = np.zeros((len(histories), width), np.int32)
    for row, history in enumerate(histories):
        buffer[row, : len(history)] = history
    lengths = np.array([len(history) for history in histories], np.int32)
    return buffer, lengths
