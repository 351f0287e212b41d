import importlib.util
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from jaxtyping import Array, Int, Integer, UInt8


# Pure-Python standard-library modules present, as source files, in every CPython
# from 3.11 on, none of them moved to another file since (datetime was, to
# _pydatetime, in 3.12). The order is the corpus's order; the text is the running
# Python's, so the corpus (about 1.6 MB) is fixed for one Python version.
CORPUS_MODULES: tuple[str, ...] = (
    "argparse",
    "collections",
    "json",
    "json.decoder",
    "json.encoder",
    "json.scanner",
    "textwrap",
    "string",
    "dataclasses",
    "functools",
    "enum",
    "typing",
    "inspect",
    "ast",
    "shutil",
    "logging",
    "difflib",
    "fractions",
    "statistics",
    "random",
    "heapq",
    "bisect",
    "copy",
    "pprint",
    "contextlib",
    "tokenize",
    "traceback",
    "calendar",
    "configparser",
    "csv",
    "threading",
    "subprocess",
    "optparse",
    "tarfile",
)
# The last twentieth of the corpus is held out from training, for the loss.
HELD_OUT_FRACTION = 0.05


def _source_bytes(module: str) -> bytes:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise FileNotFoundError(
            f"the standard library's source of {module!r} is not installed"
        )
    return Path(spec.origin).read_bytes()


def corpus(modules: Sequence[str] = CORPUS_MODULES) -> UInt8[np.ndarray, " size"]:
    """The source text of some standard-library modules, concatenated as UTF-8
    bytes: the training text of the demo models.

    Every module is read from its `.py` file, without being imported, each followed
    by one newline, in the order given.

    **Arguments:**

    - `modules`: the modules' dotted names (default `CORPUS_MODULES`, about 1.6 MB).

    **Returns:**

    A uint8 NumPy array of shape `(size,)`, one byte token per entry.

    **Raises:**

    `FileNotFoundError` when a module's source file is not installed.
    """
    text = b"".join(_source_bytes(module) + b"\n" for module in modules)
    return np.frombuffer(text, dtype=np.uint8).copy()


def split_corpus(
    tokens: UInt8[np.ndarray, " size"],
    held_out_fraction: float = HELD_OUT_FRACTION,
) -> tuple[UInt8[np.ndarray, " train"], UInt8[np.ndarray, " held_out"]]:
    """Splits a corpus into its training part and the held-out part that follows it.

    **Arguments:**

    - `tokens`: uint8 `(size,)`, as `speculax._cli._demo.corpus` returns.
    - `held_out_fraction`: the fraction of the bytes, at the end, held out.

    **Returns:**

    A tuple `(train, held_out)` of uint8 arrays, the first `size - n` bytes and the
    last `n`, where `n = round(held_out_fraction * size)`.
    """
    if not 0 < held_out_fraction < 1:
        raise ValueError("held_out_fraction must lie in (0, 1)")
    split = len(tokens) - round(held_out_fraction * len(tokens))
    return tokens[:split], tokens[split:]


def encode(text: str) -> Int[np.ndarray, " time"]:
    """Byte tokens of a string: its UTF-8 encoding.

    **Arguments:**

    - `text`: any string.

    **Returns:**

    An int32 NumPy array of shape `(time,)`, each entry in `[0, 256)`.
    """
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def decode(
    tokens: Integer[np.ndarray, " time"] | Integer[Array, " time"] | Sequence[int],
) -> str:
    """The string of some byte tokens, invalid UTF-8 replaced by `"\\ufffd"`.

    **Arguments:**

    - `tokens`: integers of shape `(time,)`, each in `[0, 256)`.

    **Returns:**

    The bytes decoded as UTF-8 with `errors="replace"`.

    **Raises:**

    `ValueError` when a token lies outside `[0, 256)`.
    """
    array = np.asarray(tokens)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ValueError("tokens must be a one-dimensional array of integers")
    if array.size and (array.min() < 0 or array.max() > 255):
        raise ValueError("tokens must lie in [0, 256)")
    return array.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
