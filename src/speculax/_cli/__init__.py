"""The command line (`speculax demo`, `run`, `bench`, `diagnose`), the benchmarks
and the demo models. Nothing in the library imports it."""
