"""Draws docs/images/benchmarks.svg: speedup of the default step over the obvious
implementation, and its time over the floor, versus the vocabulary size V.

Runs `speculax._cli._bench.run_bench` on a sweep of V (or reads the output of
`speculax bench --json` that covers several V), then plots both ratios.

Usage (a docs-time tool; needs matplotlib):

    python scripts/plot_benchmarks.py [--batch 64] [--draft 5] [--repeats 5]
        [--json results.json] [--output docs/images/benchmarks.svg]
"""

import argparse
import json
from pathlib import Path

import matplotlib


matplotlib.use("Agg")
import matplotlib.pyplot as plt

from speculax._cli._bench import Size, run_bench


# Vector output, sharp at any zoom; text stays text, so the file stays small.
matplotlib.rcParams["svg.fonttype"] = "none"

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "docs/images/benchmarks.svg"
VOCABS = (1024, 4096, 16384, 32000, 65536, 128256, 262144)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--draft", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="read `speculax bench --json` output instead")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()

    if args.json:
        results = json.loads(Path(args.json).read_text())["results"]
        title = "from " + args.json
    else:
        sizes = [Size(args.batch, args.draft, vocab) for vocab in VOCABS]
        results = run_bench(sizes, args.repeats)
        title = f"B = {args.batch}, G = {args.draft}, float32"
    for row in results:
        print(
            f"V = {row['vocab']:>6}: {row['speedup']:6.1f}x faster than the baseline, "
            f"{row['over_floor']:5.2f}x the floor"
        )

    vocab = [row["vocab"] for row in results]
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    left.plot(vocab, [row["speedup"] for row in results], "o-", color="tab:blue")
    left.axhline(30, color="grey", linestyle=":", label="target 30x")
    left.set_ylabel("baseline time / speculax time")
    left.set_title("speedup over the obvious implementation")
    right.plot(vocab, [row["over_floor"] for row in results], "o-", color="tab:red")
    right.axhline(1.5, color="grey", linestyle=":", label="target 1.5x")
    right.set_ylabel("speculax time / floor time")
    right.set_title("distance from the floor")
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("vocabulary size V")
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
