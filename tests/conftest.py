# Nothing here imports speculax at module level: the jaxtyping pytest plugin must hook
# the package's import first, so that every test runs with runtime shape checking.
import hypothesis
import pytest


hypothesis.settings.register_profile(
    "speculax",
    deadline=None,
    derandomize=True,
    print_blob=True,
)
hypothesis.settings.load_profile("speculax")


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
