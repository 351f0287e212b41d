"""The chain step on a mesh, the vocabulary split over its pieces' axis."""

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from .._chain._step import SpeculativeStep, StepOutput
from .._core._checks import check_structure
from .._core._failures import RESULTS
from .._core._numerics import index_array
from .._inputs._coercion import (
    optional_array,
    optional_index_array,
    resolve_uniforms,
    uniform_reader,
)
from .._inputs._input_array import InputArray
from .._inputs._random import KeyArray
from ._mesh import check_divisible, on_axis, run_on_mesh


def chain_step_on_mesh(
    step: SpeculativeStep,
    mesh: Mesh,
    batch_axis: str | None,
    vocab_axis: str | None,
) -> Callable[..., tuple[StepOutput, RESULTS]]:
    """`sharded_step` for the chain step, returning the output and the result."""
    step = _on_vocab_axis(step, vocab_axis)
    specs = {
        "draft_tokens": PartitionSpec(batch_axis),
        "draft_probs": PartitionSpec(batch_axis, None, vocab_axis),
        "target_probs": PartitionSpec(batch_axis, None, vocab_axis),
        "accept_uniforms": PartitionSpec(batch_axis),
        "sample_uniforms": PartitionSpec(batch_axis),
        "num_draft_tokens": PartitionSpec(batch_axis),
    }
    run = run_on_mesh(step.with_result, mesh, specs, batch_axis)

    def sharded(
        draft_tokens: InputArray,
        draft_probs: InputArray | None,
        target_probs: InputArray,
        accept_uniforms: InputArray | None = None,
        sample_uniforms: InputArray | None = None,
        *,
        key: KeyArray | None = None,
        num_draft_tokens: InputArray | None = None,
    ) -> tuple[StepOutput, RESULTS]:
        # Outside the jit: a NumPy int64 token must be checked before JAX narrows it.
        inputs = {
            "draft_tokens": index_array(draft_tokens),
            "draft_probs": optional_array(draft_probs),
            "target_probs": jnp.asarray(target_probs),
            "accept_uniforms": optional_array(accept_uniforms),
            "sample_uniforms": optional_array(sample_uniforms),
            "num_draft_tokens": optional_index_array(num_draft_tokens),
        }
        check_structure(*inputs.values())
        batch, num_draft = inputs["draft_tokens"].shape
        check_divisible("batch", batch_axis, batch, mesh)
        check_divisible("vocab", vocab_axis, inputs["target_probs"].shape[-1], mesh)
        # Drawn for the whole batch, as on one device, before the rows are split.
        inputs["accept_uniforms"], inputs["sample_uniforms"] = resolve_uniforms(
            (batch, num_draft),
            inputs["accept_uniforms"],
            inputs["sample_uniforms"],
            key,
            (uniform_reader(step.acceptance), uniform_reader(step.sampler)),
        )
        return run(inputs)

    return sharded


def _on_vocab_axis(step: SpeculativeStep, vocab_axis: str | None) -> SpeculativeStep:
    """`step` with `vocab_axis` as the `axis_name` of every piece that reads the
    vocabulary; a `ValueError` for a piece that names another axis, or that cannot
    split the vocabulary when it is split."""
    pieces = {
        "acceptance": step.acceptance,
        "residual": step.residual,
        "sampler": step.sampler,
    }
    return dataclasses.replace(
        step,
        **{
            field: on_axis(f"step.{field}", piece, vocab_axis)
            for field, piece in pieces.items()
        },
    )
