"""`speculax.sharded_step` on 8 simulated CPU devices.

The device count is fixed when JAX initialises, and this process already runs JAX on
one device, so the checks run in a subprocess (`tests/sharded_checks.py`, compiling
once per variant and mesh) and this file asserts on the JSON it prints. Under
pytest-xdist one worker runs each subprocess and the others read its JSON.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest


HERE = Path(__file__).resolve().parent
# The chain's extended checks: the vocabulary split most, both axes split, the
# batch alone with a vocabulary axis of one device (tests/sharded_checks.py).
CHAIN_MESHES = ["1x8", "2x4", "8x1"]
VARIANTS = [
    "default",
    "key",
    "ragged",
    "deterministic drafts",
    "greedy",
    "typical",
    "unfused pieces",
    "G = 0",
    "B = 0",
    "bfloat16",
    "check_all_probs",
    "throw=False",
    "block",
]
# The variants whose compiled program is searched for large collectives.
INSPECTED = ["default", "greedy", "typical", "check_all_probs", "block"]


def _run_checks(*options: str) -> dict:
    # The script adds the device count to this process's XLA_FLAGS.
    done = subprocess.run(
        [sys.executable, str(HERE / "sharded_checks.py"), *options],
        capture_output=True,
        text=True,
        # The extended tier's logits run takes 7 minutes alone, 11 beside another
        # run on the two cores.
        timeout=1500,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _checks(shared: Path | None, *options: str) -> dict:
    """The checks' JSON; under xdist, from the worker that claims `options` first
    (`shared` is the run's folder, common to its workers), so that a run of
    minutes is not repeated on every worker."""
    if shared is None:
        return _run_checks(*options)
    stem = shared / "_".join(["sharded", *options]).replace(" ", "-")
    done, failed = stem.with_suffix(".json"), stem.with_suffix(".failed")
    try:
        os.close(os.open(stem.with_suffix(".claim"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        for _ in range(1800):
            if done.exists():
                return json.loads(done.read_text())
            assert not failed.exists(), failed.read_text()
            time.sleep(1)
        raise TimeoutError(f"no worker finished the checks {options}") from None
    try:
        found = _run_checks(*options)
    except BaseException as error:
        failed.write_text(f"the worker that ran {options} failed: {error}")
        raise
    partial = stem.with_suffix(".partial")
    partial.write_text(json.dumps(found))
    partial.rename(done)
    return found


@pytest.fixture(scope="module")
def shared(tmp_path_factory, worker_id) -> Path | None:
    """The folder common to this run's xdist workers; `None` without xdist."""
    if worker_id == "master":
        return None
    return tmp_path_factory.getbasetemp().parent


@pytest.fixture(scope="module")
def result(shared) -> dict:
    """Every chain variant on the meshes of `CHAIN_MESHES`: the extended tier."""
    return _checks(shared)


@pytest.fixture(scope="module")
def trees(shared) -> dict:
    """Every tree variant with the vocabulary split under one row strategy, on
    its mesh of `SPLIT_RUNS`, and on the batch axis alone; the compiled
    programs' collectives; the inputs' coverage: the extended tier."""
    return _checks(shared, "--trees")["trees"]


@pytest.fixture(scope="module")
def logits_run(shared) -> dict:
    """Every logits variant with the vocabulary split under one row strategy, on
    its mesh of `SPLIT_RUNS`, and on the batch axis of the 4 x 2 mesh;
    `probs_from_logits` on the 1 x 8 mesh: the extended tier."""
    return _checks(shared, "--logits")


@pytest.fixture(scope="module")
def logits(logits_run) -> dict:
    return logits_run["logits"]


@pytest.fixture(scope="module")
def quick(shared) -> dict:
    """Two chain variants on the 2 x 4 mesh; one tree variant on the 2 x 4 mesh and
    on the batch axis of the 4 x 2 mesh; one logits variant on the 2 x 4 mesh; the
    other checks: the default tier."""
    return _checks(shared, "--quick")


QUICK_VARIANTS = ["default", "throw=False"]


@pytest.mark.parametrize("variant", QUICK_VARIANTS)
def test_identical_to_single_device_on_a_mesh_of_both_axes(quick, variant):
    """Tokens, counts and per-row result codes, bit for bit, on the 2 x 4 mesh."""
    assert list(quick["variants"]) == QUICK_VARIANTS
    assert quick["variants"][variant]["2x4"]["identical"]


@pytest.mark.parametrize("variant", ["default"])
def test_no_vocabulary_sized_collective_on_a_mesh_of_both_axes(quick, variant):
    entry = quick["variants"][variant]["2x4"]
    assert entry["large_collectives"] == []
    assert entry["collectives"] >= 3


QUICK_TREE_VARIANTS = ["traversal throw=False"]
TREE_VARIANTS = [
    "tree",
    "tree without replacement",
    "tree deterministic",
    "greedy tree",
    "traversal",
    "traversal without replacement",
    "traversal deterministic",
    "key",
    "throw=False",
    "traversal throw=False",
]
INSPECTED_TREES = ["tree", "tree deterministic", "traversal", "traversal deterministic"]
STRATEGIES = ["one at a time", "all at once"]
ONE, ALL = STRATEGIES
# The mesh the extended tier runs the tree and logits steps on under each row
# strategy (and the batch axis alone on the 4 x 2 mesh); each variant runs under
# one of them, which the checks report: tests/sharded_checks.py says why.
SPLIT_RUNS = {ONE: "1x8", ALL: "2x4"}


@pytest.mark.parametrize("variant", QUICK_TREE_VARIANTS)
def test_a_tree_step_on_a_mesh_of_both_axes_is_the_step_on_one_device(quick, variant):
    """The devices of a row walk its tree together: tokens, counts, accepted nodes
    and per-row codes bit for bit, on the 2 x 4 mesh (under the accelerators' row
    strategy too in the extended tier)."""
    assert list(quick["trees"]) == [*QUICK_TREE_VARIANTS, "refused"]
    assert quick["trees"][variant]["2x4"][STRATEGIES[0]]


def test_a_tree_step_on_a_batch_axis_is_the_step_on_one_device(quick):
    """Each device walks its own trees, on the batch axis of the 4 x 2 mesh."""
    assert quick["trees"]["traversal throw=False"]["batch axis only"]


@pytest.mark.slow
def test_each_strategy_walks_every_kind_of_tree(trees):
    """With the vocabulary split, each row strategy walks trees of both rules,
    with and without replacement, drafted and deterministic."""
    for strategy in STRATEGIES:
        walked = {name for name in TREE_VARIANTS if trees[name]["strategy"] == strategy}
        assert walked & {"tree", "tree without replacement"}
        assert walked & {"traversal", "traversal without replacement"}
        assert walked & {"tree deterministic", "traversal deterministic"}
        assert walked & {"tree", "traversal", "key"}
        assert walked & {"tree without replacement", "traversal without replacement"}


@pytest.mark.slow
@pytest.mark.parametrize("variant", TREE_VARIANTS)
def test_every_tree_step_on_a_split_vocabulary_is_the_step_on_one_device(
    trees, variant
):
    """Under the variant's row strategy, on that strategy's mesh."""
    strategy = trees[variant]["strategy"]
    assert trees[variant][SPLIT_RUNS[strategy]][strategy]


@pytest.mark.slow
@pytest.mark.parametrize("variant", TREE_VARIANTS)
def test_every_tree_step_on_a_batch_axis_is_the_step_on_one_device(trees, variant):
    assert trees[variant]["batch axis only"]


@pytest.mark.slow
@pytest.mark.parametrize("variant", INSPECTED_TREES)
def test_no_vocabulary_sized_collective_in_any_tree_step(trees, variant):
    entry = trees[variant][SPLIT_RUNS[trees[variant]["strategy"]]]
    assert entry["large_collectives"] == []
    assert entry["collectives"] >= 4


@pytest.mark.slow
def test_the_searched_tree_programs_cover_both_strategies(trees):
    assert {trees[name]["strategy"] for name in INSPECTED_TREES} == set(STRATEGIES)


@pytest.mark.slow
def test_the_tree_inputs_cover_the_branches(trees):
    """Paths cut at the root, in the middle and kept whole; the bad rows fail with
    the kind planted, on the last device's slice too, and only they."""
    assert set(trees["tree"]["rows"]) == {0, 2}
    assert 1 in trees["key"]["rows"]
    assert set(trees["traversal"]["rows"]) == {0, 2}
    assert trees["throw=False"]["rows of each kind"] == {
        "bad_target_row": [1],
        "bad_draft_row": [3],
        "tree_token_out_of_range": [5],
    }
    assert trees["throw=False"]["failed"] == [1, 3, 5]
    assert trees["traversal throw=False"]["failed"] == [1, 5]
    assert [name for name in trees if name in TREE_VARIANTS] == TREE_VARIANTS


def test_tree_steps_that_cannot_split_the_vocabulary_are_refused(quick):
    refused = quick["trees"]["refused"]
    assert "Normalising, is not elementwise" in refused["not elementwise"]
    assert "splits the vocabulary over 'model'" in refused["other axis"]


@pytest.mark.slow
def test_every_variant_is_checked(result):
    assert list(result["variants"]) == VARIANTS


@pytest.mark.slow
def test_inputs_cover_the_branches(result):
    # Row 0 accepts every draft (n = G); row 2 stops at a zero residual (n = 0);
    # deterministic drafts and greedy verification accept some tokens too.
    rows = result["variants"]["default"]["rows"]
    assert rows[0] == 3 and rows[2] == 0
    for name in ("deterministic drafts", "greedy"):
        rows = result["variants"][name]["rows"]
        assert rows[0] == 3 and rows[4] == 3 and rows[5] >= 1
    assert result["variants"]["B = 0"]["rows"] == []


@pytest.mark.slow
@pytest.mark.parametrize("mesh", CHAIN_MESHES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_identical_to_single_device(result, variant, mesh):
    """Tokens, counts and per-row result codes, bit for bit."""
    assert result["variants"][variant][mesh]["identical"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", CHAIN_MESHES)
@pytest.mark.parametrize("variant", INSPECTED)
def test_no_vocabulary_sized_collective(result, variant, mesh):
    entry = result["variants"][variant][mesh]
    assert entry["large_collectives"] == []
    # Proof that the parser sees the collectives it is meant to bound: the psums of
    # p_i(x_i) (and q_i(x_i)), the gathered block sums, the drawn token.
    assert entry["collectives"] >= 3


def test_each_failure_kind_is_reported_in_its_row(quick):
    """One row per failure kind of the step, among good rows; bit-identical codes on
    every mesh are asserted with the outputs above."""
    found = quick["variants"]["throw=False"]
    planted = found["planted"]
    assert len(planted) == 10
    assert found["failed"] == sorted(row for rows in planted.values() for row in rows)
    assert found["rows of each kind"] == planted


def test_inputs_on_one_device_are_placed_on_the_mesh(quick):
    assert quick["committed"]


def test_indivisible_vocabulary(quick):
    message = quick["indivisible"]
    assert message is not None
    assert "divisible" in message and "vocab_axis" in message


def test_value_checks_run(quick):
    assert quick["bad_token"] is not None
    assert "draft_tokens must lie in [0, V)" in quick["bad_token"]


def test_integer_tokens_are_read_by_value(quick):
    assert quick["int16_identical"]
    message = quick["int64_token"]
    assert message is not None and "draft_tokens must lie in [0, V)" in message


def test_an_overflowing_row_names_target_probs(quick):
    message = quick["overflow"]
    assert message is not None and "target_probs must have rows whose total" in message


def test_pieces_that_cannot_split_the_vocabulary_are_refused(quick):
    refused = quick["refused"]
    assert "splits the vocabulary over 'model'" in refused["fixed axis"]
    assert "DelegatingResidual, cannot split the vocabulary" in refused["no axis field"]


def test_structure_errors_on_one_device():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import speculax

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "vocab"))
    with pytest.raises(ValueError, match="vocab_axis must be one of"):
        speculax.sharded_step(speculax.SpeculativeStep(), mesh, vocab_axis="model")
    with pytest.raises(ValueError, match="must differ"):
        speculax.sharded_step(
            speculax.SpeculativeStep(), mesh, batch_axis="data", vocab_axis="data"
        )
    split = speculax.SpeculativeStep(
        speculax.RatioAcceptance(axis_name="vocab"),
        residual=speculax.Residual(axis_name="vocab"),
        sampler=speculax.InverseCDF(axis_name="vocab"),
    )
    # Pieces that split the vocabulary over an axis the inputs are not split over
    # would add up copies of whole rows.
    with pytest.raises(ValueError, match="but vocab_axis is None"):
        speculax.sharded_step(split, mesh, batch_axis="data")
    f = speculax.sharded_step(
        speculax.SpeculativeStep(), mesh, batch_axis="data", vocab_axis="vocab"
    )
    with pytest.raises(ValueError, match="draft_probs must have shape"):
        f(
            np.zeros((1, 2), np.int32),
            np.full((1, 2, 5), 0.2, np.float32),
            np.full((1, 3, 4), 0.25, np.float32),
            np.zeros((1, 2), np.float32),
            np.zeros((1,), np.float32),
        )
    with pytest.raises(ValueError, match="sample_uniforms is required"):
        f(
            np.zeros((1, 2), np.int32),
            np.full((1, 2, 4), 0.25, np.float32),
            np.full((1, 3, 4), 0.25, np.float32),
            np.zeros((1, 2), np.float32),
        )


def test_a_piece_whose_axis_name_is_fixed_is_refused_by_name():
    """A piece that fixes its `axis_name` at `None` with a field of `init=False`, as
    the guide writes one that reads whole rows, cannot split the vocabulary."""
    from typing import ClassVar

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    import speculax

    class WholeRows(speculax.AbstractSampler):
        reads_uniforms: ClassVar[bool] = False
        axis_name: str | None = eqx.field(default=None, static=True, init=False)

        def __call__(self, weights, sample_uniforms):
            return jnp.argmax(weights, axis=-1).astype(jnp.int32)

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "vocab"))
    step = speculax.SpeculativeStep(sampler=WholeRows())
    with pytest.raises(ValueError, match="sampler, WholeRows, cannot split"):
        speculax.sharded_step(step, mesh, vocab_axis="vocab")
    # Over the batch alone it needs no axis and runs.
    speculax.sharded_step(step, mesh, batch_axis="data")


QUICK_LOGITS_VARIANTS = ["logits throw=False"]
LOGITS_VARIANTS = [
    "logits",
    "logits ragged",
    "logits deterministic",
    "logits key",
    "logits throw=False",
]
INSPECTED_LOGITS = ["logits", "logits deterministic", "logits ragged"]


def test_the_logits_step_on_a_mesh_of_both_axes_is_the_step_on_one_device(quick):
    """Per-row temperature, top-k and top-p, greedy and sampled rows mixed, split
    with their rows and over their vocabulary, and three bad rows: counts, tokens
    and per-row codes bit for bit on the 2 x 4 mesh (the other row strategy and
    meshes in the extended tier)."""
    assert list(quick["logits"]) == [*QUICK_LOGITS_VARIANTS, "other axis refused"]
    assert quick["logits"]["logits throw=False"]["2x4"]["one at a time"]


def test_probs_from_logits_keeps_the_vocabulary_split(quick):
    """Logits split over the vocabulary and the batch give probabilities split as
    they are, as `jax.nn.softmax` keeps its input's sharding, and bit for bit those
    of one device, per-request parameters mixed (the vocabulary split alone in the
    extended tier)."""
    assert quick["probs_from_logits"] == {
        "2x4": {"spec": ["data", None, "vocab"], "same": True},
    }


@pytest.mark.slow
def test_probs_from_logits_keeps_a_split_vocabulary_split(logits_run):
    assert logits_run["probs_from_logits"] == {
        "1x8": {"spec": [None, None, "vocab"], "same": True},
    }


@pytest.mark.slow
def test_the_row_statistics_on_a_split_vocabulary_are_those_of_one_device(logits):
    """The largest logit and its index, the thresholds and the normalisers of the
    split rows, each under its own parameters, bit for bit: a last bit that the
    tokens would hide."""
    assert logits["statistics"] == dict.fromkeys(SPLIT_RUNS.values(), True)


@pytest.mark.slow
@pytest.mark.parametrize("variant", LOGITS_VARIANTS)
def test_every_logits_variant_on_a_split_vocabulary_is_the_step_on_one_device(
    logits, variant
):
    """Under the variant's row strategy, on that strategy's mesh."""
    strategy = logits[variant]["strategy"]
    assert logits[variant][SPLIT_RUNS[strategy]][strategy]


@pytest.mark.slow
@pytest.mark.parametrize("variant", LOGITS_VARIANTS)
def test_every_logits_variant_on_a_batch_axis_is_the_step_on_one_device(
    logits, variant
):
    assert logits[variant]["batch axis only"]


@pytest.mark.slow
@pytest.mark.parametrize("variant", INSPECTED_LOGITS)
def test_no_vocabulary_sized_collective_in_any_logits_step(logits, variant):
    entry = logits[variant][SPLIT_RUNS[logits[variant]["strategy"]]]
    assert entry["large_collectives"] == []
    assert entry["collectives"] >= 6


@pytest.mark.slow
def test_the_searched_logits_programs_cover_both_strategies(logits):
    assert {logits[name]["strategy"] for name in INSPECTED_LOGITS} == set(STRATEGIES)


@pytest.mark.slow
def test_the_logits_inputs_cover_the_branches(logits):
    """Rows that keep every draft, none and some; the bad rows fail, and only
    they."""
    assert {0, 3} <= set(logits["logits"]["rows"])
    assert set(logits["logits"]["rows"]) - {0, 3}
    assert logits["logits throw=False"]["failed"] == [2, 5, 6]
    assert list(logits)[:-2] == LOGITS_VARIANTS


def test_a_logits_step_on_another_axis_is_refused(quick):
    message = quick["logits"]["other axis refused"]
    assert message is not None
    assert "splits the vocabulary over 'model', but vocab_axis is 'vocab'" in message
