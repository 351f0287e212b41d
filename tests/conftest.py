# Nothing here imports speculax at module level: the jaxtyping pytest plugin must hook
# the package's import first, so that every test runs with runtime shape checking.
import hypothesis


hypothesis.settings.register_profile(
    "speculax",
    deadline=None,
    derandomize=True,
    print_blob=True,
)
hypothesis.settings.load_profile("speculax")
