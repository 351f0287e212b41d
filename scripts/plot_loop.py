"""Draws docs/images/loop.svg: tokens per target call and wall-clock speedup of the
speculative sampling loop against the number of draft tokens $G$, with the demo's
models (`speculax demo --loop`), and prints the Markdown tables of docs/loop.md.

Runs `speculax._cli._demo.measure_loop` with one prompt per call and with all
eight in one call, each with $G = 0$ (the target alone) and $G$ from 1 to 8, side
by side in one process; then times each model alone, on 1 and 8 rows, scoring 1
to 9 positions a call. About two minutes on two CPU cores (needs matplotlib, in
the `docs` extra):

    python scripts/plot_loop.py [--max-new-tokens 256] [--repeats 5]
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

from speculax._cli._demo import LoopMeasurement, load_demo_models, measure_loop


# Vector output, sharp at any zoom; text stays text, so the file stays small.
matplotlib.rcParams["svg.fonttype"] = "none"

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "docs/images/loop.svg"
NUM_DRAFTS = (1, 2, 3, 4, 5, 6, 7, 8)
BATCH_SIZES = (1, 8)
# Calls of a model inside one compiled loop, for its time per call.
CALLS = 100


def table(results: list[LoopMeasurement]) -> str:
    lines = [
        "| $G$ | acceptance rate | tokens per target call | target calls | time (ms) "
        "| speedup |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        acceptance = "-" if result.num_draft == 0 else f"{result.acceptance_rate:.3f}"
        lines.append(
            f"| {result.num_draft} | {acceptance} | {result.tokens_per_call:.2f} | "
            f"{result.target_calls} | {1000 * result.seconds:.0f} | "
            f"{result.speedup:.2f}x |"
        )
    return "\n".join(lines)


@eqx.filter_jit
def repeated_calls(model, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    """`CALLS` calls of `model`, each on positions shifted by the call's number, so
    that none can be hoisted out of the loop."""

    def call(i, total):
        return total + model(tokens, positions + i % 7).sum()

    return jax.lax.fori_loop(0, CALLS, call, jnp.zeros(()))


def model_call_times() -> str:
    """A Markdown table of each model's time per call (median of 5 loops of
    `CALLS`), on 1 and 8 rows of 256 tokens, scoring 1 to 9 positions."""
    draft, target = load_demo_models()
    lines = [
        "| positions | "
        + " | ".join(
            f"{name}, {rows} row{'s' if rows > 1 else ''} (µs)"
            for rows in BATCH_SIZES
            for name in ("target", "draft")
        )
        + " |",
        "|---:" * (1 + 2 * len(BATCH_SIZES)) + "|",
    ]
    for count in range(1, 10):
        cells = []
        for rows in BATCH_SIZES:
            tokens = jnp.zeros((rows, 256), jnp.int32)
            positions = jnp.broadcast_to(jnp.arange(count), (rows, count))
            for model in (target, draft):
                repeated_calls(model, tokens, positions).block_until_ready()
                times = []
                for _ in range(5):
                    start = time.perf_counter()
                    repeated_calls(model, tokens, positions).block_until_ready()
                    times.append(time.perf_counter() - start)
                cells.append(f"{1e6 * sorted(times)[2] / CALLS:.0f}")
        lines.append(f"| {count} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()

    measured = {
        batch_size: measure_loop(
            NUM_DRAFTS,
            batch_size=batch_size,
            max_new_tokens=args.max_new_tokens,
            repeats=args.repeats,
        )
        for batch_size in BATCH_SIZES
    }
    for batch_size, results in measured.items():
        print(f"\nbatch size {batch_size}:\n\n{table(results)}")
    print(f"\neach model alone:\n\n{model_call_times()}")

    figure, (calls, speedup) = plt.subplots(1, 2, figsize=(9, 3.4))
    for batch_size, results in measured.items():
        drafts = [result.num_draft for result in results]
        label = f"{batch_size} prompt{'s' if batch_size > 1 else ''} per call"
        calls.plot(
            drafts, [result.tokens_per_call for result in results], "o-", label=label
        )
        speedup.plot(drafts, [result.speedup for result in results], "o-", label=label)
    # If every draft passed with the probability measured at G = 1, independently,
    # a step would give 1 + a + ... + a^G tokens.
    rate = measured[BATCH_SIZES[0]][1].acceptance_rate
    calls.plot(
        drafts,
        [(1 - rate ** (g + 1)) / (1 - rate) for g in drafts],
        "k--",
        linewidth=0.8,
        label=f"each draft passing with {rate:.2f}",
    )
    print(
        "\nif each draft passed with the rate at G = 1, independently: tokens per "
        "call "
        + ", ".join(f"{(1 - rate ** (g + 1)) / (1 - rate):.2f}" for g in drafts)
        + "; acceptance rate "
        + ", ".join(
            f"{rate * (1 - rate**g) / ((1 - rate) * g):.2f}" for g in drafts if g
        )
    )
    calls.set(
        xlabel="draft tokens per step, G",
        ylabel="tokens per target call",
        title="Tokens per target call",
    )
    speedup.axhline(1, color="grey", linewidth=0.8)
    speedup.set(
        xlabel="draft tokens per step, G",
        ylabel="speedup over the target alone",
        title="Wall-clock speedup (2-core CPU)",
    )
    for axes in (calls, speedup):
        axes.legend(frameon=False)
        axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(args.output, metadata={"Date": None})
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
