"""Type-checked, not run by pytest: the library as a researcher would use it.

`pyright` (configured in pyproject.toml, in its default "standard" mode) checks this
file together with src/, so that the public surface stays usable from typed code:
constructing a step, subclassing a piece as the guide (docs/guide.md) does, calling
the step, indexing its result, and editing it with `eqx.tree_at`. The file name does
not start with `test_`, so pytest does not collect it; it is real code all the same,
and `python tests/typecheck_usage.py` runs it.
"""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, Key

import speculax
import speculax.testing


class ThresholdAcceptance(speculax.AbstractAcceptance):
    """A custom, lossy acceptance piece written as the guide writes one: passes when
    p(x) >= threshold * q(x)."""

    reads_uniforms: ClassVar[bool] = False
    reads_draft_probs: ClassVar[bool] = True
    axis_name: str | None = eqx.field(default=None, static=True, init=False)
    threshold: float = 0.5

    def __call__(
        self,
        draft_tokens: Int[Array, "batch draft"],
        draft_probs: Float[Array, "batch draft vocab"] | None,
        target_probs: Float[Array, "batch draft+1 vocab"],
        accept_uniforms: Float[Array, "batch draft"],
        *,
        num_draft_tokens: Int[Array, " batch"] | None = None,
    ) -> Bool[Array, "batch draft"]:
        del accept_uniforms
        num_draft = draft_tokens.shape[1]
        index = draft_tokens[..., None]
        p = jnp.take_along_axis(target_probs[:, :num_draft], index, axis=-1)[..., 0]
        if draft_probs is None:
            return p >= self.threshold
        q = jnp.take_along_axis(draft_probs, index, axis=-1)[..., 0]
        return p >= self.threshold * q


class LargestWeight(speculax.AbstractSampler):
    """A custom sampler that can split the vocabulary: its axis_name is a field."""

    reads_uniforms: ClassVar[bool] = False
    axis_name: str | None = eqx.field(static=True, default=None, kw_only=True)

    def __call__(
        self,
        weights: Float[Array, "batch vocab"],
        sample_uniforms: Float[Array, " batch"],
    ) -> Int[Array, " batch"]:
        del sample_uniforms
        if self.axis_name is not None:
            raise NotImplementedError("a sketch: whole rows only")
        return jnp.argmax(weights, axis=-1).astype(jnp.int32)


def make_inputs(
    key: jax.Array, batch: int, num_draft: int, vocab: int
) -> tuple[Array, Array, Array, Array, Array]:
    keys = jax.random.split(key, 5)
    target_probs = jax.nn.softmax(
        jax.random.normal(keys[0], (batch, num_draft + 1, vocab)), axis=-1
    )
    draft_probs = jax.nn.softmax(
        jax.random.normal(keys[1], (batch, num_draft, vocab)), axis=-1
    )
    draft_tokens = jax.random.categorical(keys[2], jnp.log(draft_probs), axis=-1)
    accept_uniforms = jax.random.uniform(keys[3], (batch, num_draft))
    sample_uniforms = jax.random.uniform(keys[4], (batch,))
    return draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms


def main() -> None:
    inputs = make_inputs(jax.random.key(0), batch=3, num_draft=4, vocab=16)

    # The ready-made function and the Module with its default pieces.
    out: speculax.StepOutput = speculax.speculative_step(*inputs)
    step = speculax.SpeculativeStep()
    out = step(*inputs)
    num_accepted: Array = out["num_accepted"]
    tokens: Array = out["tokens"]
    assert num_accepted.shape == (3,)
    assert tokens.shape == (3, 5)

    # Keyword arguments, NumPy arrays and nested lists are all accepted.
    listed = speculax.speculative_step(
        draft_tokens=[[3, 2]],
        draft_probs=[[[0.2, 0.59, 0.04, 0.17], [0.12, 0.43, 0.42, 0.03]]],
        target_probs=np.array(
            [
                [
                    [0.04, 0.44, 0.24, 0.28],
                    [0.27, 0.36, 0.23, 0.14],
                    [0.19, 0.34, 0.07, 0.4],
                ]
            ],
            dtype=np.float32,
        ),
        accept_uniforms=np.array([[0.27, 0.79]], dtype=np.float32),
        sample_uniforms=[0.92],
    )
    assert listed["tokens"].tolist() == [[3, 3, -1]]

    # Swap a piece through the constructor ...
    custom = speculax.SpeculativeStep(
        acceptance=ThresholdAcceptance(threshold=0.8),
        prefix=speculax.PrefixCount(),
        residual=speculax.Residual(),
        sampler=speculax.InverseCDF(block_size=128),
        check_values=True,
        check_all_probs=False,
    )
    # ... or with eqx.tree_at, which returns a new step of the same type.
    swapped: speculax.SpeculativeStep = eqx.tree_at(
        lambda s: s.acceptance, step, ThresholdAcceptance()
    )
    retuned = eqx.tree_at(lambda s: s.sampler, swapped, speculax.InverseCDF(64))
    acceptance: speculax.AbstractAcceptance = retuned.acceptance
    assert isinstance(acceptance, ThresholdAcceptance)

    # A tree step split over the batch and the vocabulary of a mesh returns a
    # TreeOutput.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("b", "v"))
    on_mesh = speculax.sharded_step(
        speculax.TreeStep(), mesh, batch_axis="b", vocab_axis="v"
    )
    tree_probs = jnp.full((1, 3, 4), 0.25)
    walked: speculax.TreeOutput = on_mesh(
        [[0, 1]], [[2, 3]], tree_probs, tree_probs, key=jax.random.key(1)
    )
    assert walked["accepted_nodes"].tolist() == [[1, 2, -1]]
    # The logits step, split over the batch and the vocabulary as docs/sharding.md
    # shows, returns a StepOutput.
    from_logits = speculax.sharded_step(
        speculax.LogitsStep(), mesh, batch_axis="b", vocab_axis="v"
    )
    verified: speculax.StepOutput = from_logits(
        [[1]], jnp.zeros((1, 1, 4)), jnp.zeros((1, 2, 4)), key=jax.random.key(2)
    )
    # The draft's distribution is the target's: the draft is kept.
    assert verified["num_accepted"].tolist() == [1]

    # Compiled, with the step as an argument so that swapping a piece recompiles.
    compiled = eqx.filter_jit(custom)
    result = compiled(*inputs)
    counts: list[int] = np.asarray(result["num_accepted"]).tolist()
    assert all(0 <= n <= 4 for n in counts)

    # Deterministic drafts reach the custom pieces as draft_probs=None.
    deterministic = speculax.SpeculativeStep(
        acceptance=ThresholdAcceptance(threshold=0.05), sampler=LargestWeight()
    )
    draft_tokens, _, target_probs, accept_uniforms, sample_uniforms = inputs
    kept = deterministic(draft_tokens, None, target_probs, accept_uniforms)
    assert kept["tokens"].shape == (3, 5)

    # The pieces can be called on their own.
    draft_probs = inputs[1]
    passed = step.acceptance(draft_tokens, draft_probs, target_probs, accept_uniforms)
    n = step.prefix(passed)
    weights = step.residual(n, draft_tokens, draft_probs, target_probs)
    drawn = step.sampler(weights, sample_uniforms)
    assert drawn.shape == (3,)

    # Per-row failure codes instead of an error: row 1 holds a token V = 16 lacks.
    reporting = speculax.SpeculativeStep(throw=False)
    bad_tokens = draft_tokens.at[1, 0].set(16)
    reported, result = reporting.with_result(bad_tokens, *inputs[1:])
    assert sorted(reported) == ["num_accepted", "tokens"]
    failed: Array = result != speculax.RESULTS.successful
    assert failed.tolist() == [False, True, False]
    messages: list[str] = speculax.failure_messages(result)
    assert messages[1].startswith("draft_tokens")

    # A piece that splits the vocabulary over a mesh axis, for use under shard_map.
    split = speculax.SpeculativeStep(
        speculax.RatioAcceptance(axis_name="vocab"),
        residual=speculax.Residual(axis_name="vocab"),
        sampler=speculax.InverseCDF(axis_name="vocab"),
    )
    assert split.axis_name == "vocab"

    # The exact check on one row, from nested lists as from arrays.
    error: float = speculax.testing.lossless_error(
        step, [[0.5, 0.3, 0.2]], [[0.2, 0.2, 0.6], [0.3, 0.3, 0.4]]
    )
    assert error < 1e-12

    # vmap over an extra leading axis of independent batches.
    stacked = tuple(jnp.stack([x, x]) for x in inputs)
    batched = jax.vmap(step)(*stacked)
    assert batched["tokens"].shape == (2, 3, 5)

    # The loop around the step, with a model and a key schedule of one's own.
    table = jax.random.normal(jax.random.key(1), (16, 16))

    def bigram(
        tokens: Int[Array, "batch time"], positions: Int[Array, "batch k"]
    ) -> Float[Array, "batch k vocab"]:
        return table[jnp.take_along_axis(tokens, positions, axis=1)]

    model: speculax.LanguageModel = bigram
    loop = speculax.SpeculativeLoop(
        num_draft=3,
        max_new_tokens=8,
        step=speculax.block_step(),
        end_token=0,
        key_schedule=StepMajorKeys(),
    )
    generated: speculax.LoopOutput = loop(
        model, model, jnp.ones((2, 3), jnp.int32), key=jax.random.key(2)
    )
    steps: Array = generated["num_steps"]
    assert generated["tokens"].shape == (2, 8) and steps.shape == (2,)

    # The exact check of a loop whose models keep a cache.
    small = CachedBigram(jnp.log(jnp.array([[0.2, 0.8], [0.6, 0.4]])))
    short = speculax.SpeculativeLoop(num_draft=1, max_new_tokens=2)
    exact: float = speculax.testing.loop_lossless_error(short, small, small, [0])
    law: dict[tuple[int, ...], float] = speculax.testing.loop_output_distribution(
        short, small, small, [0]
    )
    assert exact < 1e-6 and abs(sum(law.values()) - 1) < 1e-6


class CachedBigram(speculax.AbstractCachedModel):
    """A bigram model with a cache of the tokens it has read."""

    logits: Float[Array, "vocab vocab"]

    def init_cache(self, batch: int, max_length: int) -> Int[Array, "batch slots"]:
        return jnp.zeros((batch, max_length), jnp.int32)

    def __call__(
        self,
        tokens: Int[Array, "batch new"],
        positions: Int[Array, "batch new"],
        mask: Bool[Array, "batch new new"],
        cache: Int[Array, "batch slots"],
        cache_length: Int[Array, " batch"],
    ) -> tuple[Float[Array, "batch new vocab"], Int[Array, "batch slots"]]:
        rows = jnp.arange(tokens.shape[0])[:, None]
        slots = cache_length[:, None] + jnp.arange(tokens.shape[1])
        return self.logits[tokens], cache.at[rows, slots].set(tokens)


class StepMajorKeys(speculax.AbstractKeySchedule):
    """A key schedule of one's own: the stream and position folded in as one number."""

    def __call__(
        self,
        row_key: Key[Array, ""],
        step: Int[Array, ""],
        stream: Int[Array, ""],
        position: Int[Array, ""],
    ) -> Key[Array, ""]:
        return jax.random.fold_in(
            jax.random.fold_in(row_key, step), 3 * position + stream
        )


if __name__ == "__main__":
    main()
