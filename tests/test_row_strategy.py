"""The row strategies (`speculax.row_strategy`): all rows at once, the accelerators'
path, never loops over the batch; one row at a time, the CPU's, does.

A loop over the rows would run serially on a GPU, each row's work one after another.
The test counts the sequential loop iterations of each step's program, from its
jaxpr alone (no compilation): a `scan` contributes its length times the iterations
of its body, a `while` loop the bound of `WHILE_BOUNDS` times its body's, a `cond`
its costliest branch; and asserts that the count at B = 32 is the count at B = 4.
"""

import functools
import math
import os
import pathlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import speculax


class Sizes(NamedTuple):
    """The static sizes of a step's inputs: $G$ drafts, $N$ tree nodes, $V$."""

    draft: int
    nodes: int
    vocab: int


SIZES = Sizes(draft=3, nodes=6, vocab=16)
BATCHES = (4, 32)

# Every genuine while loop of the steps, by the function that calls `while_loop`, with
# the most iterations it can run for one row (a batched loop runs until every row is
# done: the same bound) and why. A `fori_loop` with static bounds is a `scan`.
WHILE_BOUNDS = {
    ("_stopping_rows.py", "stopping_row_summary"): (
        lambda sizes: 2,
        "the row summary's passes: the block sums, and once more as p_n for the rows "
        "whose residual has no mass",
    ),
    ("_truncation.py", "_largest_holding"): (
        lambda sizes: _search_steps(),
        "a search over the integer keys of float32 values, each step splitting the "
        "interval in `_search_width()` parts: 32 bits, log2(width) at a step",
    ),
    ("_truncation.py", "_Values._block_lanes"): (
        lambda sizes: 16,
        "a block's searched groups added in turn: at most the 16 groups of a block",
    ),
    ("_traversal.py", "TraversalStep._walk"): (
        lambda sizes: sizes.nodes,
        "one deletion per iteration, of a draft node that failed its test (the root "
        "never fails)",
    ),
    ("_traversal.py", "_advance"): (
        lambda sizes: 2 * sizes.nodes + 1,
        "one event per iteration, entering or testing a node: at most twice per "
        "draft node, once for the root",
    ),
}


def _search_steps() -> int:
    """The most steps of a threshold search under the row strategy in force."""
    from speculax._logits._truncation import _search_width

    return math.ceil(32 / math.log2(_search_width()))


def _sub_jaxprs(eqn) -> list:
    """The jaxprs inside an equation's parameters (pjit, cond branches, loop bodies,
    custom derivatives' primal functions, ...)."""
    from jax.extend import core

    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if isinstance(item, core.ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, core.Jaxpr):
                found.append(item)
    return found


# The library's own source folder, wherever the repository is cloned: a clone named
# `speculax` puts `/speculax/` in the path of every file of its virtual environment.
_LIBRARY = str(pathlib.Path(speculax.__file__).resolve().parent) + os.sep


def _caller(eqn) -> tuple[str, str] | None:
    """The innermost function of speculax on the stack that made the equation, as
    `(file name, qualified function name)`."""
    for frame in eqn.source_info.traceback.frames:
        if str(pathlib.Path(frame.file_name).resolve()).startswith(_LIBRARY):
            return frame.file_name.rsplit("/", 1)[-1], frame.function_name
    return None


def _while_bound(eqn, sizes: Sizes) -> int:
    caller = _caller(eqn)
    if caller not in WHILE_BOUNDS:
        raise AssertionError(
            f"a while loop from {caller} has no bound in WHILE_BOUNDS: derive one "
            "from the code and add it, with the reason"
        )
    bound, _ = WHILE_BOUNDS[caller]
    return bound(sizes)


def _loops(jaxpr) -> int:
    """The loops of `jaxpr`, nested ones included."""
    return sum(
        (eqn.primitive.name in ("while", "scan")) + sum(map(_loops, _sub_jaxprs(eqn)))
        for eqn in jaxpr.eqns
    )


def loop_iterations(jaxpr, sizes: Sizes) -> int:
    """The sequential loop iterations of `jaxpr`, nested loops multiplied out."""
    total = 0
    for eqn in jaxpr.eqns:
        inner = [loop_iterations(sub, sizes) for sub in _sub_jaxprs(eqn)]
        name = eqn.primitive.name
        if name == "scan":
            total += eqn.params["length"] * (1 + sum(inner))
        elif name == "while":
            total += _while_bound(eqn, sizes) * (1 + sum(inner))
        elif name == "cond":
            total += max(inner)
        else:
            total += sum(inner)
    return total


def _chain_inputs(batch: int, sizes: Sizes, draft_probs: bool = True) -> dict:
    from inputs import random_inputs

    inputs = random_inputs(0, batch, sizes.draft, sizes.vocab)
    return inputs if draft_probs else {**inputs, "draft_probs": None}


def _logits_inputs(batch: int, sizes: Sizes, truncated: bool) -> dict:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((batch, sizes.draft + 1, sizes.vocab))
    inputs = _chain_inputs(batch, sizes)
    inputs["draft_probs"] = jnp.asarray(logits[:, :-1], jnp.float32)
    inputs["target_probs"] = jnp.asarray(logits, jnp.float32)
    if truncated:
        inputs["top_k"] = jnp.full((batch,), 5)
        inputs["top_p"] = jnp.full((batch,), 0.9)
    return inputs


def _tree_inputs(batch: int, sizes: Sizes, draft_probs: bool = True) -> dict:
    rng = np.random.default_rng(0)
    shape = (batch, sizes.nodes + 1, sizes.vocab)
    parents = np.array([0, 0, 1, 1, 2, -1])[: sizes.nodes]
    draft = jnp.asarray(rng.random(shape), jnp.float32)
    return {
        "parents": jnp.tile(jnp.asarray(parents), (batch, 1)),
        "tree_tokens": jnp.zeros((batch, sizes.nodes), jnp.int32),
        "draft_probs": draft if draft_probs else None,
        "target_probs": jnp.asarray(rng.random(shape), jnp.float32),
        "accept_uniforms": jnp.full((batch, sizes.nodes), 0.5),
        "sample_uniforms": jnp.full((batch,), 0.5),
    }


def _steps() -> dict:
    """Each step, with the inputs it is traced on for a batch size."""

    def logits_step(truncated):
        def call(inputs):
            draft, target = inputs.pop("draft_probs"), inputs.pop("target_probs")
            tokens = inputs.pop("draft_tokens")
            return speculax.LogitsStep()(tokens, draft, target, **inputs)

        return call, functools.partial(_logits_inputs, truncated=truncated)

    def plain(step, inputs):
        return lambda x: step(**x), inputs

    return {
        "default": plain(speculax.SpeculativeStep(), _chain_inputs),
        "greedy": plain(speculax.greedy_step(), _chain_inputs),
        "block": plain(speculax.block_step(), _chain_inputs),
        "deterministic": plain(
            speculax.SpeculativeStep(),
            functools.partial(_chain_inputs, draft_probs=False),
        ),
        "logits": logits_step(truncated=False),
        "logits truncated": logits_step(truncated=True),
        "tree": plain(speculax.TreeStep(), _tree_inputs),
        "tree deterministic": plain(
            speculax.TreeStep(), functools.partial(_tree_inputs, draft_probs=False)
        ),
        "greedy tree": plain(
            speculax.greedy_tree_step(),
            functools.partial(_tree_inputs, draft_probs=False),
        ),
        "traversal": plain(speculax.TraversalStep(), _tree_inputs),
    }


STEP_NAMES = (
    "default",
    "greedy",
    "block",
    "deterministic",
    "logits",
    "logits truncated",
    "tree",
    "tree deterministic",
    "greedy tree",
    "traversal",
)


@functools.cache
def counts(strategy: str, names: tuple[str, ...]) -> dict[str, dict[int, int]]:
    """The loop iterations of the steps `names` under `strategy`, by step and batch
    size, traced in one `row_strategy` block (a block that changes the strategy
    clears JAX's caches on entry and exit)."""
    import speculax

    steps = _steps()
    with speculax.row_strategy(strategy):
        return {
            name: {
                batch: loop_iterations(
                    jax.make_jaxpr(steps[name][0])(steps[name][1](batch, SIZES)).jaxpr,
                    SIZES,
                )
                for batch in BATCHES
            }
            for name in names
        }


# The default tier checks two steps under each strategy, one with a genuine while
# loop; the rest are slow.
TIERED_STEP_NAMES = [
    name
    if name in ("default", "traversal")
    else pytest.param(name, marks=pytest.mark.slow)
    for name in STEP_NAMES
]


@pytest.mark.parametrize("name", TIERED_STEP_NAMES)
def test_all_at_once_runs_no_loop_over_the_batch(name):
    got = counts("all at once", (name,))[name]
    print(f"{name}, all at once: {got}")
    assert got[32] == got[4], got


# The sequential loop iterations of each step on the accelerators' path, for a row
# at `SIZES`, as counted when they last changed: a change that adds serial steps
# fails here. The truncated logits step is counted at a longer row too, where it
# searches among groups of tokens rather than the whole row (src/speculax/_logits/
# _truncation.py).
SERIAL_ITERATIONS = {
    "default": 0,
    "greedy": 0,
    "block": 0,
    "deterministic": 0,
    "logits": 1,
    "logits truncated": 15,
    "tree": 6,
    "tree deterministic": 6,
    "greedy tree": 6,
    "traversal": 103,
}
LONG_ROW_SIZES = SIZES._replace(vocab=4096)
LONG_ROW_SERIAL_ITERATIONS = 36
# Loops in the jaxpr of the long row, nested ones included: the compiled program
# holds no more (5 at V = 128256, `speculax bench --compile-only`).
LONG_ROW_LOOPS = 6


@pytest.mark.parametrize("name", TIERED_STEP_NAMES)
def test_the_serial_iterations_of_all_at_once_do_not_grow(name):
    assert counts("all at once", (name,))[name][4] <= SERIAL_ITERATIONS[name]


def test_the_loops_and_serial_iterations_of_a_long_truncated_row_do_not_grow():
    import speculax

    step, inputs = _steps()["logits truncated"]
    with speculax.row_strategy("all at once"):
        jaxpr = jax.make_jaxpr(step)(inputs(4, LONG_ROW_SIZES)).jaxpr
        iterations = loop_iterations(jaxpr, LONG_ROW_SIZES)
    assert iterations <= LONG_ROW_SERIAL_ITERATIONS
    assert _loops(jaxpr) <= LONG_ROW_LOOPS


# The count sees a loop over the batch: on the CPU's path every step has one.
@pytest.mark.parametrize("name", TIERED_STEP_NAMES)
def test_one_at_a_time_loops_over_the_batch(name):
    got = counts("one at a time", (name,))[name]
    print(f"{name}, one at a time: {got}")
    assert got[32] > got[4], got


def test_the_strategy_is_checked_and_caches_clear_only_on_a_change(monkeypatch):
    import speculax

    with (
        pytest.raises(ValueError, match=r"strategy must be one of .*; got 'gather'"),
        speculax.row_strategy("gather"),
    ):
        pass
    cleared = []
    monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(True))
    own = "one at a time" if jax.default_backend() == "cpu" else "all at once"
    other = "all at once" if own == "one at a time" else "one at a time"
    with speculax.row_strategy(own):
        assert cleared == []
        with speculax.row_strategy(other):
            assert len(cleared) == 1
            with speculax.row_strategy(other):
                assert len(cleared) == 1
        assert len(cleared) == 2
    assert len(cleared) == 2


def _loop_carries(jaxpr) -> list[tuple[int, ...]]:
    """The shapes of what every loop of `jaxpr` carries from one iteration to the
    next, nested loops included (not what a scan stacks)."""
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "while":
            shapes += [tuple(var.aval.shape) for var in eqn.outvars]
        if eqn.primitive.name == "scan":
            carried = eqn.outvars[: eqn.params["num_carry"]]
            shapes += [tuple(var.aval.shape) for var in carried]
        for sub in _sub_jaxprs(eqn):
            shapes += _loop_carries(sub)
    return shapes


WALKS_THAT_KEEP_ROWS = ("tree, q", "traversal without replacement")


@pytest.mark.parametrize("strategy", ["one at a time", "all at once"])
@pytest.mark.parametrize(
    "step",
    ["tree, target only", "greedy tree", "traversal", *WALKS_THAT_KEEP_ROWS],
)
def test_tree_walks_that_keep_numbers_carry_no_vocabulary_row(strategy, step):
    """With deterministic drafts a rejection takes its token out of the target row
    (`docs/trees.md`), and a traversal deletion with independent siblings keeps two
    numbers (`docs/keeping_more.md`): no loop of the step carries a `(V,)` row,
    which a rejection would rewrite; nor does greedy verification's, draft
    probabilities given. The recursive step with draft probabilities and the
    traversal without replacement keep their rows: the controls that the check
    sees a carried row."""
    import speculax

    sizes = Sizes(draft=3, nodes=6, vocab=97)
    inputs = _tree_inputs(4, sizes, draft_probs=step != "tree, target only")
    tree_step = {
        "tree, target only": speculax.TreeStep(),
        "tree, q": speculax.TreeStep(),
        "greedy tree": speculax.greedy_tree_step(),
        "traversal": speculax.TraversalStep(),
        "traversal without replacement": speculax.TraversalStep(
            speculax.SiblingsWithoutReplacement()
        ),
    }[step]
    with speculax.row_strategy(strategy):
        jaxpr = jax.make_jaxpr(lambda x: tree_step(**x))(inputs).jaxpr
    carries_a_row = any(sizes.vocab in shape for shape in _loop_carries(jaxpr))
    assert carries_a_row == (step in WALKS_THAT_KEEP_ROWS)
