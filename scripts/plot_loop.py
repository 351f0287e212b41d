"""Draws docs/images/loop.svg: tokens per target call and wall-clock speedup of the
speculative sampling loop for each verification (chains drafted by the draft model
and by prompt lookup, block verification, a draft tree, traversal verification) at
one and eight prompts per call, and the time
per generated token against the number of new tokens with and without the models'
key-value caches, with the demo's transformers (`speculax demo --loop`); prints
the Markdown tables of docs/loop.md, and each model's time per call.

Runs `speculax._cli._demo.measure_loop` and `measure_cache`, side by side in one
process. About ten minutes on two CPU cores (needs matplotlib, in the `docs`
extra):

    python scripts/plot_loop.py [--max-new-tokens 128] [--repeats 3]
        [--output docs/images/loop.svg]
"""

import argparse
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import matplotlib


matplotlib.use("Agg")
import matplotlib.pyplot as plt

from speculax._cli._demo import (
    VERIFICATIONS,
    CacheMeasurement,
    LoopMeasurement,
    load_demo_models,
    measure_cache,
    measure_loop,
)


# Vector output, sharp at any zoom; text stays text, so the file stays small.
matplotlib.rcParams["svg.fonttype"] = "none"

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "docs/images/loop.svg"
BATCH_SIZES = (1, 8)
CACHE_LENGTHS = (64, 128, 256, 512)
# Calls of a model inside one compiled loop, for its time per call.
CALLS = 50


def loop_table(results: list[LoopMeasurement]) -> str:
    lines = [
        "| verification | prompts per call | drafts | tokens per target call "
        "| target calls | time (ms) | speedup |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        lines.append(
            f"| {result.verification} | {result.batch_size} | {result.drafts} | "
            f"{result.tokens_per_call:.2f} | {result.target_calls} | "
            f"{1000 * result.seconds:.0f} | {result.speedup:.2f}x |"
        )
    return "\n".join(lines)


def cache_table(results: list[CacheMeasurement]) -> str:
    lines = [
        "| new tokens | buffer | with the caches (ms/token) "
        "| without (ms/token) | ratio |",
        "|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        lines.append(
            f"| {result.max_new_tokens} | {result.length} | "
            f"{1000 * result.cached:.2f} | {1000 * result.cacheless:.2f} | "
            f"{result.cacheless / result.cached:.2f}x |"
        )
    return "\n".join(lines)


@eqx.filter_jit
def repeated_calls(model, tokens, positions, mask, cache, cache_length):
    """`CALLS` calls of `model` after a cached history, each on positions shifted by
    the call's number, so that none can be hoisted out of the loop."""

    def call(i, total):
        logits, _ = model(tokens, positions + i % 7, mask, cache, cache_length)
        return total + logits.sum()

    return jax.lax.fori_loop(0, CALLS, call, jnp.zeros(()))


def model_call_times() -> str:
    """A Markdown table of each model's time per call (median of 5 loops of
    `CALLS`), on 1 and 8 rows after a cached history of 200 tokens, reading 1, 5
    and 25 new tokens as a chain."""
    draft, target = load_demo_models()
    lines = [
        "| new tokens | "
        + " | ".join(
            f"{name}, {rows} row{'s' if rows > 1 else ''} (µs)"
            for rows in BATCH_SIZES
            for name in ("target", "draft")
        )
        + " |",
        "|---:" * (1 + 2 * len(BATCH_SIZES)) + "|",
    ]
    for count in (1, 5, 25):
        cells = []
        for rows in BATCH_SIZES:
            tokens = jnp.zeros((rows, count), jnp.int32)
            positions = 200 + jnp.broadcast_to(jnp.arange(count), (rows, count))
            mask = jnp.broadcast_to(
                jnp.tril(jnp.ones((count, count), bool)), (rows, count, count)
            )
            history = jnp.full((rows,), 200)
            for model in (target, draft):
                cache = model.init_cache(rows, 256)
                arguments = (model, tokens, positions, mask, cache, history)
                repeated_calls(*arguments).block_until_ready()
                times = []
                for _ in range(5):
                    start = time.perf_counter()
                    repeated_calls(*arguments).block_until_ready()
                    times.append(time.perf_counter() - start)
                cells.append(f"{1e6 * sorted(times)[2] / CALLS:.0f}")
        lines.append(f"| {count} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()

    def progress(line: str) -> None:
        print(line, flush=True)

    results = measure_loop(
        VERIFICATIONS,
        batch_sizes=BATCH_SIZES,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        progress=progress,
    )
    cache = measure_cache(CACHE_LENGTHS, repeats=args.repeats, progress=progress)
    print(f"\n{loop_table(results)}\n\n{cache_table(cache)}")
    print(f"\neach model alone:\n\n{model_call_times()}")

    figure, (calls, speedup, per_token) = plt.subplots(1, 3, figsize=(13, 3.6))
    width = 0.38
    for offset, batch_size in zip((-width / 2, width / 2), BATCH_SIZES, strict=True):
        rows = [result for result in results if result.batch_size == batch_size]
        places = [index + offset for index in range(len(rows))]
        label = f"{batch_size} prompt{'s' if batch_size > 1 else ''} per call"
        calls.bar(places, [row.tokens_per_call for row in rows], width, label=label)
        speedup.bar(places, [row.speedup for row in rows], width, label=label)
    names = [result.verification for result in results if result.batch_size == 1]
    for axes in (calls, speedup):
        axes.set_xticks(range(len(names)), names, rotation=20)
    calls.set(ylabel="tokens per target call", title="Tokens per target call")
    speedup.axhline(1, color="grey", linewidth=0.8)
    speedup.set(
        ylabel="speedup over the target alone", title="Wall-clock speedup (2-core CPU)"
    )
    lengths = [row.max_new_tokens for row in cache]
    per_token.plot(lengths, [1000 * row.cached for row in cache], "o-", label="cached")
    per_token.plot(
        lengths, [1000 * row.cacheless for row in cache], "o-", label="cacheless"
    )
    per_token.set(
        xlabel="new tokens per prompt",
        ylabel="ms per generated token",
        title="The chain loop with and without the caches",
    )
    for axes in (calls, speedup, per_token):
        axes.legend(frameon=False)
        axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(args.output, metadata={"Date": None})
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
