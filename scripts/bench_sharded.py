"""Times `speculax.sharded_step` on simulated CPU devices against gathering every
input onto one device and running the single-device step there.

Run as `python scripts/bench_sharded.py`; it sets
`XLA_FLAGS=--xla_force_host_platform_device_count=8` itself (before JAX starts) and
prints a Markdown table for `docs/sharding.md`. The simulated devices share the
host's cores, so the numbers show the cost of the communication pattern, not the
speed of a real multi-accelerator system.
"""

import argparse
import os
import time


os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import speculax


def inputs(batch: int, draft: int, vocab: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    q = rng.random((batch, draft, vocab), dtype=np.float32)
    p = rng.random((batch, draft + 1, vocab), dtype=np.float32)
    q /= q.sum(-1, keepdims=True)
    p /= p.sum(-1, keepdims=True)
    tokens = rng.integers(0, vocab, (batch, draft), dtype=np.int32)
    accept = rng.random((batch, draft), dtype=np.float32)
    sample = rng.random(batch, dtype=np.float32)
    return tokens, q, p, accept, sample


def best_of(f, repeats: int) -> float:
    jax.block_until_ready(f())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f())
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--draft", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    devices = np.array(jax.devices())
    host = inputs(args.batch, args.draft, args.vocab)
    step = speculax.SpeculativeStep()
    single = jax.jit(step)
    print(f"B = {args.batch}, G = {args.draft}, V = {args.vocab}, float32\n")
    print(
        "| mesh (data, vocab) | sharded_step | exchanged KB | gather to one device "
        "| gathered MB |"
    )
    print("|---|---|---|---|---|")
    for data, vocab in [(8, 1), (1, 8), (2, 4)]:
        mesh = Mesh(devices.reshape(data, vocab), ("data", "vocab"))
        rows, probs = PartitionSpec("data"), PartitionSpec("data", None, "vocab")
        specs = [rows, probs, probs, rows, rows]
        placed = [
            jax.device_put(x, NamedSharding(mesh, spec))
            for x, spec in zip(host, specs, strict=True)
        ]
        f = speculax.sharded_step(step, mesh, batch_axis="data", vocab_axis="vocab")
        sharded = best_of(lambda f=f, placed=placed: f(*placed), args.repeats)

        def gathered(placed=placed):
            # What a loop without sharded_step would do: move every input onto one
            # device, run the single-device step there.
            local = [jax.device_put(x, devices[0]) for x in placed]
            return single(*local)

        gather = best_of(gathered, args.repeats)
        batch, blocks = args.batch, -(-args.vocab // 256)
        exchanged = 0 if vocab == 1 else 4 * batch * (2 * args.draft + blocks + 2)
        moved = sum(x.nbytes for x in host) * (1 - 1 / (data * vocab)) / 1e6
        print(
            f"| ({data}, {vocab}) | {sharded * 1e3:.2f} ms | {exchanged / 1e3:.1f} "
            f"| {gather * 1e3:.2f} ms "
            f"| {moved:.1f} |"
        )


if __name__ == "__main__":
    main()
