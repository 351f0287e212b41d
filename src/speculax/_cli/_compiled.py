"""A jitted program compiled from a cold start, and what that cost."""

import dataclasses
import re
import time
from collections.abc import Callable
from typing import Any

import jax


_WHILE = re.compile(r"\swhile\(")


@dataclasses.dataclass(frozen=True)
class CompileCost:
    """What building one jitted program cost: seconds to trace it, seconds to lower
    and compile it (both from a cold start), the characters of its compiled
    (optimised) HLO text, the while loops in it, and the temporary memory it
    needs when it runs (`-1` where XLA does not say)."""

    trace_s: float
    compile_s: float
    hlo_chars: int
    while_loops: int
    temp_bytes: int

    @property
    def total_s(self) -> float:
        return self.trace_s + self.compile_s


def compile_cold(function: Callable, *args: Any) -> tuple[Any, CompileCost]:
    """`jax.jit(function)` traced, lowered and compiled for `args` after clearing
    JAX's caches, so that nothing traced or compiled before is reused (the same
    program under another name would otherwise compile in no time); the compiled
    program and its cost."""
    jax.clear_caches()
    start = time.perf_counter()
    traced = jax.jit(function).trace(*args)
    traced_at = time.perf_counter()
    compiled = traced.lower().compile()
    compiled_at = time.perf_counter()
    text = compiled.as_text() or ""
    memory = compiled.memory_analysis()
    cost = CompileCost(
        trace_s=traced_at - start,
        compile_s=compiled_at - traced_at,
        hlo_chars=len(text),
        while_loops=len(_WHILE.findall(text)),
        temp_bytes=int(memory.temp_size_in_bytes) if memory is not None else -1,
    )
    return compiled, cost
