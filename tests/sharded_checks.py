"""The checks of `tests/test_sharded.py`, run in a subprocess on 8 simulated CPU
devices: the device count must be fixed before JAX initialises, which the test
process (already running JAX on one device) cannot do. Prints one JSON object:
every chain variant on three meshes; with `--quick`, the default tier's subset of
the chain's and the trees' checks; with `--trees` and `--logits`, every tree or
logits variant on the meshes that split the vocabulary.
"""

import json
import os
import re
import sys


# Beside the flags it was given (tests/conftest.py's).
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
).strip()

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


# Runtime type checking, as in the pytest run that starts this process.
with jaxtyping.install_import_hook(["speculax"], "beartype.beartype"):
    import speculax

sys.path.insert(0, os.path.dirname(__file__))
from doubles import DelegatingResidual


BATCH, DRAFT, VOCAB = 8, 3, 8 * 256 * 2
MESHES = {"8x1": (8, 1), "1x8": (1, 8), "2x4": (2, 4), "4x2": (4, 2)}
# The opcode of a collective instruction, after the result shape: `= f32[4,16]{0,1}
# all-gather(%x), ...`, possibly in its asynchronous form (`all-gather-start`).
_COLLECTIVE = re.compile(
    r"=\s*\(?[^=]*?\b(all-gather|all-reduce|collective-permute|all-to-all)"
    r"(-start)?\("
)
_SHAPE = re.compile(r"\b[a-z]+[0-9]*\[([0-9,]*)\]")


def inputs(seed: int, batch: int = BATCH, num_draft: int = DRAFT) -> dict:
    """Peaked random distributions with the draft tokens drawn from q; row 0 accepts
    every draft (n = G), row 2 stops at a zero residual (p_0 = q_0 and
    p_0(x_0) = q_0(x_0) = 0), which takes the fallback to p_0.
    """
    rng = np.random.default_rng(seed)

    def dist(shape):
        x = rng.gamma(0.3, size=shape)
        return x / x.sum(-1, keepdims=True)

    q = dist((batch, num_draft, VOCAB))
    p = dist((batch, num_draft + 1, VOCAB))
    tokens = np.array(
        [
            [rng.choice(VOCAB, p=q[b, i]) for i in range(num_draft)]
            for b in range(batch)
        ],
        np.int32,
    ).reshape(batch, num_draft)
    accept = rng.random((batch, num_draft))
    if batch > 2 and num_draft > 0:
        q[2, 0, tokens[2, 0]] = 0
        q[2, 0] /= q[2, 0].sum()
        p[2, 0] = q[2, 0]
        accept[0] = 0
    return {
        "draft_tokens": tokens,
        "draft_probs": q.astype(np.float32),
        "target_probs": p.astype(np.float32),
        "accept_uniforms": accept.astype(np.float32),
        "sample_uniforms": rng.random(batch).astype(np.float32),
    }


# The row of each failure kind in `with_bad_rows`; the other rows are good.
BAD_ROWS = {
    1: "num_draft_tokens_out_of_range",
    3: "draft_token_out_of_range",
    5: "accept_uniform_out_of_range",
    6: "sample_uniform_out_of_range",
    7: "bad_target_prob_at_draft_token",
    9: "bad_draft_prob_at_draft_token",
    10: "bad_target_row",
    11: "bad_draft_row",
    12: "target_row_overflows",
    13: "no_mass",
}


def with_bad_rows() -> dict:
    """16 rows, one per failure kind of a step without the full scan (`BAD_ROWS`),
    among good ones. Rows 10 to 13 stop at n = 0, their first draft token having
    target probability 0.
    """
    args = inputs(5, batch=16)
    tokens, q, p = args["draft_tokens"], args["draft_probs"], args["target_probs"]
    lengths = np.full(16, DRAFT)
    lengths[1] = DRAFT + 1
    tokens[3, 1] = VOCAB
    args["accept_uniforms"][5, 2] = 1.0
    args["sample_uniforms"][6] = np.nan
    p[7, 0, tokens[7, 0]] = -1.0
    q[9, 0, tokens[9, 0]] = np.nan
    for row in (10, 11, 12, 13):
        p[row, 0, tokens[row, 0]] = 0
    other = (tokens[:, 0] + 1) % VOCAB
    p[10, 0, other[10]] = np.nan
    q[11, 0, other[11]] = np.nan
    p[12, 0, :8] = 2e38
    p[13, 0] = 0
    return {**args, "num_draft_tokens": lengths}


def variants() -> dict:
    """Each variant: a step (pieces without an axis name) and its inputs."""
    base = inputs(0)
    no_uniforms = {
        name: base[name] for name in ("draft_tokens", "draft_probs", "target_probs")
    }
    # Every target row's largest value twice, half a vocabulary apart (on two
    # devices whenever the vocabulary is split): the first of the two is the argmax.
    tied = base["target_probs"].copy()
    largest = tied.argmax(-1)
    twin = (largest + VOCAB // 2) % VOCAB
    np.put_along_axis(tied, twin[..., None], tied.max(-1, keepdims=True), axis=-1)
    # Drafts the target agrees with in rows 0 and 4 (all accepted) and at the first
    # position of row 5, so that deterministic and greedy steps accept some.
    agreeing = base["draft_tokens"].copy()
    argmax = tied[:, :DRAFT].argmax(-1)
    agreeing[[0, 4]] = argmax[[0, 4]]
    agreeing[5, 0] = argmax[5, 0]
    deterministic = {
        **no_uniforms,
        "draft_tokens": agreeing,
        "draft_probs": None,
        "target_probs": tied,
    }
    half = {
        name: value.astype(jnp.bfloat16) if value.dtype == np.float32 else value
        for name, value in base.items()
    }
    return {
        "default": (speculax.SpeculativeStep(), base),
        "key": (speculax.SpeculativeStep(), {**no_uniforms, "key": jax.random.key(3)}),
        "ragged": (
            speculax.SpeculativeStep(),
            {**base, "num_draft_tokens": np.array([3, 0, 1, 2, 3, 1, 0, 2])},
        ),
        "deterministic drafts": (
            speculax.SpeculativeStep(),
            {
                **deterministic,
                "accept_uniforms": np.where(
                    np.isin(np.arange(BATCH), [0, 4, 5])[:, None],
                    0,
                    base["accept_uniforms"],
                ).astype(np.float32),
                "sample_uniforms": base["sample_uniforms"],
            },
        ),
        "greedy": (speculax.greedy_step(), deterministic),
        "typical": (
            speculax.SpeculativeStep(speculax.TypicalAcceptance()),
            {**base},
        ),
        "unfused pieces": (
            speculax.SpeculativeStep(
                residual=DelegatingResidual(), sampler=speculax.Argmax()
            ),
            base,
        ),
        "G = 0": (speculax.SpeculativeStep(), inputs(1, num_draft=0)),
        "B = 0": (speculax.SpeculativeStep(), inputs(2, batch=0)),
        "bfloat16": (speculax.SpeculativeStep(), half),
        "check_all_probs": (speculax.SpeculativeStep(check_all_probs=True), base),
        "throw=False": (speculax.SpeculativeStep(throw=False), with_bad_rows()),
        "block": (
            speculax.block_step(),
            {**base, "num_draft_tokens": np.array([3, 0, 1, 2, 3, 1, 0, 2])},
        ),
    }


def on_axis(step: speculax.SpeculativeStep, axis: str) -> speculax.SpeculativeStep:
    """`step` with a custom residual told the axis by hand: its `axis_name` is its
    inner residual's, not a field that `sharded_step` can set."""
    if not isinstance(step.residual, DelegatingResidual):
        return step
    return speculax.SpeculativeStep(
        speculax.RatioAcceptance(axis_name=axis),
        residual=DelegatingResidual(speculax.Residual(axis_name=axis)),
        sampler=speculax.Argmax(axis_name=axis),
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


def run_inspected(f, args: dict, sizes: set[int] | None) -> tuple[tuple, dict]:
    """`f`'s output on `args` and, given `sizes` (the lengths a vocabulary-sized
    collective would have), its compiled program's collectives: the large ones and
    how many there are. One compilation either way."""
    if sizes is None:
        return f(**args), {}
    compiled = jax.jit(lambda a: f(**a)).lower(args).compile()
    hlo = compiled.as_text()
    entry = {
        "large_collectives": large_collectives(hlo, sizes),
        "collectives": len(collectives(hlo)),
    }
    return compiled(args), entry


def same(got: tuple, want: tuple) -> bool:
    """Whether two `(output, result)` pairs agree bit for bit, the output's keys
    included."""
    (got_out, got_result), (want_out, want_result) = got, want
    if list(got_out) != ["num_accepted", "tokens"] or list(got_out) != list(want_out):
        return False
    equal = all(np.array_equal(got_out[k], want_out[k]) for k in want_out)
    return equal and bool(np.all(got_result == want_result))


# The default test tier's subset (`--quick`): the plain step and per-row codes, on
# a mesh that splits both the batch and the vocabulary.
QUICK_VARIANTS = ("default", "throw=False")
QUICK_MESHES = ("2x4",)
# The extended tier's: the vocabulary split most, then both axes split, then the
# batch alone with a vocabulary axis of one device.
CHAIN_MESHES = ("1x8", "2x4", "8x1")


def check_variants(devices: np.ndarray, quick: bool) -> dict:
    found: dict = {}
    meshes = {
        name: shape
        for name, shape in MESHES.items()
        if name in (QUICK_MESHES if quick else CHAIN_MESHES)
    }
    for name, (step, args) in variants().items():
        if quick and name not in QUICK_VARIANTS:
            continue
        reference = jax.jit(step.with_result)(**args)
        found[name] = {"rows": reference[0]["num_accepted"].tolist()}
        if name == "throw=False":
            result = reference[1]
            found[name]["failed"] = np.flatnonzero(
                np.asarray(result != speculax.RESULTS.successful)
            ).tolist()
            found[name]["planted"] = {kind: [row] for row, kind in BAD_ROWS.items()}
            found[name]["rows of each kind"] = {
                kind: np.flatnonzero(
                    np.asarray(result == getattr(speculax.RESULTS, kind))
                ).tolist()
                for kind in BAD_ROWS.values()
            }
        for mesh_name, shape in meshes.items():
            mesh = Mesh(devices.reshape(shape), ("data", "vocab"))
            f = speculax.sharded_step(
                on_axis(step, "vocab"),
                mesh,
                batch_axis="data",
                vocab_axis="vocab",
                with_result=True,
            )
            inspected = name in ("default", "greedy", "typical", "check_all_probs")
            inspected |= name == "block"
            sizes = {VOCAB, VOCAB // shape[1]} if inspected else None
            output, entry = run_inspected(f, args, sizes)
            found[name][mesh_name] = {"identical": same(output, reference), **entry}
    return found


TREE_PARENTS = [0, 0, 1, 1, 2, -1]
# The smallest vocabulary whose slices are whole blocks of 256 on 8 devices.
TREE_VOCAB = 8 * 256


def tree_inputs(seed: int) -> dict:
    """Peaked random trees of one shape with an unused slot, the tokens drawn from
    q, on a batch of `BATCH` rows and a vocabulary of `TREE_VOCAB`; the target is
    the draft, perturbed, so that some paths are kept whole."""
    rng = np.random.default_rng(seed)
    vocab, positions = TREE_VOCAB, len(TREE_PARENTS) + 1
    q = rng.dirichlet(np.full(vocab, 0.05), (BATCH, positions))
    noise = rng.dirichlet(np.full(vocab, 0.05), (BATCH, positions))
    closeness = rng.uniform(0, 1, (BATCH, 1, 1))
    p = closeness * q + (1 - closeness) * noise
    tokens = [
        [rng.choice(vocab, p=q[b, max(k, 0)]) for k in TREE_PARENTS]
        for b in range(BATCH)
    ]
    return {
        "parents": np.tile(TREE_PARENTS, (BATCH, 1)),
        "tree_tokens": np.array(tokens, np.int32),
        "draft_probs": q.astype(np.float32),
        "target_probs": p.astype(np.float32),
        "accept_uniforms": rng.random((BATCH, len(TREE_PARENTS))).astype(np.float32),
        "sample_uniforms": rng.random(BATCH).astype(np.float32),
    }


def tree_variants() -> dict:
    """The tree steps under `sharded_step`: each drafting mode of both walks, the
    greedy tree, uniforms from a key, and per-row codes for bad rows, one of them
    on the last device's slice of the vocabulary."""
    args = tree_inputs(1)
    target_only = {**args, "draft_probs": None}
    keyed = {
        **{k: v for k, v in args.items() if not k.endswith("uniforms")},
        "key": jax.random.key(3),
    }
    bad = {name: np.copy(value) for name, value in args.items()}
    # Rows 1 and 3 lose every child of the root, whose rows are then read whole.
    bad["target_probs"][1, 0, TREE_VOCAB - 5] = np.nan
    bad["draft_probs"][3, 0, TREE_VOCAB - 3] = np.nan
    bad["tree_tokens"][5, 1] = TREE_VOCAB
    without = speculax.SiblingsWithoutReplacement()
    return {
        "tree": (speculax.TreeStep(), args),
        "tree without replacement": (speculax.TreeStep(without), args),
        "tree deterministic": (speculax.TreeStep(), target_only),
        "greedy tree": (speculax.greedy_tree_step(), target_only),
        "traversal": (speculax.TraversalStep(), args),
        "traversal without replacement": (speculax.TraversalStep(without), args),
        "traversal deterministic": (speculax.TraversalStep(), target_only),
        "key": (speculax.TraversalStep(), keyed),
        "throw=False": (speculax.TreeStep(throw=False), bad),
        "traversal throw=False": (speculax.TraversalStep(throw=False), bad),
    }


# The default tier's subset of the tree checks, on one mesh of both axes, under
# the CPU's row strategy (another strategy would drop every compiled program), with
# the batch axis alone too; the compiled programs are searched in the extended
# tier.
QUICK_TREE_VARIANTS = ("traversal throw=False",)
QUICK_TREE_MESHES = ("2x4",)
# The variants whose compiled program is searched for large collectives.
INSPECTED_TREES = ("tree", "tree deterministic", "traversal", "traversal deterministic")
STRATEGIES = ("one at a time", "all at once")
# The extended tier runs the tree and logits steps, a compilation of seconds each
# on eight devices, with the vocabulary split under one row strategy each, on that
# strategy's mesh: the CPU's on the mesh that splits the vocabulary most, the
# accelerators' on the mesh of both axes (the default tier runs the CPU's there);
# and every variant on the batch axis alone. The chain's variants, cheaper, run on
# every mesh.
SPLIT_RUNS = {"one at a time": "1x8", "all at once": "2x4"}
ONE, ALL = STRATEGIES
# Each strategy walks trees of both rules, with and without replacement, drafted
# and deterministic, and checks a searched program of each rule; the default
# tier's variant runs under the other strategy here.
TREE_RUNS = {
    "tree": ONE,
    "tree without replacement": ALL,
    "tree deterministic": ALL,
    "greedy tree": ONE,
    "traversal": ALL,
    "traversal without replacement": ONE,
    "traversal deterministic": ONE,
    "key": ALL,
    "throw=False": ONE,
    "traversal throw=False": ALL,
}
# The failures planted in the bad rows of `tree_variants`.
TREE_FAILURES = ("bad_target_row", "bad_draft_row", "tree_token_out_of_range")


def same_trees(got: tuple, want: tuple) -> bool:
    """Whether two tree steps' `(output, result)` pairs agree bit for bit, the
    output's keys included."""
    (got_out, got_result), (want_out, want_result) = got, want
    # As for any dict through `jax.jit`, in the sorted order of its keys.
    keys = ["accepted_nodes", "num_accepted", "tokens"]
    if list(got_out) != keys or list(want_out) != keys:
        return False
    equal = all(np.array_equal(got_out[k], want_out[k]) for k in keys)
    return equal and bool(np.all(got_result == want_result))


def check_trees(devices: np.ndarray, quick: bool) -> dict:
    """Each tree variant with the vocabulary split under its strategy of
    `TREE_RUNS` on that strategy's mesh, and on the batch axis alone, against one
    device; the collectives of the compiled programs; the refusals (`quick`: the
    default tier's subset, one variant on the 2 x 4 mesh under the CPU's
    strategy, and on the batch axis of the 4 x 2 mesh)."""
    found: dict = {}
    for name, (step, args) in tree_variants().items():
        if quick and name not in QUICK_TREE_VARIANTS:
            continue
        reference = jax.jit(step.with_result)(**args)
        result = reference[1]
        found[name] = {
            "rows": np.asarray(reference[0]["num_accepted"]).tolist(),
            "failed": np.flatnonzero(
                np.asarray(result != speculax.RESULTS.successful)
            ).tolist(),
            "rows of each kind": {
                kind: np.flatnonzero(
                    np.asarray(result == getattr(speculax.RESULTS, kind))
                ).tolist()
                for kind in TREE_FAILURES
            },
        }
        strategy = ONE if quick else TREE_RUNS[name]
        found[name]["strategy"] = strategy
        batch_only = Mesh(devices.reshape(MESHES["4x2"]), ("data", "vocab"))
        f = speculax.sharded_step(step, batch_only, batch_axis="data", with_result=True)
        found[name]["batch axis only"] = same_trees(f(**args), reference)
        mesh_name = QUICK_TREE_MESHES[0] if quick else SPLIT_RUNS[strategy]
        shape = MESHES[mesh_name]
        mesh = Mesh(devices.reshape(shape), ("data", "vocab"))
        with speculax.row_strategy(strategy):
            f = speculax.sharded_step(
                step, mesh, batch_axis="data", vocab_axis="vocab", with_result=True
            )
            inspected = not quick and name in INSPECTED_TREES
            sizes = {TREE_VOCAB, TREE_VOCAB // shape[1]} if inspected else None
            output, entry = run_inspected(f, args, sizes)
        found[name][mesh_name] = {strategy: same_trees(output, reference), **entry}
    found["refused"] = tree_refusals(devices)
    return found


def tree_refusals(devices: np.ndarray) -> dict:
    """The messages of the tree steps that `sharded_step` refuses to split the
    vocabulary for: a sibling rule that reads its rows whole, a sampler that
    names another axis."""

    class Normalising(speculax.AbstractSiblingRule):
        takes_out_one_hot_drafts = False
        subtracts_a_kept_draft = False
        elementwise = False

        def __call__(self, target, draft, rejected):
            left = jnp.maximum(target - draft, 0)
            return left / jnp.sum(left), draft

    mesh = Mesh(devices.reshape(MESHES["4x2"]), ("data", "vocab"))
    refused = {}
    for name, step in {
        "not elementwise": speculax.TreeStep(Normalising()),
        "other axis": speculax.TraversalStep(
            sampler=speculax.InverseCDF(axis_name="model"), axis_name="model"
        ),
    }.items():
        try:
            speculax.sharded_step(step, mesh, batch_axis="data", vocab_axis="vocab")
            refused[name] = None
        except ValueError as error:
            refused[name] = str(error)
    return refused


def logits_variants(vocab: int = TREE_VOCAB) -> dict:
    """`LogitsStep` with the vocabulary split: per-row temperature, top-k and top-p
    with greedy and sampled rows mixed (a top-k of 300 keeps several groups of one
    block, a flat row under a top-p is searched whole), ragged rows, deterministic
    drafts, uniforms from a key, and per-row codes for bad rows, one of them with a
    NaN on the last device's slice."""
    rng = np.random.default_rng(4)
    draft = rng.normal(size=(BATCH, DRAFT, vocab)).astype(np.float32) * 3
    draft[5] /= 30
    target = draft[:, [0, 1, 2, 2]] + rng.normal(size=(BATCH, DRAFT + 1, vocab))
    tokens = draft.argmax(-1).astype(np.int32)
    args = {
        "draft_tokens": tokens,
        "draft_logits": draft,
        "target_logits": target.astype(np.float32),
        "accept_uniforms": rng.random((BATCH, DRAFT)).astype(np.float32),
        "sample_uniforms": rng.random(BATCH).astype(np.float32),
        "temperature": np.array([0, 0.7, 1, 1.3, 0, 1, 0.5, 2], np.float32),
        "top_k": np.array([0, 5, 0, 300, 3, 0, 1, vocab], np.int64),
        "top_p": np.array([1, 1, 0.9, 0.5, 1, 0.95, 1, 0.8], np.float32),
    }
    keyed = {
        **{k: v for k, v in args.items() if not k.endswith("uniforms")},
        "key": jax.random.key(5),
    }
    bad = {name: np.copy(value) for name, value in args.items()}
    bad["target_logits"][2, 0, 7] = np.nan
    bad["temperature"][5] = -1
    bad["draft_logits"][6, 0, vocab - 3] = np.nan
    return {
        "logits": args,
        "logits ragged": {**args, "num_draft_tokens": np.array([3, 0, 1, 2] * 2)},
        "logits deterministic": {**args, "draft_logits": None},
        "logits key": keyed,
        "logits throw=False": bad,
    }


# The default tier's subset of the logits checks, on the 2 x 4 mesh.
QUICK_LOGITS_VARIANTS = ("logits throw=False",)
INSPECTED_LOGITS = ("logits", "logits deterministic", "logits ragged")
# As `TREE_RUNS`, with a searched program on each mesh; the default tier's variant
# runs under the other strategy here.
LOGITS_RUNS = {
    "logits": ONE,
    "logits ragged": ALL,
    "logits deterministic": ONE,
    "logits key": ALL,
    "logits throw=False": ALL,
}


def check_logits(devices: np.ndarray, quick: bool) -> dict:
    """Each logits variant with the vocabulary split under its strategy of
    `LOGITS_RUNS` on that strategy's mesh, and on the batch axis alone, against
    one device; the row statistics and the collectives of the compiled programs
    (`quick`: the default tier's subset, one variant on the 2 x 4 mesh alone)."""
    found: dict = {}
    for name, args in logits_variants().items():
        if quick and name not in QUICK_LOGITS_VARIANTS:
            continue
        step = speculax.LogitsStep(throw=name != "logits throw=False")
        reference = jax.jit(step.with_result)(**args)
        found[name] = {
            "rows": np.asarray(reference[0]["num_accepted"]).tolist(),
            "failed": np.flatnonzero(
                np.asarray(reference[1] != speculax.RESULTS.successful)
            ).tolist(),
            "strategy": ONE if quick else LOGITS_RUNS[name],
        }
        if not quick:
            batch_only = Mesh(devices.reshape(MESHES["4x2"]), ("data", "vocab"))
            f = speculax.sharded_step(
                step, batch_only, batch_axis="data", with_result=True
            )
            found[name]["batch axis only"] = same(f(**args), reference)
        strategy = found[name]["strategy"]
        mesh_name = "2x4" if quick else SPLIT_RUNS[strategy]
        shape = MESHES[mesh_name]
        mesh = Mesh(devices.reshape(shape), ("data", "vocab"))
        with speculax.row_strategy(strategy):
            f = speculax.sharded_step(
                step, mesh, batch_axis="data", vocab_axis="vocab", with_result=True
            )
            inspected = not quick and name in INSPECTED_LOGITS
            sizes = {TREE_VOCAB, TREE_VOCAB // shape[1]} if inspected else None
            output, entry = run_inspected(f, args, sizes)
        found[name][mesh_name] = {strategy: same(output, reference), **entry}
    if not quick:
        found["statistics"] = check_statistics(devices, tuple(SPLIT_RUNS.values()))
    mesh = Mesh(devices.reshape(MESHES["2x4"]), ("data", "vocab"))
    try:
        other = speculax.LogitsStep(axis_name="model")
        speculax.sharded_step(other, mesh, vocab_axis="vocab")
        found["other axis refused"] = None
    except ValueError as error:
        found["other axis refused"] = str(error)
    return found


# Slices of more groups than the fewest searched (2304 and 4608 tokens), so that the
# rows are searched among their groups, as the steps' shorter slices are not
# (`speculax._logits._truncation`).
STATISTICS_VOCAB = 8 * 2304


def check_statistics(devices: np.ndarray, meshes: tuple[str, ...]) -> dict:
    """Whether the statistics of every row of target logits (the largest logit and
    its index, the threshold, the normaliser, the flags), each row under its own
    parameters, are those of one device bit for bit on each of `meshes`, and the
    bad rows are flagged alike: the tokens drawn would hide most differences in a
    last bit."""
    from speculax._logits._parameters import sampling_parameters
    from speculax._logits._truncation import request_statistics

    args = logits_variants(STATISTICS_VOCAB)["logits throw=False"]
    logits = jnp.asarray(args["target_logits"])
    parameters = sampling_parameters(
        args["temperature"], args["top_k"], args["top_p"], BATCH, jnp.dtype("float32")
    )
    (reference,) = request_statistics((logits,), parameters)
    found = {}
    for mesh_name in meshes:
        mesh = Mesh(devices.reshape(MESHES[mesh_name]), ("data", "vocab"))
        split = jax.jit(
            jax.shard_map(
                lambda x, p: request_statistics((x,), p, "vocab")[0],
                mesh=mesh,
                in_specs=(PartitionSpec("data", None, "vocab"), PartitionSpec("data")),
                out_specs=PartitionSpec("data"),
                check_vma=False,
            )
        )(logits, parameters)
        # A bad row (the NaN logit) is flagged alike; the rest of its statistics
        # is never read.
        good = ~np.asarray(reference.bad)
        found[mesh_name] = np.array_equal(split.bad, reference.bad) and all(
            np.array_equal(np.asarray(got)[good], np.asarray(want)[good])
            for got, want in zip(
                jax.tree.leaves(split), jax.tree.leaves(reference), strict=True
            )
        )
    return found


def check_probs_from_logits(devices: np.ndarray, meshes: tuple[str, ...]) -> dict:
    """`probs_from_logits` of logits split over the vocabulary (and the batch), each
    request under its own temperature, top-k and top-p: for each mesh, the
    partition spec of the probabilities (the input's, where none is gathered) and
    whether they are those of one device bit for bit."""
    rng = np.random.default_rng(5)
    logits = (3 * rng.normal(size=(4, 3, TREE_VOCAB))).astype(np.float32)
    parameters = {
        "temperature": np.array([0.0, 0.7, 1.0, 1.3], np.float32),
        "top_k": np.array([0, 5, 0, 40]),
        "top_p": np.array([1.0, 0.9, 0.5, 0.8], np.float32),
    }
    want = np.asarray(speculax.probs_from_logits(logits, **parameters))
    found = {}
    specs = {
        "2x4": PartitionSpec("data", None, "vocab"),
        "1x8": PartitionSpec(None, None, "vocab"),
    }
    for mesh_name in meshes:
        spec = specs[mesh_name]
        mesh = Mesh(devices.reshape(MESHES[mesh_name]), ("data", "vocab"))
        split = jax.device_put(logits, NamedSharding(mesh, spec))
        got = speculax.probs_from_logits(split, **parameters)
        found[mesh_name] = {
            "spec": list(got.sharding.spec),
            "same": bool(np.array_equal(np.asarray(got), want)),
        }
    return found


def raised(f, **args) -> str | None:
    try:
        jax.block_until_ready(f(**args))
    except Exception as error:  # Equinox raises an XlaRuntimeError / RuntimeError
        return str(error)
    return None


def main() -> None:
    devices = np.array(jax.devices())
    # The extended tier's runs apart, each with a time limit of its own.
    if "--logits" in sys.argv:
        found = {
            "logits": check_logits(devices, quick=False),
            "probs_from_logits": check_probs_from_logits(devices, ("1x8",)),
        }
        print(json.dumps(found))
        return
    if "--trees" in sys.argv:
        print(json.dumps({"trees": check_trees(devices, quick=False)}))
        return
    quick = "--quick" in sys.argv
    result: dict = {"variants": check_variants(devices, quick)}
    if quick:
        result["trees"] = check_trees(devices, quick=True)
        result["logits"] = check_logits(devices, quick=True)
        result["probs_from_logits"] = check_probs_from_logits(devices, ("2x4",))
    mesh = Mesh(devices, ("v",))
    step = speculax.SpeculativeStep()
    f = speculax.sharded_step(step, mesh, vocab_axis="v", with_result=True)
    args = inputs(0)
    reference = jax.jit(step.with_result)(**args)
    # Inputs already on one device are placed on the mesh.
    committed = {
        name: jax.device_put(value, devices[0]) for name, value in args.items()
    }
    result["committed"] = same(f(**committed), reference)
    short = {
        **args,
        "draft_probs": args["draft_probs"][..., :-4],
        "target_probs": args["target_probs"][..., :-4],
    }
    try:
        f(**short)
        result["indivisible"] = None
    except ValueError as error:
        result["indivisible"] = str(error)
    bad = {name: value.copy() for name, value in args.items()}
    bad["draft_tokens"][3, 1] = VOCAB
    result["bad_token"] = raised(f, **bad)
    # Tokens of any integer dtype are read by value: int16 answers as int32 does, and
    # an int64 2**32 + 1 is out of range, not token 1.
    narrow = f(**{**args, "draft_tokens": args["draft_tokens"].astype(np.int16)})
    result["int16_identical"] = same(narrow, reference)
    wide = args["draft_tokens"].astype(np.int64)
    wide[3, 1] = 2**32 + 1
    result["int64_token"] = raised(f, **{**args, "draft_tokens": wide})
    # Row 0 accepts every draft: a p_G of finite values summing past float32.
    huge = args["target_probs"].copy()
    huge[0, DRAFT] = 2e38
    result["overflow"] = raised(f, **{**args, "target_probs": huge})
    refused = {}
    for name, piece in {
        "fixed axis": speculax.SpeculativeStep(
            speculax.RatioAcceptance(axis_name="model"),
            residual=speculax.Residual(axis_name="model"),
            sampler=speculax.InverseCDF(axis_name="model"),
        ),
        "no axis field": speculax.SpeculativeStep(residual=DelegatingResidual()),
    }.items():
        try:
            speculax.sharded_step(piece, mesh, vocab_axis="v")
            refused[name] = None
        except ValueError as error:
            refused[name] = str(error)
    result["refused"] = refused
    print(json.dumps(result))


if __name__ == "__main__":
    main()
