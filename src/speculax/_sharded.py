"""The verification step on inputs sharded over a device mesh, by JAX's own SPMD
machinery (`jax.shard_map` with `psum`, `pmax` and `all_gather` inside).

See `docs/sharding.md` for the design and the communication volume.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, ArrayLike, Float, Int

from ._acceptance import RatioAcceptance, draft_token_probs
from ._checks import (
    check_structure,
    draft_token_prob_failures,
    overflow_failure,
    raise_first_failure,
    sampled_failure,
    stopping_row_failures,
    token_and_uniform_failures,
)
from ._numerics import BLOCK_SIZE, as_index, index_array
from ._prefix import PrefixCount
from ._residual import Residual
from ._sampling import InverseCDF, find_block, find_token
from ._step import SpeculativeStep, StepOutput, assemble_tokens
from ._stopping_rows import block_weights, stopping_row_summary


def sharded_step(
    step: SpeculativeStep,
    mesh: Mesh,
    *,
    batch_axis: str | None = None,
    vocab_axis: str | None = None,
) -> Callable[..., StepOutput]:
    """The verification step `step` on inputs sharded over the devices of `mesh`.

    The batch axis of the mesh shards dimension 0 of every input; the vocabulary axis
    shards the last dimension of `draft_probs` and `target_probs`, so that no device
    ever holds a whole `(batch, vocab)` row. Each device then reads only its own
    slice of the probabilities, and the devices exchange only small arrays: the
    $2 B G$ probabilities of the draft tokens (`psum`), the $B \\lceil V / 256
    \\rceil$ block sums of the residual (`all_gather`) and the $B$ drawn tokens
    (`pmax`). The answer is bit for bit the one of `step` on one device when every
    device's share $V / d$ of the vocabulary is a multiple of the block size 256 (or
    when the vocabulary is not sharded).

    With a batch axis only, any pieces work: each device runs `step` on its rows.
    Sharding the vocabulary needs the default pieces ([`speculax.RatioAcceptance`][],
    [`speculax.PrefixCount`][], [`speculax.Residual`][], [`speculax.InverseCDF`][]
    with its default block size), whose computation is rewritten here around the
    collectives.

    **Arguments:**

    - `step`: a [`speculax.SpeculativeStep`][].
    - `mesh`: a `jax.sharding.Mesh`.
    - `batch_axis`: the name of the mesh axis that shards the batch, or `None`.
    - `vocab_axis`: the name of the mesh axis that shards the vocabulary, or `None`.
        The vocabulary size must be divisible by its size.

    **Returns:**

    A function of the five arrays `draft_tokens`, `draft_probs` (an array, not
    `None`), `target_probs`, `accept_uniforms` and `sample_uniforms`, with the
    shapes of [`speculax.SpeculativeStep.__call__`][], returning the same
    [`speculax.StepOutput`][] dict, compiled once per input structure. Inputs placed
    otherwise are resharded by `jit`. Tokens of any integer dtype are read by value,
    checked before any narrowing, as by the single-device step.

    **Raises:**

    `ValueError`, at once, for an axis name that is not in the mesh or given twice,
    or a non-default piece with a vocabulary axis; at trace time, for the structure
    errors of the single-device step, a batch not divisible by the batch axis or a
    vocabulary not divisible by the vocabulary axis. With `step.check_values`, the
    cheap value checks run as in the single-device step: draft tokens, uniforms, the
    probabilities of the draft tokens and the rows drawn from. `check_all_probs` is
    honoured with a batch axis only: under vocabulary sharding the full scan is
    skipped (it would be a full pass per device, but no communication).
    """
    if not isinstance(step, SpeculativeStep):
        raise TypeError(f"step must be a SpeculativeStep; got {type(step).__name__}")
    for name, axis in {"batch_axis": batch_axis, "vocab_axis": vocab_axis}.items():
        if axis is not None and axis not in mesh.axis_names:
            raise ValueError(
                f"{name} must be one of the mesh's axes {tuple(mesh.axis_names)}; "
                f"got {axis!r}"
            )
    if batch_axis is not None and batch_axis == vocab_axis:
        raise ValueError(
            f"batch_axis and vocab_axis must differ; both are {batch_axis!r}"
        )
    if vocab_axis is None:
        run = _batch_sharded(step, mesh, batch_axis)
    else:
        _check_default_pieces(step)
        run = _vocab_sharded(step, mesh, batch_axis, vocab_axis)

    @eqx.filter_jit
    def checked(
        draft_tokens: Array,
        draft_probs: Array,
        target_probs: Array,
        accept_uniforms: Array,
        sample_uniforms: Array,
    ) -> StepOutput:
        check_structure(
            draft_tokens,
            draft_probs,
            target_probs,
            accept_uniforms,
            sample_uniforms,
            None,
        )
        batch = draft_tokens.shape[0]
        vocab = target_probs.shape[-1]
        for name, axis, size in (
            ("batch", batch_axis, batch),
            ("vocab", vocab_axis, vocab),
        ):
            devices = 1 if axis is None else mesh.shape[axis]
            if size % devices:
                raise ValueError(
                    f"the {name} size must be divisible by the size of {name}_axis "
                    f"{axis!r}, {devices}; got {size}"
                )
        return run(
            as_index(draft_tokens),
            draft_probs,
            target_probs,
            accept_uniforms,
            sample_uniforms,
        )

    def sharded(
        draft_tokens: ArrayLike,
        draft_probs: ArrayLike,
        target_probs: ArrayLike,
        accept_uniforms: ArrayLike,
        sample_uniforms: ArrayLike,
    ) -> StepOutput:
        # Outside the jit: a NumPy int64 token must be checked before JAX narrows it.
        return checked(
            index_array(draft_tokens),
            jnp.asarray(draft_probs),
            jnp.asarray(target_probs),
            jnp.asarray(accept_uniforms),
            jnp.asarray(sample_uniforms),
        )

    return sharded


def _check_default_pieces(step: SpeculativeStep) -> None:
    pieces = {
        "acceptance": (step.acceptance, RatioAcceptance),
        "prefix": (step.prefix, PrefixCount),
        "residual": (step.residual, Residual),
        "sampler": (step.sampler, InverseCDF),
    }
    for field, (piece, default) in pieces.items():
        if type(piece) is not default:
            raise ValueError(
                f"sharding the vocabulary needs the default pieces; step.{field} is "
                f"{type(piece).__name__}, not {default.__name__}"
            )
    if isinstance(step.sampler, InverseCDF) and step.sampler.block_size != BLOCK_SIZE:
        raise ValueError(
            "sharding the vocabulary needs InverseCDF's default block_size "
            f"{BLOCK_SIZE}; got {step.sampler.block_size}"
        )


def _batch_sharded(
    step: SpeculativeStep, mesh: Mesh, batch_axis: str | None
) -> Callable[..., StepOutput]:
    # Rows are independent (batch invariance), so each device runs the whole
    # step on its rows with no communication at all.
    rows = PartitionSpec(batch_axis)

    def local(draft_tokens, draft_probs, target_probs, accept_uniforms, samples):
        out = step(draft_tokens, draft_probs, target_probs, accept_uniforms, samples)
        return out["num_accepted"], out["tokens"]

    # Equinox's runtime errors are `cond`s whose branches JAX's replication check
    # cannot match up; the outputs are per-row, so there is nothing for it to check.
    mapped = jax.shard_map(
        local, mesh=mesh, in_specs=(rows,) * 5, out_specs=(rows, rows), check_vma=False
    )

    def run(*arrays: Array) -> StepOutput:
        num_accepted, tokens = mapped(*arrays)
        return {"num_accepted": num_accepted, "tokens": tokens}

    return run


def _vocab_sharded(
    step: SpeculativeStep, mesh: Mesh, batch_axis: str | None, vocab_axis: str
) -> Callable[..., StepOutput]:
    rows = PartitionSpec(batch_axis)
    probs = PartitionSpec(batch_axis, None, vocab_axis)

    def local(
        draft_tokens: Int[Array, "batch draft"],
        draft_probs: Float[Array, "batch draft vocab_shard"],
        target_probs: Float[Array, "batch draft+1 vocab_shard"],
        accept_uniforms: Float[Array, "batch draft"],
        sample_uniforms: Float[Array, " batch"],
    ) -> tuple[Int[Array, " batch"], Int[Array, "batch draft+1"]]:
        shard_vocab = target_probs.shape[-1]
        offset = jax.lax.axis_index(vocab_axis) * shard_vocab

        # (1) p_i(x_i) and q_i(x_i): the owner of each draft token reads it, the
        # others add zeros, so the psum is exact (x + 0 = x).
        local_token = draft_tokens - offset
        owned = (local_token >= 0) & (local_token < shard_vocab)
        local_token = jnp.clip(local_token, 0, shard_vocab - 1)
        target_at, draft_at = draft_token_probs(local_token, draft_probs, target_probs)
        target_at = jax.lax.psum(jnp.where(owned, target_at, 0), vocab_axis)
        draft_at = jax.lax.psum(jnp.where(owned, draft_at, 0), vocab_axis)

        # (2) RatioAcceptance's test and the prefix count, on the gathered values.
        passed = accept_uniforms * draft_at < target_at
        num_accepted = step.prefix(passed)

        # (3) Block sums of the local share of the rows p_n, q_n, by the one-pass
        # summary of the single-device step. A share that is a multiple of 256 makes
        # the same blocks, summed in the same order, as on one device.
        summary = stopping_row_summary(
            num_accepted,
            draft_probs,
            target_probs,
            block_size=BLOCK_SIZE,
            vocab_axis=vocab_axis,
        )
        local_blocks = summary.block_mass.shape[-1]
        block_mass = jax.lax.all_gather(
            summary.block_mass, vocab_axis, axis=1, tiled=True
        )
        # (4) Every device runs the same prefix sum over the same block sums, so
        # they agree on the block; its owner searches inside it.
        block_index, before_block, threshold, total = find_block(
            block_mass, sample_uniforms
        )
        owner = block_index // local_blocks
        local_block = block_index - owner * local_blocks
        token = find_token(
            block_weights(summary, local_block),
            local_block,
            summary.block_size,
            before_block,
            threshold,
            total,
        )
        token = jnp.where(token >= 0, token + offset, token)
        mine = owner == jax.lax.axis_index(vocab_axis)
        drawn = jax.lax.pmax(jnp.where(mine, token, -1), vocab_axis)
        outputs = (
            num_accepted.astype(jnp.int32),
            assemble_tokens(draft_tokens, num_accepted, drawn),
        )
        if step.check_values:
            # Inside the shard_map and after the last collective, on values every
            # device of a vocabulary group shares: all raise the same error, and no
            # device is left waiting in a collective for one that raised.
            in_use = jnp.ones(draft_tokens.shape, bool)
            vocab = shard_vocab * jax.lax.axis_size(vocab_axis)
            failures = [
                *token_and_uniform_failures(
                    draft_tokens, accept_uniforms, sample_uniforms, vocab, in_use
                ),
                *draft_token_prob_failures(target_at, draft_at, in_use),
                *stopping_row_failures(summary.row_mass),
                overflow_failure(summary.row_mass),
                sampled_failure(drawn, vocab),
            ]
            outputs = raise_first_failure(outputs, failures)
        return outputs

    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows, probs, probs, rows, rows),
        out_specs=(rows, rows),
        # `all_gather` leaves its result typed as varying over the vocabulary axis,
        # though every device holds the same, and so are the outputs computed from it;
        # the static replication check cannot see this.
        check_vma=False,
    )

    def run(*arrays: Array) -> StepOutput:
        num_accepted, tokens = mapped(*arrays)
        return {"num_accepted": num_accepted, "tokens": tokens}

    return run
