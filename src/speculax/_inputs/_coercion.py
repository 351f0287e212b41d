"""What every step does first with its inputs: JAX arrays from whatever was passed,
their structure checked at trace time, the integers as `int32`, and the uniforms
given, drawn from a key or not needed. The chain, logits and tree steps share it."""

from typing import ClassVar, Protocol, final, runtime_checkable

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array

from .._core._checks import check_structure, check_tree_structure
from .._core._numerics import as_index, index_array
from ._input_array import InputArray
from ._random import KeyArray, uniforms


# Runtime checkable for the tests' runtime type checks.
@runtime_checkable
class _ReadsUniforms(Protocol):
    """A piece that says whether it reads uniforms: an acceptance or a sampler."""

    reads_uniforms: ClassVar[bool]


@final
class StepInputs(eqx.Module):
    """A step's inputs as JAX arrays, their structure checked, the integers `int32`.

    The shapes are those of the step's own arguments (`(B, G)` tokens and `(B, G,
    V)`, `(B, G + 1, V)` distributions for a chain; `(B, N)` and `(B, N + 1, V)` for
    a tree). The uniforms are as given, `None` where omitted, until
    `StepInputs.uniforms` resolves them.
    """

    tokens: Array
    draft: Array | None
    target: Array
    accept_uniforms: Array | None
    sample_uniforms: Array | None
    num_draft_tokens: Array | None
    parents: Array | None

    def uniforms(
        self, key: KeyArray | None, readers: tuple[str | None, str | None]
    ) -> tuple[Array, Array]:
        """The uniforms as given, drawn from `key`, or zeros where nothing reads
        them (`resolve_uniforms`, over the tokens' shape).

        **Arguments:**

        - `key`: the step's `key` argument, or `None`.
        - `readers`: the names of what reads `accept_uniforms` and
            `sample_uniforms`, `None` where nothing does (see `uniform_reader`).

        **Returns:**

        `(accept_uniforms, sample_uniforms)`, of shapes `(B, G)` and `(B,)`.
        """
        return resolve_uniforms(
            self.tokens.shape, self.accept_uniforms, self.sample_uniforms, key, readers
        )


def coerce_inputs(
    tokens: InputArray,
    draft: InputArray | None,
    target: InputArray,
    accept_uniforms: InputArray | None,
    sample_uniforms: InputArray | None,
    *,
    num_draft_tokens: InputArray | None = None,
    parents: InputArray | None = None,
    given_as: str = "probs",
) -> StepInputs:
    """A step's inputs as JAX arrays, checked: the one entry point of every step's
    coercion, before any arithmetic.

    Integers are read by value (`index_array`, then `as_index`), so that a NumPy
    `int64` out of `int32`'s range becomes an out-of-range index rather than
    wrapping; lists become arrays. The structure check (`check_structure` for a
    chain, `check_tree_structure` when `parents` is given) raises `ValueError` or
    `TypeError` naming the argument.

    **Arguments:**

    - `tokens`: the draft tokens of a chain, or the tree tokens of a tree.
    - `draft`, `target`: the draft's and the target's distributions (or logits).
    - `accept_uniforms`, `sample_uniforms`: as passed, `None` where omitted.
    - `num_draft_tokens`: keyword only, a chain's ragged lengths, or `None`.
    - `parents`: keyword only, a tree's parents (an unrepresentable one becomes
        $-2$, out of range, not $-1$, an unused slot); `None` for a chain.
    - `given_as`: keyword only, how a chain's error messages name the
        distributions: `draft_probs` and `target_probs` (`"probs"`) or
        `draft_logits` and `target_logits` (`"logits"`).

    **Returns:**

    A `StepInputs`.
    """
    if parents is not None:
        parents = index_array(parents, unrepresentable=-2)
    tokens = index_array(tokens)
    target = jnp.asarray(target)
    draft = optional_array(draft)
    accept_uniforms = optional_array(accept_uniforms)
    sample_uniforms = optional_array(sample_uniforms)
    num_draft_tokens = optional_index_array(num_draft_tokens)
    if parents is None:
        check_structure(
            tokens,
            draft,
            target,
            accept_uniforms,
            sample_uniforms,
            num_draft_tokens,
            given_as=given_as,
        )
    else:
        check_tree_structure(
            parents, tokens, draft, target, accept_uniforms, sample_uniforms
        )
        parents = as_index(parents, -2)
    if num_draft_tokens is not None:
        num_draft_tokens = as_index(num_draft_tokens)
    return StepInputs(
        as_index(tokens),
        draft,
        target,
        accept_uniforms,
        sample_uniforms,
        num_draft_tokens,
        parents,
    )


def uniform_reader(piece: _ReadsUniforms) -> str | None:
    """The name of `piece`'s class, the reader an error about missing uniforms
    names; `None` where the piece reads no uniform (its `reads_uniforms` is
    `False`).

    **Arguments:**

    - `piece`: a step's acceptance or sampler piece.

    **Returns:**

    The name, or `None`, as `resolve_uniforms` takes each of its `readers`.
    """
    return type(piece).__name__ if piece.reads_uniforms else None


def resolve_uniforms(
    shape: tuple[int, ...],
    accept_uniforms: Array | None,
    sample_uniforms: Array | None,
    key: KeyArray | None,
    readers: tuple[str | None, str | None],
) -> tuple[Array, Array]:
    """The uniforms as given, drawn from `key`, or zeros where nothing reads them;
    a `ValueError` where the reader named in `readers` (for `accept_uniforms`, then
    `sample_uniforms`; `None` for none) needs them and they are missing.
    """
    batch, num_draft = shape
    if key is not None:
        if accept_uniforms is not None or sample_uniforms is not None:
            raise ValueError(
                "pass either key or accept_uniforms and sample_uniforms, not both"
            )
        return uniforms(key, batch, num_draft)
    given = {"accept_uniforms": accept_uniforms, "sample_uniforms": sample_uniforms}
    for (name, value), reader in zip(given.items(), readers, strict=True):
        if value is None and reader is not None:
            raise ValueError(
                f"{name} is required: {reader} reads it; pass it, or key= to draw"
            )
    if accept_uniforms is None:
        accept_uniforms = jnp.zeros((batch, num_draft), jnp.float32)
    if sample_uniforms is None:
        sample_uniforms = jnp.zeros((batch,), jnp.float32)
    return accept_uniforms, sample_uniforms


def optional_array(x: InputArray | None) -> Array | None:
    """`x` as a JAX array, `None` staying `None`."""
    return None if x is None else jnp.asarray(x)


def optional_index_array(x: InputArray | None) -> Array | None:
    """`x` as an integer JAX array by `index_array`, `None` staying `None`."""
    return None if x is None else index_array(x)
