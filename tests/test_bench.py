"""`speculax bench`: it runs, and its three functions agree where they should. No
timing assertions.
"""

import ast
import json
import pathlib
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import speculax
from speculax._cli._bench import (
    Size,
    argmax_verification,
    baseline_step,
    baseline_tree_step,
    eagle_tree,
    floor,
    format_table,
    make_inputs,
    make_logits_inputs,
    make_tree_inputs,
    verify_from_logits,
    verify_through_probs,
)
from speculax._cli._compile_cost import format_compile_table, programs
from speculax._cli._compiled import compile_cold


DEVICE_CHECK = pathlib.Path(__file__).parents[1] / "scripts" / "device_check.py"


@pytest.mark.slow
def test_bench_command_runs_on_tiny_sizes(capsys):
    from speculax._cli._command import main

    sizes = [
        "2x3x300",
        "3x2x257:bfloat16",
        "2x2x300:deterministic",
        "2x2x300:greedy",
        "2x25x300:tree",
        "2x2x300:logits",
        "2x2x300:bfloat16:truncated",
    ]
    status = main(
        [
            "bench",
            "--sizes",
            *sizes,
            "--repeats",
            "1",
            "--json",
            "--compile-size",
            "none",
        ]
    )
    assert status == 0
    captured = capsys.readouterr()
    # Standard output is the JSON alone; the progress, a line as each size starts
    # and one as it ends, is on standard error.
    report = json.loads(captured.out)
    progress = captured.err.splitlines()
    assert len(progress) == 1 + 2 * len(sizes)
    assert progress[1] == "speculax bench: [1/7] 2x3x300:float32: timing ..."
    assert progress[-1].startswith("speculax bench: [7/7] 2x2x300:bfloat16:truncated: ")
    assert progress[-1].endswith(" s)") and "x the floor" in progress[-1]
    assert report["backend"] == jax.default_backend()
    rows = report["results"]
    assert [row["size"] for row in rows] == [
        "2x3x300:float32",
        "3x2x257:bfloat16",
        "2x2x300:float32:deterministic",
        "2x2x300:float32:greedy",
        "2x25x300:float32:tree",
        "2x2x300:float32:logits",
        "2x2x300:bfloat16:truncated",
    ]
    for row in rows:
        for key in ("baseline_ms", "speculax_ms", "floor_ms", "compile_s", "hlo_chars"):
            assert row[key] > 0
        assert row["speedup"] == pytest.approx(row["baseline_ms"] / row["speculax_ms"])
        assert row["over_floor"] == pytest.approx(row["speculax_ms"] / row["floor_ms"])
        assert 0 <= row["temp_bytes"] <= row["temp_limit_bytes"]
    ratios, details = format_table(rows).split("\n\n")
    for table in (ratios, details):
        # A header, its rule and a row per size; few enough columns for a page.
        assert table.count("\n") == 8 and table.splitlines()[0].count("|") <= 8
        assert "\n| 2x3x300 | float32 | default |" in table
        assert "\n| 2x2x300 | float32 | greedy |" in table
    assert "speculax / floor" in ratios and "temp bytes" in details
    assert report["compile"] == []


def test_bench_table_without_json(capsys):
    from speculax._cli._command import main

    assert (
        main(["bench", "--sizes", "1x1x64", "--repeats", "1", "--compile-size", "none"])
        == 0
    )
    out = capsys.readouterr().out
    assert "baseline / speculax" in out and "| 1x1x64 | float32 |" in out
    assert "trace + compile s" in out and "timing" not in out
    assert "Compile cost" not in out


def test_a_cold_compile_traces_again_and_counts_the_while_loops():
    traces = []

    def looping(x):
        traces.append(None)
        return jax.lax.fori_loop(0, x.astype(jnp.int32)[0], lambda i, y: y + i, x)

    x = jnp.ones(3)
    _, first = compile_cold(looping, x)
    compiled, second = compile_cold(looping, x)
    # Compiled twice from scratch: a warm cache would not have traced again.
    assert len(traces) == 2
    assert first.while_loops == second.while_loops == 1
    assert first.hlo_chars == second.hlo_chars > 0
    assert compiled(x).tolist() == looping(x).tolist()
    _, plain = compile_cold(lambda x: 2 * x, x)
    assert plain.while_loops == 0 and plain.hlo_chars < first.hlo_chars


@pytest.mark.slow
def test_the_compile_table_measures_every_step_and_loop(capsys):
    from speculax._cli._command import main

    status = main(["bench", "--compile-only", "--compile-size", "2x2x64", "--json"])
    assert status == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["results"] == []
    rows = {row["program"]: row for row in report["compile"]}
    assert list(rows) == list(programs(Size(2, 2, 64), tree_nodes=2))
    assert {"default", "traversal", "logits, mixed batch", "loop, sampling"} <= set(
        rows
    )
    assert rows["default"]["time_ratio"] == rows["default"]["hlo_ratio"] == 1
    for row in rows.values():
        assert row["trace_s"] > 0 and row["compile_s"] > 0 and row["hlo_chars"] > 0
        assert row["hlo_ratio"] == row["hlo_chars"] / rows["default"]["hlo_chars"]
    # Python numbers leave out what no row needs; the loops hold while loops.
    logits = [
        rows[f"logits, {kind}"]["hlo_chars"]
        for kind in ("temperature=0", "temperature", "mixed batch")
    ]
    assert logits == sorted(logits)
    assert rows["loop, chain"]["while_loops"] >= 1
    assert len(captured.err.splitlines()) == len(rows)
    table = format_compile_table(report["compile"])
    assert table.count("\n") == len(rows) + 1
    assert "\n| loop, tree |" in table


@pytest.mark.parametrize(
    "bad", ["64x5", "ax5x3", "1x1x8:int8", "0x1x8", "1x1x8:greedy:deterministic"]
)
def test_bench_rejects_a_bad_size(bad, capsys):
    from speculax._cli._command import main

    assert main(["bench", "--sizes", bad]) == 2
    assert "speculax bench: error:" in capsys.readouterr().err


@pytest.mark.parametrize(
    "size",
    [
        Size(8, 4, 1000),
        Size(5, 3, 3000, "bfloat16"),
        pytest.param(Size(4, 1, 513), marks=pytest.mark.slow),
    ],
)
def test_baseline_and_step_agree(size):
    inputs = make_inputs(size, seed=3)
    expected = jax.jit(baseline_step)(*inputs)
    got = jax.jit(speculax.SpeculativeStep())(*inputs)
    np.testing.assert_array_equal(got["num_accepted"], expected["num_accepted"])
    np.testing.assert_array_equal(got["tokens"], expected["tokens"])


def test_floor_reads_the_arrays_it_is_given():
    inputs = make_inputs(Size(3, 2, 100), seed=4)
    target_row, draft_row = inputs[2][:, 0], inputs[1][:, 0]
    np.testing.assert_allclose(
        jax.jit(floor)(target_row, draft_row),
        jnp.sum(target_row) + jnp.sum(draft_row),
        rtol=1e-6,
    )


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_the_variants_baselines_agree_with_their_steps(seed):
    """The deterministic row's baseline is the step with one-hot draft_probs; the
    greedy row's is a plain argmax verification: each gives the step's answer."""
    tokens, _, target, accept, sample = make_inputs(Size(6, 4, 700), seed=seed)
    # Drafts that are often the target's argmax, so that greedy runs get long.
    argmax = jnp.argmax(target[:, :4], axis=-1).astype(jnp.int32)
    keep = jax.random.uniform(jax.random.key(seed), tokens.shape) < 0.7
    tokens = jnp.where(keep, argmax, tokens)
    greedy = jax.jit(speculax.greedy_step())(tokens, None, target)
    plain = jax.jit(argmax_verification)(tokens, target)
    for name in ("num_accepted", "tokens"):
        np.testing.assert_array_equal(greedy[name], plain[name])
    assert np.asarray(greedy["num_accepted"]).max() > 0
    one_hot = jax.nn.one_hot(tokens, 700, dtype=target.dtype)
    step = jax.jit(speculax.SpeculativeStep())
    deterministic = step(tokens, None, target, accept, sample)
    explicit = step(tokens, one_hot, target, accept, sample)
    for name in ("num_accepted", "tokens"):
        np.testing.assert_array_equal(deterministic[name], explicit[name])


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["logits", "truncated"])
def test_the_logits_baseline_agrees_with_the_logits_step(variant):
    """Verifying from logits and through probs_from_logits give one answer: the
    bench's comparison is of the same computation."""
    inputs = make_logits_inputs(Size(6, 3, 700, variant=variant), seed=6)
    got = jax.jit(verify_from_logits)(*inputs)
    expected = jax.jit(verify_through_probs)(*inputs)
    for name in ("num_accepted", "tokens"):
        np.testing.assert_array_equal(got[name], expected[name])
    assert np.asarray(got["num_accepted"]).max() > 0


@pytest.mark.slow
def test_the_tree_baseline_agrees_with_the_tree_step():
    size = Size(12, 40, 600, variant="tree")
    inputs = make_tree_inputs(size, seed=5)
    expected = jax.jit(baseline_tree_step)(*inputs)
    got = jax.jit(speculax.TreeStep())(*inputs)
    np.testing.assert_array_equal(got["num_accepted"], expected["num_accepted"])
    np.testing.assert_array_equal(got["tokens"], expected["tokens"])
    assert np.asarray(got["num_accepted"]).max() >= 3
    assert eagle_tree(60)[:11] == [0] * 10 + [1]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU memory layout")
def test_the_tree_step_copies_no_tree():
    """The walk reads the rows in place: a loop over the rows themselves copied each
    tree's two (N + 1, V) slabs, 82 rows of V here, against a few (B, V) rows."""
    size = Size(4, 40, 20000, variant="tree")
    inputs = make_tree_inputs(size)
    compiled = jax.jit(speculax.TreeStep()).lower(*inputs).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < 8 * size.batch * size.vocab * 4


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU memory layout")
@pytest.mark.parametrize(
    "check_values", [True, pytest.param(False, marks=pytest.mark.slow)]
)
def test_default_step_materialises_no_batch_by_vocab_array(check_values):
    # The fast path of the default Residual + InverseCDF pair: the weights are never
    # materialised, so the temporaries are far below one (B, V) float32 array.
    size = Size(16, 3, 40000)
    inputs = make_inputs(size)
    step = speculax.SpeculativeStep(check_values=check_values)
    compiled = jax.jit(step).lower(*inputs).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < size.batch * size.vocab * 4 / 4


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU memory layout")
def test_greedy_step_copies_no_row():
    # Greedy verification reads every target row once: a slice of them feeding two
    # reductions would be copied whole, (B, G, V), and TargetRow's weights would be a
    # (B, V) copy of p_n; the fused pair makes neither. (At a V that is not a
    # multiple of the block size the blocked argmax still copies the full blocks:
    # a known limit, see docs/performance.md.)
    size = Size(16, 3, 157 * 256)
    tokens, _, target, _, _ = make_inputs(size)
    step = speculax.greedy_step()
    compiled = jax.jit(lambda t, p: step(t, None, p)).lower(tokens, target).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < size.batch * size.vocab * 4 / 4


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU memory layout")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_memory_bound_at_the_benchmark_size(dtype):
    # The bound at the benchmark's size (docs/performance.md), 2 B V float32 numbers
    # plus 1 MiB, compiled from shapes alone. Half-precision rows are gathered and
    # upcast in one fused pass; sliced inside a loop, XLA CPU would convert whole
    # (B, G + 1, V) arrays.
    batch, num_draft, vocab = 64, 5, 128256
    shapes = (
        jax.ShapeDtypeStruct((batch, num_draft), jnp.int32),
        jax.ShapeDtypeStruct((batch, num_draft, vocab), dtype),
        jax.ShapeDtypeStruct((batch, num_draft + 1, vocab), dtype),
        jax.ShapeDtypeStruct((batch, num_draft), jnp.float32),
        jax.ShapeDtypeStruct((batch,), jnp.float32),
    )
    compiled = jax.jit(speculax.SpeculativeStep()).lower(*shapes).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= 2 * batch * vocab * 4 + 2**20


@pytest.mark.slow
def test_custom_sampler_gets_the_residual_weights():
    # The cooperation of the default pair must not change what a custom sampler sees.
    class Recording(speculax.AbstractSampler):
        reads_uniforms: ClassVar[bool] = True
        axis_name: ClassVar[None] = None
        inner: speculax.InverseCDF = speculax.InverseCDF()

        def __call__(self, weights, sample_uniforms):
            seen.append(weights)
            return self.inner(weights, sample_uniforms)

    seen = []
    inputs = make_inputs(Size(3, 2, 700), seed=5)
    out = jax.jit(speculax.SpeculativeStep(sampler=Recording()))(*inputs)
    expected = jax.jit(speculax.SpeculativeStep())(*inputs)
    np.testing.assert_array_equal(out["tokens"], expected["tokens"])
    assert seen[0].shape == (3, 700)


def _device_check():
    """`scripts/device_check.py` as a module (it is a script, not in the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("device_check", DEVICE_CHECK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_device_check_names_tests_that_exist():
    """Every test the device check selects is a test function of its file: a renamed
    test would otherwise make pytest refuse the whole run on the device."""
    device_check = _device_check()
    root = DEVICE_CHECK.parents[1]
    for selection in (device_check.SELECTION, device_check.QUICK_SELECTION):
        for path, names in selection.items():
            tree = ast.parse((root / path).read_text())
            defined = {
                node.name for node in tree.body if isinstance(node, ast.FunctionDef)
            }
            assert set(names) <= defined, (path, set(names) - defined)
    ids = device_check.node_ids({"tests/a.py": (), "tests/b.py": ("test_x", "test_y")})
    assert ids == ["tests/a.py", "tests/b.py::test_x", "tests/b.py::test_y"]


def test_the_device_check_reports_tests_per_file(tmp_path):
    """The JUnit report read back per file, into the test table and the combined
    Markdown report, without running anything."""
    device_check = _device_check()
    (tmp_path / "tests.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_block" name="test_a[1]" time="1.5"/>'
        '<testcase classname="tests.test_block" name="test_a[2]" time="0.5">'
        '<failure message="no"/></testcase>'
        '<testcase classname="tests.test_trees" name="test_b" time="0.25">'
        '<skipped message="gpu"/></testcase>'
        '<testcase classname="" name="tests.test_loop" time="0"><error/></testcase>'
        # The test pytest was running when it was interrupted.
        '<testcase time="0.001" />'
        "</testsuite></testsuites>"
    )
    files = device_check.junit_summary(tmp_path / "tests.xml")
    columns = (*device_check.OUTCOMES, "seconds")
    rows = {name: [counts[key] for key in columns] for name, counts in files.items()}
    # passed, failed, errors, skipped, seconds
    assert rows == {
        "tests/test_block.py": [1, 1, 0, 0, 2.0],
        "tests/test_trees.py": [0, 0, 0, 1, 0.25],
        "tests/test_loop.py": [0, 0, 1, 0, 0.0],
    }
    table = device_check.tests_markdown(files)
    assert "| tests/test_block.py | 1 | 1 | 0 | 0 | 2.0 |" in table
    assert table.splitlines()[-1] == "| **total** | 1 | 1 | 1 | 1 | 2.2 |"
    stage = {"returncode": 0, "seconds": 3.0, "timed_out": False}
    report = {
        "quick": False,
        "platform": {"backend": "gpu", "devices": ["cuda:0"], "jax_version": "0.9"},
        "stages": {
            "platform": stage,
            "bench": {**stage, "timed_out": True, "returncode": None},
            "tests": {**stage, "returncode": 1},
        },
        "passed": False,
        "seconds": 290.0,
    }
    markdown = device_check.report_markdown(report, "| bench |", table)
    assert "- backend: gpu; devices: cuda:0" in markdown
    assert "- bench: stopped at its time limit, 3.0 s" in markdown
    assert "- tests: failed (exit status 1), 3.0 s" in markdown
    assert "| bench |" in markdown and table in markdown
    assert markdown.endswith("**FAIL** in 290 s\n")


@pytest.mark.slow
def test_the_device_check_runs_end_to_end_in_quick_mode(tmp_path):
    """`scripts/device_check.sh --quick` on this backend: one tiny bench size and
    one test, every report written with its fields, exit status 0."""
    import os
    import subprocess
    import sys

    script = DEVICE_CHECK.with_suffix(".sh")
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(
        [str(script), str(tmp_path / "out"), "--quick"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = tmp_path / "out"
    for name in ("bench.json", "bench.md", "tests.xml", "tests.md", "pytest.log"):
        assert (out / name).is_file(), name
    report = json.loads((out / "device_check.json").read_text())
    assert report["passed"] is True and report["quick"] is True
    assert report["platform"]["backend"] == jax.default_backend()
    assert set(report["stages"]) == {"platform", "bench", "tests"}
    assert all(stage["returncode"] == 0 for stage in report["stages"].values())
    (row,) = report["bench"]["results"]
    assert row["size"] == "2x2x300:float32" and row["speculax_ms"] > 0
    assert report["tests"]["totals"]["passed"] > 0
    assert report["tests"]["totals"]["failed"] == 0
    assert set(report["tests"]["files"]) == {"tests/test_batch_invariance.py"}
    markdown = (out / "device_check.md").read_text()
    assert "| 2x2x300 | float32 | default |" in markdown
    assert "| tests/test_batch_invariance.py |" in markdown
    assert markdown.endswith(" s\n") and "**PASS**" in markdown
    # The combined report closes standard output, where a short tail shows it.
    assert result.stdout.endswith(markdown + "\n")
