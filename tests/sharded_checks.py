"""The checks of `tests/test_sharded.py`, run in a subprocess on 8 simulated CPU
devices: the device count must be fixed before JAX initialises, which the test
process (already running JAX on one device) cannot do. Prints one JSON object.
"""

import json
import os
import re


os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax
import jaxtyping
import numpy as np
from jax.sharding import Mesh


# Runtime type checking, as in the pytest run that starts this process.
with jaxtyping.install_import_hook(["speculax"], "beartype.beartype"):
    import speculax


BATCH, DRAFT, VOCAB = 8, 3, 8 * 256 * 2
# The opcode of a collective instruction, after the result shape: `= f32[4,16]{0,1}
# all-gather(%x), ...`, possibly in its asynchronous form (`all-gather-start`).
_COLLECTIVE = re.compile(
    r"=\s*\(?[^=]*?\b(all-gather|all-reduce|collective-permute|all-to-all)"
    r"(-start)?\("
)
_SHAPE = re.compile(r"\b[a-z]+[0-9]*\[([0-9,]*)\]")


def inputs(seed: int) -> tuple[np.ndarray, ...]:
    """Peaked random distributions with the draft tokens drawn from q; row 0 accepts
    every draft (n = G), row 2 stops at a zero residual (p_0 = q_0 and
    p_0(x_0) = q_0(x_0) = 0), which takes the fallback to p_0.
    """
    rng = np.random.default_rng(seed)

    def dist(shape):
        x = rng.gamma(0.3, size=shape)
        return x / x.sum(-1, keepdims=True)

    q = dist((BATCH, DRAFT, VOCAB))
    p = dist((BATCH, DRAFT + 1, VOCAB))
    tokens = np.array(
        [[rng.choice(VOCAB, p=q[b, i]) for i in range(DRAFT)] for b in range(BATCH)]
    )
    q[2, 0, tokens[2, 0]] = 0
    q[2, 0] /= q[2, 0].sum()
    p[2, 0] = q[2, 0]
    accept = rng.random((BATCH, DRAFT))
    accept[0] = 0
    sample = rng.random(BATCH)
    return (
        tokens.astype(np.int32),
        q.astype(np.float32),
        p.astype(np.float32),
        accept.astype(np.float32),
        sample.astype(np.float32),
    )


def collectives(hlo: str) -> list[str]:
    """The collective instructions of a compiled HLO text."""
    return [line.strip() for line in hlo.splitlines() if _COLLECTIVE.search(line)]


def large_collectives(hlo: str, sizes: set[int]) -> list[str]:
    """The collective instructions with a result dimension in `sizes`.

    The result shape is the one printed on the line (compiled HLO names its operands
    without shapes). It is enough: an all-reduce, all-to-all or collective-permute
    has its operand's shape, and an all-gather keeps every dimension of its operand
    but the gathered one, which grows by the group size (V / d becomes V).
    """
    found = []
    for line in collectives(hlo):
        match = _COLLECTIVE.search(line)
        assert match is not None
        result = line[match.start() : match.start(1)]
        dims = {
            int(d) for shape in _SHAPE.findall(result) for d in shape.split(",") if d
        }
        if dims & sizes:
            found.append(line)
    return found


def main() -> None:
    devices = np.array(jax.devices())
    step = speculax.SpeculativeStep()
    meshes = {
        f"{d}x{v}": (Mesh(devices.reshape(d, v), ("data", "vocab")), "data", "vocab")
        for d, v in [(8, 1), (1, 8), (2, 4), (4, 2)]
    }
    meshes["vocab8"] = (Mesh(devices, ("v",)), None, "v")
    meshes["batch8"] = (Mesh(devices, ("b",)), "b", None)
    cases = [inputs(seed) for seed in range(2)]
    reference = [jax.jit(step)(*args) for args in cases]
    result: dict = {"num_accepted": [r["num_accepted"].tolist() for r in reference]}
    for name, (mesh, batch_axis, vocab_axis) in meshes.items():
        f = speculax.sharded_step(
            step, mesh, batch_axis=batch_axis, vocab_axis=vocab_axis
        )
        same = all(
            np.array_equal(f(*args)[k], ref[k])
            for args, ref in zip(cases, reference, strict=True)
            for k in ("num_accepted", "tokens")
        )
        shards = 1 if vocab_axis is None else mesh.shape[vocab_axis]
        hlo = jax.jit(f).lower(*cases[0]).compile().as_text()
        result[name] = {
            "identical": same,
            "large_collectives": large_collectives(hlo, {VOCAB, VOCAB // shards}),
            "collectives": len(collectives(hlo)),
        }
    mesh = meshes["vocab8"][0]
    f = speculax.sharded_step(step, mesh, vocab_axis="v")
    tokens, q, p, accept, sample = cases[0]
    try:
        f(tokens, q[..., :-4], p[..., :-4], accept, sample)
        result["indivisible"] = None
    except ValueError as error:
        result["indivisible"] = str(error)
    try:
        bad = tokens.copy()
        bad[3, 1] = VOCAB
        jax.block_until_ready(f(bad, q, p, accept, sample))
        result["bad_token"] = None
    except Exception as error:  # Equinox raises an XlaRuntimeError / RuntimeError
        result["bad_token"] = str(error)
    # Tokens of any integer dtype are read by value: int8 answers as int32 does, and
    # an int64 2**32 + 1 is out of range, not token 1.
    narrow = f(tokens.astype(np.int16), q, p, accept, sample)
    result["int16_identical"] = bool(
        np.array_equal(narrow["tokens"], reference[0]["tokens"])
    )
    try:
        wide = tokens.astype(np.int64)
        wide[3, 1] = 2**32 + 1
        jax.block_until_ready(f(wide, q, p, accept, sample))
        result["int64_token"] = None
    except Exception as error:
        result["int64_token"] = str(error)
    try:
        # Row 0 accepts every draft: a p_G of finite values summing past float32.
        huge = p.copy()
        huge[0, DRAFT] = 2e38
        jax.block_until_ready(f(tokens, q, huge, accept, sample))
        result["overflow"] = None
    except Exception as error:
        result["overflow"] = str(error)
    try:
        speculax.sharded_step(speculax.greedy_step(), mesh, vocab_axis="v")
        result["non_default"] = None
    except ValueError as error:
        result["non_default"] = str(error)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
