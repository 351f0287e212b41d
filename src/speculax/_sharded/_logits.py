"""The logits step on a mesh: each device verifies its rows under their own
sampling parameters, and the devices of a row's slices of the vocabulary compute
its statistics together."""

import dataclasses
from collections.abc import Callable

from jax.sharding import Mesh, PartitionSpec
from jaxtyping import ArrayLike

from .._chain._step import StepOutput
from .._core._failures import RESULTS
from .._inputs._input_array import InputArray
from .._inputs._random import KeyArray
from .._logits._step import LogitsStep, read_logits_inputs
from ._mesh import check_divisible, check_no_other_axis, run_on_mesh


def logits_step_on_mesh(
    step: LogitsStep,
    mesh: Mesh,
    batch_axis: str | None,
    vocab_axis: str | None,
) -> Callable[..., tuple[StepOutput, RESULTS]]:
    """`sharded_step` for the logits step, returning the output and the result."""
    check_no_other_axis("step", step.axis_name, vocab_axis)
    step = dataclasses.replace(step, axis_name=vocab_axis)
    rows = PartitionSpec(batch_axis)
    names = (
        "draft_tokens",
        "accept_uniforms",
        "sample_uniforms",
        "temperature",
        "top_k",
        "top_p",
        "num_draft_tokens",
    )
    specs: dict[str, PartitionSpec] = dict.fromkeys(names, rows)
    for name in ("draft_logits", "target_logits"):
        specs[name] = PartitionSpec(batch_axis, None, vocab_axis)
    run = run_on_mesh(step.with_result, mesh, specs, batch_axis)

    def sharded(
        draft_tokens: InputArray,
        draft_logits: InputArray | None,
        target_logits: InputArray,
        accept_uniforms: InputArray | None = None,
        sample_uniforms: InputArray | None = None,
        *,
        temperature: ArrayLike = 1.0,
        top_k: ArrayLike | None = None,
        top_p: ArrayLike | None = None,
        key: KeyArray | None = None,
        num_draft_tokens: InputArray | None = None,
    ) -> tuple[StepOutput, RESULTS]:
        # Checked and read by value outside the jit, as on one device; the
        # parameters become one value per row, to be split with the rows, and the
        # uniforms are drawn for the whole batch before the rows are split.
        given, parameters, accept, sample = read_logits_inputs(
            draft_tokens,
            draft_logits,
            target_logits,
            accept_uniforms,
            sample_uniforms,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            key=key,
            num_draft_tokens=num_draft_tokens,
        )
        check_divisible("batch", batch_axis, given.tokens.shape[0], mesh)
        check_divisible("vocab", vocab_axis, given.target.shape[-1], mesh)
        return run(
            {
                "draft_tokens": given.tokens,
                "draft_logits": given.draft,
                "target_logits": given.target,
                "accept_uniforms": accept,
                "sample_uniforms": sample,
                "temperature": parameters.temperature,
                "top_k": parameters.top_k,
                "top_p": parameters.top_p,
                "num_draft_tokens": given.num_draft_tokens,
            }
        )

    return sharded
