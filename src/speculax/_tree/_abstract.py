"""The tree step's interface and what every tree step shares: the inputs, their
checks, the final draw and the output. See `docs/trees.md`."""

import abc
import functools
from collections.abc import Callable
from typing import TypedDict

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._core._checks import check_static_int
from .._core._failures import (
    RESULTS,
    Failure,
    first_failure,
    not_a_probability,
    outside_unit_interval,
    report_failures,
)
from .._core._numerics import (
    arithmetic_dtype,
    ordered_block_sums,
    upcast,
)
from .._core._row_strategy import rows_one_at_a_time
from .._core._vocab_axis import (
    any_over_vocab,
    first_argmax_over_vocab,
    full_vocab,
    gather_blocks,
    ordered_row_sums,
)
from .._inputs._coercion import coerce_inputs, uniform_reader
from .._inputs._input_array import InputArray
from .._inputs._random import KeyArray
from .._pieces._sampling import AbstractBlockSumSampler, AbstractSampler, block_reader
from .._pieces._stopping_rows import summation_lanes
from ._rows import TreeRows, tree_rows
from ._siblings import AbstractSiblingRule
from ._taken_out import draw_taken_out
from ._walk import TreeWalk, start_walk


class TreeOutput(TypedDict):
    """What one tree verification step returns: a plain `dict` with exactly these
    three keys.

    - `num_accepted`: int32 `(batch,)`, the depth $n$ of the accepted path.
    - `tokens`: int32 `(batch, max_depth + 1)`: the $n$ tokens of the accepted
        path, then the drawn token, then `-1`.
    - `accepted_nodes`: int32 `(batch, max_depth + 1)`: the nodes of the accepted
        path (root excluded), then `-1`; the KV-cache entries an engine keeps.

    Each row's outcome comes beside it from
    [`speculax.AbstractTreeStep.with_result`][], as for the chain step.
    """

    num_accepted: Int[Array, " batch"]
    tokens: Int[Array, "batch depth+1"]
    accepted_nodes: Int[Array, "batch depth+1"]


class AbstractTreeStep(eqx.Module):
    """A verification step over a batch of draft trees: the inputs, their checks,
    the final draw and the output are shared; how a row's tree is walked is each
    step's own.

    Every tree step has a sibling rule (what a rejected child leaves for the
    distributions it was tested against), a sampler, a depth limit, the flags of
    [`speculax.SpeculativeStep`][], and `axis_name`: inside `jax.shard_map`, the
    mesh axis the vocabulary is split over, or `None` (the rows are whole). With
    an axis, the sampler names the same one and the sibling rule is `elementwise`;
    [`speculax.sharded_step`][] sets both. The concrete steps are final.
    """

    siblings: eqx.AbstractVar[AbstractSiblingRule]
    sampler: eqx.AbstractVar[AbstractSampler]
    max_depth: eqx.AbstractVar[int | None]
    check_values: eqx.AbstractVar[bool]
    throw: eqx.AbstractVar[bool]
    axis_name: eqx.AbstractVar[str | None]

    def __check_init__(self):
        if self.max_depth is not None:
            check_static_int("max_depth", self.max_depth, minimum=1)
        if not self.check_values and not self.throw:
            raise ValueError("throw=False needs check_values=True")
        if self.sampler.axis_name != self.axis_name:
            raise ValueError(
                f"the sampler must split the vocabulary over the step's axis_name "
                f"{self.axis_name!r}; got sampler.axis_name "
                f"{self.sampler.axis_name!r}"
            )
        if self.axis_name is not None and not self.siblings.elementwise:
            raise ValueError(
                f"siblings, {type(self.siblings).__name__}, is not elementwise, so "
                "it cannot run on a slice of the vocabulary: axis_name must be None"
            )

    def __call__(
        self,
        parents: InputArray,
        tree_tokens: InputArray,
        draft_probs: InputArray | None,
        target_probs: InputArray,
        accept_uniforms: InputArray | None = None,
        sample_uniforms: InputArray | None = None,
        *,
        key: KeyArray | None = None,
    ) -> TreeOutput:
        """Runs the step on a batch of $B$ trees of up to $N$ draft nodes each, over a
        vocabulary of $V$. Node 0 is the root, the last verified token; the draft
        nodes are $1, \\dots, N$.

        **Arguments:**

        - `parents`: integer `(B, N)`: entry $j - 1$ is the parent of node $j$, in
            `[0, j)` (parents come first), or `-1` for an unused slot.
        - `tree_tokens`: integer `(B, N)`: entry $j - 1$ is the token of node $j$.
        - `draft_probs`: float `(B, N + 1, V)`: row $k$ is the distribution the
            children of node $k$ were drawn from; or `None` for deterministic drafts
            (each child's $q$ its own one-hot).
        - `target_probs`: float `(B, N + 1, V)`: row $k$ is the target distribution
            of the token after the path from the root to node $k$.
        - `accept_uniforms`: float `(B, N)` in `[0, 1)`, the coin of each node.
        - `sample_uniforms`: float `(B,)` in `[0, 1)`, the final draw's.
        - `key`: keyword only, a PRNG key to draw both uniforms from instead.

        **Returns:**

        A [`speculax.TreeOutput`][] dict with exactly the keys `num_accepted`,
        `tokens` and `accepted_nodes`.
        """
        output, _ = self.with_result(
            parents,
            tree_tokens,
            draft_probs,
            target_probs,
            accept_uniforms,
            sample_uniforms,
            key=key,
        )
        return output

    def with_result(
        self,
        parents: InputArray,
        tree_tokens: InputArray,
        draft_probs: InputArray | None,
        target_probs: InputArray,
        accept_uniforms: InputArray | None = None,
        sample_uniforms: InputArray | None = None,
        *,
        key: KeyArray | None = None,
    ) -> tuple[TreeOutput, RESULTS]:
        """Runs the step as [`speculax.AbstractTreeStep.__call__`][] does, and
        returns each row's outcome beside the output, as
        [`speculax.SpeculativeStep.with_result`][] does for chains.

        **Arguments:**

        As for [`speculax.AbstractTreeStep.__call__`][].

        **Returns:**

        A tuple `(output, result)`: the [`speculax.TreeOutput`][] dict, and a
        [`speculax.RESULTS`][] item of shape `(B,)` per row.
        """
        inputs = coerce_inputs(
            tree_tokens,
            draft_probs,
            target_probs,
            accept_uniforms,
            sample_uniforms,
            parents=parents,
        )
        accept_uniforms, sample_uniforms = inputs.uniforms(key, self._uniform_readers)
        # Given parents, coerce_inputs returns them.
        assert inputs.parents is not None
        parents, tree_tokens = inputs.parents, inputs.tokens
        draft_probs, target_probs = inputs.draft, inputs.target
        batch, num_nodes = parents.shape
        max_depth = num_nodes if self.max_depth is None else self.max_depth
        shard_vocab = target_probs.shape[-1]
        vocab = full_vocab(shard_vocab, self.axis_name)

        if batch == 0 or num_nodes == 0:
            # Every walk ends at the root before it starts; and the walks' loops,
            # traced even for no rows or no nodes, would index empty arrays.
            dtype = arithmetic_dtype(draft_probs, target_probs)
            start = start_walk(shard_vocab, dtype, max_depth)
            walks = jax.tree.map(
                lambda x: jnp.broadcast_to(x, (batch, *x.shape)), start
            )
        else:
            rows = tree_rows(
                parents,
                tree_tokens,
                draft_probs if self._reads_draft_probs else None,
                target_probs,
                accept_uniforms,
                most_likely=self._reads_most_likely,
                axis_name=self.axis_name,
            )
            walks = _walk_every_tree(
                lambda b: self._walk(max_depth, parents, rows.row(b)), batch
            )
        drawn, row_failures = self._draw(
            walks, parents, tree_tokens, draft_probs, target_probs, sample_uniforms
        )
        # The path's tokens are -1 past its depth: the drawn token goes at the depth.
        at_depth = jnp.arange(max_depth + 1)[None, :] == walks.depth[:, None]
        failures = []
        if self.check_values:
            failures = _tree_failures(
                parents,
                tree_tokens,
                accept_uniforms,
                sample_uniforms,
                vocab,
                walks,
                row_failures,
                drawn,
            )
        result = first_failure(failures, batch)
        output: TreeOutput = {
            "num_accepted": walks.depth,
            "tokens": jnp.where(at_depth, drawn[:, None], walks.path_tokens),
            "accepted_nodes": walks.path_nodes,
        }
        return report_failures(
            output, result, check_values=self.check_values, throw=self.throw
        )

    @property
    def _uniform_readers(self) -> tuple[str | None, str | None]:
        """What reads `accept_uniforms` and `sample_uniforms`, for drawing them
        (`StepInputs.uniforms`), also where the batch is split over devices."""
        return self._coin_reader, uniform_reader(self.sampler)

    @property
    @abc.abstractmethod
    def _coin_reader(self) -> str | None:
        """What reads `accept_uniforms`, named as an error about missing uniforms
        names it (see `uniform_reader`); `None` where the walk reads no coin."""

    @property
    @abc.abstractmethod
    def _reads_most_likely(self) -> bool:
        """Whether the walk reads each target row's most likely token, found for
        every row once, before the walks."""

    @property
    @abc.abstractmethod
    def _reads_draft_probs(self) -> bool:
        """Whether the walk reads `draft_probs`; where it does not, it walks the
        drafts as deterministic."""

    @property
    @abc.abstractmethod
    def _draws_most_likely(self) -> bool:
        """Whether the final token is the most likely target token of the node the
        walk ended at, whatever its rejected children: greedy verification, which
        reads only which token of a row is most likely, and so takes logits too."""

    @abc.abstractmethod
    def _walk(
        self, max_depth: int, parents: Int[Array, "batch nodes"], rows: TreeRows
    ) -> TreeWalk:
        """The walk over the tree of row `rows.b`, of at least one node, reading the
        arrays of the whole batch in place. `parents` hold -1 for unused slots and
        are otherwise valid where the checks pass (what they return for bad parents
        is discarded); nodes deeper than `max_depth` are ignored.

        **Returns:**

        Where the walk ended: the node whose distribution the final token is drawn
        from, its depth and the path to it, that distribution (`updated`, or the
        node's own target row), and the bad values it met.
        """

    def _draw(
        self,
        walks: TreeWalk,
        parents: Int[Array, "batch nodes"],
        tree_tokens: Int[Array, "batch nodes"],
        draft_probs: Float[Array, "batch positions vocab"] | None,
        target_probs: Float[Array, "batch positions vocab"],
        sample_uniforms: Float[Array, " batch"],
    ) -> tuple[Int[Array, " batch"], list[Failure]]:
        """The final token, from what the rejected children left or from the target
        row of the node the walk ended at (the bonus token), and the checks of the
        weights drawn from: a negative or non-finite value, a total that overflows.

        A sampler that draws from block sums (`AbstractBlockSumSampler`, such as
        [`speculax.InverseCDF`][]) gets the weights summed in the lanes the chain
        step's row summary uses for the same inputs, so that a chain drawn as a
        tree gets the chain step's token even for a uniform on a block's edge.
        """
        batch = target_probs.shape[0]
        own_row = upcast(target_probs[jnp.arange(batch), walks.current])
        draw = functools.partial(
            self._draw_from,
            lanes=summation_lanes(target_probs, draft_probs),
            sample_uniforms=sample_uniforms,
        )
        if self._draws_most_likely:
            # The rejected children, never the most likely token, leave it in place:
            # no row is drawn from, and a row of logits gives the same token.
            drawn, _ = first_argmax_over_vocab(own_row, self.axis_name)
            total = ordered_row_sums(own_row, self.axis_name)
            bad_row = any_over_vocab(
                jnp.any(not_a_probability(own_row), axis=-1), self.axis_name
            )
        elif walks.takes_out:
            # The walk read no row whole: the one drawn from is checked here.
            drawn, total, bad_row = draw_taken_out(
                draw, walks, parents, tree_tokens, own_row, self.axis_name
            )
        else:
            weights = jnp.where(walks.updated[:, None], walks.target, own_row)
            drawn, total = draw(weights)
            # Only the rows as given: a bad value in what the rejected children
            # left came from the node's rows, checked at its first loss, and
            # named there (a NaN in q leaves NaN in the target drawn from).
            bad_row = ~walks.updated & any_over_vocab(
                jnp.any(not_a_probability(weights), axis=-1), self.axis_name
            )
        failures = [
            (walks.bad_target_row | bad_row, RESULTS.bad_target_row),
            (walks.bad_draft_row, RESULTS.bad_draft_row),
            (walks.overflow | jnp.isinf(total), RESULTS.target_row_overflows),
        ]
        return drawn, failures

    def _draw_from(
        self,
        weights: Float[Array, "batch vocab"],
        *,
        lanes: int,
        sample_uniforms: Float[Array, " batch"],
    ) -> tuple[Int[Array, " batch"], Float[Array, " batch"]]:
        """The token the sampler draws from each row of `weights`, and the row's
        total, summed in `lanes` lanes for a sampler that draws from block sums."""
        shard_vocab = weights.shape[-1]
        if isinstance(self.sampler, AbstractBlockSumSampler):
            # The draw's block sums serve the overflow check too: summing the rows
            # apart would cost two (B, V) temporaries.
            block_size = min(self.sampler.block_size, shard_vocab)
            block_mass = ordered_block_sums(weights, block_size, lanes)
            blocks = gather_blocks(block_mass, self.axis_name)
            total = ordered_block_sums(blocks, blocks.shape[-1], lanes=8)[:, 0]
            drawn = self.sampler.draw_from_block_sums(
                block_mass,
                block_reader(weights, block_size),
                block_size,
                shard_vocab,
                sample_uniforms,
            )
            return drawn, total
        total = ordered_row_sums(weights, self.axis_name)
        drawn = self.sampler(weights, sample_uniforms)
        return drawn, total[..., 0] if total.ndim > 1 else total


def _walk_every_tree(
    one_tree: Callable[[Int[Array, ""]], TreeWalk], batch: int
) -> TreeWalk:
    """The walks of the `batch` rows' trees, `one_tree` taking a row's index, as the
    row strategy in force (`rows_one_at_a_time`) chooses. One at a time, a loop over
    the row indices with the arrays read in place (looping over the rows themselves
    would copy each tree's `(N + 1, V)` slab), so that each row's work follows its
    own path. All at once, the walk batched over the rows: its conditionals become
    selects that compute both sides, and its loops run until every row is done, but
    nothing runs serially row after row, which on an accelerator would cost the
    whole batch's time per row. Each row's answer is the same to the last bit."""
    rows = jnp.arange(batch, dtype=jnp.int32)
    if rows_one_at_a_time():
        return jax.lax.map(one_tree, rows)
    return jax.vmap(one_tree)(rows)


def _tree_failures(
    parents: Int[Array, "batch nodes"],
    tree_tokens: Int[Array, "batch nodes"],
    accept_uniforms: Float[Array, "batch nodes"],
    sample_uniforms: Float[Array, " batch"],
    vocab: int,
    walks: TreeWalk,
    row_failures: list[Failure],
    drawn: Int[Array, " batch"],
) -> list[Failure]:
    """The value checks, in the order of `speculax.RESULTS`."""
    num_nodes = parents.shape[1]
    node = jnp.arange(1, num_nodes + 1)[None, :]
    used = parents >= 0
    parent_used = jnp.take_along_axis(
        jnp.concatenate([jnp.ones_like(used[:, :1]), used], axis=1),
        jnp.clip(parents, 0, num_nodes),
        axis=1,
    )
    bad_parent = (parents < -1) | (parents >= node) | (used & ~parent_used)
    return [
        (jnp.any(bad_parent, axis=1), RESULTS.bad_parents),
        (
            jnp.any(used & ((tree_tokens < 0) | (tree_tokens >= vocab)), axis=1),
            RESULTS.tree_token_out_of_range,
        ),
        (
            jnp.any(used & outside_unit_interval(accept_uniforms), axis=1),
            RESULTS.accept_uniform_out_of_range,
        ),
        (outside_unit_interval(sample_uniforms), RESULTS.sample_uniform_out_of_range),
        (walks.bad_target, RESULTS.bad_target_prob_at_draft_token),
        (walks.bad_draft, RESULTS.bad_draft_prob_at_draft_token),
        *row_failures,
        ((drawn < 0) | (drawn >= vocab), RESULTS.no_mass),
    ]
