"""The tree steps on a mesh: each device walks its rows' trees, or the devices of
a row walk its tree together on a split vocabulary."""

import dataclasses
from collections.abc import Callable

from jax.sharding import Mesh, PartitionSpec

from .._core._failures import RESULTS
from .._inputs._coercion import coerce_inputs
from .._inputs._input_array import InputArray
from .._inputs._random import KeyArray
from .._tree._abstract import AbstractTreeStep, TreeOutput
from ._mesh import check_divisible, check_no_other_axis, on_axis, run_on_mesh


def tree_step_on_mesh(
    step: AbstractTreeStep,
    mesh: Mesh,
    batch_axis: str | None,
    vocab_axis: str | None,
) -> Callable[..., tuple[TreeOutput, RESULTS]]:
    """`sharded_step` for a tree step, returning the output and the result."""
    step = _tree_on_vocab_axis(step, vocab_axis)
    specs = {
        "parents": PartitionSpec(batch_axis),
        "tree_tokens": PartitionSpec(batch_axis),
        "draft_probs": PartitionSpec(batch_axis, None, vocab_axis),
        "target_probs": PartitionSpec(batch_axis, None, vocab_axis),
        "accept_uniforms": PartitionSpec(batch_axis),
        "sample_uniforms": PartitionSpec(batch_axis),
    }
    run = run_on_mesh(step.with_result, mesh, specs, batch_axis)

    def sharded(
        parents: InputArray,
        tree_tokens: InputArray,
        draft_probs: InputArray | None,
        target_probs: InputArray,
        accept_uniforms: InputArray | None = None,
        sample_uniforms: InputArray | None = None,
        *,
        key: KeyArray | None = None,
    ) -> tuple[TreeOutput, RESULTS]:
        # Checked and read by value outside the jit, as on one device.
        given = coerce_inputs(
            tree_tokens,
            draft_probs,
            target_probs,
            accept_uniforms,
            sample_uniforms,
            parents=parents,
        )
        check_divisible("batch", batch_axis, given.tokens.shape[0], mesh)
        check_divisible("vocab", vocab_axis, given.target.shape[-1], mesh)
        # Drawn for the whole batch, as on one device, before the rows are split.
        accept, sample = given.uniforms(key, step._uniform_readers)
        return run(
            {
                "parents": given.parents,
                "tree_tokens": given.tokens,
                "draft_probs": given.draft,
                "target_probs": given.target,
                "accept_uniforms": accept,
                "sample_uniforms": sample,
            }
        )

    return sharded


def _tree_on_vocab_axis(
    step: AbstractTreeStep, vocab_axis: str | None
) -> AbstractTreeStep:
    """`step` and its sampler with `vocab_axis` as their `axis_name`; a `ValueError`
    as for the chain step's pieces (`on_axis`), or for a sibling rule that is not
    elementwise when the vocabulary is split."""
    if vocab_axis is not None and not step.siblings.elementwise:
        raise ValueError(
            f"step.siblings, {type(step.siblings).__name__}, is not elementwise, so "
            f"it cannot split the vocabulary over vocab_axis {vocab_axis!r}"
        )
    check_no_other_axis("step", step.axis_name, vocab_axis)
    return dataclasses.replace(
        step,
        sampler=on_axis("step.sampler", step.sampler, vocab_axis),
        axis_name=vocab_axis,
    )
