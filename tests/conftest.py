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


@pytest.fixture(params=["per_row", "gather"])
def row_access(request, monkeypatch):
    """Both row-access strategies of the summary (CPU loop, GPU gather), on CPU."""
    from speculax._pieces import _stopping_rows

    monkeypatch.setattr(
        _stopping_rows, "_per_row_default", lambda: request.param == "per_row"
    )
    return request.param
