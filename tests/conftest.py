# Nothing here imports speculax at module level: the jaxtyping pytest plugin must hook
# the package's import first, so that every test runs with runtime shape checking.
import os

import hypothesis
import pytest


# XLA splits each program it compiles for the CPU into modules that LLVM compiles on
# parallel threads. The two test workers already keep both cores busy, and there the
# split costs more than it saves: tests/test_logits.py took 7% less CPU time
# unsplit. Only the compilation's threads change, not the code it generates.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_cpu_parallel_codegen_split_count=1"]
).strip()


# Compilation is most of the suite's time, and LLVM's optimization of the code XLA
# emits is a third of it. The suite compiles without it (JAX's
# `jax_disable_most_optimizations`: LLVM at -O0, its expensive passes off), as its
# subprocesses do, which inherit the variable; XLA's own passes, which choose the
# operations and their order, run as for any user. tests/test_optimization_level.py
# checks that the logits step and a loop give the bits they give at the level users
# compile at. `JAX_DISABLE_MOST_OPTIMIZATIONS=0 pytest` runs the suite at that level.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")


hypothesis.settings.register_profile(
    "speculax",
    deadline=None,
    derandomize=True,
    print_blob=True,
)
hypothesis.settings.load_profile("speculax")


# The files whose tests take longest (the sharded checks run subprocesses of minutes
# on eight devices; the documentation pages and the demo compile many programs)
# run first: a long test left for the end would keep one worker busy while the
# other waits.
_LONGEST_FIRST = ("test_sharded.py", "test_docs.py", "test_cli.py")


def pytest_collection_modifyitems(config, items):
    """Puts the tests of `_LONGEST_FIRST` first, in that order, the others after in
    the order they were collected (every xdist worker collects the same)."""
    rank = {name: k for k, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """Drops JAX's compiled programs after each test file. Each program XLA compiles
    for the CPU maps about three more regions of memory, and the suite compiles
    thousands: past the kernel's limit of 65530 maps (`vm.max_map_count`) the
    compiler's next `mmap` fails, and the run ended in a segmentation fault inside
    XLA's compiler near its end. Tests within a file still share their programs."""
    yield
    import jax

    jax.clear_caches()


@pytest.fixture(params=["one at a time", "all at once"], ids=["one", "all"])
def row_access(request):
    """Both row strategies (`speculax.row_strategy`: the CPU's loop over the rows,
    the accelerators' batched form), on CPU: the one way the tests choose."""
    import speculax

    with speculax.row_strategy(request.param):
        yield request.param


@pytest.fixture
def without_runtime_type_checks():
    """Runtime type checking off for the test: what a caller without it sees, such
    as the library's own error for an argument of the wrong type, which the checker
    otherwise reports first."""
    import jaxtyping

    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)
