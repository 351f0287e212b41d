"""The verification step under `jax.shard_map`, on inputs sharded over a device mesh.
See `docs/sharding.md`."""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal, overload

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, ArrayLike

from ._chain._step import SpeculativeStep, StepOutput
from ._core._checks import check_structure
from ._core._failures import RESULTS
from ._core._numerics import arithmetic_dtype, as_index, index_array
from ._inputs._coercion import (
    coerce_inputs,
    optional_array,
    optional_index_array,
    resolve_uniforms,
    uniform_reader,
)
from ._inputs._input_array import InputArray
from ._inputs._random import KeyArray
from ._logits._parameters import sampling_parameters
from ._logits._step import LogitsStep
from ._tree._abstract import AbstractTreeStep, TreeOutput


@overload
def sharded_step(
    step: SpeculativeStep,
    mesh: Mesh,
    *,
    batch_axis: str | None = None,
    vocab_axis: str | None = None,
    with_result: Literal[False] = False,
) -> Callable[..., StepOutput]: ...


@overload
def sharded_step(
    step: SpeculativeStep,
    mesh: Mesh,
    *,
    batch_axis: str | None = None,
    vocab_axis: str | None = None,
    with_result: Literal[True],
) -> Callable[..., tuple[StepOutput, RESULTS]]: ...


@overload
def sharded_step(
    step: AbstractTreeStep,
    mesh: Mesh,
    *,
    batch_axis: str | None = None,
    vocab_axis: str | None = None,
    with_result: Literal[False] = False,
) -> Callable[..., TreeOutput]: ...


@overload
def sharded_step(
    step: AbstractTreeStep,
    mesh: Mesh,
    *,
    batch_axis: str | None = None,
    vocab_axis: str | None = None,
    with_result: Literal[True],
) -> Callable[..., tuple[TreeOutput, RESULTS]]: ...


@overload
def sharded_step(
    step: LogitsStep,
    mesh: Mesh,
    *,
    batch_axis: str | None = None,
    vocab_axis: None = None,
    with_result: Literal[False] = False,
) -> Callable[..., StepOutput]: ...


@overload
def sharded_step(
    step: LogitsStep,
    mesh: Mesh,
    *,
    batch_axis: str | None = None,
    vocab_axis: None = None,
    with_result: Literal[True],
) -> Callable[..., tuple[StepOutput, RESULTS]]: ...


def sharded_step(
    step: SpeculativeStep | AbstractTreeStep | LogitsStep,
    mesh: Mesh,
    *,
    batch_axis: str | None = None,
    vocab_axis: str | None = None,
    with_result: bool = False,
) -> Callable[..., Any]:
    """The verification step `step`, run under `jax.shard_map` on inputs sharded over
    the devices of `mesh`.

    The batch axis of the mesh shards dimension 0 of every input; the vocabulary axis
    shards the last dimension of `draft_probs` and `target_probs`, so that no device
    ever holds a whole `(batch, vocab)` row. Each device runs `step` on its slice; the
    pieces that read the vocabulary, built with `axis_name=vocab_axis`, exchange only
    small arrays: the $2 B G$ probabilities of the draft tokens (`psum`), the
    $B \\lceil V / 256 \\rceil$ block sums of the residual (`all_gather`), for
    block verification the $B (G - 1) \\lceil V / 256 \\rceil$ block sums of its
    masses, and one number per row for the rest. Outputs are bit for bit those of
    `step` on one device when every device's share $V / d$ of the vocabulary is a
    multiple of the block size 256 (or the vocabulary is not sharded).

    With a batch axis only, any pieces whose `axis_name` is `None` work, with no
    communication at all. With a vocabulary axis, the pieces of `step` whose
    `axis_name` is `None` are given `vocab_axis` (every piece of speculax can split
    the vocabulary); a piece that cannot (its `axis_name` fixed at `None`, a field
    with `init=False` or a class variable) is refused. A piece that names an axis
    other than `vocab_axis` is refused either way: it would reduce over the wrong
    devices.

    A tree step ([`speculax.TreeStep`][], [`speculax.TraversalStep`][],
    [`speculax.greedy_tree_step`][]) splits both too. With a batch axis only, each
    device walks its own trees, with no communication. With a vocabulary axis, the
    step and its sampler are given `vocab_axis` as their `axis_name` (the sibling
    rule must be `elementwise`), and the devices of a row walk its tree together:
    the $2 B N$ probabilities of the draft tokens are read once (`psum`), and a
    failed test exchanges one number per value read at a token (`psum`), per bad
    value check (`pmax`), and the $\\lceil V / 256 \\rceil$ block sums of each row
    it sums (`all_gather`), as does the final draw. Outputs are bit for bit those on
    one device, under the same condition as for the chain step.

    [`speculax.LogitsStep`][] runs with a batch axis only, each device verifying
    its rows under their own sampling parameters, with no communication: its
    truncation reads whole rows of logits, so a vocabulary axis is refused.

    **Arguments:**

    - `step`: a [`speculax.SpeculativeStep`][], any flags included
        (`check_all_probs`, `throw=False`), an [`speculax.AbstractTreeStep`][], or
        a [`speculax.LogitsStep`][].
    - `mesh`: a `jax.sharding.Mesh`.
    - `batch_axis`: keyword only, the name of the mesh axis that shards the batch, or
        `None`.
    - `vocab_axis`: keyword only, the name of the mesh axis that shards the
        vocabulary, or `None` (always, for a `LogitsStep`).
    - `with_result`: keyword only, whether the function returns each row's
        outcome beside the output, as [`speculax.SpeculativeStep.with_result`][]
        does. Default `False`.

    **Returns:**

    A function with the arguments of [`speculax.SpeculativeStep.__call__`][]
    (`draft_probs=None`, omitted uniforms, `key=` and `num_draft_tokens=` included),
    for a tree step those of [`speculax.AbstractTreeStep.__call__`][], for a
    `LogitsStep` those of [`speculax.LogitsStep.__call__`][] (the sampling
    parameters split with the rows), returning
    the same [`speculax.StepOutput`][] (or [`speculax.TreeOutput`][]) dict (with
    `with_result=True`, the tuple `(output, result)`), compiled once per input
    structure. Inputs may lie anywhere (NumPy, one device, another sharding): they
    are placed on the mesh first; uniforms drawn from `key` are drawn for the whole
    batch, as on one device, before the rows are split.

    **Raises:**

    `TypeError` for a `step` of another kind. `ValueError`, at once, for an axis
    name that is not in the mesh or given twice, a piece that cannot split the
    vocabulary (for a tree step, a sibling rule that is not elementwise), or a
    vocabulary axis for a `LogitsStep`; when called, for the
    structure errors of the single-device step, and a batch or vocabulary not
    divisible by the size of its axis. The value checks run as in the
    single-device step, on every device, after the last collective.
    """
    if not isinstance(step, (SpeculativeStep, AbstractTreeStep, LogitsStep)):
        raise TypeError(
            "step must be a SpeculativeStep, an AbstractTreeStep or a LogitsStep; "
            f"got {type(step).__name__}"
        )
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
    if isinstance(step, AbstractTreeStep):
        sharded = _tree_step_on_mesh(step, mesh, batch_axis, vocab_axis)
    elif isinstance(step, LogitsStep):
        sharded = _logits_step_on_mesh(step, mesh, batch_axis, vocab_axis)
    else:
        sharded = _chain_step_on_mesh(step, mesh, batch_axis, vocab_axis)
    if with_result:
        return sharded

    def sharded_output(*args: Any, **kwargs: Any) -> Any:
        output, _ = sharded(*args, **kwargs)
        return output

    return functools.wraps(sharded)(sharded_output)


def _chain_step_on_mesh(
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
    run = _run_on_mesh(step.with_result, mesh, specs, batch_axis)

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
        _check_divisible("batch", batch_axis, batch, mesh)
        _check_divisible("vocab", vocab_axis, inputs["target_probs"].shape[-1], mesh)
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


def _tree_step_on_mesh(
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
    run = _run_on_mesh(step.with_result, mesh, specs, batch_axis)

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
        _check_divisible("batch", batch_axis, given.tokens.shape[0], mesh)
        _check_divisible("vocab", vocab_axis, given.target.shape[-1], mesh)
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


def _logits_step_on_mesh(
    step: LogitsStep,
    mesh: Mesh,
    batch_axis: str | None,
    vocab_axis: str | None,
) -> Callable[..., tuple[StepOutput, RESULTS]]:
    """`sharded_step` for the logits step, batch axis only, returning the output and
    the result."""
    if vocab_axis is not None:
        raise ValueError(
            "LogitsStep's truncation reads whole rows of logits, so it cannot split "
            f"the vocabulary: vocab_axis must be None for it; got {vocab_axis!r}"
        )
    rows = PartitionSpec(batch_axis)
    names = (
        "draft_tokens",
        "draft_logits",
        "target_logits",
        "accept_uniforms",
        "sample_uniforms",
        "temperature",
        "top_k",
        "top_p",
        "num_draft_tokens",
    )
    run = _run_on_mesh(step.with_result, mesh, dict.fromkeys(names, rows), batch_axis)

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
        # parameters become one value per row, to be split with the rows.
        given = coerce_inputs(
            draft_tokens,
            draft_logits,
            target_logits,
            accept_uniforms,
            sample_uniforms,
            num_draft_tokens=num_draft_tokens,
            given_as="logits",
        )
        batch = given.tokens.shape[0]
        parameters = sampling_parameters(
            temperature,
            top_k,
            top_p,
            batch,
            arithmetic_dtype(given.target, given.draft),
        )
        _check_divisible("batch", batch_axis, batch, mesh)
        # Drawn for the whole batch, as on one device, before the rows are split.
        accept, sample = given.uniforms(key, ("LogitsStep", "LogitsStep"))
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


def _run_on_mesh(
    with_result: Callable[..., tuple[Any, RESULTS]],
    mesh: Mesh,
    specs: dict[str, PartitionSpec],
    batch_axis: str | None,
) -> Callable[[dict[str, Array | None]], tuple[Any, RESULTS]]:
    """`with_result` under `jax.shard_map`, jitted, on inputs by name (`None` where
    left out), each placed on the mesh by its spec in `specs` first."""

    @eqx.filter_jit
    def run(inputs: dict[str, Array]) -> tuple[Any, RESULTS]:
        inputs = {
            name: as_index(x) if jnp.issubdtype(x.dtype, jnp.integer) else x
            for name, x in inputs.items()
        }
        return jax.shard_map(
            # Arguments left out (None) are passed as None.
            lambda local: with_result(**{name: local.get(name) for name in specs}),
            mesh=mesh,
            in_specs=({name: specs[name] for name in inputs},),
            out_specs=PartitionSpec(batch_axis),
            # Equinox's runtime errors are `cond`s whose branches the replication
            # check cannot match up, and the outputs computed after an `all_gather`
            # are typed as varying though every device holds the same.
            check_vma=False,
        )(inputs)

    def placed_and_run(inputs: dict[str, Array | None]) -> tuple[Any, RESULTS]:
        placed = {
            name: jax.device_put(x, NamedSharding(mesh, specs[name]))
            for name, x in inputs.items()
            if x is not None
        }
        return run(placed)

    return placed_and_run


def _check_divisible(name: str, axis: str | None, size: int, mesh: Mesh) -> None:
    """A `ValueError` where the `name` size is not divisible by its axis's."""
    devices = 1 if axis is None else mesh.shape[axis]
    if size % devices:
        raise ValueError(
            f"the {name} size must be divisible by the size of {name}_axis "
            f"{axis!r}, {devices}; got {size}"
        )


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
            field: _on_axis(f"step.{field}", piece, vocab_axis)
            for field, piece in pieces.items()
        },
    )


def _tree_on_vocab_axis(
    step: AbstractTreeStep, vocab_axis: str | None
) -> AbstractTreeStep:
    """`step` and its sampler with `vocab_axis` as their `axis_name`; a `ValueError`
    as for `_on_vocab_axis`, or for a sibling rule that is not elementwise when the
    vocabulary is split."""
    if vocab_axis is not None and not step.siblings.elementwise:
        raise ValueError(
            f"step.siblings, {type(step.siblings).__name__}, is not elementwise, so "
            f"it cannot split the vocabulary over vocab_axis {vocab_axis!r}"
        )
    _check_no_other_axis("step", step.axis_name, vocab_axis)
    return dataclasses.replace(
        step,
        sampler=_on_axis("step.sampler", step.sampler, vocab_axis),
        axis_name=vocab_axis,
    )


def _on_axis(name: str, module: Any, vocab_axis: str | None) -> Any:
    """`module`, named `name`, with `vocab_axis` as its `axis_name`; a `ValueError`
    where it names another axis, or where it cannot split the vocabulary when it
    is split."""
    if module.axis_name == vocab_axis:
        return module
    _check_no_other_axis(name, module.axis_name, vocab_axis)
    # A piece that reads whole rows fixes its axis_name at None: a field with
    # init=False, or a class variable.
    if not any(f.name == "axis_name" and f.init for f in dataclasses.fields(module)):
        raise ValueError(
            f"{name}, {type(module).__name__}, cannot split the vocabulary: "
            "its axis_name is fixed, not a field set at construction"
        )
    return dataclasses.replace(module, axis_name=vocab_axis)


def _check_no_other_axis(
    name: str, axis_name: str | None, vocab_axis: str | None
) -> None:
    """A `ValueError` where `name` splits the vocabulary over another axis than
    `vocab_axis`: it would reduce over the wrong devices."""
    if axis_name not in (None, vocab_axis):
        raise ValueError(
            f"{name} splits the vocabulary over {axis_name!r}, but vocab_axis is "
            f"{vocab_axis!r}"
        )
