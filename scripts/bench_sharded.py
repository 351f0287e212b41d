"""Times `speculax.sharded_step` on simulated CPU devices against gathering every
input onto one device and running the single-device step there, and measures what
its collectives carry.

Run as `python scripts/bench_sharded.py`; it sets
`XLA_FLAGS=--xla_force_host_platform_device_count=8` itself (before JAX starts) and
prints a Markdown table for `docs/sharding.md`. The simulated devices share the
host's cores, so the times show the cost of the communication pattern, not the
speed of a real multi-accelerator system.

The bytes exchanged are measured, not estimated: the compiled program gives each
collective's result shape, a profile of one call counts how often each ran (the
tree walks run theirs inside loops, as often as their rows' tests fail), and the
column is the sum over one device's executions of the share of each result that
other devices contributed, $(d - 1) / d$ of it on a vocabulary axis of $d$
devices. Beside it, what an all-gather of the probabilities (or logits) would bring
each device for its rows: the same share of its rows' whole draft and target
arrays.
"""

import argparse
import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time


os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import speculax


# A collective in compiled HLO: `%name = f32[4,16]{1,0} all-gather(...)`, or a
# tuple of shapes for a combined one.
_COLLECTIVE = re.compile(
    r"%([\w.-]+) = (\(?[^=]*?) (all-gather|all-reduce|collective-permute|all-to-all)"
    r"(-start)?\("
)
_SHAPE = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "pred": 1, "f64": 8, "s64": 8, "bf16": 2}
TREE_PARENTS = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]


def chain_inputs(batch: int, draft: int, vocab: int) -> dict:
    rng = np.random.default_rng(0)
    q = rng.random((batch, draft, vocab), dtype=np.float32)
    p = rng.random((batch, draft + 1, vocab), dtype=np.float32)
    q /= q.sum(-1, keepdims=True)
    p /= p.sum(-1, keepdims=True)
    return {
        "draft_tokens": rng.integers(0, vocab, (batch, draft), dtype=np.int32),
        "draft_probs": q,
        "target_probs": p,
        "accept_uniforms": rng.random((batch, draft), dtype=np.float32),
        "sample_uniforms": rng.random(batch, dtype=np.float32),
    }


def tree_inputs(batch: int, vocab: int) -> dict:
    """A binary tree of depth 3 (14 draft nodes) per row, peaked rows, the target
    a perturbed draft, so that some paths are kept and some tests fail."""
    rng = np.random.default_rng(0)
    positions = len(TREE_PARENTS) + 1
    q = rng.dirichlet(np.full(vocab, 0.01), (batch, positions)).astype(np.float32)
    noise = rng.dirichlet(np.full(vocab, 0.01), (batch, positions))
    p = (0.7 * q + 0.3 * noise).astype(np.float32)
    tokens = [
        [rng.choice(vocab, p=q[b, k] / q[b, k].sum()) for k in TREE_PARENTS]
        for b in range(batch)
    ]
    return {
        "parents": np.tile(TREE_PARENTS, (batch, 1)),
        "tree_tokens": np.array(tokens, np.int32),
        "draft_probs": q,
        "target_probs": p,
        "accept_uniforms": rng.random((batch, len(TREE_PARENTS)), dtype=np.float32),
        "sample_uniforms": rng.random(batch, dtype=np.float32),
    }


def logits_inputs(batch: int, draft: int, vocab: int) -> dict:
    """Peaked logits, the target a perturbed draft, and per-row sampling parameters
    as `speculax bench`'s truncated variant draws them: a temperature in
    `[0.5, 1.2]`, a top-k in `[20, 100]` and a top-p in `[0.8, 0.95]`."""
    rng = np.random.default_rng(0)
    q = (3 * rng.standard_normal((batch, draft, vocab))).astype(np.float32)
    p = q[:, [*range(draft), draft - 1]] + rng.standard_normal(
        (batch, draft + 1, vocab)
    ).astype(np.float32)
    return {
        "draft_tokens": q.argmax(-1).astype(np.int32),
        "draft_logits": q,
        "target_logits": p.astype(np.float32),
        "accept_uniforms": rng.random((batch, draft), dtype=np.float32),
        "sample_uniforms": rng.random(batch, dtype=np.float32),
        "temperature": rng.uniform(0.5, 1.2, batch).astype(np.float32),
        "top_k": rng.integers(20, 101, batch).astype(np.int32),
        "top_p": rng.uniform(0.8, 0.95, batch).astype(np.float32),
    }


# The inputs split over the vocabulary; every other one is split with the rows.
SPLIT = ("draft_probs", "target_probs", "draft_logits", "target_logits")


def best_of(f, repeats: int) -> float:
    jax.block_until_ready(f())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f())
        times.append(time.perf_counter() - start)
    return min(times)


def collective_bytes(hlo: str) -> dict[str, int]:
    """The bytes of each collective's result, by instruction name (with `_` for
    `-`, as the profiler names them)."""
    found = {}
    for match in _COLLECTIVE.finditer(hlo):
        name, result = match.group(1), match.group(2)
        size = 0
        for dtype, dims in _SHAPE.findall(result):
            count = int(np.prod([int(d) for d in dims.split(",") if d]))
            size += count * _BYTES[dtype]
        found[name.replace("-", "_")] = size
    return found


def exchanged_per_device(f, args: dict, devices: int) -> tuple[int, int]:
    """The bytes of the collectives' results in one device's share of a call of
    `f`, and how many collectives it runs, from the compiled program and a
    profile."""
    sizes = collective_bytes(jax.jit(lambda a: f(**a)).lower(args).compile().as_text())
    jax.block_until_ready(f(**args))
    folder = tempfile.mkdtemp()
    with jax.profiler.trace(folder, create_perfetto_trace=True):
        jax.block_until_ready(f(**args))
    (path,) = glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True)
    with gzip.open(path) as file:
        events = json.load(file)["traceEvents"]
    runs = collections.Counter(
        event["name"].replace("-", "_")
        for event in events
        if event.get("name", "").replace("-", "_") in sizes
    )
    total = sum(sizes[name] * count for name, count in runs.items())
    return total // devices, sum(runs.values()) // devices


def placed(args: dict, mesh: Mesh) -> dict:
    return {
        name: jax.device_put(
            x,
            NamedSharding(
                mesh,
                PartitionSpec("data", None, "vocab")
                if name in SPLIT
                else PartitionSpec("data"),
            ),
        )
        for name, x in args.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--draft", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    devices = np.array(jax.devices())
    cases = {
        "chain": (
            speculax.SpeculativeStep(),
            chain_inputs(args.batch, args.draft, args.vocab),
        ),
        "tree": (speculax.TreeStep(), tree_inputs(args.batch, args.vocab)),
        "traversal": (
            speculax.TraversalStep(),
            tree_inputs(args.batch, args.vocab),
        ),
        "logits": (
            speculax.LogitsStep(),
            logits_inputs(args.batch, args.draft, args.vocab),
        ),
    }
    print(
        f"B = {args.batch}, V = {args.vocab}, float32; chain G = {args.draft}, "
        f"trees of {len(TREE_PARENTS)} draft nodes (binary, depth 3)\n"
    )
    # Each row in turn (the CPU's strategy), then all at once (the accelerators'),
    # forced here, on the vocabulary alone.
    for strategy, meshes in [
        ("one at a time", [(8, 1), (1, 8), (2, 4)]),
        ("all at once", [(1, 8)]),
    ]:
        print(f"\nRows {strategy}:\n")
        print(
            "| step | mesh | time | collectives | exchanged KB | all-gather MB "
            "| on one device |"
        )
        print("|---|---|---|---|---|---|---|")
        for name, (step, host) in cases.items():
            for data, vocab in meshes:
                with speculax.row_strategy(strategy):
                    print(measure(name, step, host, devices, data, vocab, args))


def measure(name, step, host, devices, data, vocab, args) -> str:
    """One table row: `step` on the `data` x `vocab` mesh, timed beside the
    single-device step on the inputs gathered to one device."""
    mesh = Mesh(devices.reshape(data, vocab), ("data", "vocab"))
    on_mesh = placed(host, mesh)
    f = speculax.sharded_step(step, mesh, batch_axis="data", vocab_axis="vocab")
    sharded = best_of(lambda: f(**on_mesh), args.repeats)
    results, runs = exchanged_per_device(f, on_mesh, devices.size)
    single = jax.jit(step)

    def gathered():
        # What a loop without sharded_step would do: move every input onto one
        # device, run the single-device step there.
        return single(**{k: jax.device_put(x, devices[0]) for k, x in on_mesh.items()})

    gather = best_of(gathered, args.repeats)
    elsewhere = 1 - 1 / vocab
    probs = sum(x.nbytes for name, x in host.items() if name in SPLIT)
    return (
        f"| {name} | {data} x {vocab} | {sharded * 1e3:.2f} ms | {runs} "
        f"| {results * elsewhere / 1e3:.1f} | {probs / data * elsewhere / 1e6:.1f} "
        f"| {gather * 1e3:.2f} ms |"
    )


if __name__ == "__main__":
    main()
