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


Model = AbstractCachedModel | LanguageModel
"""A model as the loop and its checks take it: with a cache, or a plain callable
that reads the whole history."""


@final
class Cacheless(AbstractCachedModel):
    """A [`speculax.LanguageModel`][] as a [`speculax.AbstractCachedModel`][]: its
    cache is the int32 `(B, T)` buffer of tokens read so far, and each call writes
    the new tokens into it and scores them from the whole buffer.

    A chain (new tokens at the positions of the slots they are written in, each
    seeing those before it) is scored in one call of the model. A tree read whole,
    each new token seeing its ancestors among the new tokens (a
    [`speculax.DraftTree`][] in the loop), is scored in one call per new token, on
    the buffer of the history followed by the tokens it sees, in order: token $k$
    must sit at position `cache_length + (number of tokens it sees) - 1`, and each
    token it sees must see exactly those of them before it. Any other mask or
    positions raise an Equinox runtime error.

    **Arguments:**

    - `model`: the [`speculax.LanguageModel`][], a callable
        `(tokens, positions) -> logits`.
    - `name`: keyword only, how errors name the model (a model whose logits are not
        of shape `(B, K, V)` for positions of shape `(B, K)`, or not floats, raises
        a `ValueError` or `TypeError` at trace time). The loop sets it to
        `"draft_model"` or `"target_model"`. Default `"model"`.
    """

    model: LanguageModel
    name: str = eqx.field(static=True, default="model", kw_only=True)

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
        slots = _slots(cache_length, tokens.shape[1])
        is_chain = (positions == slots).all() & (
            mask == jnp.tril(jnp.ones_like(mask))
        ).all()
        positions = eqx.error_if(
            positions,
            ~is_chain & ~_reads_paths(positions, mask, cache_length),
            "speculax.Cacheless scores chains and trees only: each new token at "
            "position cache_length + (the number of new tokens it sees) - 1, and "
            "seeing, of the new tokens before it, those that the ones it sees see",
        )
        return jax.lax.cond(
            is_chain,
            lambda: self._scored_chain(tokens, cache, cache_length),
            lambda: self._scored_paths(tokens, positions, mask, cache, cache_length),
        )

    def _scored_chain(
        self,
        tokens: Int[Array, "batch new"],
        cache: Int[Array, "batch slots"],
        cache_length: Int[Array, " batch"],
    ) -> tuple[Float[Array, "batch new vocab"], Int[Array, "batch slots"]]:
        """`__call__` for new tokens known before tracing to read a chain (new
        token $k$ at position `cache_length + k`, seeing those before it), as
        `read_new` calls it: the model called once, on the buffer."""
        buffer = _written(cache, tokens, cache_length)
        return self._scored(buffer, _slots(cache_length, tokens.shape[1])), buffer

    def _scored_paths(
        self,
        tokens: Int[Array, "batch new"],
        positions: Int[Array, "batch new"],
        mask: Bool[Array, "batch new new"],
        cache: Int[Array, "batch slots"],
        cache_length: Int[Array, " batch"],
    ) -> tuple[Float[Array, "batch new vocab"], Int[Array, "batch slots"]]:
        """`__call__` for new tokens known before tracing to read paths of a tree
        and no chain, as `read_new` calls it: the model called once per new token,
        on its path."""
        batch, width = tokens.shape
        buffer = _written(cache, tokens, cache_length)
        logits = self._scored(
            path_buffers(cache, tokens, mask, cache_length), positions.reshape(-1, 1)
        )
        return logits.reshape(batch, width, -1), buffer

    def _scored(
        self, tokens: Int[Array, "rows slots"], positions: Int[Array, "rows k"]
    ) -> Float[Array, "rows k vocab"]:
        logits = self.model(tokens, positions)
        check_logits(logits, self.name, positions.shape, "(tokens, positions)")
        return logits


def _slots(cache_length: Int[Array, " batch"], width: int) -> Int[Array, "batch new"]:
    """The slots `cache_length + k` the new tokens of a call are written in."""
    return cache_length[:, None] + jnp.arange(width)


def _written(
    cache: Int[Array, "batch slots"],
    tokens: Int[Array, "batch new"],
    cache_length: Int[Array, " batch"],
) -> Int[Array, "batch slots"]:
    """The buffer with the new tokens written at their slots."""
    slots = _slots(cache_length, tokens.shape[1])
    return cache.at[jnp.arange(tokens.shape[0])[:, None], slots].set(tokens)


@final
class FullRead(eqx.Module):
    """A [`speculax.AbstractCachedModel`][] read whole at every call, as a
    [`speculax.LanguageModel`][]: the reference its cached reads must match.

    Each call makes an empty cache as long as the buffer and reads every token of
    it in one call of the model, at `cache_length = 0`, each token at its own
    position and seeing those before it (a lower-triangular mask). What the model
    returns there depends on no earlier call, so the loop given `FullRead(model)`
    and the loop given `model` must give the same tokens for the same keys, up to
    the rounding of the model's arithmetic (attention summed over the cache in
    another order): the check `docs/loop.md` recommends for a new cached model.

    **Arguments:**

    - `model`: the [`speculax.AbstractCachedModel`][].
    """

    model: AbstractCachedModel

    def __call__(
        self,
        tokens: Int[Array, "batch time"],
        positions: Int[Array, "batch positions"],
    ) -> Float[Array, "batch positions vocab"]:
        """The logits after each of `positions`, from the whole buffer `tokens`, as
        a [`speculax.LanguageModel`][] returns them."""
        batch, length = tokens.shape
        every = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        mask = jnp.broadcast_to(
            jnp.tril(jnp.ones((length, length), bool)), (batch, length, length)
        )
        logits, _ = self.model(
            tokens,
            every,
            mask,
            self.model.init_cache(batch, length),
            jnp.zeros((batch,), jnp.int32),
        )
        return jnp.take_along_axis(logits, positions[..., None], axis=1)


@final
class NamedModel(AbstractCachedModel):
    """A model as the loop calls it: its own calls, each checked at trace time
    against the interface of [`speculax.AbstractCachedModel`][] (logits of shape
    `(B, K, V)` in a float dtype, the cache given back with the structure, shapes
    and dtypes it came with), with errors that name it."""

    model: AbstractCachedModel
    name: str = eqx.field(static=True)

    def init_cache(self, batch: int, max_length: int) -> Cache:
        return self.model.init_cache(batch, max_length)

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
        returned: Any = self.model(tokens, positions, mask, cache, cache_length)
        if not isinstance(returned, tuple | list) or len(returned) != 2:
            raise TypeError(
                f"{self.name} must return a pair (logits, cache), as "
                "speculax.AbstractCachedModel.__call__ does; got "
                f"{_described(returned)}"
            )
        logits, new_cache = returned
        check_logits(logits, self.name, tokens.shape, "(tokens, positions, ...)")
        _check_cache(new_cache, cache, self.name)
        return logits, new_cache


def check_logits(logits: Any, name: str, shape: tuple[int, ...], call: str) -> None:
    """Raises unless `logits` are floats of shape `(B, K, V)` for new tokens of
    `shape` `(B, K)`, naming the model and the call."""
    got = jnp.shape(logits) if hasattr(logits, "shape") else None
    if got is None or len(got) != 3 or got[:2] != tuple(shape):
        raise ValueError(
            f"{name}{call} must return logits of shape (B, K, V) = ({shape[0]}, "
            f"{shape[1]}, V), one row per new token; got {_described(logits)}"
        )
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise TypeError(
            f"{name}{call} must return floating-point logits; got dtype {logits.dtype}"
        )


def _check_cache(new: Any, given: Cache, name: str) -> None:
    """Raises unless the cache a call returned has the structure, shapes and dtypes
    of the one it was given: the loop carries it from round to round."""
    if jax.tree.structure(new) != jax.tree.structure(given):
        raise ValueError(
            f"{name} must return its cache with the structure it was given, the new "
            f"entries written into it; got {jax.tree.structure(new)}, given "
            f"{jax.tree.structure(given)}"
        )
    for new_leaf, given_leaf in zip(
        jax.tree.leaves(new), jax.tree.leaves(given), strict=True
    ):
        if (jnp.shape(new_leaf), jnp.result_type(new_leaf)) != (
            jnp.shape(given_leaf),
            jnp.result_type(given_leaf),
        ):
            raise ValueError(
                f"{name} must return its cache with the shapes and dtypes it was "
                f"given; got an array {_described(new_leaf)} for one "
                f"{_described(given_leaf)}"
            )


def _described(value: Any) -> str:
    """A value as an error message shows it: an array by its shape and dtype."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"of shape {tuple(value.shape)} and dtype {value.dtype}"
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def _reads_paths(
    positions: Int[Array, "batch new"],
    mask: Bool[Array, "batch new new"],
    cache_length: Int[Array, " batch"],
) -> Bool[Array, ""]:
    """Whether every new token reads one path after the history: it sees itself and
    no later token, sits at the position its path ends at, and each token it sees
    sees exactly the tokens of its path before that one."""
    width = positions.shape[1]
    earlier = jnp.tril(jnp.ones((width, width), jnp.bool_))
    own = jnp.diagonal(mask, axis1=1, axis2=2).all() & ~(mask & ~earlier).any()
    at_end = positions == cache_length[:, None] + mask.sum(axis=-1) - 1
    # [b, k, j, i]: token j, seen by k, sees i exactly when k sees i and i <= j.
    prefix = mask[:, :, None, :] & earlier[None, None]
    closed = ~mask[:, :, :, None] | (mask[:, None, :, :] == prefix)
    return own & at_end.all() & closed.all()


def path_buffers(
    history: Int[Array, "batch slots"],
    tokens: Int[Array, "batch new"],
    mask: Bool[Array, "batch new new"],
    cache_length: Int[Array, " batch"],
) -> Int[Array, "rows slots"]:
    """What each new token of a call reads, as a row of tokens of its own: the
    history (the first `cache_length` entries of its row of `history`), then the new
    tokens it sees, in order; past them, what `history` holds.

    **Returns:**

    Int32 `(B * K, T)`, row `b * K + k` for new token $k$ of row $b$, which sits at
    position `cache_length[b]` + (the number of new tokens it sees) - 1.
    """

    def one_path(row: Array, seen: Array, row_tokens: Array, start: Array) -> Array:
        at = jnp.where(seen, start + jnp.cumsum(seen) - 1, row.shape[0])
        return row.at[at].set(row_tokens, mode="drop")

    paths = jax.vmap(
        lambda row, seen, row_tokens, start: jax.vmap(
            lambda k_seen: one_path(row, k_seen, row_tokens, start)
        )(seen)
    )(history, mask, tokens, cache_length)
    return paths.reshape(-1, history.shape[1])


def as_cached_model(model: Any, name: str) -> NamedModel:
    """`model` as a `NamedModel` called `name`: a model with a cache as it is, a
    callable wrapped in [`speculax.Cacheless`][]; a `TypeError` naming the argument
    otherwise."""
    if isinstance(model, NamedModel):
        model = model.model
    if isinstance(model, Cacheless):
        model = Cacheless(model.model, name=name)
    if isinstance(model, AbstractCachedModel):
        return NamedModel(model, name)
    if callable(model):
        # Runtime checks cannot see a callable's signature: the call is its test.
        return NamedModel(Cacheless(cast(LanguageModel, model), name=name), name)
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
    return read_new(
        model,
        jnp.take_along_axis(buffer, window, axis=1),
        window,
        jnp.broadcast_to(mask, (buffer.shape[0], width, width)),
        cache,
        first,
        chain=True,
    )


def read_new(
    model: AbstractCachedModel,
    tokens: Int[Array, "batch new"],
    positions: Int[Array, "batch new"],
    mask: Bool[Array, "batch new new"],
    cache: Cache,
    cache_length: Int[Array, " batch"],
    *,
    chain: bool,
) -> tuple[Float[Array, "batch new vocab"], Cache]:
    """`model(tokens, positions, mask, cache, cache_length)` for a call the loop
    knows before tracing to read a chain (`chain`) or paths of a tree and no chain.
    A [`speculax.Cacheless`][] model, which tells them apart from the arrays
    (tracing both ways to score them, and the check that a tree's tokens read
    paths), then traces only the one way it scores them: the same logits, from a
    program two thirds the size (a chain round's jaxpr)."""
    inner = model.model if isinstance(model, NamedModel) else model
    if not isinstance(inner, Cacheless):
        return model(tokens, positions, mask, cache, cache_length)
    if chain:
        return inner._scored_chain(tokens, cache, cache_length)
    return inner._scored_paths(tokens, positions, mask, cache, cache_length)


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
