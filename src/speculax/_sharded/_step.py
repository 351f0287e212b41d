"""`sharded_step`: a verification step run under `jax.shard_map`, on inputs
sharded over a device mesh. See `docs/sharding.md`."""

import functools
from collections.abc import Callable
from typing import Any, Literal, overload

from jax.sharding import Mesh

from .._chain._step import SpeculativeStep, StepOutput
from .._core._failures import RESULTS
from .._logits._step import LogitsStep
from .._tree._abstract import AbstractTreeStep, TreeOutput
from ._chain import chain_step_on_mesh
from ._logits import logits_step_on_mesh
from ._tree import tree_step_on_mesh


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
    vocab_axis: str | None = None,
    with_result: Literal[False] = False,
) -> Callable[..., StepOutput]: ...


@overload
def sharded_step(
    step: LogitsStep,
    mesh: Mesh,
    *,
    batch_axis: str | None = None,
    vocab_axis: str | None = None,
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

    [`speculax.LogitsStep`][] splits both as well, each row verified under its own
    sampling parameters, which are split with the rows. With a vocabulary axis the
    step is given `vocab_axis` as its `axis_name`, and the devices of a row compute
    its statistics together: the largest logit and its index (`pmax`, `pmin`),
    each bisection step's count (`psum`) and mass (the
    $\\lceil V / 256 \\rceil$ block sums, `all_gather`), the logits at the draft
    tokens (`psum`), and the final draw as for the chain step. Outputs are bit
    for bit those on one device, under the same condition.

    **Arguments:**

    - `step`: a [`speculax.SpeculativeStep`][], any flags included
        (`check_all_probs`, `throw=False`), an [`speculax.AbstractTreeStep`][], or
        a [`speculax.LogitsStep`][].
    - `mesh`: a `jax.sharding.Mesh`.
    - `batch_axis`: keyword only, the name of the mesh axis that shards the batch, or
        `None`.
    - `vocab_axis`: keyword only, the name of the mesh axis that shards the
        vocabulary, or `None`.
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
    step on another axis than `vocab_axis`; when called, for the
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
        sharded = tree_step_on_mesh(step, mesh, batch_axis, vocab_axis)
    elif isinstance(step, LogitsStep):
        sharded = logits_step_on_mesh(step, mesh, batch_axis, vocab_axis)
    else:
        sharded = chain_step_on_mesh(step, mesh, batch_axis, vocab_axis)
    if with_result:
        return sharded

    def sharded_output(*args: Any, **kwargs: Any) -> Any:
        output, _ = sharded(*args, **kwargs)
        return output

    return functools.wraps(sharded)(sharded_output)
