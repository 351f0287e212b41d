import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from ..._chain._step import block_step
from ..._drafters._prompt_lookup import PromptLookup
from ..._inputs._tree_formats import parents_from_paths
from ..._loop._cache import Cacheless
from ..._loop._draft_tree import DraftTree
from ..._loop._dynamic_tree import DynamicTree
from ..._loop._loop import SpeculativeLoop
from ..._loop._state import LoopOutput
from ..._tree._recursive import TreeStep
from ..._tree._siblings import SiblingsWithoutReplacement
from ..._tree._traversal import TraversalStep
from ._corpus import decode, encode
from ._heads import load_demo_heads
from ._models import FeatureKeeping
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
# An EAGLE-like template, as vLLM's paths of child ranks: wide near the root, a few
# branches deeper, the most likely chain longest. 24 nodes, depth 6.
TREE_PATHS: tuple[tuple[int, ...], ...] = (
    (0,),
    (1,),
    (2,),
    (3,),
    (0, 0),
    (0, 1),
    (0, 2),
    (1, 0),
    (1, 1),
    (2, 0),
    (0, 0, 0),
    (0, 0, 1),
    (0, 1, 0),
    (1, 0, 0),
    (2, 0, 0),
    (0, 0, 0, 0),
    (0, 0, 0, 1),
    (0, 1, 0, 0),
    (1, 0, 0, 0),
    (0, 0, 0, 0, 0),
    (0, 0, 0, 1, 0),
    (0, 1, 0, 0, 0),
    (0, 0, 0, 0, 0, 0),
    (0, 0, 0, 0, 0, 1),
)
# Medusa's tree of candidates, as paths of each head's ranks: its heads' best
# tokens at every depth, the most likely chain longest. 9 nodes, depth 4, within
# the shipped heads.
MEDUSA_TREE_PATHS: tuple[tuple[int, ...], ...] = (
    (0,),
    (1,),
    (2,),
    (0, 0),
    (0, 1),
    (1, 0),
    (0, 0, 0),
    (0, 1, 0),
    (0, 0, 0, 0),
)
# EAGLE-2's tree for the demo's head: as many nodes as `TREE_PATHS`, as deep, grown
# from the 8 best children of the 8 best nodes at each depth.
DYNAMIC_TREE = DynamicTree(num_nodes=len(TREE_PATHS), depth=6, top_k=8)
VERIFICATIONS = (
    "target alone",
    "chain",
    "prompt lookup",
    "Medusa",
    "EAGLE",
    "Medusa tree",
    "EAGLE tree",
    "EAGLE dynamic tree",
    "block",
    "tree",
    "dynamic tree",
    "traversal",
)


def demo_loop(
    verification: str, *, num_draft: int, max_new_tokens: int
) -> SpeculativeLoop:
    """The loop of one verification of the demo: the target alone ($G = 0$); a
    chain of $G$ drafts verified token by token (`"chain"`, and `"prompt lookup"`,
    `"Medusa"` and `"EAGLE"`, whose drafts come from another drafter than the
    draft model: `drafting_models`) or by block verification (`"block"`); or the
    `TREE_PATHS` template, its children drawn without replacement, verified by
    recursive rejection sampling (`"tree"`, and `"EAGLE tree"`, filled by the
    EAGLE-style head) or by traversal verification (`"traversal"`); or Medusa's
    `MEDUSA_TREE_PATHS`, each depth's children its head's most likely tokens,
    verified as deterministic drafts (`"Medusa tree"`); or `DYNAMIC_TREE`, grown
    for each row by the draft model (`"dynamic tree"`) or the EAGLE-style head
    (`"EAGLE dynamic tree"`), verified as deterministic drafts."""
    tree = DraftTree(parents_from_paths(TREE_PATHS), drafting="without replacement")
    siblings = SiblingsWithoutReplacement()
    loops: dict[str, Callable[[], SpeculativeLoop]] = {
        "target alone": lambda: SpeculativeLoop(
            num_draft=0, max_new_tokens=max_new_tokens
        ),
        "chain": lambda: SpeculativeLoop(
            num_draft=num_draft, max_new_tokens=max_new_tokens
        ),
        "block": lambda: SpeculativeLoop(
            num_draft=num_draft, max_new_tokens=max_new_tokens, step=block_step()
        ),
        "tree": lambda: SpeculativeLoop(
            draft_tree=tree,
            max_new_tokens=max_new_tokens,
            step=TreeStep(siblings=siblings),
        ),
        "traversal": lambda: SpeculativeLoop(
            draft_tree=tree,
            max_new_tokens=max_new_tokens,
            step=TraversalStep(siblings=siblings),
        ),
        "Medusa tree": lambda: SpeculativeLoop(
            draft_tree=DraftTree(
                parents_from_paths(MEDUSA_TREE_PATHS), drafting="top-k"
            ),
            max_new_tokens=max_new_tokens,
            step=TreeStep(),
        ),
        "EAGLE dynamic tree": lambda: SpeculativeLoop(
            draft_tree=DYNAMIC_TREE, max_new_tokens=max_new_tokens, step=TreeStep()
        ),
    }
    # The chain's loop: only the drafters differ (`drafting_models`).
    for drafter in ("prompt lookup", "Medusa", "EAGLE"):
        loops[drafter] = loops["chain"]
    loops["EAGLE tree"] = loops["tree"]
    loops["dynamic tree"] = loops["EAGLE dynamic tree"]
    if verification not in loops:
        raise ValueError(
            f"verification must be one of {VERIFICATIONS}; got {verification!r}"
        )
    return loops[verification]()


# The verifications drafted by a shipped head: its index in `load_demo_heads`.
_HEAD_OF = {
    "Medusa": 0,
    "EAGLE": 1,
    "Medusa tree": 0,
    "EAGLE tree": 1,
    "EAGLE dynamic tree": 1,
}


def drafting_models(verification: str, models: tuple[Any, Any]) -> tuple[Any, Any]:
    """The drafter and the target a verification's loop is called with: the demo's
    draft model and target; for `"prompt lookup"` n-gram lookup in the row's
    history ([`speculax.PromptLookup`][], no draft model) and the target; for
    `"Medusa"` and `"EAGLE"` (their chains and trees) the shipped heads
    (`load_demo_heads`) and the target keeping its features in its cache
    (`FeatureKeeping`)."""
    if verification == "prompt lookup":
        return PromptLookup(max_ngram=4), models[1]
    if verification in _HEAD_OF:
        heads = load_demo_heads(models[1])
        return heads[_HEAD_OF[verification]], FeatureKeeping(models[1])
    return models


class LoopMeasurement(NamedTuple):
    """What the runs of one verification at one batch size gave.

    - `verification`: one of `VERIFICATIONS`.
    - `batch_size`: the prompts of one call of the loop.
    - `drafts`: the draft tokens of a step: $G$ for a chain, the template's $N$
        nodes for a tree, 0 for the target alone.
    - `tokens_per_call`: generated tokens per target call of a row: the tokens of
        every row over the steps they took (each row's step scores it once).
    - `target_calls`: the batched calls of the target, added over the batches; a
        batch calls the target until its slowest row has finished.
    - `seconds`: the median wall-clock time of one run of every batch, added up.
    - `speedup`: the time of the target alone at the same batch size over
        `seconds`.
    - `sample`: the text the first row generated.
    """

    verification: str
    batch_size: int
    drafts: int
    tokens_per_call: float
    target_calls: int
    seconds: float
    speedup: float
    sample: str


class CacheMeasurement(NamedTuple):
    """The time per generated token of the chain loop at one length, with the
    models' key-value caches and without (each call reading the whole buffer).

    - `max_new_tokens`: the tokens generated per prompt.
    - `length`: the buffer's length, the prompts' longest, the new tokens, one
        step's drafts and the token drawn after them: what a cacheless call reads.
    - `cached`, `cacheless`: seconds per generated token, over every prompt.
    """

    max_new_tokens: int
    length: int
    cached: float
    cacheless: float


def _prompts() -> tuple[np.ndarray, np.ndarray, jax.Array]:
    """`PROMPTS` as a zero-padded batch, their lengths and one key per prompt."""
    encoded = [encode(prompt) for prompt in PROMPTS]
    prompt = np.zeros((len(encoded), max(map(len, encoded))), np.int32)
    for row, tokens in enumerate(encoded):
        prompt[row, : len(tokens)] = tokens
    lengths = np.array([len(tokens) for tokens in encoded], np.int32)
    return prompt, lengths, jax.random.split(jax.random.key(0), len(encoded))


def _timed_runs(
    loop: SpeculativeLoop, models: tuple[Any, Any], batch_size: int, repeats: int
) -> tuple[list[LoopOutput], float]:
    """Runs `loop` on `PROMPTS`, `batch_size` at a time, each batch once to compile
    and then `repeats` times: the outputs, and the batches' median times added."""
    if len(PROMPTS) % batch_size:
        raise ValueError(
            f"batch_size must divide the {len(PROMPTS)} prompts; got {batch_size}"
        )
    prompt, lengths, keys = _prompts()
    outputs, seconds = [], 0.0
    for start in range(0, len(PROMPTS), batch_size):
        rows = slice(start, start + batch_size)

        def generate(rows: slice = rows) -> LoopOutput:
            out = loop(
                *models, prompt[rows], key=keys[rows], prompt_lengths=lengths[rows]
            )
            return jax.block_until_ready(out)

        outputs.append(generate())
        times = []
        for _ in range(repeats):
            begin = time.perf_counter()
            generate()
            times.append(time.perf_counter() - begin)
        seconds += statistics.median(times)
    return outputs, seconds


def measure_loop(
    verifications: Sequence[str] = VERIFICATIONS,
    *,
    batch_sizes: Sequence[int] = (1, 8),
    num_draft: int = 4,
    max_new_tokens: int = 128,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
) -> list[LoopMeasurement]:
    """Runs the speculative sampling loop with the demo's models on `PROMPTS`, for
    each verification at each batch size, side by side in one process, the target
    alone first at each batch size (the speedups' baseline).

    **Arguments:**

    - `verifications`: some of `VERIFICATIONS`.
    - `batch_sizes`: keyword only, prompts per call of the loop, each a divisor of
        the number of prompts (8).
    - `num_draft`: keyword only, $G$ for the chains.
    - `max_new_tokens`: keyword only, the tokens to generate per prompt.
    - `repeats`: keyword only, timed runs per batch.
    - `progress`: keyword only, if given, called with a line of text as each run
        starts and as it ends (its compilation and runs take seconds each).

    **Returns:**

    One [`LoopMeasurement`][speculax._cli._demo.LoopMeasurement] per batch size
    and verification, the target alone first.
    """
    models = load_demo_models()
    order = ["target alone", *(v for v in verifications if v != "target alone")]
    runs = [(size, verification) for size in batch_sizes for verification in order]
    results: list[LoopMeasurement] = []
    baseline = 0.0
    for number, (batch_size, verification) in enumerate(runs, start=1):
        label = f"[{number}/{len(runs)}] {verification}, {batch_size} per call"
        if progress is not None:
            progress(f"{label}: compiling and timing ...")
        begin = time.perf_counter()
        loop = demo_loop(
            verification, num_draft=num_draft, max_new_tokens=max_new_tokens
        )
        outputs, seconds = _timed_runs(
            loop, drafting_models(verification, models), batch_size, repeats
        )
        if progress is not None:
            progress(
                f"{label}: {1000 * seconds:.1f} ms a run "
                f"({time.perf_counter() - begin:.1f} s)"
            )
        baseline = seconds if verification == "target alone" else baseline
        num_tokens, num_steps, tokens = (
            np.concatenate([np.asarray(out[name]) for out in outputs])
            for name in ("num_tokens", "num_steps", "tokens")
        )
        results.append(
            LoopMeasurement(
                verification=verification,
                batch_size=batch_size,
                drafts=loop.num_nodes,
                tokens_per_call=float(num_tokens.sum() / num_steps.sum()),
                target_calls=sum(int(out["num_target_calls"]) for out in outputs),
                seconds=seconds,
                speedup=baseline / seconds,
                sample=decode(tokens[0, : num_tokens[0]]),
            )
        )
    return results


def measure_cache(
    new_token_counts: Sequence[int],
    *,
    num_draft: int = 4,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
) -> list[CacheMeasurement]:
    """Times the chain loop with the demo's models, one prompt per call, for each
    number of new tokens: with the models' caches, and with each model wrapped as a
    [`speculax.LanguageModel`][] that reads the whole buffer at every call
    ([`speculax.Cacheless`][]).

    **Arguments:**

    - `new_token_counts`: the numbers of tokens to generate per prompt.
    - `num_draft`: keyword only, $G$.
    - `repeats`: keyword only, timed runs per prompt.
    - `progress`: keyword only, as for `measure_loop`.

    **Returns:**

    One [`CacheMeasurement`][speculax._cli._demo.CacheMeasurement] per count.
    """
    draft, target = load_demo_models()
    pairs = {
        "cached": (draft, target),
        "cacheless": (Cacheless(draft.read), Cacheless(target.read)),
    }
    results = []
    for count in new_token_counts:
        loop = demo_loop("chain", num_draft=num_draft, max_new_tokens=count)
        per_token = {}
        for name, models in pairs.items():
            if progress is not None:
                progress(f"{count} new tokens, {name}: compiling and timing ...")
            outputs, seconds = _timed_runs(loop, models, 1, repeats)
            generated = sum(int(np.sum(out["num_tokens"])) for out in outputs)
            per_token[name] = seconds / generated
        results.append(
            CacheMeasurement(
                max_new_tokens=count,
                length=_prompts()[0].shape[1] + count + num_draft + 1,
                cached=per_token["cached"],
                cacheless=per_token["cacheless"],
            )
        )
    return results
