from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray


VOCAB = 256
# The embedding of the slots before the start of the buffer.
BEFORE_START = VOCAB


@final
class WindowModel(eqx.Module):
    """A byte-level language model that reads a fixed window of the last tokens: the
    draft and target models of the demo.

    The logits of the token after position $t$ are an MLP of the embeddings of
    tokens $t - w + 1, \\ldots, t$ (window $w$), concatenated; slots before the start
    of the buffer get an embedding of their own. The model is causal by
    construction: it reads no token past the position.

    **Arguments:**

    - `window`: keyword only, $w \\ge 1$, the number of tokens read.
    - `embed_size`: keyword only, the size of each token's embedding.
    - `hidden_size`: keyword only, the width of the MLP's hidden layers.
    - `depth`: keyword only, the number of hidden layers.
    - `key`: keyword only, a PRNG key for the initial weights.
    """

    embedding: eqx.nn.Embedding
    mlp: eqx.nn.MLP
    window: int = eqx.field(static=True)

    def __init__(
        self,
        *,
        window: int,
        embed_size: int,
        hidden_size: int,
        depth: int,
        key: PRNGKeyArray,
    ):
        sizes = {"window": window, "embed_size": embed_size, "hidden_size": hidden_size}
        for name, size in sizes.items():
            if size < 1:
                raise ValueError(f"{name} must be positive; got {size}")
        if depth < 0:
            raise ValueError(f"depth must be non-negative; got {depth}")
        embed_key, mlp_key = jax.random.split(key)
        self.window = window
        self.embedding = eqx.nn.Embedding(VOCAB + 1, embed_size, key=embed_key)
        self.mlp = eqx.nn.MLP(
            window * embed_size,
            VOCAB,
            hidden_size,
            depth,
            activation=jax.nn.gelu,
            key=mlp_key,
        )

    def __call__(
        self, tokens: Int[Array, "batch time"], positions: Int[Array, "batch k"]
    ) -> Float[Array, "batch k vocab"]:
        """The next-token logits at some positions of a batch of token buffers.

        **Arguments:**

        - `tokens`: integer `(B, T)`, byte tokens in `[0, 256)`. Entries past the
            positions asked for are not read, and may hold anything.
        - `positions`: integer `(B, K)`, each in `[0, T)`.

        **Returns:**

        Float32 `(B, K, 256)`: entry `[b, k]` holds the logits of the token that
        follows position `positions[b, k]`, given `tokens[b, :positions[b, k] + 1]`;
        it reads only `tokens[b, i]` for `positions[b, k] - window < i <=
        positions[b, k]`.
        """
        batch, k = positions.shape
        offsets = jnp.arange(1 - self.window, 1, dtype=positions.dtype)
        indices = positions[:, :, None] + offsets  # (B, K, window)
        read = jnp.take_along_axis(
            tokens, jnp.maximum(indices, 0).reshape(batch, -1), axis=1
        ).reshape(indices.shape)
        read = jnp.where(indices < 0, BEFORE_START, read)
        features = self.embedding.weight[read].reshape(batch * k, -1)
        logits = jax.vmap(self.mlp)(features)
        return logits.reshape(batch, k, VOCAB)
