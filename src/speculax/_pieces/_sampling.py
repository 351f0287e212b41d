import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._core._checks import check_static_int
from .._core._numerics import BLOCK_SIZE, ordered_block_sums, upcast
from .._core._vocab_axis import first_argmax_over_vocab, gather_blocks, vocab_offset
from ._stopping_rows import RowSummary, block_weights


# Pyright does not see `eqx.AbstractClassVar` as the `ClassVar` it is when type
# checking, and reads it as an instance attribute, which a subclass's `ClassVar` may
# not override: equinox's documented workaround (pyright issue 4965).
if TYPE_CHECKING:
    from typing import ClassVar as AbstractClassVar
else:
    from equinox import AbstractClassVar


class AbstractSampler(eqx.Module):
    """Draws one token per batch element from unnormalised non-negative weights,
    driven by one uniform number per element.

    Subclass it and implement `__call__` to write your own; plug it into
    [`speculax.SpeculativeStep`][] with `SpeculativeStep(sampler=...)`. Every sampler
    states the class variable `reads_uniforms`, whether it reads `sample_uniforms` (a
    deterministic one, `False`, lets a step be called without them), and the field
    `axis_name`: inside `jax.shard_map`, the mesh axis the vocabulary is split over,
    `None` for whole rows (see [`speculax.AbstractAcceptance`][]).

    The concrete samplers are final: to change one, wrap it in a piece of your own.
    """

    reads_uniforms: AbstractClassVar[bool]
    axis_name: eqx.AbstractVar[str | None]

    @abc.abstractmethod
    def __call__(
        self,
        weights: Float[Array, "batch vocab"],
        sample_uniforms: Float[Array, " batch"],
    ) -> Int[Array, " batch"]:
        """**Arguments:**

        - `weights`: non-negative, not necessarily normalised weights $w$.
        - `sample_uniforms`: $s$, uniform noise in `[0, 1)`.

        **Returns:**

        An int32 array of shape `(batch,)`: a token $y$ with $w(y) > 0$, or `-1` for a
        row with no positive weight.
        """


class AbstractBlockSumSampler(AbstractSampler):
    """A sampler that can draw from the block sums of the weights and the weights of
    one chosen block per row, without the whole `(batch, vocab)` weights.

    This is the sampler's side of a fused draw (see
    [`speculax.AbstractResidual`][]): a residual that can sum its weights by block in
    one pass over its rows, as [`speculax.Residual`][] and
    [`speculax.BlockResidual`][] do, hands the sums and a reader of one block to
    `draw_from_block_sums` instead of making its weights, and the tree steps draw
    their final token the same way. [`speculax.InverseCDF`][] is one. A new sampler
    joins by subclassing this class, stating the field `block_size` and
    implementing `draw_from_block_sums`.
    """

    block_size: eqx.AbstractVar[int]

    @abc.abstractmethod
    def draw_from_block_sums(
        self,
        block_mass: Float[Array, "batch local_blocks"],
        chosen_block: Callable[[Int[Array, " batch"]], Float[Array, "batch block"]],
        block_size: int,
        shard_vocab: int,
        sample_uniforms: Float[Array, " batch"],
    ) -> Int[Array, " batch"]:
        """Draws the token that `__call__` draws from the same weights and uniforms.
        The fused paths rely on this being the same computation as `__call__`, up to
        the order of the additions in the block sums.

        **Arguments:**

        - `block_mass`: the sums of the weights in consecutive blocks of
            `block_size` tokens (of this device's slice, under a split vocabulary),
            upcast to the arithmetic dtype.
        - `chosen_block`: a function from one block index per row (into this
            device's slice) to the weights of that block, zero past the vocabulary.
        - `block_size`: the number of tokens in a block: the field `block_size`, or
            the vocabulary size where that is smaller.
        - `shard_vocab`: the number of tokens in this device's slice of the
            vocabulary (the whole vocabulary outside `shard_map`).
        - `sample_uniforms`: $s$, uniform noise in `[0, 1)`.

        **Returns:**

        An int32 array of shape `(batch,)`, as from `__call__`.
        """


@final
class InverseCDF(AbstractBlockSumSampler):
    """Inverse-CDF sampling: $y$ is the smallest $v$ with $r(0) + \\dots + r(v) > s$,
    where $r = w / \\sum w$.

    Computed as the smallest $v$ whose unnormalised cumulative weight exceeds
    $s \\sum w$, without a cumulative sum over the whole vocabulary: the weights are
    summed in blocks of `block_size`, a cumulative sum over the block sums (a few
    hundred of them) finds the block where the threshold is crossed, and a short
    cumulative sum inside that one block finds the token. No sum runs over more than
    a few hundred terms (and XLA splits these short cumulative sums further), so the
    float32 cumulative sums stay within about $10^{-7}$ of the exact ones even at a
    vocabulary of 262144, where a sequential running sum would drift by $10^{-5}$.

    Two rules make the answer well defined under rounding: $y$ always has $w(y) > 0$
    (a token of zero probability is never emitted), and when rounding leaves no $v$
    whose cumulative weight exceeds the threshold, $y$ is the largest $v$ with
    $w(v) > 0$. A row with no positive weight at all gives $-1$.

    Inside a [`speculax.SpeculativeStep`][] beside the default
    [`speculax.Residual`][] (or [`speculax.BlockResidual`][]), the pair runs as one
    (`sample_residual`): the same computation, drawn from block sums of the rows
    $p_n$ and $q_n$ without materialising the weights. It can because it draws from
    block sums (`draw_from_block_sums`, the interface `AbstractBlockSumSampler`).

    **Arguments:**

    - `block_size`: the number of vocabulary entries summed in one block, a
        positive static integer. Default 256.
    - `axis_name`: keyword only, the mesh axis the vocabulary is split over, or
        `None` (the default). The devices exchange the block sums, and the one that
        holds the chosen block searches it: the same token as on one device when each
        device's slice is a whole number of blocks.
    """

    reads_uniforms: ClassVar[bool] = True
    block_size: int = eqx.field(static=True, default=BLOCK_SIZE)
    axis_name: str | None = eqx.field(static=True, default=None, kw_only=True)

    def __check_init__(self):
        check_static_int("block_size", self.block_size, minimum=1)

    def __call__(
        self,
        weights: Float[Array, "batch vocab"],
        sample_uniforms: Float[Array, " batch"],
    ) -> Int[Array, " batch"]:
        return inverse_cdf(
            weights,
            sample_uniforms,
            self.block_size,
            lanes=8,
            axis_name=self.axis_name,
        )

    def draw_from_block_sums(
        self,
        block_mass: Float[Array, "batch local_blocks"],
        chosen_block: Callable[[Int[Array, " batch"]], Float[Array, "batch block"]],
        block_size: int,
        shard_vocab: int,
        sample_uniforms: Float[Array, " batch"],
    ) -> Int[Array, " batch"]:
        return draw_from_blocks(
            block_mass,
            chosen_block,
            block_size,
            shard_vocab,
            sample_uniforms,
            self.axis_name,
        )


def inverse_cdf(
    weights: Float[Array, "batch vocab"],
    sample_uniforms: Float[Array, " batch"],
    block_size: int,
    *,
    lanes: int,
    axis_name: str | None,
) -> Int[Array, " batch"]:
    """[`speculax.InverseCDF`][]'s draw, its block sums added in `lanes` lanes (see
    `ordered_block_sums`): the lanes fix the last bit of the block sums, and so the
    token drawn for a uniform on a block's edge."""
    weights = upcast(weights)
    block_size = min(block_size, weights.shape[-1])
    return draw_from_blocks(
        ordered_block_sums(weights, block_size, lanes=lanes),
        block_reader(weights, block_size),
        block_size,
        weights.shape[-1],
        sample_uniforms,
        axis_name,
    )


def block_reader(
    weights: Float[Array, "batch vocab"], block_size: int
) -> Callable[[Int[Array, " batch"]], Float[Array, "batch block"]]:
    """A function from one block index per row to the weights of that block, zero
    past the vocabulary."""
    batch, vocab = weights.shape
    num_blocks = -(-vocab // block_size)
    padding = num_blocks * block_size - vocab
    blocks = jnp.pad(weights, ((0, 0), (0, padding))).reshape(
        batch, num_blocks, block_size
    )
    return lambda block: jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]


@final
class Argmax(AbstractSampler):
    """Greedy sampling: $y = \\arg\\max_v w(v)$, ties going to the smallest token id.
    Deterministic: the uniforms are not read.

    **Arguments:**

    - `axis_name`: keyword only, the mesh axis the vocabulary is split over, or
        `None` (the default).
    """

    reads_uniforms: ClassVar[bool] = False
    axis_name: str | None = eqx.field(static=True, default=None, kw_only=True)

    def __call__(
        self,
        weights: Float[Array, "batch vocab"],
        sample_uniforms: Float[Array, " batch"],
    ) -> Int[Array, " batch"]:
        token, largest = first_argmax_over_vocab(upcast(weights), self.axis_name)
        return jnp.where(largest > 0, token, -1)


def sample_residual(
    summary: RowSummary,
    sampler: AbstractBlockSumSampler,
    sample_uniforms: Float[Array, " batch"],
) -> Int[Array, " batch"]:
    """`sampler` applied to the weights the summary describes (those of
    [`speculax.Residual`][] or [`speculax.BlockResidual`][]), without materialising
    them: the block sums come from the one-pass summary of the stopping rows, and
    only the chosen block of $p_n$ and $q_n$ is read again. The same computation as
    the residual and the sampler in turn, up to the order of the additions inside a
    block.
    """
    return sampler.draw_from_block_sums(
        summary.block_mass,
        lambda block: block_weights(summary, block),
        summary.block_size,
        summary.target_probs.shape[-1],
        sample_uniforms,
    )


def draw_from_blocks(
    block_mass: Float[Array, "batch local_blocks"],
    chosen_block: Callable[[Int[Array, " batch"]], Float[Array, "batch block"]],
    block_size: int,
    shard_vocab: int,
    sample_uniforms: Float[Array, " batch"],
    axis_name: str | None,
) -> Int[Array, " batch"]:
    """The inverse-CDF token from the block sums of each row and a function that
    reads the weights of one block per row.

    On a split vocabulary the devices gather everyone's block sums, all find the same
    block, and the device that holds it searches it: only the block sums and one
    token per row cross devices.
    """
    block_index, before_block, threshold, total = find_block(
        gather_blocks(block_mass, axis_name), sample_uniforms
    )
    if axis_name is None:
        return find_token(
            chosen_block(block_index),
            block_index,
            block_size,
            before_block,
            threshold,
            total,
        )
    local_blocks = block_mass.shape[-1]
    owner = block_index // local_blocks
    local_block = block_index - owner * local_blocks
    token = find_token(
        chosen_block(local_block),
        local_block,
        block_size,
        before_block,
        threshold,
        total,
    )
    token = jnp.where(token >= 0, token + vocab_offset(shard_vocab, axis_name), token)
    mine = owner == jax.lax.axis_index(axis_name)
    return jax.lax.pmax(jnp.where(mine, token, -1), axis_name)


def find_block(
    block_mass: Float[Array, "batch blocks"], sample_uniforms: Float[Array, " batch"]
) -> tuple[
    Int[Array, " batch"],
    Float[Array, "batch 1"],
    Float[Array, "batch 1"],
    Float[Array, " batch"],
]:
    """The block where the cumulative weight first exceeds $s \\sum w$, with the
    cumulative weight before it, the threshold and the total.
    """
    through_block = jnp.cumsum(block_mass, axis=-1)
    total = through_block[:, -1]
    threshold = (sample_uniforms.astype(block_mass.dtype) * total)[:, None]
    # Clamped for the gathers below; with no positive block the token is -1 anyway.
    block_index = jnp.maximum(
        _first_crossing(through_block > threshold, block_mass > 0), 0
    )
    before_block = jnp.take_along_axis(
        through_block, jnp.maximum(block_index - 1, 0)[:, None], axis=1
    )
    before_block = jnp.where(block_index[:, None] > 0, before_block, 0)
    return block_index, before_block, threshold, total


def find_token(
    chosen: Float[Array, "batch block"],
    block_index: Int[Array, " batch"],
    block_size: int,
    before_block: Float[Array, "batch 1"],
    threshold: Float[Array, "batch 1"],
    total: Float[Array, " batch"],
) -> Int[Array, " batch"]:
    """The token inside the chosen block, by a short cumulative sum."""
    through_token = before_block + jnp.cumsum(chosen, axis=-1)
    token_in_block = _first_crossing(through_token > threshold, chosen > 0)
    token = block_index * block_size + token_in_block
    return jnp.where(total > 0, token, -1).astype(jnp.int32)


def _first_crossing(
    crossed: Bool[Array, "batch n"], positive: Bool[Array, "batch n"]
) -> Int[Array, " batch"]:
    """The first index that is both crossed and positive; where there is none (the
    threshold was not reached, by rounding), the last positive index; `-1` where no
    index is positive.
    """
    # One reduction over a score that ranks every crossed positive index above every
    # other positive one, earlier crossings higher and later positives higher.
    n = crossed.shape[-1]
    index = jnp.arange(n)
    score = jnp.where(positive, jnp.where(crossed, 2 * n - index, index + 1), 0)
    best = jnp.max(score, axis=-1, initial=0)
    return jnp.where(best > n, 2 * n - best, best - 1).astype(jnp.int32)
