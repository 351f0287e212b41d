"""The key schedule of the loop: which PRNG key each of its random numbers is drawn
from, one stream per use."""

import abc
from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Int, Key


DRAFT = 0
"""The stream of the key schedule that draws the draft tokens: $G$ uniforms a step,
draft token $i$ drawn from $q_i$ by inverse CDF with uniform $i$ (for a draft tree,
one per node, node $j$ with uniform $j - 1$)."""
ACCEPT = 1
"""The stream of the key schedule that draws the acceptance tests' uniforms $u_i$:
$G$ a step (for a draft tree, one per node, node $j$'s coin at $j - 1$)."""
SAMPLE = 2
"""The stream of the key schedule that draws the uniform $s$ of the correction or
bonus token: one a step, at position 0."""


class AbstractKeySchedule(eqx.Module):
    """Which PRNG key each random number of the loop is drawn from.

    In step $t$ the loop reads, per row, the uniforms of three streams: `DRAFT`
    ($G$ of them, one per draft token, drawn by inverse CDF from $q_i$), `ACCEPT`
    ($G$, the acceptance tests' $u_i$) and `SAMPLE` (one, the drawn token's $s$).
    Each is `jax.random.uniform(schedule(row_key, t, stream, i))`. The loop is
    lossless only if no two of these keys are equal: a reused key gives the same
    number twice, and the two uses are then not independent.

    Subclass it to try another schedule, an engine's for instance, and check it with
    [`speculax.testing.loop_output_distribution`][], which treats uses with equal
    keys as one random number. The loop calls it once per step and row, vmapped
    over every stream and position (`step_keys`), as the exact test does: its
    arguments are traced, so a schedule chooses by them with `jnp.where` or
    `lax.switch`, never with a Python `if` or a dict.
    """

    @abc.abstractmethod
    def __call__(
        self,
        row_key: Key[Array, ""],
        step: Int[Array, ""],
        stream: Int[Array, ""],
        position: Int[Array, ""],
    ) -> Key[Array, ""]:
        """**Arguments:**

        - `row_key`: the row's key, a typed scalar key.
        - `step`: $t$, the step number, from 0, an int32 scalar.
        - `stream`: `DRAFT` (0), `ACCEPT` (1) or `SAMPLE` (2), an int32 scalar.
        - `position`: $i$, the draft position, an int32 scalar in `[0, G)` (`[0, N)`
            for a tree of $N$ nodes); 0 for `SAMPLE`.

        **Returns:**

        The typed scalar key of that uniform.
        """


@final
class FoldInKeys(AbstractKeySchedule):
    """The default schedule: the uniform of stream $c$ at position $i$ in step $t$ is
    drawn from `fold_in(fold_in(fold_in(row_key, t), c), i)`.

    Distinct $(t, c, i)$ give distinct keys, so no random number is used twice: not
    across steps (a fixed key per position would repeat the noise of the previous
    step), and not across streams (the draft's noise reused for the acceptance test
    would bias it towards accepting). The row's own key is the root, so a row's
    tokens do not depend on the batch it runs in.
    """

    def __call__(
        self,
        row_key: Key[Array, ""],
        step: Int[Array, ""],
        stream: Int[ArrayLike, ""],
        position: Int[Array, ""],
    ) -> Key[Array, ""]:
        fold_in = jax.random.fold_in
        return fold_in(fold_in(fold_in(row_key, step), stream), position)


def step_keys(
    schedule: AbstractKeySchedule,
    row_key: Key[Array, ""],
    step: Int[Array, ""],
    num_nodes: int,
) -> Key[Array, " uses"]:
    """The keys of every uniform a row reads in step `step`: `num_nodes` of `DRAFT`,
    `num_nodes` of `ACCEPT`, then one of `SAMPLE`, in that order. One call of
    `schedule`, vmapped over the streams and positions, so that its hashes are
    compiled once, not once per stream (four per key for `FoldInKeys`)."""
    n = num_nodes
    streams = np.repeat([DRAFT, ACCEPT, SAMPLE], [n, n, 1]).astype(np.int32)
    positions = np.concatenate([np.arange(n), np.arange(n), [0]]).astype(np.int32)
    return jax.vmap(lambda stream, position: schedule(row_key, step, stream, position))(
        jnp.asarray(streams), jnp.asarray(positions)
    )
