"""What each program costs before it runs: the time to trace it and to lower and
compile it from a cold start, the size of the compiled HLO and its while loops, for
every step variant and for the loop, each beside the default chain step's.

JAX users pay this once per shape bucket, so it is measured as performance is:
side by side in one process, as ratios to the default step.

- The steps at `REFERENCE` ($B = 8$, $G = 4$, $V = 128256$; the trees have
    `TREE_NODES` draft nodes, `eagle_tree`'s shape): each variant of
    `speculax bench`, and [`speculax.LogitsStep`][] three ways: a mixed batch (a
    temperature, a top-$k$ and a top-$p$ per row, all traced), a temperature alone
    (traced, no truncation asked for), and greedy (`temperature=0` as a Python
    number).
- The loop ([`speculax.SpeculativeLoop`][]) with cached bigram models of
    `LOOP_VOCAB` tokens, `LOOP_PROMPTS` prompts and `LOOP_NEW_TOKENS` new tokens: a
    chain of 4 drafts (the default step), a tree of `TREE_NODES` independently
    drafted nodes ([`speculax.TreeStep`][]), and a chain verified from logits under
    traced per-row sampling parameters (per-request sampling).
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, final

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._logits._step import LogitsStep
from .._loop._cache import AbstractCachedModel
from .._loop._draft_tree import DraftTree
from .._loop._loop import SpeculativeLoop
from .._tree._recursive import TreeStep
from ._bench import (
    Size,
    eagle_tree,
    make_logits_inputs,
    make_size_inputs,
    step_functions,
)
from ._compiled import compile_cold


REFERENCE = Size(8, 4, 128256)
TREE_NODES = 20
LOOP_VOCAB = 512
LOOP_PROMPTS = 4
LOOP_NEW_TOKENS = 64


@final
class _CachedBigram(AbstractCachedModel):
    """A bigram model whose cache is the tokens it has read (a transformer would
    keep its keys and values there): the logits of the next token are a row of a
    table."""

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
        del positions, mask
        rows = jnp.arange(tokens.shape[0])[:, None]
        slots = cache_length[:, None] + jnp.arange(tokens.shape[1])
        return self.logits[tokens], cache.at[rows, slots].set(tokens)


def _loop_program(loop: SpeculativeLoop, sampling: bool) -> tuple[Callable, tuple]:
    """`loop` as one function of the two models, the prompts, the key and (for
    `sampling`) each row's temperature, top-$k$ and top-$p$, with its arguments."""
    keys = jax.random.split(jax.random.key(0), 3)
    draft = _CachedBigram(jax.random.normal(keys[0], (LOOP_VOCAB, LOOP_VOCAB)))
    target = _CachedBigram(jax.random.normal(keys[1], (LOOP_VOCAB, LOOP_VOCAB)))
    prompt = jax.random.randint(keys[2], (LOOP_PROMPTS, 4), 0, LOOP_VOCAB)
    key = jax.random.key(1)
    if not sampling:
        return (
            lambda draft, target, prompt, key: loop(draft, target, prompt, key=key),
            (draft, target, prompt, key),
        )
    parameters = (
        jnp.linspace(0.0, 1.2, LOOP_PROMPTS),
        jnp.arange(LOOP_PROMPTS, dtype=jnp.int32) * 20,
        jnp.linspace(1.0, 0.8, LOOP_PROMPTS),
    )

    def sampled(draft, target, prompt, key, temperature, top_k, top_p):
        return loop(
            draft,
            target,
            prompt,
            key=key,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
        )

    return sampled, (draft, target, prompt, key, *parameters)


def _logits_programs(size: Size) -> dict[str, tuple[Callable, tuple]]:
    """[`speculax.LogitsStep`][] on a mixed batch, with a temperature alone, and
    greedy, each with its arguments."""
    inputs = make_logits_inputs(dataclasses.replace(size, variant="truncated"))
    tokens, _, target, accept, sample, *_ = inputs

    def mixed(tokens, draft, target, accept, sample, temperature, top_k, top_p):
        return LogitsStep()(
            tokens,
            draft,
            target,
            accept,
            sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
        )

    def temperature_alone(tokens, draft, target, accept, sample, temperature):
        return LogitsStep()(
            tokens, draft, target, accept, sample, temperature=temperature
        )

    def greedy(tokens, target, accept, sample):
        return LogitsStep()(tokens, None, target, accept, sample, temperature=0)

    return {
        "logits, mixed batch": (mixed, inputs),
        "logits, temperature": (temperature_alone, inputs[:6]),
        "logits, temperature=0": (greedy, (tokens, target, accept, sample)),
    }


def programs(
    size: Size = REFERENCE, tree_nodes: int = TREE_NODES
) -> dict[str, tuple[Callable, tuple]]:
    """Every program of the table, by name, each a function with its arguments: the
    default step first, the reference of the ratios."""
    table: dict[str, tuple[Callable, tuple]] = {}
    for variant in ("default", "deterministic", "greedy", "block"):
        step_size = dataclasses.replace(size, variant=variant)
        step, args, *_ = step_functions(step_size, make_size_inputs(step_size))
        table[variant] = (step, args)
    for variant in ("tree", "deterministic-tree", "greedy-tree", "traversal"):
        tree_size = dataclasses.replace(size, num_draft=tree_nodes, variant=variant)
        step, args, *_ = step_functions(tree_size, make_size_inputs(tree_size))
        table[variant] = (step, args)
    table.update(_logits_programs(size))
    tree = DraftTree(eagle_tree(tree_nodes), drafting="independent")
    loops = {
        "loop, chain": (
            SpeculativeLoop(num_draft=4, max_new_tokens=LOOP_NEW_TOKENS),
            False,
        ),
        "loop, tree": (
            SpeculativeLoop(
                draft_tree=tree, max_new_tokens=LOOP_NEW_TOKENS, step=TreeStep()
            ),
            False,
        ),
        "loop, sampling": (
            SpeculativeLoop(
                num_draft=4, max_new_tokens=LOOP_NEW_TOKENS, step=LogitsStep()
            ),
            True,
        ),
    }
    for name, (loop, sampling) in loops.items():
        table[name] = _loop_program(loop, sampling)
    return table


def run_compile_costs(
    size: Size = REFERENCE,
    tree_nodes: int = TREE_NODES,
    *,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """The cost of compiling every program of `programs` from a cold start
    (`compile_cold`), one after another, each with its ratios to the default step's
    total time and HLO size."""
    results = []
    for name, (function, args) in programs(size, tree_nodes).items():
        _, cost = compile_cold(function, *args)
        results.append(
            {
                "program": name,
                "trace_s": cost.trace_s,
                "compile_s": cost.compile_s,
                "total_s": cost.total_s,
                "hlo_chars": cost.hlo_chars,
                "while_loops": cost.while_loops,
            }
        )
        if progress is not None:
            progress(
                f"speculax bench: compile cost of {name}: {cost.total_s:.2f} s, "
                f"{cost.hlo_chars:,} characters of HLO"
            )
    default = results[0]
    for result in results:
        result["time_ratio"] = result["total_s"] / default["total_s"]
        result["hlo_ratio"] = result["hlo_chars"] / default["hlo_chars"]
    return results


def format_compile_table(results: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of the results of `run_compile_costs`."""
    header = (
        "| program | trace s | compile s | x default | HLO KB | x default "
        "| while loops |\n"
        "|:---|---:|---:|---:|---:|---:|---:|\n"
    )
    return header + "\n".join(
        f"| {r['program']} | {r['trace_s']:.2f} | {r['compile_s']:.2f} "
        f"| {r['time_ratio']:.1f}x | {r['hlo_chars'] / 1000:,.0f} "
        f"| {r['hlo_ratio']:.1f}x | {r['while_loops']} |"
        for r in results
    )


__all__ = [
    "LOOP_NEW_TOKENS",
    "LOOP_PROMPTS",
    "LOOP_VOCAB",
    "REFERENCE",
    "TREE_NODES",
    "format_compile_table",
    "programs",
    "run_compile_costs",
]
