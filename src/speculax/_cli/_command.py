"""The `speculax` command line: `demo` runs the worked examples, `run` one JSON input,
`bench` times the step."""

import argparse
import functools
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

import numpy as np

# The parser lists the demo's verifications, so every run reads them.
from ._demo._measure import VERIFICATIONS


if TYPE_CHECKING:
    from .._core._failures import RESULTS
    from .._inputs._random import KeyArray

INPUT_NAMES = (
    "draft_tokens",
    "draft_probs",
    "target_probs",
    "accept_uniforms",
    "sample_uniforms",
)
UNIFORM_NAMES = ("accept_uniforms", "sample_uniforms")
# jax.random.key reads a seed modulo 2^32: a larger one would be another seed.
SEED_LIMIT = 2**32
# Read as integers by value, never as floats.
INTEGER_NAMES = ("draft_tokens", "parents", "tree_tokens", "top_k")
SAMPLING_NAMES = ("temperature", "top_k", "top_p")
NULLABLE_NAMES = ("draft_probs", "draft_logits")


class _Kind(NamedTuple):
    """A kind of input `speculax run` takes, known by a key only it has: the arrays
    its step is called with, in order (the uniforms last; the second may be
    `null`), the keyword parameters it may be given, and its output's keys."""

    arrays: tuple[str, ...]
    parameters: tuple[str, ...]
    outputs: tuple[str, ...]


KINDS = {
    "chain": _Kind(INPUT_NAMES, (), ("num_accepted", "tokens")),
    "tree": _Kind(
        ("parents", "tree_tokens", "draft_probs", "target_probs", *UNIFORM_NAMES),
        (),
        ("num_accepted", "tokens", "accepted_nodes"),
    ),
    "logits": _Kind(
        ("draft_tokens", "draft_logits", "target_logits", *UNIFORM_NAMES),
        SAMPLING_NAMES,
        ("num_accepted", "tokens"),
    ),
}

# `speculax demo --loop` without `--full` compiles five loops (the cache's table
# reuses the chain's at one prompt per call), within a minute on two cores; the full
# comparison adds the other drafters, block verification and the trees (the slowest
# to compile), longer runs, and the cache's table at more lengths.
QUICK_DEMO = {"verify": ["chain"], "max_new_tokens": 64, "cache_lengths": [64]}
FULL_DEMO = {
    "verify": [v for v in VERIFICATIONS if v != "target alone"],
    "max_new_tokens": 128,
    "cache_lengths": [64, 128, 256],
}


class InputError(Exception):
    """Bad input, reported as one line on standard error with exit status 2."""


def main(argv: Sequence[str] | None = None) -> int:
    """The `speculax` command line; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        # Options left out take the quick run's values, or the full comparison's.
        for name, value in (FULL_DEMO if args.full else QUICK_DEMO).items():
            if getattr(args, name) is None:
                setattr(args, name, value)
        if None in args.cache_lengths:
            if len(args.cache_lengths) > 1:
                parser.error("--cache-lengths: none stands alone, without lengths")
            args.cache_lengths = []
        if args.loop:
            from ._demo._heads import NUM_HEADS

            if "Medusa" in args.verify and args.num_draft > NUM_HEADS:
                parser.error(
                    f"--num-draft: the shipped Medusa heads draft at most {NUM_HEADS} "
                    f"tokens; got {args.num_draft}"
                )
            return _demo_loop(args)
        return _demo()
    if args.command == "bench":
        return _bench(args)
    return _run_command(args.file)


class _OneLineErrors(argparse.ArgumentParser):
    """A parser whose errors are one line on standard error and exit status 2, as
    every other bad input of the command line (`--help` shows the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    """The parser of the command line, with one subcommand each for `demo`, `run`
    and `bench`."""
    from .. import __version__

    parser = _OneLineErrors(
        prog="speculax",
        description="The verification step of speculative decoding.",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}"
    )
    commands = parser.add_subparsers(
        dest="command", required=True, parser_class=_OneLineErrors
    )
    _add_demo_parser(commands)
    run_parser = commands.add_parser(
        "run",
        help="run one step on a JSON object of its inputs, uniforms or a seed: a "
        "chain, a tree (given parents) or logits (given target_logits)",
    )
    run_parser.add_argument(
        "file", nargs="?", help="JSON file to read (default: standard input)"
    )
    _add_bench_parser(commands)
    return parser


def _add_demo_parser(commands: Any) -> None:
    """The `demo` subcommand and its `--loop` options."""
    demo_parser = commands.add_parser(
        "demo",
        help="run the worked examples of the specification and a random batch; with "
        "--loop, the speculative sampling loop on two small trained models",
    )
    demo_parser.add_argument(
        "--loop",
        action="store_true",
        help="run the loop with the shipped draft and target transformers and "
        "report the tokens per target call and the speedup of each verification, "
        "and the time per token with and without the models' caches",
    )
    demo_parser.add_argument(
        "--full",
        action="store_true",
        help="with --loop: the full comparison, a few minutes on two cores: every "
        "verification, 128 new tokens, and the cache's table at 64, 128 and 256 new "
        "tokens; without it, the quick run: the chain verified token by token, 64 new "
        "tokens, the cache's table at 64, within a minute (each option below "
        "replaces the run's own value)",
    )
    demo_parser.add_argument(
        "--verify",
        nargs="+",
        choices=[v for v in VERIFICATIONS if v != "target alone"],
        help="with --loop: the verifications to run beside the target alone "
        "(default: chain; with --full, all)",
    )
    demo_parser.add_argument(
        "--num-draft",
        type=_positive_int,
        default=4,
        metavar="G",
        help="with --loop: the draft tokens of the chains (default: 4)",
    )
    demo_parser.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        help="with --loop: tokens to generate per prompt (default: 64; with --full, "
        "128)",
    )
    demo_parser.add_argument(
        "--batch-sizes",
        nargs="+",
        type=int,
        choices=[1, 2, 4, 8],
        default=[1, 8],
        help="with --loop: prompts per call of the loop (default: 1 8)",
    )
    demo_parser.add_argument(
        "--cache-lengths",
        nargs="+",
        type=_positive_int_or_none,
        metavar="N",
        help="with --loop: the new tokens per prompt at which to time the chain "
        "loop with and without the caches, or the word none to skip the table "
        "(default: 64; with --full, 64 128 256)",
    )
    demo_parser.add_argument(
        "--repeats",
        type=_positive_int,
        default=3,
        help="with --loop: timed runs per batch (median; default: 3)",
    )


def _add_bench_parser(commands: Any) -> None:
    """The `bench` subcommand."""
    from ._bench import DTYPES, VARIANTS

    bench_parser = commands.add_parser(
        "bench",
        help="time the default step against the obvious implementation and the floor",
    )
    bench_parser.add_argument(
        "--sizes",
        nargs="+",
        metavar="BxGxV[:dtype][:variant]",
        help="sizes to run, e.g. 64x5x128256, 64x5x128256:bfloat16 or "
        f"64x5x128256:greedy (dtypes: {', '.join(DTYPES)}; variants: "
        f"{', '.join(VARIANTS)}; default: a table from 1x4x32000 to 8x4x262144 "
        "and every variant)",
    )
    bench_parser.add_argument(
        "--repeats", type=int, default=7, help="timed runs per function (median)"
    )
    bench_parser.add_argument(
        "--json", action="store_true", help="print machine-readable JSON"
    )
    bench_parser.add_argument(
        "--compile-size",
        default="8x4x128256",
        metavar="BxGxV",
        help="the size of the steps in the compile-cost table (each step and loop "
        "traced and compiled from a cold start, beside the default step), or none "
        "to skip the table (default: 8x4x128256)",
    )
    bench_parser.add_argument(
        "--compile-only",
        action="store_true",
        help="print the compile-cost table alone, timing nothing",
    )


def _bench(args: argparse.Namespace) -> int:
    """`speculax bench`: every size checked before anything is timed; progress on
    standard error, one line as each size starts and ends, and the results alone
    on standard output."""
    import jax

    from ._bench import DEFAULT_SIZES, Size, format_table, json_report, run_bench
    from ._compile_cost import format_compile_table, run_compile_costs

    try:
        sizes = [Size.parse(text) for text in args.sizes or ()] or DEFAULT_SIZES
        compile_size = (
            None if args.compile_size == "none" else Size.parse(args.compile_size)
        )
    except ValueError as error:
        print(f"speculax bench: error: {error}", file=sys.stderr)
        return 2
    repeats = max(args.repeats, 1)
    progress = functools.partial(print, file=sys.stderr, flush=True)
    results = []
    if not args.compile_only:
        progress(f"speculax bench: {len(sizes)} sizes, median of {repeats} runs each")
        results = run_bench(sizes, repeats, progress=progress)
    costs = []
    if compile_size is not None:
        costs = run_compile_costs(compile_size, progress=progress)
    if args.json:
        print(json.dumps(json_report(results, repeats, costs), indent=2))
        return 0
    print(
        f"speculax bench: backend {jax.default_backend()}, jax {jax.__version__}, "
        f"median of {repeats} runs per function\n"
    )
    tables = [format_table(results)] if results else []
    if costs:
        tables.append(
            f"Compile cost at {compile_size} (loops: see docs/benchmarks.md):\n\n"
            + format_compile_table(costs)
        )
    print("\n\n".join(tables))
    return 0


def _run_command(path: str | None) -> int:
    """`speculax run`: the step's output as JSON on standard output, or one line on
    standard error and exit status 2."""
    try:
        print(_run(path))
    except InputError as error:
        print(f"speculax run: error: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        # The promise is one line and exit status 2 for any input, even one that
        # reaches a failure nobody foresaw.
        first_line = (str(error).strip().splitlines() or [""])[0]
        print(
            f"speculax run: error: unexpected {type(error).__name__}: {first_line}",
            file=sys.stderr,
        )
        return 2
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text}")
    return value


def _positive_int_or_none(text: str) -> int | None:
    """A positive integer, or `None` for the word `none`."""
    return None if text == "none" else _positive_int(text)


def _run(path: str | None) -> str:
    try:
        if path is None:
            data = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as file:
                data = file.read()
    except OSError as error:
        raise InputError(f"cannot read {path}: {error.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError("the input is not UTF-8 text") from None
    try:
        inputs = json.loads(
            text,
            object_pairs_hook=_without_duplicate_keys,
            parse_constant=_not_json,
            parse_float=_finite_float,
        )
    except json.JSONDecodeError as error:
        raise InputError(f"malformed JSON: {error}") from None
    except RecursionError:
        raise InputError("malformed JSON: nested too deeply") from None
    return json.dumps(step_json(inputs), separators=(",", ":"))


def _without_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict, refusing a key given twice (the JSON module would
    keep the last one silently)."""
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise InputError(f"duplicate key: {key}")
        found[key] = value
    return found


def _not_json(constant: str) -> float:
    """Refuses `NaN`, `Infinity` and `-Infinity`, which the JSON module reads though
    JSON has no such numbers."""
    raise InputError(f"{constant} is not a JSON number")


def _finite_float(text: str) -> float:
    """A JSON number as a float, refusing one beyond float64's range, which Python
    reads as infinite."""
    value = float(text)
    if not math.isfinite(value):
        raise InputError(f"the number {text[:20]} lies beyond float64's range")
    return value


def step_json(inputs: Any) -> dict[str, list]:
    """Runs a step on a decoded JSON object, reading its failures as codes
    (`throw=False`): the default chain step, as [`speculax.speculative_step`][]
    does; [`speculax.TreeStep`][] where the object holds `parents`; and
    [`speculax.LogitsStep`][] where it holds `target_logits`.

    The object holds the step's inputs under their argument names, `draft_probs`
    (or `draft_logits`) `null` for deterministic drafts; or, instead of the two
    uniform arrays, a `seed` in $[0, 2^{32})$, from which the step draws them as
    with `key=jax.random.key(seed)`. Logits may come with `temperature`, `top_k`
    and `top_p`, each a number or one per row.

    **Raises:**

    `InputError` with a one-line message for anything that is not a valid input; for
    bad values, the first failing row and its [`speculax.RESULTS`][] message.
    """
    from .._core._failures import failure_messages

    if not isinstance(inputs, dict):
        raise InputError(
            f"expected a JSON object with the keys {', '.join(INPUT_NAMES)}"
        )
    name = _kind_of(inputs)
    kind = KINDS[name]
    seeded = "seed" in inputs
    names = [n for n in kind.arrays if not (seeded and n in UNIFORM_NAMES)]
    missing = [n for n in names if n not in inputs]
    if missing:
        raise InputError(f"missing key(s): {', '.join(missing)}")
    if seeded and any(n in inputs for n in UNIFORM_NAMES):
        raise InputError(
            "give either seed or accept_uniforms and sample_uniforms, not both"
        )
    unknown = sorted(set(inputs) - {*kind.arrays, *kind.parameters, "seed"})
    if unknown:
        raise InputError(f"unknown key(s) for a {name} step: {', '.join(unknown)}")
    # A null second array: deterministic drafts, q_i the one-hot of x_i.
    arrays = [
        None if n in NULLABLE_NAMES and inputs[n] is None else _input(n, inputs[n])
        for n in names
    ]
    keywords: dict[str, Any] = {
        n: _parameter(n, inputs[n]) for n in kind.parameters if n in inputs
    }
    if seeded:
        keywords["key"] = _key(inputs["seed"])
    try:
        out, result = _reporting_step(name)(*arrays, **keywords)
    except (ValueError, TypeError) as error:
        raise InputError(str(error)) from None
    for row, message in enumerate(failure_messages(result)):
        if message:
            raise InputError(f"row {row}: {message}")
    return {n: np.asarray(out[n]).tolist() for n in kind.outputs}


def _kind_of(inputs: dict[str, Any]) -> str:
    """The kind of step an object asks for, by the key only that kind has."""
    marks = {"tree": "parents", "logits": "target_logits"}
    found = [name for name, key in marks.items() if key in inputs]
    if len(found) > 1:
        raise InputError(
            "give parents (a tree step) or target_logits (the logits step), not both"
        )
    return found[0] if found else "chain"


def _parameter(name: str, value: Any) -> Any:
    """A sampling parameter of the logits step: a JSON number, read as a Python
    number (its range checked now) or an array of one per row; `null` for `top_k`
    and `top_p` keeps all."""
    if value is None and name != "temperature":
        return None
    if type(value) in (int, float):
        return value
    return _input(name, value)


def _input(name: str, value: Any) -> Any:
    """A JSON value as the array the step takes, integers narrowed by value outside
    the jit (which would wrap a NumPy `int64` such as $2^{32} + 1$ to 1): a token
    out of range stays out of range, a parent too (-1 marks an unused slot), and a
    `top_k` beyond `int32` keeps all, as it does."""
    from .._core._numerics import index_array

    array = _as_array(name, value)
    if name not in INTEGER_NAMES:
        return array
    return index_array(array, {"parents": -2, "top_k": None}.get(name, -1))


@functools.cache
def _reporting_step(kind: str) -> Callable[..., tuple[Any, "RESULTS"]]:
    """The jitted `with_result` of the step of a kind of input."""
    import equinox as eqx

    from .._chain._step import SpeculativeStep
    from .._logits._step import LogitsStep
    from .._tree._recursive import TreeStep

    step = {"chain": SpeculativeStep, "tree": TreeStep, "logits": LogitsStep}[kind]
    return eqx.filter_jit(step(throw=False).with_result)


def _key(seed: Any) -> "KeyArray":
    """The JAX key of a JSON seed, an integer read by value (never wrapped)."""
    import jax

    # bool is an int in Python, and 1.0 is no integer in JSON terms.
    if type(seed) is not int:
        shown = json.dumps(seed)
        shown = shown if len(shown) <= 20 else f"{shown[:20]}..."
        raise InputError(f"seed must be an integer; got {shown}")
    if not 0 <= seed < SEED_LIMIT:
        raise InputError(f"seed must lie in [0, 2^32); got {seed}")
    return jax.random.key(seed)


def _as_array(name: str, value: Any) -> np.ndarray:
    """A JSON value as the NumPy array the step takes: integers for the tokens,
    float32 for the rest (JSON integers such as `0` and `1` included).
    """
    not_numbers = InputError(f"{name} is not a rectangular array of numbers")
    # Only numbers: NumPy would quietly read true as 1 and null as NaN.
    if not _leaf_types(value) <= {int, float}:
        raise not_numbers
    try:
        array = np.asarray(value)
    except (ValueError, TypeError, OverflowError, RecursionError):
        raise not_numbers from None
    if name in INTEGER_NAMES:
        from .._core._numerics import host_integers

        if array.size == 0:
            return array.astype(np.int32)
        if _leaf_types(value) <= {int}:
            # JSON integers exactly, whatever NumPy makes of them (objects beyond 64
            # bits, float64 for negative ones beside ones beyond int64): the step
            # reads them by value, one beyond int32 a token out of range.
            return host_integers(value)
        if array.dtype.kind == "O":
            # Floats beside integers beyond float64's range.
            raise InputError(f"{name} must have an integer dtype; got a float")
        return array
    try:
        array = np.asarray(value, np.float64)
    except OverflowError:
        raise InputError(f"{name} holds an integer beyond float64's range") from None
    # JSON numbers are float64 in Python; the step computes in float32 unless x64 is
    # on, in which case float64 input rightly gives float64 arithmetic. A number
    # float32 cannot hold is refused here: the step's checks read only the rows the
    # step uses, and one elsewhere would pass as infinite.
    with np.errstate(over="ignore"):
        narrowed = array.astype(np.float32)
    if not np.isfinite(narrowed).all():
        raise InputError(f"{name} holds a number beyond float32's range")
    return narrowed


def _leaf_types(value: Any) -> set[type]:
    """The types of the non-list values nested in `value`, without recursion (JSON
    may nest deeper than Python's stack)."""
    types, stack = set(), [value]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        else:
            types.add(type(item))
    return types


def _demo() -> int:
    import jax
    import jax.numpy as jnp

    from .._chain._step import speculative_step
    from ._examples import WORKED_EXAMPLES

    print("speculax demo: the worked examples of the specification\n")
    all_matched = True
    for number, (inputs, expected) in enumerate(WORKED_EXAMPLES, start=1):
        tokens = np.asarray(inputs["draft_tokens"])
        vocab = np.asarray(inputs["target_probs"]).shape[-1]
        print(
            f"example {number}: B={tokens.shape[0]} G={tokens.shape[1]} V={vocab}  "
            f"draft_tokens={inputs['draft_tokens']}  "
            f"accept_uniforms={inputs['accept_uniforms']}  "
            f"sample_uniforms={inputs['sample_uniforms']}"
        )
        got = step_json(inputs)
        matched = got == expected
        all_matched &= matched
        print(f"  got      {json.dumps(got, separators=(',', ':'))}")
        print(f"  expected {json.dumps(expected, separators=(',', ':'))}")
        print(f"  {'MATCH' if matched else 'MISMATCH'}\n")

    batch, num_draft, vocab = 4, 4, 32000
    key_target, key_draft, key_tokens, key_accept, key_sample = jax.random.split(
        jax.random.key(0), 5
    )
    target_probs = jax.nn.softmax(
        2.0 * jax.random.normal(key_target, (batch, num_draft + 1, vocab)), axis=-1
    )
    draft_logits = jnp.log(target_probs[:, :num_draft]) + 0.5 * jax.random.normal(
        key_draft, (batch, num_draft, vocab)
    )
    draft_probs = jax.nn.softmax(draft_logits, axis=-1)
    draft_tokens = jax.random.categorical(key_tokens, draft_logits, axis=-1)
    out = speculative_step(
        draft_tokens,
        draft_probs,
        target_probs,
        jax.random.uniform(key_accept, (batch, num_draft)),
        jax.random.uniform(key_sample, (batch,)),
    )
    print(
        f"random batch: B={batch} G={num_draft} V={vocab}, drafts sampled from a "
        "perturbed copy of the target"
    )
    print(f"  draft_tokens = {np.asarray(draft_tokens).tolist()}")
    print(f"  num_accepted = {np.asarray(out['num_accepted']).tolist()}")
    print(f"  tokens       = {np.asarray(out['tokens']).tolist()}\n")

    print("all worked examples match" if all_matched else "a worked example DIFFERS")
    return 0 if all_matched else 1


def _demo_loop(args: argparse.Namespace) -> int:
    from ._demo import PROMPTS, TREE_PATHS, measure_cache, measure_loop

    runs_trees = bool({"tree", "traversal"} & set(args.verify))
    trees = f", trees of {len(TREE_PATHS)} nodes" if runs_trees else ""
    print(
        "speculax demo --loop: speculative sampling with two byte-level transformers "
        "trained on the standard library's sources\n"
        f"{len(PROMPTS)} prompts, {args.max_new_tokens} new tokens each; chains of "
        f"G = {args.num_draft}{trees}; wall-clock time is the median of "
        f"{args.repeats} runs\n",
        flush=True,
    )

    # Progress on standard error: the tables on standard output come at the end.
    def progress(line: str) -> None:
        print(f"speculax demo --loop: {line}", file=sys.stderr, flush=True)

    results = measure_loop(
        args.verify,
        batch_sizes=sorted(set(args.batch_sizes)),
        num_draft=args.num_draft,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        progress=progress,
    )
    cache = measure_cache(
        args.cache_lengths,
        num_draft=args.num_draft,
        repeats=args.repeats,
        progress=progress,
    )
    width = max(len("verification"), *(len(result.verification) for result in results))
    print(
        f"{'verification':<{width}}  per call  drafts  tokens/call  target calls"
        "      time  speedup"
    )
    for result in results:
        print(
            f"{result.verification:<{width}}  {result.batch_size:8d}"
            f"  {result.drafts:6d}"
            f"  {result.tokens_per_call:11.2f}  {result.target_calls:12d}"
            f"  {1000 * result.seconds:6.0f} ms  {result.speedup:6.2f}x"
        )
    best = max(results, key=lambda result: result.speedup)
    print(
        "\ndrafts: the draft tokens of a step (a tree's nodes); tokens/call: a row's "
        "tokens per target call of that row; target calls: the batched calls; "
        "speedup: over the target alone at the same batch size.\nFastest: "
        f"{best.verification}, {best.batch_size} per call, {best.speedup:.2f}x."
    )
    if cache:
        print(
            "\nThe chain loop, one prompt per call, with and without the models' "
            "key-value caches (a call then reads the whole buffer):\n"
            "new tokens  buffer  cached (ms/token)  cacheless (ms/token)  ratio"
        )
        for row in cache:
            print(
                f"{row.max_new_tokens:10d}  {row.length:6d}  {1000 * row.cached:17.2f}"
                f"  {1000 * row.cacheless:20.2f}  {row.cacheless / row.cached:5.2f}x"
            )
    print(
        f"\nThe first prompt, {PROMPTS[0]!r}, continued by {best.verification}:\n"
        f"{PROMPTS[0]}{best.sample}"
    )
    if not args.full:
        print(
            "\nThe full comparison, block verification and the draft trees included "
            "(a few minutes): speculax demo --loop --full"
        )
    return 0
