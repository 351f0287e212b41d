from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ..._loop._cache import AbstractCachedModel


VOCAB = 256


@final
class _Block(eqx.Module):
    """One pre-norm transformer block: causal self-attention, then an MLP."""

    attention_norm: eqx.nn.LayerNorm
    qkv: Float[Array, "qkv width"]
    output: Float[Array, "width width"]
    mlp_norm: eqx.nn.LayerNorm
    hidden: Float[Array, "hidden width"]
    hidden_bias: Float[Array, " hidden"]
    back: Float[Array, "width hidden"]

    def __init__(self, width: int, key: PRNGKeyArray):
        keys = jax.random.split(key, 3)
        scale = width**-0.5
        self.attention_norm = eqx.nn.LayerNorm(width)
        self.qkv = scale * jax.random.normal(keys[0], (3 * width, width))
        self.output = jnp.zeros((width, width))
        self.mlp_norm = eqx.nn.LayerNorm(width)
        self.hidden = scale * jax.random.normal(keys[1], (4 * width, width))
        self.hidden_bias = jnp.zeros(4 * width)
        self.back = jnp.zeros((width, 4 * width))

    def __call__(
        self,
        x: Float[Array, "batch new width"],
        positions: Int[Array, "batch new"],
        layer_cache: Float[Array, "batch slots 2 heads head"],
        slots: Int[Array, "batch new"],
        visible: Bool[Array, "batch new slots"],
    ) -> tuple[
        Float[Array, "batch new width"], Float[Array, "batch slots 2 heads head"]
    ]:
        """The block on the new tokens `x` at `positions`, their keys (rotated to
        their positions) and values written into their `slots` of the layer's
        cache, each attending to the slots it sees."""
        batch, new, width = x.shape
        heads, head = layer_cache.shape[-2:]
        normed = jax.vmap(jax.vmap(self.attention_norm))(x)
        q, k, v = (
            part.reshape(batch, new, heads, head)
            for part in jnp.split(normed @ self.qkv.T, 3, axis=-1)
        )
        q, k = _rotated(q, positions), _rotated(k, positions)
        written = jnp.stack([k, v], axis=2)
        # The new tokens' slots follow one another: one slice of each row.
        layer_cache = jax.vmap(
            lambda row, new_rows, first: jax.lax.dynamic_update_slice(
                row, new_rows, (first, 0, 0, 0)
            )
        )(layer_cache, written, slots[:, 0])
        keys, values = layer_cache[:, :, 0], layer_cache[:, :, 1]
        scores = jnp.einsum("bkhd,bthd->bhkt", q, keys)
        scores = jnp.where(visible[:, None], scores * head**-0.5, -jnp.inf)
        weights = jax.nn.softmax(scores, axis=-1)
        attended = jnp.einsum("bhkt,bthd->bkhd", weights, values)
        x = x + attended.reshape(batch, new, width) @ self.output.T
        normed = jax.vmap(jax.vmap(self.mlp_norm))(x)
        hidden = jax.nn.gelu(normed @ self.hidden.T + self.hidden_bias)
        return x + hidden @ self.back.T, layer_cache


@final
class CausalTransformer(AbstractCachedModel):
    """A byte-level causal transformer with a key-value cache: the draft and target
    models of the demo.

    Each block is causal self-attention then an MLP (pre-norm, residual), and the
    logits are a linear map of the last layer norm. A token attends to the `window`
    tokens up to its own, by rotary position embeddings (queries and keys rotated
    by their positions): what it reads depends on the distances between positions
    alone, all of which training at rows of `window` tokens has seen, so the model
    runs at any position. The cache holds every layer's keys and values, one slot
    per token read, as [`speculax.AbstractCachedModel`][] lays it out, so that a
    call reads only the new tokens.

    **Arguments:**

    - `width`: keyword only, the size of each token's vector.
    - `depth`: keyword only, the number of blocks.
    - `heads`: keyword only, the attention heads, a divisor of `width` into an even
        size.
    - `window`: keyword only, the tokens a token attends to, its own included.
    - `key`: keyword only, a PRNG key for the initial weights.
    """

    embedding: Float[Array, "vocab width"]
    blocks: tuple[_Block, ...]
    norm: eqx.nn.LayerNorm
    unembedding: Float[Array, "vocab width"]
    heads: int = eqx.field(static=True)
    window: int = eqx.field(static=True)

    def __init__(
        self, *, width: int, depth: int, heads: int, window: int, key: PRNGKeyArray
    ):
        if min(width, depth, heads, window) < 1 or width % (2 * heads):
            raise ValueError(
                "width, depth, heads and window must be positive, and heads a "
                f"divisor of width into an even size; got {width}, {depth}, {heads}, "
                f"{window}"
            )
        keys = jax.random.split(key, depth + 2)
        self.embedding = jax.random.normal(keys[0], (VOCAB, width))
        self.blocks = tuple(_Block(width, block_key) for block_key in keys[2:])
        self.norm = eqx.nn.LayerNorm(width)
        self.unembedding = width**-0.5 * jax.random.normal(keys[1], (VOCAB, width))
        self.heads = heads
        self.window = window

    def init_cache(
        self, batch: int, max_length: int
    ) -> tuple[Float[Array, "batch slots 2 heads head"], ...]:
        width = self.embedding.shape[1]
        shape = (batch, max_length, 2, self.heads, width // self.heads)
        return tuple(jnp.zeros(shape, self.embedding.dtype) for _ in self.blocks)

    def __call__(
        self,
        tokens: Int[Array, "batch new"],
        positions: Int[Array, "batch new"],
        mask: Bool[Array, "batch new new"],
        cache: tuple[Float[Array, "batch slots 2 heads head"], ...],
        cache_length: Int[Array, " batch"],
    ) -> tuple[
        Float[Array, "batch new vocab"],
        tuple[Float[Array, "batch slots 2 heads head"], ...],
    ]:
        normed, cache = self.features(tokens, positions, mask, cache, cache_length)
        return normed @ self.unembedding.T, cache

    def features(
        self,
        tokens: Int[Array, "batch new"],
        positions: Int[Array, "batch new"],
        mask: Bool[Array, "batch new new"],
        cache: tuple[Float[Array, "batch slots 2 heads head"], ...],
        cache_length: Int[Array, " batch"],
    ) -> tuple[
        Float[Array, "batch new width"],
        tuple[Float[Array, "batch slots 2 heads head"], ...],
    ]:
        """The call's last hidden states, normed, of which the logits are a linear
        map (`unembedding`), and the cache: the features the demo's draft heads
        read.

        **Arguments:**

        As for `__call__`.

        **Returns:**

        `(features, cache)`: float `(B, K, width)`, and the cache after the call.
        """
        slots = cache_length[:, None] + jnp.arange(tokens.shape[1])
        x = self.embedding[tokens]
        visible = _visible(
            mask, positions, slots, cache_length, cache[0].shape[1], self.window
        )
        written = []
        for block, layer_cache in zip(self.blocks, cache, strict=True):
            x, layer_cache = block(x, positions, layer_cache, slots, visible)
            written.append(layer_cache)
        return jax.vmap(jax.vmap(self.norm))(x), tuple(written)

    def read(
        self, tokens: Int[Array, "batch time"], positions: Int[Array, "batch k"]
    ) -> Float[Array, "batch k vocab"]:
        """The model as a [`speculax.LanguageModel`][]: the whole buffer read in one
        call into an empty cache, each token seeing those before it.

        **Arguments:**

        - `tokens`: integer `(B, T)`, byte tokens in `[0, 256)`.
        - `positions`: integer `(B, K)`, each in `[0, T)`.

        **Returns:**

        Float `(B, K, 256)`: entry `[b, k]` holds the logits of the token after
        `tokens[b, :positions[b, k] + 1]`.
        """
        every = self.read_all(tokens)
        return jnp.take_along_axis(every, positions[..., None], axis=1)

    def read_all(
        self, tokens: Int[Array, "batch time"]
    ) -> Float[Array, "batch time vocab"]:
        """The logits after every token of each row, read in one call into an empty
        cache, each token seeing those before it.

        **Arguments:**

        - `tokens`: integer `(B, T)`, byte tokens in `[0, 256)`.

        **Returns:**

        Float `(B, T, 256)`.
        """
        return self.features_all(tokens) @ self.unembedding.T

    def features_all(
        self, tokens: Int[Array, "batch time"]
    ) -> Float[Array, "batch time width"]:
        """The features (see `features`) of every token of each row, read in one
        call into an empty cache, each token seeing those before it.

        **Arguments:**

        - `tokens`: integer `(B, T)`, byte tokens in `[0, 256)`.

        **Returns:**

        Float `(B, T, width)`.
        """
        batch, time = tokens.shape
        causal = jnp.broadcast_to(
            jnp.tril(jnp.ones((time, time), bool)), (batch, time, time)
        )
        features, _ = self.features(
            tokens,
            jnp.broadcast_to(jnp.arange(time), (batch, time)),
            causal,
            self.init_cache(batch, time),
            jnp.zeros((batch,), jnp.int32),
        )
        return features


@final
class FeatureKeeping(AbstractCachedModel):
    """A `CausalTransformer` that keeps its features (its last hidden states,
    normed) in its cache beside its keys and values, one slot per token, where the
    demo's draft heads read them: the same logits, and a cache `(kv, features)`.

    **Arguments:**

    - `model`: the `CausalTransformer`.
    """

    model: CausalTransformer

    def init_cache(
        self, batch: int, max_length: int
    ) -> tuple[
        tuple[Float[Array, "batch slots 2 heads head"], ...],
        Float[Array, "batch slots width"],
    ]:
        width = self.model.embedding.shape[1]
        features = jnp.zeros((batch, max_length, width), self.model.embedding.dtype)
        return self.model.init_cache(batch, max_length), features

    def __call__(
        self,
        tokens: Int[Array, "batch new"],
        positions: Int[Array, "batch new"],
        mask: Bool[Array, "batch new new"],
        cache: tuple[
            tuple[Float[Array, "batch slots 2 heads head"], ...],
            Float[Array, "batch slots width"],
        ],
        cache_length: Int[Array, " batch"],
    ) -> tuple[
        Float[Array, "batch new vocab"],
        tuple[
            tuple[Float[Array, "batch slots 2 heads head"], ...],
            Float[Array, "batch slots width"],
        ],
    ]:
        kv, features = cache
        normed, kv = self.model.features(tokens, positions, mask, kv, cache_length)
        features = jax.vmap(
            lambda row, new, first: jax.lax.dynamic_update_slice(row, new, (first, 0))
        )(features, normed, cache_length)
        return normed @ self.model.unembedding.T, (kv, features)


def kept_features(
    cache: tuple[tuple[Array, ...], Float[Array, "batch slots width"]],
) -> Float[Array, "batch slots width"]:
    """Where `FeatureKeeping` keeps the features in its cache."""
    return cache[1]


def _visible(
    mask: Bool[Array, "batch new new"],
    positions: Int[Array, "batch new"],
    slots: Int[Array, "batch new"],
    cache_length: Int[Array, " batch"],
    num_slots: int,
    window: int,
) -> Bool[Array, "batch new slots"]:
    """Which slots each new token attends to: those of the history (slot $j$ at
    position $j$) and of the new tokens its mask lets it see, less than `window`
    positions back."""
    every_slot = jnp.arange(num_slots)
    back = positions[:, :, None] - window
    history = (every_slot < cache_length[:, None, None]) & (every_slot > back)
    near = mask & (positions[:, None, :] > back)
    written = (slots[..., None] == every_slot).astype(jnp.float32)
    seen = jnp.einsum("bki,bit->bkt", near.astype(jnp.float32), written) > 0
    return history | seen


def _rotated(
    x: Float[Array, "batch new heads head"], positions: Int[Array, "batch new"]
) -> Float[Array, "batch new heads head"]:
    """Rotary position embedding: each pair of features $(i, i + d/2)$ rotated by
    the position times $10000^{-2i/d}$."""
    half = x.shape[-1] // 2
    frequencies = 10000.0 ** (-jnp.arange(half) / half)
    angles = positions[..., None, None] * frequencies
    first, second = x[..., :half], x[..., half:]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    return jnp.concatenate(
        [first * cos - second * sin, first * sin + second * cos], axis=-1
    )
