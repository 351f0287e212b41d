"""Models with a cache, as the loop calls them: the interface, the adapter that gives a
cacheless model the same interface, and the two calls the loop makes of every model
(filling a cache with a history, scoring a history whole)."""

import abc
from typing import Any, cast, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PyTree, Shaped

from ._model import LanguageModel


Cache = PyTree[Shaped[Array, "batch slots ..."]]
"""A model's cache: a PyTree of arrays, each with the batch on axis 0 and the slot on
axis 1, one slot per token the model has read."""


class AbstractCachedModel(eqx.Module):
    """A model that keeps a cache of what it has read, so that a call reads only the
    new tokens: a KV cache, for a transformer.

    The cache is a PyTree of arrays, each of shape `(B, T, ...)`: the batch first, then
    one slot per token, so that the loop can read and keep slots whatever the model
    stores in them. Row $b$'s first `cache_length[b]` slots hold the history, slot $j$
    the token at position $j$; the slots past them hold anything (the entries of
    rejected drafts, say), and a call must not read them.

    Subclass it and implement `init_cache` and `__call__`. A
    [`speculax.LanguageModel`][], which reads the whole history at every call, gets
    this interface from [`speculax.Cacheless`][], and the loop wraps one so itself.
    """

    @abc.abstractmethod
    def init_cache(
        self, batch: int, max_length: int
    ) -> PyTree[Shaped[Array, "batch slots ..."]]:
        """An empty cache.

        **Arguments:**

        - `batch`: $B$, the number of rows.
        - `max_length`: $T$, the number of slots.

        **Returns:**

        A PyTree of arrays, each of shape `(B, T, ...)`.
        """

    @abc.abstractmethod
    def __call__(
        self,
        tokens: Int[Array, "batch new"],
        positions: Int[Array, "batch new"],
        mask: Bool[Array, "batch new new"],
        cache: PyTree[Shaped[Array, "batch slots ..."]],
        cache_length: Int[Array, " batch"],
    ) -> tuple[
        Float[Array, "batch new vocab"], PyTree[Shaped[Array, "batch slots ..."]]
    ]:
        """Reads $K$ new tokens after each row's cached history.

        New token $k$ of row $b$ sits at position `positions[b, k]` of its sequence
        and is written into slot `cache_length[b] + k`. It sees the history (slots
        below `cache_length[b]`) and the new tokens $j$ with `mask[b, k, j]`, itself
        included: a lower-triangular mask for a chain, in which positions are
        `cache_length[b] + k`.

        **Arguments:**

        - `tokens`: int32 `(B, K)`, the new tokens.
        - `positions`: int32 `(B, K)`, their positions.
        - `mask`: bool `(B, K, K)`, which new tokens each one sees.
        - `cache`: the cache, as `init_cache` made it and earlier calls wrote it.
        - `cache_length`: int32 `(B,)`, the number of slots of each row that hold
            its history.

        **Returns:**

        `(logits, cache)`: the float `(B, K, V)` logits, entry $[b, k]$ those of the
        token after new token $k$ and what it sees; and the cache with the new
        tokens' entries written at slots `cache_length + k`, the slots below
        `cache_length` unchanged. The logits must not depend on what the slots at
        or past `cache_length` held before the call.
        """


@final
class Cacheless(AbstractCachedModel):
    """A [`speculax.LanguageModel`][] as a [`speculax.AbstractCachedModel`][]: its
    cache is the int32 `(B, T)` buffer of tokens read so far, and each call writes
    the new tokens into it and scores them from the whole buffer.

    It scores chains only: new tokens at the positions of the slots they are written
    in, each seeing those before it (what the loop's chain drafts give it). Any other
    mask or positions raise an Equinox runtime error.

    **Arguments:**

    - `model`: the [`speculax.LanguageModel`][], a callable
        `(tokens, positions) -> logits`.
    """

    model: LanguageModel

    def init_cache(self, batch: int, max_length: int) -> Int[Array, "batch slots"]:
        return jnp.zeros((batch, max_length), jnp.int32)

    def __call__(
        self,
        tokens: Int[Array, "batch new"],
        positions: Int[Array, "batch new"],
        mask: Bool[Array, "batch new new"],
        cache: PyTree[Shaped[Array, "batch slots ..."]],
        cache_length: Int[Array, " batch"],
    ) -> tuple[Float[Array, "batch new vocab"], Int[Array, "batch slots"]]:
        slots = cache_length[:, None] + jnp.arange(tokens.shape[1])
        positions = eqx.error_if(
            positions,
            (positions != slots).any() | (mask != jnp.tril(jnp.ones_like(mask))).any(),
            "speculax.Cacheless scores chains only: each new token at the position "
            "of its slot (cache_length + k), seeing the tokens before it",
        )
        buffer = cache.at[jnp.arange(tokens.shape[0])[:, None], slots].set(tokens)
        return self.model(buffer, positions), buffer


def as_cached_model(model: Any, name: str) -> AbstractCachedModel:
    """`model` itself if it has a cache, else a callable wrapped in
    [`speculax.Cacheless`][]; a `TypeError` naming the argument otherwise."""
    if isinstance(model, AbstractCachedModel):
        return model
    if callable(model):
        # Runtime checks cannot see a callable's signature: the call is its test.
        return Cacheless(cast(LanguageModel, model))
    raise TypeError(
        f"{name} must be a speculax.AbstractCachedModel or a callable "
        f"(tokens, positions) -> logits; got a {type(model).__name__}"
    )


def empty_cache(
    model: AbstractCachedModel, batch: int, max_length: int, name: str
) -> Cache:
    """`model.init_cache(batch, max_length)`, after checking that each array has the
    batch and the slots first, with an error naming the model."""
    cache = model.init_cache(batch, max_length)
    for leaf in jax.tree.leaves(cache):
        if jnp.shape(leaf)[:2] != (batch, max_length):
            raise ValueError(
                f"{name}.init_cache({batch}, {max_length}) must return arrays of "
                f"shape ({batch}, {max_length}, ...), the batch then the slots; got "
                f"one of shape {jnp.shape(leaf)}"
            )
    return cache


def read_chain(
    model: AbstractCachedModel,
    buffer: Int[Array, "batch time"],
    first: Int[Array, " batch"],
    width: int,
    cache: Cache,
) -> tuple[Float[Array, "batch new vocab"], Cache]:
    """Reads the `width` tokens of each row of `buffer` from slot `first` on, as a
    chain (each at the position of its slot, seeing those before it), after the
    `first` slots of `cache`.

    **Returns:**

    `(logits, cache)`: the `(B, width, V)` logits after each token, and the cache
    with their entries written.
    """
    window = first[:, None] + jnp.arange(width)
    mask = jnp.tril(jnp.ones((width, width), jnp.bool_))
    return model(
        jnp.take_along_axis(buffer, window, axis=1),
        window,
        jnp.broadcast_to(mask, (buffer.shape[0], width, width)),
        cache,
        first,
    )


def read_history(
    model: AbstractCachedModel,
    tokens: Int[Array, "batch time"],
    max_length: int,
    name: str,
) -> tuple[Float[Array, "batch time vocab"], Cache]:
    """Reads every token of `tokens` into an empty cache of `max_length` slots, in
    one call.

    **Returns:**

    `(logits, cache)`: the logits after each token, `(B, T, V)`, and the cache.
    """
    batch, width = tokens.shape
    cache = empty_cache(model, batch, max_length, name)
    return read_chain(model, tokens, jnp.zeros((batch,), jnp.int32), width, cache)
