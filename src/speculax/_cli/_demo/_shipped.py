import io
from pathlib import Path
from typing import BinaryIO, cast

import equinox as eqx
import jax
import jax.numpy as jnp

from ._models import CausalTransformer


# The hyperparameters of the shipped weights, which scripts/train_demo_models.py
# trained: loading builds a model of exactly these shapes.
DRAFT_HYPERPARAMETERS: dict[str, int] = {
    "width": 64,
    "depth": 1,
    "heads": 2,
    "window": 128,
}
TARGET_HYPERPARAMETERS: dict[str, int] = {
    "width": 192,
    "depth": 4,
    "heads": 6,
    "window": 128,
}
WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
DRAFT_WEIGHTS = "draft.eqx"
TARGET_WEIGHTS = "target.eqx"
# Weights are stored in float16, and computed with in float32.
STORAGE_DTYPE = jnp.float16


def _as_dtype(model: CausalTransformer, dtype) -> CausalTransformer:
    return jax.tree.map(
        lambda leaf: leaf.astype(dtype) if eqx.is_inexact_array(leaf) else leaf, model
    )


def file_object(path: str | Path | io.BufferedIOBase):
    # Equinox's annotation is typing.BinaryIO, which no real file object subclasses,
    # so the runtime checks of this package cannot use it (nor this return type).
    return cast(str | Path | BinaryIO, path)


def save_model(model: CausalTransformer, path: str | Path | io.BufferedIOBase) -> None:
    """Writes a model's weights, in float16, as `eqx.tree_serialise_leaves` does.

    **Arguments:**

    - `model`: the model.
    - `path`: the file, or a binary file object, to write.
    """
    eqx.tree_serialise_leaves(file_object(path), _as_dtype(model, STORAGE_DTYPE))


def load_model(
    path: str | Path | io.BufferedIOBase, hyperparameters: dict[str, int]
) -> CausalTransformer:
    """Reads the weights `save_model` wrote, back in float32.

    **Arguments:**

    - `path`: the file, or a binary file object, to read.
    - `hyperparameters`: the keyword arguments of `CausalTransformer` (less `key`) that
        the saved model was built with.

    **Returns:**

    The model, its weights float32.
    """
    skeleton = eqx.filter_eval_shape(
        lambda: CausalTransformer(**hyperparameters, key=jax.random.key(0))
    )
    skeleton = jax.tree.map(
        lambda leaf: (
            jax.ShapeDtypeStruct(leaf.shape, STORAGE_DTYPE)
            if isinstance(leaf, jax.ShapeDtypeStruct)
            and jnp.issubdtype(leaf.dtype, jnp.inexact)
            else leaf
        ),
        skeleton,
    )
    return _as_dtype(
        eqx.tree_deserialise_leaves(file_object(path), skeleton), jnp.float32
    )


def _load_shipped(name: str, hyperparameters: dict[str, int]) -> CausalTransformer:
    return load_model(WEIGHTS_DIR / name, hyperparameters)


def load_demo_models() -> tuple[CausalTransformer, CausalTransformer]:
    """The demo's draft and target models, with the weights shipped in the package.

    Both are `CausalTransformer`s with a key-value cache, trained by
    `scripts/train_demo_models.py` on the source of some standard-library modules
    (`corpus`): the draft has one block of width 64 (2 heads), the target four of
    width 192 (6 heads), each attending to the last 128 tokens.

    **Returns:**

    A tuple `(draft, target)` of `CausalTransformer`s, their weights float32.
    """
    return (
        _load_shipped(DRAFT_WEIGHTS, DRAFT_HYPERPARAMETERS),
        _load_shipped(TARGET_WEIGHTS, TARGET_HYPERPARAMETERS),
    )
