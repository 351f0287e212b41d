"""`speculax bench`: the default step against the obvious implementation and the floor.

Three jitted functions run side by side in one process on the same inputs:

- **baseline**: the obvious implementation, written for the benchmark: the residual for
    all $G + 1$ positions, normalised, `jnp.cumsum` along the vocabulary, then the
    row $n$ selected.
- **speculax**: `jax.jit(speculax.SpeculativeStep())`, value checks on.
- **floor**: a function that only reads what the step must read, two `V`-long rows per
    batch element: the sums of `p[:, 0]` and `q[:, 0]` taken from contiguous `(B, V)`
    arrays. No implementation of the step can beat it by much.

Two variants compare against what a user would otherwise run:

- **deterministic** drafts (`draft_probs=None`): the baseline is the same default step
    given the drafts as an explicit one-hot `draft_probs`; the floor reads one row,
    $p_n$.
- **greedy** verification (`greedy_step()`): the baseline is a plain argmax
    verification written in JAX (`jnp.argmax` over every target row); the floor is one
    flat sum over all of `target_probs`, which greedy verification must read.

And one for trees:

- **tree**: `TreeStep()` on an EAGLE-2-like tree of $G$ draft nodes in levels of
    ten (ten children of the root; at each level the four most likely nodes have 4,
    3, 2 and 1 children), the children drawn independently from their parent's
    draft row. The baseline is the same walk written the obvious way, vectorised over
    the batch, every node updating `(B, V)` arrays by `jnp.where`; the floor reads
    the target and draft rows of one root-to-leaf path per tree.
- **deterministic-tree**: `TreeStep()` on the same trees given no draft
    probabilities (`draft_probs=None`, the target-only rule), where a rejection takes
    its token out of the target row. The baseline is the same step with the same
    rule called on whole rows at every rejection, as the walk did before; the floor
    reads the target rows of one root-to-leaf path per tree.
- **greedy-tree**: `greedy_tree_step()` on the same trees, against `TreeStep()` on
    target-only trees given the one-hot rows of the most likely tokens, made by
    `jax.nn.one_hot` as a user would; the floor is one flat sum over all of
    `target_probs`, whose every row greedy verification reads for its most likely
    token.

Two measure what keeping more tokens costs, against the rule it replaces as the
baseline (a ratio below 1: the baseline is the cheaper one):

- **block**: `block_step()`, whose test reads every row, against the default
    token-by-token step; the floor is one flat sum over all of `draft_probs` and
    `target_probs`, which block verification must read.
- **traversal**: `TraversalStep(max_depth=...)` on the tree variant's trees, with
    `max_depth` their depth, against `TreeStep()`; the floor is the tree
    variant's.

Two verify from logits, with sampling parameters of one value per row, against
[`speculax.probs_from_logits`][] on both arrays followed by the default step (the
same parameters) as the baseline; the floor is one flat sum over both arrays of
logits, which the step must read whole for the normalisers:

- **logits**: `LogitsStep()` with a temperature per row, no truncation.
- **truncated**: the same with a top-$k$ and a top-$p$ per row as well.

Every floor is a flat sum of the arrays it names, each copied first to be
contiguous: on XLA CPU the fastest read of a given set of bytes found (a sum per row
took 2.5 times as long, a flat maximum 1.25 times).
"""

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, final

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._chain._step import SpeculativeStep, StepOutput, block_step, greedy_step
from .._logits._probs import probs_from_logits
from .._logits._step import LogitsStep
from .._tree._abstract import TreeOutput
from .._tree._recursive import TreeStep, greedy_tree_step
from .._tree._siblings import AbstractSiblingRule, IndependentSiblings
from .._tree._traversal import TraversalStep
from ._compiled import compile_cold


@dataclasses.dataclass(frozen=True)
class Size:
    """One benchmark configuration."""

    batch: int
    num_draft: int
    vocab: int
    dtype: str = "float32"
    variant: str = "default"

    @classmethod
    def parse(cls, text: str) -> "Size":
        """Parses `BxGxV`, optionally followed by `:dtype` and `:variant` in either
        order, e.g. `64x5x128256:bfloat16` or `64x5x128256:greedy`.
        """
        shape, *options = text.split(":")
        try:
            batch, num_draft, vocab = (int(part) for part in shape.split("x"))
        except ValueError:
            raise ValueError(
                f"a size must look like BxGxV[:dtype][:variant]; got {text!r}"
            ) from None
        dtypes = [option for option in options if option not in VARIANTS]
        variants = [option for option in options if option in VARIANTS]
        if len(dtypes) > 1 or len(variants) > 1:
            raise ValueError(f"at most one dtype and one variant; got {text!r}")
        dtype = dtypes[0] if dtypes else "float32"
        if dtype not in DTYPES:
            raise ValueError(
                f"dtype must be one of {', '.join(DTYPES)}, and a variant one of "
                f"{', '.join(VARIANTS)}; got {dtype!r}"
            )
        if batch < 1 or num_draft < 1 or vocab < 1:
            raise ValueError(f"B, G and V must be positive; got {text!r}")
        return cls(
            batch, num_draft, vocab, dtype, variants[0] if variants else "default"
        )

    def __str__(self) -> str:
        text = f"{self.batch}x{self.num_draft}x{self.vocab}:{self.dtype}"
        return text if self.variant == "default" else f"{text}:{self.variant}"


DTYPES = ("float32", "bfloat16", "float16")
VARIANTS = (
    "default",
    "deterministic",
    "greedy",
    "tree",
    "deterministic-tree",
    "greedy-tree",
    "block",
    "traversal",
    "logits",
    "truncated",
)
TREE_VARIANTS = ("tree", "deterministic-tree", "greedy-tree", "traversal")
LOGITS_VARIANTS = ("logits", "truncated")


DEFAULT_SIZES = (
    Size(1, 4, 32000),
    Size(8, 8, 50257),
    Size(64, 5, 128256),
    Size(64, 5, 128256, "bfloat16"),
    Size(8, 4, 262144),
    Size(64, 5, 128256, variant="deterministic"),
    Size(64, 5, 128256, variant="greedy"),
    Size(8, 60, 128256, variant="tree"),
    Size(8, 60, 128256, variant="deterministic-tree"),
    Size(8, 60, 128256, variant="greedy-tree"),
    Size(64, 5, 128256, variant="block"),
    Size(8, 60, 128256, variant="traversal"),
    Size(64, 5, 128256, variant="logits"),
    Size(64, 5, 128256, "bfloat16", variant="logits"),
    Size(64, 5, 128256, variant="truncated"),
)


def make_inputs(size: Size, seed: int = 0) -> tuple[Array, ...]:
    """Random realistic inputs: peaked target distributions (softmax of logits with
    standard deviation 2), draft distributions a perturbed copy of them, draft tokens
    sampled from the drafts, and uniform noise.

    **Returns:**

    `(draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms)`,
    the probabilities in `size.dtype`.
    """
    batch, num_draft, vocab = size.batch, size.num_draft, size.vocab
    dtype = jnp.dtype(size.dtype)

    @jax.jit
    def make(key):
        keys = jax.random.split(key, 5)
        target_logits = 2.0 * jax.random.normal(keys[0], (batch, num_draft + 1, vocab))
        draft_logits = target_logits[:, :num_draft] + 0.5 * jax.random.normal(
            keys[1], (batch, num_draft, vocab)
        )
        draft_tokens = jax.random.categorical(keys[2], draft_logits, axis=-1)
        return (
            draft_tokens.astype(jnp.int32),
            jax.nn.softmax(draft_logits, axis=-1).astype(dtype),
            jax.nn.softmax(target_logits, axis=-1).astype(dtype),
            jax.random.uniform(keys[3], (batch, num_draft)),
            jax.random.uniform(keys[4], (batch,)),
        )

    return jax.block_until_ready(make(jax.random.key(seed)))


def make_logits_inputs(size: Size, seed: int = 0) -> tuple[Array, ...]:
    """Inputs of the logits variants: the logits of `make_inputs` in `size.dtype`,
    draft tokens drawn from the untruncated drafts, and one temperature per row in
    `[0.5, 1.2]`; for the truncated variant also a top-$k$ per row in `[20, 100]` and
    a top-$p$ in `[0.8, 0.95]`, else none (0 and 1).

    **Returns:**

    `(draft_tokens, draft_logits, target_logits, accept_uniforms, sample_uniforms,
    temperature, top_k, top_p)`.
    """
    batch, num_draft, vocab = size.batch, size.num_draft, size.vocab
    dtype = jnp.dtype(size.dtype)
    truncated = size.variant == "truncated"

    @jax.jit
    def make(key):
        keys = jax.random.split(key, 8)
        target_logits = 2.0 * jax.random.normal(keys[0], (batch, num_draft + 1, vocab))
        draft_logits = target_logits[:, :num_draft] + 0.5 * jax.random.normal(
            keys[1], (batch, num_draft, vocab)
        )
        draft_tokens = jax.random.categorical(keys[2], draft_logits, axis=-1)
        top_k = jax.random.randint(keys[6], (batch,), 20, 101)
        top_p = jax.random.uniform(keys[7], (batch,), minval=0.8, maxval=0.95)
        return (
            draft_tokens.astype(jnp.int32),
            draft_logits.astype(dtype),
            target_logits.astype(dtype),
            jax.random.uniform(keys[3], (batch, num_draft)),
            jax.random.uniform(keys[4], (batch,)),
            jax.random.uniform(keys[5], (batch,), minval=0.5, maxval=1.2),
            jnp.where(truncated, top_k, 0).astype(jnp.int32),
            jnp.where(truncated, top_p, 1.0),
        )

    return jax.block_until_ready(make(jax.random.key(seed)))


def verify_from_logits(
    draft_tokens: Int[Array, "batch draft"],
    draft_logits: Float[Array, "batch draft vocab"],
    target_logits: Float[Array, "batch positions vocab"],
    accept_uniforms: Float[Array, "batch draft"],
    sample_uniforms: Float[Array, " batch"],
    temperature: Float[Array, " batch"],
    top_k: Int[Array, " batch"],
    top_p: Float[Array, " batch"],
) -> StepOutput:
    """`LogitsStep()` with the parameters as positional arguments."""
    return LogitsStep()(
        draft_tokens,
        draft_logits,
        target_logits,
        accept_uniforms,
        sample_uniforms,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    )


def verify_through_probs(
    draft_tokens: Int[Array, "batch draft"],
    draft_logits: Float[Array, "batch draft vocab"],
    target_logits: Float[Array, "batch positions vocab"],
    accept_uniforms: Float[Array, "batch draft"],
    sample_uniforms: Float[Array, " batch"],
    temperature: Float[Array, " batch"],
    top_k: Int[Array, " batch"],
    top_p: Float[Array, " batch"],
) -> StepOutput:
    """What a user does without `LogitsStep`: `probs_from_logits` on both arrays,
    then the default step."""
    probs = functools.partial(
        probs_from_logits, temperature=temperature, top_k=top_k, top_p=top_p
    )
    return SpeculativeStep()(
        draft_tokens,
        probs(draft_logits),
        probs(target_logits),
        accept_uniforms,
        sample_uniforms,
    )


def eagle_tree(num_nodes: int) -> list[int]:
    """The parents of an EAGLE-2-like tree of `num_nodes` draft nodes, level by level
    in levels of ten: ten children of the root, then at each level the first four
    nodes have 4, 3, 2 and 1 children (the most likely ones expanded most)."""
    parents: list[int] = []
    level = [0]
    while len(parents) < num_nodes:
        if level == [0]:
            fanout = [(0, 10)]
        else:
            fanout = list(zip(level[:4], (4, 3, 2, 1), strict=False))
        next_level = []
        for parent, count in fanout:
            for _ in range(count):
                if len(parents) < num_nodes:
                    parents.append(parent)
                    next_level.append(len(parents))
        level = next_level
    return parents


def make_tree_inputs(size: Size, seed: int = 0) -> tuple[Array, ...]:
    """Inputs of the tree variant: `eagle_tree(size.num_draft)`, target and draft
    rows for every node as in `make_inputs`, each node's token drawn from its
    parent's draft row.

    **Returns:**

    `(parents, tree_tokens, draft_probs, target_probs, accept_uniforms,
    sample_uniforms)`.
    """
    batch, num_nodes, vocab = size.batch, size.num_draft, size.vocab
    parents = jnp.tile(jnp.asarray(eagle_tree(num_nodes), jnp.int32), (batch, 1))

    @jax.jit
    def make(key):
        keys = jax.random.split(key, 5)
        shape = (batch, num_nodes + 1, vocab)
        target_logits = 2.0 * jax.random.normal(keys[0], shape)
        draft_logits = target_logits + 0.5 * jax.random.normal(keys[1], shape)
        parent_logits = jnp.take_along_axis(draft_logits, parents[:, :, None], axis=1)
        tree_tokens = jax.random.categorical(keys[2], parent_logits, axis=-1)
        return (
            parents,
            tree_tokens.astype(jnp.int32),
            jax.nn.softmax(draft_logits, axis=-1),
            jax.nn.softmax(target_logits, axis=-1),
            jax.random.uniform(keys[3], (batch, num_nodes)),
            jax.random.uniform(keys[4], (batch,)),
        )

    return jax.block_until_ready(make(jax.random.key(seed)))


def baseline_tree_step(
    parents: Int[Array, "batch nodes"],
    tree_tokens: Int[Array, "batch nodes"],
    draft_probs: Float[Array, "batch positions vocab"],
    target_probs: Float[Array, "batch positions vocab"],
    accept_uniforms: Float[Array, "batch nodes"],
    sample_uniforms: Float[Array, " batch"],
) -> dict[str, Array]:
    """The tree walk written the obvious way: one loop over the nodes for the whole
    batch, every node gathering each row's current target and draft rows and
    updating `(B, V)` arrays with `jnp.where`, then `jnp.cumsum` for the draw.
    Independent drafts; the same answers as `TreeStep()` up to rounding."""
    batch, num_nodes = parents.shape
    rows = jnp.arange(batch)

    def visit(j, state):
        current, depth, p, q, path = state
        token = tree_tokens[:, j]
        is_child = parents[:, j] == current
        p_x = jnp.take_along_axis(p, token[:, None], axis=1)[:, 0]
        q_x = jnp.take_along_axis(q, token[:, None], axis=1)[:, 0]
        passed = is_child & (accept_uniforms[:, j] * q_x < p_x)
        rejected = is_child & ~passed
        residual = jnp.maximum(p - q, 0)
        mass = jnp.sum(residual, axis=-1, keepdims=True)
        residual = jnp.where(mass > 0, residual / mass, target_probs[rows, current])
        p = jnp.where(rejected[:, None], residual, p)
        p = jnp.where(passed[:, None], target_probs[rows, j + 1], p)
        q = jnp.where(passed[:, None], draft_probs[rows, j + 1], q)
        path = jnp.where(
            passed[:, None] & (jnp.arange(path.shape[1]) == depth[:, None]),
            token[:, None],
            path,
        )
        current = jnp.where(passed, j + 1, current)
        return current, depth + passed, p, q, path

    start = (
        jnp.zeros(batch, jnp.int32),
        jnp.zeros(batch, jnp.int32),
        target_probs[:, 0],
        draft_probs[:, 0],
        jnp.full((batch, num_nodes + 1), -1, jnp.int32),
    )
    _, depth, p, _, path = jax.lax.fori_loop(0, num_nodes, visit, start)
    cdf = jnp.cumsum(p / jnp.sum(p, axis=-1, keepdims=True), axis=-1)
    drawn = jnp.argmax(cdf > sample_uniforms[:, None], axis=-1).astype(jnp.int32)
    tokens = jnp.where(
        jnp.arange(num_nodes + 1) == depth[:, None], drawn[:, None], path
    )
    return {"num_accepted": depth, "tokens": tokens}


def baseline_step(
    draft_tokens: Int[Array, "batch draft"],
    draft_probs: Float[Array, "batch draft vocab"],
    target_probs: Float[Array, "batch draft+1 vocab"],
    accept_uniforms: Float[Array, "batch draft"],
    sample_uniforms: Float[Array, " batch"],
) -> dict[str, Array]:
    """The obvious implementation: the residual at every position, normalised, a
    `jnp.cumsum` over the whole vocabulary, then row $n$ selected. Same outputs as
    the step for valid inputs, up to float32 rounding of its sequential cumulative sum.
    """
    draft_probs = draft_probs.astype(jnp.float32)
    target_probs = target_probs.astype(jnp.float32)
    batch, num_draft, _ = draft_probs.shape
    index = draft_tokens[..., None]
    p_x = jnp.take_along_axis(target_probs[:, :num_draft], index, axis=-1)[..., 0]
    q_x = jnp.take_along_axis(draft_probs, index, axis=-1)[..., 0]
    passed = accept_uniforms * q_x < p_x
    num_accepted = jnp.sum(jnp.cumprod(passed.astype(jnp.int32), axis=-1), axis=-1)

    residual = jnp.maximum(target_probs[:, :num_draft] - draft_probs, 0)
    residual = jnp.concatenate([residual, target_probs[:, num_draft:]], axis=1)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(mass > 0, residual, target_probs)
    cdf = jnp.cumsum(residual / jnp.sum(residual, axis=-1, keepdims=True), axis=-1)
    rows = jnp.arange(batch)
    cdf_n = cdf[rows, num_accepted]
    positive = residual[rows, num_accepted] > 0
    hit = (cdf_n > sample_uniforms[:, None]) & positive
    last_positive = positive.shape[-1] - 1 - jnp.argmax(positive[:, ::-1], axis=-1)
    drawn = jnp.where(jnp.any(hit, axis=-1), jnp.argmax(hit, axis=-1), last_positive)

    position = jnp.arange(num_draft + 1)[None, :]
    stop = num_accepted[:, None]
    padded = jnp.concatenate(
        [draft_tokens.astype(jnp.int32), jnp.full((batch, 1), -1, jnp.int32)], axis=1
    )
    tokens = jnp.where(
        position < stop, padded, jnp.where(position == stop, drawn[:, None], -1)
    )
    return {"num_accepted": num_accepted.astype(jnp.int32), "tokens": tokens}


def floor(*arrays: Float[Array, "..."]) -> Float[Array, ""]:
    """Reads the given arrays once and nothing else (a flat sum of each): given the
    rows a step must read, the least any implementation of it can read.
    """
    total = jnp.zeros((), jnp.float32)
    for array in arrays:
        total = total + jnp.sum(array.astype(jnp.float32))
    return total


def argmax_verification(
    draft_tokens: Int[Array, "batch draft"],
    target_probs: Float[Array, "batch draft+1 vocab"],
) -> dict[str, Array]:
    """Greedy verification as one would write it in JAX: `jnp.argmax` over every
    target row, the drafts kept up to the first that is not the argmax, then the
    argmax at that position."""
    batch, num_draft = draft_tokens.shape
    argmax = jnp.argmax(target_probs, axis=-1).astype(jnp.int32)
    matches = argmax[:, :num_draft] == draft_tokens
    num_accepted = jnp.sum(jnp.cumprod(matches.astype(jnp.int32), axis=-1), axis=-1)
    drawn = jnp.take_along_axis(argmax, num_accepted[:, None], axis=1)
    position = jnp.arange(num_draft + 1)[None, :]
    stop = num_accepted[:, None]
    padded = jnp.concatenate(
        [draft_tokens, jnp.full((batch, 1), -1, jnp.int32)], axis=1
    )
    tokens = jnp.where(position < stop, padded, jnp.where(position == stop, drawn, -1))
    return {"num_accepted": num_accepted, "tokens": tokens}


def step_functions(
    size: Size, inputs: tuple[Array, ...]
) -> tuple[Callable, tuple, Callable, tuple, tuple]:
    """The step, the baseline and the floor of a size's variant, each with its
    arguments."""
    if size.variant in TREE_VARIANTS:
        path = _root_to_leaf(eagle_tree(size.num_draft))
        path_rows = (inputs[3][:, jnp.asarray(path)], inputs[2][:, jnp.asarray(path)])
        if size.variant == "traversal":
            depth = len(path) - 1
            return TraversalStep(max_depth=depth), inputs, TreeStep(), inputs, path_rows
        target_only = (*inputs[:2], *inputs[3:])
        if size.variant == "deterministic-tree":
            step, on_rows = _target_only(TreeStep()), _target_only(_ON_ROWS)
            return step, target_only, on_rows, target_only, path_rows[:1]
        if size.variant == "greedy-tree":
            greedy = _target_only(greedy_tree_step())
            return greedy, target_only, _on_one_hot_rows, target_only, inputs[3:4]
        return TreeStep(), inputs, baseline_tree_step, inputs, path_rows
    if size.variant in LOGITS_VARIANTS:
        every_logit = inputs[1:3]
        return verify_from_logits, inputs, verify_through_probs, inputs, every_logit
    draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms = inputs
    row_copies = (target_probs[:, 0], draft_probs[:, 0])
    if size.variant == "deterministic":
        one_hot = jax.nn.one_hot(draft_tokens, size.vocab, dtype=target_probs.dtype)
        explicit = (draft_tokens, one_hot, *inputs[2:])
        return (
            lambda tokens, p, u, s: SpeculativeStep()(tokens, None, p, u, s),
            (draft_tokens, target_probs, accept_uniforms, sample_uniforms),
            SpeculativeStep(),
            explicit,
            row_copies[:1],
        )
    if size.variant == "greedy":
        return (
            lambda tokens, p: greedy_step()(tokens, None, p),
            (draft_tokens, target_probs),
            argmax_verification,
            (draft_tokens, target_probs),
            (target_probs,),
        )
    if size.variant == "block":
        every_row = (draft_probs, target_probs)
        return block_step(), inputs, SpeculativeStep(), inputs, every_row
    return SpeculativeStep(), inputs, baseline_step, inputs, row_copies


@final
class _SiblingsOnRows(AbstractSiblingRule):
    """[`speculax.IndependentSiblings`][] called on whole rows at every rejection,
    deterministic drafts included: the target-only walk before it took tokens out."""

    takes_out_one_hot_drafts: ClassVar[bool] = False
    subtracts_a_kept_draft: ClassVar[bool] = True
    elementwise: ClassVar[bool] = True

    def __call__(
        self,
        target: Float[Array, " vocab"],
        draft: Float[Array, " vocab"],
        rejected: Int[Array, ""],
    ) -> tuple[Float[Array, " vocab"], Float[Array, " vocab"]]:
        return IndependentSiblings()(target, draft, rejected)


_ON_ROWS = TreeStep(_SiblingsOnRows())


def _target_only(step: TreeStep) -> Callable[..., TreeOutput]:
    """`step` called on target-only trees, without `draft_probs`."""

    def call(parents, tree_tokens, target_probs, accept_uniforms, sample_uniforms):
        return step(
            parents, tree_tokens, None, target_probs, accept_uniforms, sample_uniforms
        )

    return call


def _on_one_hot_rows(
    parents: Int[Array, "batch nodes"],
    tree_tokens: Int[Array, "batch nodes"],
    target_probs: Float[Array, "batch positions vocab"],
    accept_uniforms: Float[Array, "batch nodes"],
    sample_uniforms: Float[Array, " batch"],
) -> TreeOutput:
    """Greedy tree verification as one would write it without its own step:
    `TreeStep()` on target-only trees given the one-hot rows of the most likely
    tokens."""
    most_likely = jnp.argmax(target_probs, axis=-1)
    one_hot = jax.nn.one_hot(most_likely, target_probs.shape[-1], dtype=jnp.float32)
    return TreeStep()(
        parents, tree_tokens, None, one_hot, accept_uniforms, sample_uniforms
    )


def _root_to_leaf(parents: list[int]) -> list[int]:
    """The nodes of the path from the root to the first deepest node."""
    depth = [0]
    for parent in parents:
        depth.append(depth[parent] + 1)
    node = depth.index(max(depth))
    path = [node]
    while node:
        node = parents[node - 1]
        path.append(node)
    return path[::-1]


def make_size_inputs(size: Size, seed: int = 0) -> tuple[Array, ...]:
    """The inputs of `size`'s variant: `make_tree_inputs`, `make_logits_inputs` or
    `make_inputs`."""
    if size.variant in TREE_VARIANTS:
        return make_tree_inputs(size, seed)
    if size.variant in LOGITS_VARIANTS:
        return make_logits_inputs(size, seed)
    return make_inputs(size, seed)


def bench_size(size: Size, repeats: int = 7, seed: int = 0) -> dict[str, Any]:
    """Times the baseline, the default step and the floor on one size, in one process
    on the same inputs, and reports medians.

    **Returns:**

    A dict with the size, `baseline_ms`, `speculax_ms`, `floor_ms`, `speedup`
    (baseline over speculax), `over_floor` (speculax over floor), `temp_bytes`,
    `trace_s`, `compile_s` and `hlo_chars` of the step (a cold start: see
    `compile_cold`), and `temp_limit_bytes` ($2 B V \\cdot 4$ bytes plus
    1 MiB; $4 B V \\cdot 4$ for the tree variants).
    """
    tree = size.variant in TREE_VARIANTS
    logits = size.variant in LOGITS_VARIANTS
    inputs = make_size_inputs(size, seed)
    step_fn, step_args, baseline_fn, baseline_args, rows = step_functions(size, inputs)
    # Copies, so that the floor reads contiguous arrays.
    rows = jax.block_until_ready(tuple(jnp.array(row, copy=True) for row in rows))

    step, cost = compile_cold(step_fn, *step_args)
    baseline = jax.jit(baseline_fn).lower(*baseline_args).compile()
    floor_fn = jax.jit(floor).lower(*rows).compile()
    times: dict[str, list[float]] = {"baseline": [], "speculax": [], "floor": []}

    def timed(name: str, function: Callable, args: tuple[Array, ...]) -> None:
        start = time.perf_counter()
        jax.block_until_ready(function(*args))
        times[name].append(1e3 * (time.perf_counter() - start))

    # The baseline runs alone first, after two untimed calls. It streams through
    # gigabytes of temporaries, after which any function runs up to 3 times slower for
    # a while (caches, TLB, page faults, idle worker threads); the step and the floor
    # are warmed up past that, then timed in alternation, call by call, so that a
    # change in the machine's speed (a shared CPU) reaches both alike.
    for _ in range(2):
        jax.block_until_ready(baseline(*baseline_args))
    for _ in range(repeats):
        timed("baseline", baseline, baseline_args)
    for _ in range(3):
        jax.block_until_ready(step(*step_args))
        jax.block_until_ready(floor_fn(*rows))
    for _ in range(repeats):
        timed("speculax", step, step_args)
        timed("floor", floor_fn, rows)
    ms = {name: statistics.median(values) for name, values in times.items()}
    return {
        "size": str(size),
        "batch": size.batch,
        "num_draft": size.num_draft,
        "vocab": size.vocab,
        "dtype": size.dtype,
        "variant": size.variant,
        "baseline_ms": ms["baseline"],
        "speculax_ms": ms["speculax"],
        "floor_ms": ms["floor"],
        "speedup": ms["baseline"] / ms["speculax"],
        "over_floor": ms["speculax"] / ms["floor"],
        "temp_bytes": cost.temp_bytes,
        # The tree steps keep each row's two V-wide distributions and draw from a
        # third, and the logits step makes the two rows it draws from: a few (B, V)
        # rows, where the chain step needs at most two.
        "temp_limit_bytes": (4 if tree or logits else 2) * size.batch * size.vocab * 4
        + 2**20,
        "trace_s": cost.trace_s,
        "compile_s": cost.compile_s,
        "hlo_chars": cost.hlo_chars,
    }


def run_bench(
    sizes: Sequence[Size] = DEFAULT_SIZES,
    repeats: int = 7,
    seed: int = 0,
    *,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """`bench_size` for every size, in order; `progress`, if given, is called with a
    line of text as each size starts and as it ends."""
    results = []
    for number, size in enumerate(sizes, start=1):
        count = f"speculax bench: [{number}/{len(sizes)}] {size}"
        if progress is not None:
            progress(f"{count}: timing ...")
        start = time.perf_counter()
        result = bench_size(size, repeats, seed)
        results.append(result)
        if progress is not None:
            progress(
                f"{count}: {result['speculax_ms']:.2f} ms, "
                f"{result['over_floor']:.2f}x the floor, "
                f"{result['speedup']:.1f}x the baseline "
                f"({time.perf_counter() - start:.1f} s)"
            )
    return results


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """Two Markdown tables of the results of `run_bench`, each narrow enough for a
    page: the step's time and its two ratios, then the times behind the ratios, the
    temporary memory and the time to trace and compile the step from a cold start
    (its HLO size is in the JSON and the compile-cost table)."""
    size = [
        f"| {r['batch']}x{r['num_draft']}x{r['vocab']} | {r['dtype']} | {r['variant']} "
        for r in results
    ]
    # The two ratios first: they are the point; the times behind them follow.
    ratios = (
        "| size | dtype | variant | speculax / floor | baseline / speculax "
        "| speculax ms |\n"
        "|:---|:---|:---|---:|---:|---:|\n"
    ) + "\n".join(
        f"{s}| {r['over_floor']:.2f}x | {r['speedup']:.1f}x | {r['speculax_ms']:.2f} |"
        for s, r in zip(size, results, strict=True)
    )
    details = (
        "| size | dtype | variant | floor ms | baseline ms | temp bytes "
        "| trace + compile s |\n"
        "|:---|:---|:---|---:|---:|---:|---:|\n"
    ) + "\n".join(
        f"{s}| {r['floor_ms']:.2f} | {r['baseline_ms']:.2f} "
        f"| {r['temp_bytes']:,} | {r['trace_s'] + r['compile_s']:.2f} |"
        for s, r in zip(size, results, strict=True)
    )
    return f"{ratios}\n\n{details}"


def json_report(
    results: Sequence[dict[str, Any]],
    repeats: int,
    compile_costs: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """What `speculax bench --json` prints: the backend, its devices, JAX's version,
    the number of timed runs, the results of `run_bench` and those of
    `run_compile_costs` (`compile`)."""
    return {
        "backend": jax.default_backend(),
        "devices": [str(device) for device in jax.devices()],
        "jax_version": jax.__version__,
        "repeats": repeats,
        "results": list(results),
        "compile": list(compile_costs),
    }


__all__ = [
    "DEFAULT_SIZES",
    "Size",
    "baseline_step",
    "bench_size",
    "floor",
    "format_table",
    "json_report",
    "make_inputs",
    "make_logits_inputs",
    "make_size_inputs",
    "run_bench",
    "step_functions",
    "verify_from_logits",
    "verify_through_probs",
]
