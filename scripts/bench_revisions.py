"""Times the steps of `speculax bench` at another git revision and at the working
tree side by side, in one process, on the same inputs: the check that a refactor left
the speed unchanged.

The other revision's `src/speculax` is exported to a temporary folder as a package
named `speculax_revision`, so that both import at once; for each size of the bench's
default table (or `--sizes`), both steps are compiled, then timed in alternation, call
by call, so that a change in the machine's speed reaches both alike. Medians in
milliseconds; about five minutes on two CPU cores:

    python scripts/bench_revisions.py REVISION [--sizes 64x5x128256 ...] [--repeats 15]
"""

import argparse
import importlib
import pathlib
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

import jax


ROOT = pathlib.Path(__file__).resolve().parents[1]
# Where the bench module has lived.
BENCH_MODULES = ("_cli._bench", "_bench")


def export_revision(revision: str, folder: pathlib.Path) -> None:
    """Writes `revision`'s `src/speculax` to `folder/speculax_revision`, its absolute
    imports of speculax renamed."""
    archive = folder / "src.tar"
    with archive.open("wb") as file:
        subprocess.run(
            ["git", "-C", str(ROOT), "archive", revision, "src/speculax"],
            stdout=file,
            check=True,
        )
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")
    package = folder / "speculax_revision"
    (folder / "src" / "speculax").rename(package)
    for path in package.rglob("*.py"):
        text = path.read_text()
        renamed = re.sub(r"\b(import|from) speculax\b", r"\1 speculax_revision", text)
        path.write_text(renamed)


def bench_module(package: str):
    for name in BENCH_MODULES:
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError:
            continue
    raise SystemExit(f"{package} has no bench module")


def time_side_by_side(size, before, after, repeats: int) -> tuple[float, float]:
    """The median times, in ms, of the revision's step and the working tree's on one
    size's inputs."""
    inputs = after.make_size_inputs(size, 0)
    compiled = []
    for module in (before, after):
        # Named `_functions` in revisions before the compile-cost table.
        functions = getattr(module, "step_functions", None) or module._functions
        function, arguments, *_ = functions(size, inputs)
        compiled.append((jax.jit(function).lower(*arguments).compile(), arguments))
    answers = [jax.device_get(step(*arguments)) for step, arguments in compiled]
    same = jax.tree.all(
        jax.tree.map(lambda a, b: bool((a == b).all()), answers[0], answers[1])
    )
    if not same:
        raise SystemExit(f"{size}: the two revisions answer differently")
    times: list[list[float]] = [[], []]
    for _ in range(3):
        for step, arguments in compiled:
            jax.block_until_ready(step(*arguments))
    for _ in range(repeats):
        for k, (step, arguments) in enumerate(compiled):
            start = time.perf_counter()
            jax.block_until_ready(step(*arguments))
            times[k].append(1e3 * (time.perf_counter() - start))
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("revision")
    parser.add_argument("--sizes", nargs="+")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        export_revision(args.revision, pathlib.Path(folder))
        sys.path.insert(0, folder)
        before = bench_module("speculax_revision")
        after = bench_module("speculax")
        sizes = (
            [after.Size.parse(text) for text in args.sizes]
            if args.sizes
            else after.DEFAULT_SIZES
        )
        print(f"| size | dtype | variant | {args.revision} ms | now ms | now / then |")
        print("|:---|:---|:---|---:|---:|---:|")
        for size in sizes:
            then, now = time_side_by_side(size, before, after, args.repeats)
            shape = f"{size.batch}x{size.num_draft}x{size.vocab}"
            print(
                f"| {shape} | {size.dtype} | {size.variant} | {then:.2f} | {now:.2f} "
                f"| {now / then:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
