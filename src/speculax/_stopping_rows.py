"""One pass over the two rows the step draws from: $p_n$ and $q_n$ of each batch
element, at the stopping position $n$.

The default residual and sampler, and the value checks, need only block sums of
these rows and, afterwards, the entries of one block per row; this module computes
both without materialising a `(batch, vocab)` array. See `docs/performance.md`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._numerics import upcast


def stopping_rows(
    num_accepted: Int[Array, " batch"],
    draft_probs: Float[Array, "batch draft vocab"] | None,
    target_probs: Float[Array, "batch positions vocab"],
) -> tuple[Float[Array, "batch vocab"], Float[Array, "batch vocab"] | None]:
    """Gathers $p_n$ and $q_n$ in their input dtype.

    $q_n$ is `None` when there are no draft positions or no draft distributions
    (deterministic drafts); when $n = G$ it is the last draft row, a stand-in that the
    caller must mask out.
    """
    batch = jnp.arange(num_accepted.shape[0])
    target_row = target_probs[batch, num_accepted]
    if draft_probs is None or draft_probs.shape[1] == 0:
        return target_row, None
    num_draft = draft_probs.shape[1]
    draft_row = draft_probs[batch, jnp.minimum(num_accepted, num_draft - 1)]
    return target_row, draft_row


class RowSummary(eqx.Module):
    """What one pass over the rows $p_n$ and $q_n$ of every batch element yields.

    Blocks are consecutive runs of `block_size` tokens (the last one padded with
    zeros). For valid inputs `excess_block_mass` holds the block sums of the weights
    before the zero-mass fallback: $\\max(p_n - q_n, 0)$, or $p_G$ when $n = G$. A
    negative or non-finite value in $p_n$ makes its block's entry NaN, and one in $q_n$
    while drafting ($n < G$) makes it $+\\infty$: this is how the value checks
    (`check_stopping_rows`) see them, at no extra pass. The block sums of $p_n$,
    needed only by the zero-mass fallback, cost a second pass that runs only when
    some row needs it.
    """

    excess_block_mass: Float[Array, "batch blocks"]
    num_accepted: Int[Array, " batch"]
    drafting: Bool[Array, " batch"]
    draft_probs: Float[Array, "batch draft vocab"] | None
    target_probs: Float[Array, "batch positions vocab"]
    block_size: int = eqx.field(static=True)
    per_row: bool = eqx.field(static=True)

    def fallback_block_mass(
        self, needed: Bool[Array, ""]
    ) -> Float[Array, "batch blocks"]:
        """The block sums of $p_n$ when `needed`, zeros otherwise (without reading the
        rows).
        """
        return jax.lax.cond(
            needed,
            lambda: _row_block_sums(
                self.num_accepted,
                self.drafting,
                self.draft_probs,
                self.target_probs,
                self.block_size,
                self.per_row,
                weights=False,
            ),
            lambda: jnp.zeros_like(self.excess_block_mass),
        )


def stopping_row_summary(
    num_accepted: Int[Array, " batch"],
    draft_probs: Float[Array, "batch draft vocab"] | None,
    target_probs: Float[Array, "batch positions vocab"],
    *,
    block_size: int,
    num_draft_tokens: Int[Array, " batch"] | None = None,
    per_row: bool | None = None,
) -> RowSummary:
    """The block sums of $\\max(p_n - q_n, 0)$ (or $p_G$ when $n = G$) and of $p_n$, in
    one pass over the two rows, reading nothing else.

    The step computes it once and hands it to the value checks and, for the default
    residual and sampler, to the sampling, so that the two rows are read once between
    them.

    **Arguments:**

    - `num_accepted`, `draft_probs`, `target_probs`, `num_draft_tokens`: as for the
        residual. With `draft_probs=None` (deterministic drafts) the summary covers
        $p_n$ alone, enough for the value checks.
    - `block_size`: the number of tokens summed into one block (at most the
        vocabulary size is used).
    - `per_row`: `True` loops over the batch (`lax.map` of `dynamic_slice`s: on XLA
        CPU this is several times faster than a batched gather, whose fused form is
        not vectorised); `False` gathers the rows of the whole batch at once, which
        suits GPUs, where a loop over the batch would run serially. `None` chooses by
        `jax.default_backend()`. Half-precision inputs always take the gather: XLA
        CPU converts a whole half-precision array to float32 before slicing it
        inside a loop, an extra pass and a temporary twice the array's size.

    **Returns:**

    A `RowSummary`.
    """
    if per_row is None:
        per_row = _per_row_default()
    if _half(target_probs, *([] if draft_probs is None else [draft_probs])):
        per_row = False
    num_draft = target_probs.shape[1] - 1
    limit = num_draft if num_draft_tokens is None else num_draft_tokens
    drafting = (num_accepted < limit) & (draft_probs is not None)
    block_size = min(block_size, target_probs.shape[-1])
    excess = _row_block_sums(
        num_accepted,
        drafting,
        draft_probs,
        target_probs,
        block_size,
        per_row,
        weights=True,
    )
    return RowSummary(
        excess, num_accepted, drafting, draft_probs, target_probs, block_size, per_row
    )


def block_excess_rows(
    summary: RowSummary, block_index: Int[Array, " batch"]
) -> tuple[Float[Array, "batch block"], Float[Array, "batch block"]]:
    """The weights $\\max(p_n - q_n, 0)$ (or $p_n$ where not drafting) and $p_n$ inside
    one block per batch element, upcast, zero beyond the vocabulary: $2 \\cdot$
    `block_size` reads per element.
    """
    num_accepted, draft_probs, target_probs = (
        summary.num_accepted,
        summary.draft_probs,
        summary.target_probs,
    )
    block_size = summary.block_size
    batch, positions, vocab = target_probs.shape
    num_draft = positions - 1
    rows = jnp.arange(batch)[:, None]
    token = block_index[:, None] * block_size + jnp.arange(block_size)[None, :]
    inside = token < vocab
    token = jnp.minimum(token, vocab - 1)
    stop = num_accepted[:, None]
    target = upcast(target_probs[rows, stop, token])
    target = jnp.where(inside, target, 0)
    if draft_probs is None or num_draft == 0:
        return target, target
    draft = upcast(draft_probs[rows, jnp.minimum(stop, num_draft - 1), token])
    drafting = summary.drafting[:, None]
    excess = jnp.where(drafting, jnp.maximum(target - draft, 0), target)
    return jnp.where(inside, excess, 0), target


def _row_block_sums(
    num_accepted: Int[Array, " batch"],
    drafting: Bool[Array, " batch"],
    draft_probs: Float[Array, "batch draft vocab"] | None,
    target_probs: Float[Array, "batch positions vocab"],
    block_size: int,
    per_row: bool,
    *,
    weights: bool,
) -> Float[Array, "batch blocks"]:
    """Block sums of the flagged weights (`weights=True`, see `RowSummary`) or of
    $p_n$ (`weights=False`), by a loop over the batch or a batched gather.

    Everything a row needs is one elementwise fusion feeding one reduction, so that
    XLA reads each of the two rows once.
    """
    batch, positions, vocab = target_probs.shape
    num_draft = positions - 1
    num_blocks = -(-vocab // block_size)
    num_full = vocab // block_size

    def block_sums(target_row, draft_row, drafting):
        # Works on (..., vocab) rows; `drafting` broadcasts against them.
        target_row = upcast(target_row)
        if not weights:
            x = target_row
        else:
            x = target_row
            if draft_row is not None:
                draft_row = upcast(draft_row)
                x = jnp.where(drafting, jnp.maximum(target_row - draft_row, 0), x)
                x = jnp.where(drafting & _invalid(draft_row), jnp.inf, x)
            x = jnp.where(_invalid(target_row), jnp.nan, x)
        # The full blocks and the partial last one apart: padding to whole blocks
        # would make XLA CPU take a reduction ten times slower.
        full = x[..., : num_full * block_size]
        sums = jnp.sum(full.reshape(*x.shape[:-1], num_full, block_size), axis=-1)
        if num_full == num_blocks:
            return sums
        tail = jnp.sum(x[..., num_full * block_size :], axis=-1, keepdims=True)
        return jnp.concatenate([sums, tail], axis=-1)

    if per_row and batch > 0:

        def one_row(b):
            # Explicit int32 indices: dynamic_slice wants one index type, and under
            # x64 Python ints would become int64.
            zero = jnp.zeros((), jnp.int32)
            stop = num_accepted[b].astype(jnp.int32)
            target_row = _slice_row(target_probs, b, stop, zero)
            if draft_probs is None or num_draft == 0 or not weights:
                return block_sums(target_row, None, None)
            draft_row = _slice_row(
                draft_probs, b, jnp.minimum(stop, num_draft - 1), zero
            )
            return block_sums(target_row, draft_row, drafting[b])

        return jax.lax.map(one_row, jnp.arange(batch, dtype=jnp.int32))
    target_row, draft_row = stopping_rows(num_accepted, draft_probs, target_probs)
    if not weights:
        draft_row = None
    return block_sums(target_row, draft_row, drafting[:, None])


def _invalid(x: Float[Array, "*shape"]) -> Bool[Array, "*shape"]:
    # Negative, NaN or infinite, in two comparisons (NaN fails both).
    return ~((x >= 0) & (x < jnp.inf))


def _per_row_default() -> bool:
    """The row-access strategy for the backend: a loop over the batch on CPU, a
    batched gather elsewhere (a loop would run serially on a GPU). Tests replace this
    function to run the other strategy on CPU.
    """
    return jax.default_backend() == "cpu"


def _half(*arrays: Array) -> bool:
    return any(x.dtype.itemsize < 4 for x in arrays)


def _slice_row(
    probs: Float[Array, "batch position vocab"],
    b: Int[Array, ""],
    position: Int[Array, ""],
    zero: Int[Array, ""],
) -> Float[Array, " vocab"]:
    """`probs[b, position]` by `dynamic_slice`, upcast."""
    row = jax.lax.dynamic_slice(probs, (b, position, zero), (1, 1, probs.shape[-1]))
    return upcast(row[0, 0])
