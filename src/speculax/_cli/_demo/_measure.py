import statistics
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np

from ..._loop._loop import SpeculativeLoop
from ..._loop._state import LoopOutput
from ._corpus import decode, encode
from ._shipped import load_demo_models


# Openings of code in the style of the corpus.
PROMPTS = (
    "def __init__(self, ",
    "        for name in ",
    "import os\nimport ",
    "class Parser:\n    def ",
    "    if not isinstance(",
    "        raise ValueError(",
    "        return self.",
    "    # The ",
)


class LoopMeasurement(NamedTuple):
    """What one run of the loop gave, for one number of draft tokens.

    - `num_draft`: $G$.
    - `acceptance_rate`: the fraction of draft tokens the step accepted, over every
        step of every row (`nan` for $G = 0$); drafts cut at `max_new_tokens` count
        as accepted.
    - `tokens_per_call`: generated tokens per target call of a row: the tokens of
        every row over the steps they took (each row's step scores it once).
    - `target_calls`: the batched calls of the target, added over the batches; a
        batch calls the target until its slowest row has finished.
    - `seconds`: the median wall-clock time of one run of the jitted loop.
    - `speedup`: the time of $G = 0$ (the target alone) over `seconds`.
    - `sample`: the text the first row generated.
    """

    num_draft: int
    acceptance_rate: float
    tokens_per_call: float
    target_calls: int
    seconds: float
    speedup: float
    sample: str


def measure_loop(
    num_drafts: Sequence[int],
    *,
    batch_size: int = 1,
    max_new_tokens: int = 128,
    repeats: int = 5,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[LoopMeasurement]:
    """Runs the speculative sampling loop with the demo's models on `PROMPTS`, with
    no draft tokens (the target alone) and then with each number of draft tokens,
    and measures each, side by side in one process.

    The prompts run `batch_size` at a time, each batch once to compile and then
    `repeats` times; `seconds` adds up the batches' median times.

    **Arguments:**

    - `num_drafts`: the numbers of draft tokens $G$ to run, each positive.
    - `batch_size`: keyword only, the rows of one call of the loop, a divisor of
        the number of prompts (8).
    - `max_new_tokens`: keyword only, the tokens to generate per prompt.
    - `repeats`: keyword only, timed runs per batch and $G$.
    - `seed`: keyword only, the root of the rows' keys.
    - `progress`: keyword only, if given, called with a line of text as each $G$
        starts and as it ends (its compilation and runs take seconds each).

    **Returns:**

    One [`LoopMeasurement`][speculax._cli._demo.LoopMeasurement] for $G = 0$, then one
    per entry of `num_drafts`.
    """
    if any(num_draft < 1 for num_draft in num_drafts):
        raise ValueError(f"num_drafts must all be positive; got {list(num_drafts)}")
    if len(PROMPTS) % batch_size:
        raise ValueError(
            f"batch_size must divide the {len(PROMPTS)} prompts; got {batch_size}"
        )
    draft, target = load_demo_models()
    encoded = [encode(prompt) for prompt in PROMPTS]
    prompt = np.zeros((len(encoded), max(map(len, encoded))), np.int32)
    for row, tokens in enumerate(encoded):
        prompt[row, : len(tokens)] = tokens
    lengths = np.array([len(tokens) for tokens in encoded], np.int32)
    keys = jax.random.split(jax.random.key(seed), len(encoded))
    batches = [
        slice(start, start + batch_size) for start in range(0, len(encoded), batch_size)
    ]

    def run(num_draft: int) -> tuple[list[LoopOutput], float]:
        loop = SpeculativeLoop(num_draft=num_draft, max_new_tokens=max_new_tokens)
        outputs, seconds = [], 0.0
        for rows in batches:

            def generate(rows: slice = rows) -> LoopOutput:
                out = loop(
                    draft,
                    target,
                    prompt[rows],
                    key=keys[rows],
                    prompt_lengths=lengths[rows],
                )
                return jax.block_until_ready(out)

            outputs.append(generate())
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                generate()
                times.append(time.perf_counter() - start)
            seconds += statistics.median(times)
        return outputs, seconds

    results = []
    baseline_seconds = None
    for number, num_draft in enumerate((0, *num_drafts), start=1):
        count = f"[{number}/{len(num_drafts) + 1}] G = {num_draft}"
        if progress is not None:
            progress(f"{count}: compiling and timing ...")
        start = time.perf_counter()
        outputs, seconds = run(num_draft)
        if progress is not None:
            progress(
                f"{count}: {1000 * seconds:.1f} ms a run "
                f"({time.perf_counter() - start:.1f} s)"
            )
        if baseline_seconds is None:
            baseline_seconds = seconds
        num_tokens, num_steps, accepted, tokens = (
            np.concatenate([np.asarray(out[name]) for out in outputs])
            for name in ("num_tokens", "num_steps", "num_accepted", "tokens")
        )
        proposed = num_draft * num_steps.sum()
        results.append(
            LoopMeasurement(
                num_draft=num_draft,
                acceptance_rate=float(accepted[accepted >= 0].sum() / proposed)
                if proposed
                else float("nan"),
                tokens_per_call=float(num_tokens.sum() / num_steps.sum()),
                target_calls=sum(int(out["num_target_calls"]) for out in outputs),
                seconds=seconds,
                speedup=baseline_seconds / seconds,
                sample=decode(tokens[0, : num_tokens[0]]),
            )
        )
    return results
