"""The device check: on a machine with a GPU or TPU, the bench table of every variant
and the batch-invariance and exactness tests of every step, run on that device, with
a JSON and a Markdown report: within five minutes off CPU (every stage has a time
limit), as long as it takes on CPU.

    scripts/device_check.sh [OUTDIR] [--quick] [--repeats N] [--workers N]
                            [--sizes SIZE ...] [--tests NODEID ...]

Three stages, each in its own process so that this one never holds the device (JAX
takes most of a GPU's memory in the first process that touches it):

1. **platform**: `jax.default_backend()`, `jax.devices()` and the versions;
2. **bench**: `speculax bench`'s default table (`--quick`: one tiny size), writing
    `bench.json` and `bench.md` again after every row, so that a stage stopped by
    its time limit keeps the rows it finished;
3. **tests**: pytest on the tests named in `SELECTION`, extended tier included,
    writing `tests.xml` (JUnit) and `pytest.log`.

Then `tests.md` (passed, failed, errors and skipped per file), `device_check.json`
(everything) and `device_check.md` (the three together), printed at the end. The exit
status is 0 when every stage finished and no test failed or errored, 1 otherwise.
Off CPU each stage has a time limit (`--bench-timeout`, 120 s; `--tests-timeout`,
what is left of 270 s): at its limit the stage gets SIGINT (pytest then writes the
tests it ran) and, 20 seconds later, SIGKILL.

Only the standard library here; the bench stage (`--stage bench`) imports speculax.
"""

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


ROOT = Path(__file__).resolve().parents[1]

# The batch-invariance and exactness tests of every step, by file: the test functions
# to run (every parametrisation of each), or () for the whole file.
SELECTION: dict[str, tuple[str, ...]] = {
    # The default step: a row alone equals the row in any batch, bit for bit.
    "tests/test_batch_invariance.py": (),
    # The default step's output distribution is the target's, exactly, and the
    # jitted step's samples pass a chi-square test against it.
    "tests/test_lossless.py": (
        "test_exact_output_distribution_is_target",
        "test_exact_output_distribution_corners",
        "test_statistical_output_distribution_is_target",
    ),
    # Cumulative sums against float64 at V = 262144 and a realistic batch.
    "tests/test_accuracy.py": (),
    # Greedy, deterministic drafts, per-row keys, ragged drafts, vmap.
    "tests/test_variants.py": (
        "test_greedy_step_matches_numpy_without_uniforms",
        "test_a_row_keyed_step_is_reproducible_whatever_its_batch_mates",
        "test_deterministic_drafts_are_lossless",
        "test_a_ragged_batch_is_each_row_run_alone",
        "test_variants_under_vmap_match_each_copy_alone",
    ),
    # Block verification.
    "tests/test_block.py": (
        "test_lossless_by_exact_enumeration",
        "test_deterministic_drafts_keep_exactly_as_many_tokens",
        "test_row_alone_equals_row_in_batch",
        "test_a_ragged_row_is_the_row_alone_with_its_own_draft_length",
        "test_the_fused_draw_is_the_residual_then_the_sampler",
    ),
    # The tree steps, recursive and traversal.
    "tests/test_trees.py": (
        "test_lossless_by_exact_enumeration",
        "test_deterministic_drafts_are_lossless",
        "test_the_jitted_step_draws_the_exact_distribution",
        "test_a_chain_is_verified_as_the_chain_step_does",
        "test_traversal_on_a_chain_is_block_verification",
        "test_row_alone_equals_row_in_batch",
        "test_the_step_walks_the_rule",
        # The walks and draws of both row strategies, on the device.
        "test_both_row_strategies_walk_the_trees_alike",
        "test_both_row_strategies_give_the_same_answers",
        "test_a_row_alone_equals_the_row_in_the_batch_under_both_strategies",
        "test_both_row_strategies_draw_alike_on_block_edges",
    ),
    # Target-only trees, which take rejected tokens out, and greedy trees.
    "tests/test_target_only_trees.py": (),
    "tests/test_greedy_trees.py": (),
    # The traversal's deletion in two numbers, against its rows.
    "tests/test_traversal.py": (),
    # The all-at-once path, the accelerators' own, loops over no batch.
    "tests/test_row_strategy.py": (),
    # Verification from logits.
    "tests/test_logits.py": (
        "test_logits_step_is_the_probability_path_row_by_row",
        "test_a_row_never_sees_the_other_rows",
        "test_the_row_statistics_do_not_depend_on_the_neighbouring_row",
        "test_per_row_parameters_are_each_row_alone",
        "test_truncation_without_sorting_is_truncation_by_sorting",
        "test_the_jitted_step_samples_the_truncated_target",
        "test_probabilities_from_logits_compose_losslessly",
    ),
    # The sampling loop.
    "tests/test_loop.py": (
        "test_loop_is_lossless_exactly",
        "test_loop_is_lossless_exactly_with_half_precision_logits",
        "test_row_is_batch_invariant_bit_for_bit",
        "test_jitted_loop_samples_the_target",
    ),
}
QUICK_SELECTION: dict[str, tuple[str, ...]] = {
    "tests/test_batch_invariance.py": ("test_row_order_does_not_matter",),
}
QUICK_SIZES = ("2x2x300",)
# Off CPU, the limits that keep the whole under five minutes: the tests get what the
# first two stages leave of DEVICE_TOTAL_S (and GRACE_S more to write their report).
DEVICE_BENCH_TIMEOUT_S = 120
DEVICE_TOTAL_S = 270
PLATFORM_TIMEOUT_S = 60
DEVICE_WORKERS = 8
# After SIGINT, how long a stage may take to write what it has.
GRACE_S = 20
OUTCOMES = ("passed", "failed", "errors", "skipped")


def node_ids(selection: Mapping[str, Sequence[str]]) -> list[str]:
    """The pytest node ids of a selection: a file, or `file::test` for each test
    named (pytest runs every parametrisation of it)."""
    ids = []
    for path, names in selection.items():
        ids.extend([f"{path}::{name}" for name in names] if names else [path])
    return ids


def run_stage(
    command: Sequence[str],
    timeout: float | None,
    *,
    env: Mapping[str, str] | None = None,
    stdout: Any = None,
) -> dict[str, Any]:
    """Runs one stage's process in its own process group, with a time limit.

    **Returns:**

    `{"returncode", "seconds", "timed_out"}`; `returncode` is `None` when the process
    had to be killed.
    """
    start = time.perf_counter()
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=stdout, start_new_session=True
    )
    timed_out = False
    try:
        returncode = process.wait(timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        # SIGINT first: pytest stops as after ^C and still writes its JUnit report.
        os.killpg(process.pid, signal.SIGINT)
        try:
            returncode = process.wait(GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            returncode = None
    return {
        "returncode": returncode,
        "seconds": round(time.perf_counter() - start, 2),
        "timed_out": timed_out,
    }


def probe_platform() -> None:
    """`--stage platform`: the backend, the devices and the versions, as one JSON
    object on standard output."""
    import jax

    import speculax

    print(
        json.dumps(
            {
                "backend": jax.default_backend(),
                "devices": [str(device) for device in jax.devices()],
                "device_kinds": sorted({d.device_kind for d in jax.devices()}),
                "jax_version": jax.__version__,
                "speculax_version": speculax.__version__,
                "python": sys.version.split()[0],
            }
        )
    )


def bench_rows(outdir: Path, sizes: Sequence[str] | None, repeats: int) -> None:
    """`--stage bench`: `bench_size` for each size (default: the bench's default
    table), rewriting `bench.json` and `bench.md` in `outdir` after every row."""
    from speculax._cli._bench import (
        DEFAULT_SIZES,
        Size,
        bench_size,
        format_table,
        json_report,
    )

    planned = [Size.parse(text) for text in sizes] if sizes else list(DEFAULT_SIZES)
    report = {**json_report([], repeats), "sizes": [str(size) for size in planned]}
    for number, size in enumerate(planned, start=1):
        print(f"device check: bench [{number}/{len(planned)}] {size}", file=sys.stderr)
        start = time.perf_counter()
        report["results"].append(bench_size(size, repeats))
        report["results"][-1]["seconds"] = round(time.perf_counter() - start, 2)
        (outdir / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
        (outdir / "bench.md").write_text(
            f"{len(report['results'])} of {len(planned)} sizes on "
            f"{report['backend']}, median of {repeats} runs per function\n\n"
            f"{format_table(report['results'])}\n"
        )


def junit_summary(path: Path) -> dict[str, dict[str, float]]:
    """Passed, failed, errors and skipped tests and their seconds per file, read
    from a JUnit XML report of pytest (its `classname` is the module's dotted path,
    `tests.test_block`)."""
    files: dict[str, dict[str, float]] = {}
    for case in ElementTree.parse(path).iter("testcase"):
        # A file that failed to collect is a case named after it, with no class; the
        # test running when pytest was interrupted, a case with neither.
        dotted = case.get("classname") or case.get("name")
        if not dotted:
            continue
        module = dotted.split(".")
        name = "/".join(module[:2]) + ".py" if len(module) >= 2 else "(collection)"
        counts = files.setdefault(name, {**dict.fromkeys(OUTCOMES, 0), "seconds": 0.0})
        tags = {child.tag for child in case}
        outcome = (
            "failed"
            if "failure" in tags
            else "errors"
            if "error" in tags
            else "skipped"
            if "skipped" in tags
            else "passed"
        )
        counts[outcome] += 1
        counts["seconds"] = round(counts["seconds"] + float(case.get("time", 0)), 2)
    return files


def tests_markdown(files: Mapping[str, Mapping[str, float]]) -> str:
    """A Markdown table of `junit_summary`, a row per file and one of totals."""
    columns = (*OUTCOMES, "seconds")
    total = {key: sum(counts[key] for counts in files.values()) for key in columns}
    lines = [
        "| file | passed | failed | errors | skipped | seconds |",
        "|:---|---:|---:|---:|---:|---:|",
    ]
    for name, counts in [*files.items(), ("**total**", total)]:
        numbers = [str(int(counts[key])) for key in OUTCOMES]
        lines.append(f"| {name} | {' | '.join(numbers)} | {counts['seconds']:.1f} |")
    return "\n".join(lines)


def stage_line(name: str, stage: Mapping[str, Any]) -> str:
    """One line saying how a stage ended and how long it took."""
    if stage.get("timed_out"):
        ending = "stopped at its time limit"
    elif stage.get("returncode") == 0:
        ending = "finished"
    else:
        ending = f"failed (exit status {stage.get('returncode')})"
    return f"- {name}: {ending}, {stage.get('seconds', 0):.1f} s"


def report_markdown(report: Mapping[str, Any], bench_md: str, tests_md: str) -> str:
    """The combined Markdown report: platform, stages, bench tables, test table and
    the verdict."""
    platform = report["platform"]
    lines = [
        "# speculax device check" + (" (quick)" if report["quick"] else ""),
        "",
        f"- backend: {platform.get('backend', 'unknown')}; devices: "
        f"{', '.join(platform.get('devices', [])) or 'unknown'}",
        f"- jax {platform.get('jax_version', '?')}, speculax "
        f"{platform.get('speculax_version', '?')}, "
        f"python {platform.get('python', '?')}",
        stage_line("platform", report["stages"]["platform"]),
        stage_line("bench", report["stages"]["bench"]),
        stage_line("tests", report["stages"]["tests"]),
        "",
        "## Bench",
        "",
        bench_md.strip() or "No bench rows finished.",
        "",
        "## Tests",
        "",
        tests_md.strip() or "No test report was written.",
        "",
        f"**{'PASS' if report['passed'] else 'FAIL'}** in {report['seconds']:.0f} s",
    ]
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    """The command line's parser; `--stage` runs one stage in a child process."""
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "outdir",
        nargs="?",
        default=os.environ.get("OUT") or "device_check",
        help="folder for the reports (default: $OUT, else device_check)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="one tiny bench size and one test"
    )
    parser.add_argument(
        "--repeats", type=int, default=7, help="timed runs per function (default 7)"
    )
    parser.add_argument("--sizes", nargs="+", help="bench sizes instead of the table")
    parser.add_argument(
        "--tests",
        nargs="+",
        metavar="NODEID",
        help="pytest node ids instead of SELECTION, e.g. tests/test_block.py",
    )
    parser.add_argument(
        "--workers",
        type=int,
        help=f"pytest-xdist workers (default: {DEVICE_WORKERS} off CPU, 0 on CPU)",
    )
    parser.add_argument(
        "--bench-timeout",
        type=float,
        help=f"seconds (default: {DEVICE_BENCH_TIMEOUT_S} off CPU, none on CPU)",
    )
    parser.add_argument(
        "--tests-timeout",
        type=float,
        help=f"seconds (default: what is left of {DEVICE_TOTAL_S} s off CPU, none "
        "on CPU)",
    )
    parser.add_argument(
        "--stage", choices=["platform", "bench"], help=argparse.SUPPRESS
    )
    return parser


def _run_platform(outdir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The platform stage: its report, and how the stage went."""
    log = outdir / "platform.json"
    with log.open("w") as file:
        stage = run_stage(
            [sys.executable, __file__, str(outdir), "--stage", "platform"],
            PLATFORM_TIMEOUT_S,
            stdout=file,
        )
    try:
        platform = json.loads(log.read_text())
    except json.JSONDecodeError:
        platform = {}
    return platform, stage


def _run_bench(args: argparse.Namespace, outdir: Path, on_cpu: bool) -> dict[str, Any]:
    """The bench stage in its own process; how it went."""
    sizes = list(QUICK_SIZES) if args.quick else args.sizes
    command = [sys.executable, __file__, str(outdir), "--stage", "bench"]
    command += ["--repeats", str(1 if args.quick else args.repeats)]
    command += ["--sizes", *sizes] if sizes else []
    timeout = args.bench_timeout or (None if on_cpu else DEVICE_BENCH_TIMEOUT_S)
    return run_stage(command, timeout)


def _test_ids(args: argparse.Namespace) -> list[str]:
    """The node ids the test stage runs: `--tests`, else the quick or the full
    selection."""
    if args.tests:
        return list(args.tests)
    return node_ids(QUICK_SELECTION if args.quick else SELECTION)


def _run_tests(
    args: argparse.Namespace, outdir: Path, on_cpu: bool, elapsed: float
) -> dict[str, Any]:
    """The test stage, pytest in its own process, its output in `pytest.log`, given
    the seconds the check has run so far; how it went."""
    workers = (
        args.workers if args.workers is not None else (0 if on_cpu else DEVICE_WORKERS)
    )
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider"]
    # The project's addopts name plugins a bare environment may lack: each flag is
    # added here only where its plugin is installed.
    command += ["-o", "addopts=", "-m", "slow or not slow"]
    command += [f"--junitxml={outdir / 'tests.xml'}"]
    if importlib.util.find_spec("beartype") is not None:
        command += ["--jaxtyping-packages=speculax,beartype.beartype"]
    if workers > 0 and importlib.util.find_spec("xdist") is not None:
        command += ["-n", str(workers), "--dist", "worksteal"]
    command += _test_ids(args)
    # Several processes share the device: none may take most of its memory.
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    left = max(DEVICE_TOTAL_S - elapsed, 30)
    timeout = args.tests_timeout or (None if on_cpu else left)
    with (outdir / "pytest.log").open("w") as log:
        return run_stage(command, timeout, env=env, stdout=log)


def check(args: argparse.Namespace) -> int:
    """Runs the three stages and writes the reports; returns the exit status."""
    start = time.perf_counter()
    outdir = Path(args.outdir).resolve()
    outdir.mkdir(parents=True, exist_ok=True)
    platform, platform_stage = _run_platform(outdir)
    print(f"device check: {json.dumps(platform)}", flush=True)
    # A probe that failed leaves the backend unknown: the limits then apply.
    on_cpu = platform.get("backend") == "cpu"
    bench_stage = _run_bench(args, outdir, on_cpu)
    tests_stage = _run_tests(args, outdir, on_cpu, time.perf_counter() - start)
    bench_path, xml_path = outdir / "bench.json", outdir / "tests.xml"
    bench = json.loads(bench_path.read_text()) if bench_path.exists() else {}
    files = junit_summary(xml_path) if xml_path.exists() else {}
    tests_md = tests_markdown(files) if files else ""
    (outdir / "tests.md").write_text(tests_md + "\n")
    stages = {"platform": platform_stage, "bench": bench_stage, "tests": tests_stage}
    totals = {key: sum(counts[key] for counts in files.values()) for key in OUTCOMES}
    report = {
        "quick": args.quick,
        "platform": platform,
        "stages": stages,
        "bench": bench,
        "tests": {
            "files": files,
            "totals": totals,
            "node_ids": _test_ids(args),
        },
        "passed": all(stage["returncode"] == 0 for stage in stages.values())
        and totals["passed"] > 0
        and totals["failed"] == totals["errors"] == 0,
        "seconds": round(time.perf_counter() - start, 1),
    }
    (outdir / "device_check.json").write_text(json.dumps(report, indent=2) + "\n")
    bench_md_path = outdir / "bench.md"
    bench_md = bench_md_path.read_text() if bench_md_path.exists() else ""
    markdown = report_markdown(report, bench_md, tests_md)
    (outdir / "device_check.md").write_text(markdown)
    log_tail = (outdir / "pytest.log").read_text().splitlines()[-30:]
    print("\n".join(["", "device check: the end of pytest.log", *log_tail, ""]))
    print(markdown, flush=True)
    return 0 if report["passed"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.stage == "platform":
        probe_platform()
        return 0
    if args.stage == "bench":
        bench_rows(Path(args.outdir), args.sizes, args.repeats)
        return 0
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
