"""The house rules that keep the library readable, checked on its source: data flows
one way through the families (no module imports a family above its own), and no
definition is longer than a reader can hold at once. See `CONTRIBUTING.md`."""

import ast
import io
import pathlib
import tokenize

import pytest


PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "src" / "speculax"

# The families, lowest first. A module may import its own family and the ones below;
# families on one line are peers and may not import each other.
FAMILIES = [
    ("_core",),
    ("_inputs",),
    ("_pieces",),
    ("_chain",),
    ("_tree", "_logits"),
    ("_sharded",),
    ("_loop",),
    ("_drafters",),
    ("testing",),
    ("_cli",),
    ("__init__", "__main__"),
]
RANK = {family: rank for rank, peers in enumerate(FAMILIES) for family in peers}

# Lines of code, docstrings, comments and blank lines aside.
LONGEST_FUNCTION = 100
LONGEST_CLASS = 200

MODULES = sorted(PACKAGE.rglob("*.py"))


def _module_name(path: pathlib.Path) -> list[str]:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts


def _family(parts: list[str]) -> str:
    return parts[0] if parts else "__init__"


def _imported(path: pathlib.Path) -> list[tuple[int, list[str]]]:
    """Every module of speculax that `path` imports, as its parts below the
    package, with the line."""
    parts = _module_name(path)
    package = parts if path.name == "__init__.py" else parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "speculax":
                target = node.module.split(".")[1:]
            else:
                continue
            found.append((node.lineno, target))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "speculax":
                    found.append((node.lineno, alias.name.split(".")[1:]))
    return found


@pytest.mark.parametrize(
    "path", MODULES, ids=[str(p.relative_to(PACKAGE)) for p in MODULES]
)
def test_imports_flow_one_way(path):
    own = _family(_module_name(path))
    assert own in RANK, f"{own} is in no family of FAMILIES"
    upward = []
    for line, target in _imported(path):
        other = _family(target)
        if other == own or not target:
            continue
        if RANK[other] >= RANK[own]:
            upward.append(f"line {line}: imports {'.'.join(target)} ({other})")
    assert not upward, f"{path.relative_to(PACKAGE)} ({own}) imports up or across: " + (
        "; ".join(upward)
    )


def _lines_with_code(source: str) -> set[int]:
    """The lines of `source` that hold a token: not blank, not only a comment."""
    layout = {
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
    }
    code = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in layout:
            code.update(range(token.start[0], token.end[0] + 1))
    return code


def _code_lines(code: set[int], node: ast.AST) -> int:
    """The lines of `node` that hold code (`code`: the file's lines with code), not
    in a docstring of `node` or of a definition inside it."""
    lines = set(range(node.lineno, node.end_lineno + 1))
    for inner in ast.walk(node):
        if isinstance(
            inner, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Module
        ):
            body = inner.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                lines -= set(range(body[0].lineno, body[0].end_lineno + 1))
    return len(lines & code)


def definitions() -> list[tuple[str, int, int]]:
    """Every function and class of the package: its name, its lines of code, and
    the limit it is held to."""
    found = []
    for path in MODULES:
        source = path.read_text()
        code = _lines_with_code(source)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                limit = LONGEST_FUNCTION
            elif isinstance(node, ast.ClassDef):
                limit = LONGEST_CLASS
            else:
                continue
            name = f"{path.relative_to(PACKAGE)}:{node.name}"
            found.append((name, _code_lines(code, node), limit))
    return found


def test_no_definition_is_longer_than_a_reader_can_hold():
    too_long = [
        f"{name}: {lines} lines of code (at most {limit})"
        for name, lines, limit in definitions()
        if lines > limit
    ]
    assert not too_long, "\n".join(too_long)


if __name__ == "__main__":
    for name, lines, _ in sorted(definitions(), key=lambda d: -d[1])[:15]:
        print(f"{lines:4d}  {name}")
