"""What every step on a mesh shares: the step under `jax.shard_map` on inputs
placed on the mesh, and the checks of the batch, the vocabulary and the axes."""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array

from .._core._failures import RESULTS
from .._core._numerics import as_index


def run_on_mesh(
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


def check_divisible(name: str, axis: str | None, size: int, mesh: Mesh) -> None:
    """A `ValueError` where the `name` size is not divisible by its axis's."""
    devices = 1 if axis is None else mesh.shape[axis]
    if size % devices:
        raise ValueError(
            f"the {name} size must be divisible by the size of {name}_axis "
            f"{axis!r}, {devices}; got {size}"
        )


def on_axis(name: str, module: Any, vocab_axis: str | None) -> Any:
    """`module`, named `name`, with `vocab_axis` as its `axis_name`; a `ValueError`
    where it names another axis, or where it cannot split the vocabulary when it
    is split."""
    if module.axis_name == vocab_axis:
        return module
    check_no_other_axis(name, module.axis_name, vocab_axis)
    # A piece that reads whole rows fixes its axis_name at None: a field with
    # init=False, or a class variable.
    if not any(f.name == "axis_name" and f.init for f in dataclasses.fields(module)):
        raise ValueError(
            f"{name}, {type(module).__name__}, cannot split the vocabulary: "
            "its axis_name is fixed, not a field set at construction"
        )
    return dataclasses.replace(module, axis_name=vocab_axis)


def check_no_other_axis(
    name: str, axis_name: str | None, vocab_axis: str | None
) -> None:
    """A `ValueError` where `name` splits the vocabulary over another axis than
    `vocab_axis`: it would reduce over the wrong devices."""
    if axis_name not in (None, vocab_axis):
        raise ValueError(
            f"{name} splits the vocabulary over {axis_name!r}, but vocab_axis is "
            f"{vocab_axis!r}"
        )
