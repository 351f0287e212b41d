"""The documentation cannot rot: every ```python block in it runs.

Each Markdown page under docs/ (and README.md) has its ```python blocks run in order,
in one namespace per page, so a page reads like a notebook. Blocks fenced with another
language (```bash, ```text, ```json, ```console) are shown, never run. The ```python
blocks in the docstrings of the public API, which the API reference renders, run too.
"""

import inspect
import re
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]

# An opening fence of the language `python`, possibly indented (inside an admonition
# or a list), up to the closing fence of the same indentation and at least as long.
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]*)")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """The ```python blocks of a Markdown text, as `(first code line, code)` with the
    line number 1-based and the code dedented.
    """
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        indent, fence, lang = match["indent"], match["fence"], match["lang"]
        start = i + 1
        end = start
        while end < len(lines):
            closing = lines[end].strip()
            if closing.startswith(fence[0] * len(fence)) and not closing.strip(
                fence[0]
            ):
                break
            end += 1
        if lang == "python":
            body = [line[len(indent) :] for line in lines[start:end]]
            blocks.append((start + 1, "\n".join(body) + "\n"))
        i = end + 1
    return blocks


def run_blocks(blocks: list[tuple[int, str]], filename: str) -> dict:
    """Runs the blocks in order in one namespace, and returns it."""
    namespace: dict = {"__name__": "__docs__"}
    for first_line, code in blocks:
        # Pad so that a traceback points at the right line of the Markdown file.
        compiled = compile("\n" * (first_line - 1) + code, filename, "exec")
        exec(compiled, namespace)
    return namespace


def test_fence_parser():
    text = "\n".join(
        [
            "# Title",
            "```python",
            "x = 1",
            "```",
            "```bash",
            "echo no",
            "```",
            "!!! note",
            "    ```python",
            "    y = x + 1",
            "    ```",
            "````python",
            "s = '```'",
            "````",
        ]
    )
    assert python_blocks(text) == [
        (3, "x = 1\n"),
        (10, "y = x + 1\n"),
        (13, "s = '```'\n"),
    ]


# The pages whose code takes longest (a loop, logits at scale, the guide's tour) run
# in the extended tier.
SLOW_PAGES = {"loop.md", "from_logits.md", "guide.md", "performance.md", "sharding.md"}


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(page, marks=pytest.mark.slow) if page.name in SLOW_PAGES else page
        for page in PAGES
    ],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_page_code_runs(page: Path):
    if not page.exists():
        pytest.skip(f"{page.name} does not exist")
    blocks = python_blocks(page.read_text())
    run_blocks(blocks, str(page))


def _public_objects() -> list[tuple[str, object]]:
    import speculax
    import speculax.testing

    modules = [speculax, speculax.testing]
    found = []
    for module in modules:
        names = getattr(module, "__all__", None) or [
            name for name in vars(module) if not name.startswith("_")
        ]
        found.append((module.__name__, module))
        for name in names:
            obj = getattr(module, name)
            if inspect.ismodule(obj):
                continue
            found.append((f"{module.__name__}.{name}", obj))
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if callable(member) and (attr == "__call__" or attr[0] != "_"):
                        found.append((f"{module.__name__}.{name}.{attr}", member))
    return found


# A control character renders as nothing or breaks a line: a `"\rceil"` written in a
# string that is not raw became a carriage return and printed "⌈V/256 ceil".
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def test_no_control_characters_in_the_documentation():
    # Bytes decoded, not `read_text`, which would turn a carriage return into "\n".
    pages = [*PAGES, ROOT / "CONTRIBUTING.md"]
    texts = [
        (str(page.relative_to(ROOT)), page.read_bytes().decode()) for page in pages
    ]
    texts += [
        (f"the docstring of {name}", inspect.getdoc(obj) or "")
        for name, obj in _public_objects()
    ]
    found = [
        f"{where}, line {text.count(chr(10), 0, match.start()) + 1}: {match.group()!r}"
        for where, text in texts
        for match in _CONTROL.finditer(text)
    ]
    assert found == []
    assert _CONTROL.search("$\\lceil V/256 \rceil$") is not None


@pytest.mark.slow
def test_docstring_code_runs():
    ran = 0
    for qualified_name, obj in _public_objects():
        doc = inspect.getdoc(obj)
        if not doc:
            continue
        blocks = python_blocks(doc)
        run_blocks(blocks, f"<docstring of {qualified_name}>")
        ran += len(blocks)
    assert ran > 0


def test_the_guide_s_piece_takes_deterministic_drafts():
    """The guide's example acceptance test, its first block, on `draft_probs=None`,
    as the step passes deterministic drafts: $q_i$ the one-hot of $x_i$, so that
    with $c = 2$ draft token $x_i$ passes when $u_i < 2 p_i(x_i)$."""
    import speculax

    page = DOCS / "guide.md"
    namespace = run_blocks(python_blocks(page.read_text())[:1], str(page))
    step = speculax.SpeculativeStep(acceptance=namespace["RelaxedAcceptance"](2.0))
    out = step(
        draft_tokens=[[1, 2, 0]],
        draft_probs=None,
        target_probs=[
            [[0.1, 0.5, 0.4], [0.2, 0.2, 0.6], [0.4, 0.3, 0.3], [0.2, 0.4, 0.4]]
        ],
        # 0.9 < 2 * 0.5 and 0.3 < 2 * 0.6 pass (the exact test would reject the
        # first), 0.95 >= 2 * 0.4 rejects.
        accept_uniforms=[[0.9, 0.3, 0.95]],
        sample_uniforms=[0.25],
    )
    # The correction token is drawn from p_2 with x_2 = 0 taken out, [0, 0.5, 0.5].
    assert out["tokens"].tolist() == [[1, 2, 1, -1]]


def test_docs_pages_have_code():
    """The pages that teach by example keep their examples (a guard against a fence
    typo that would silently turn a page's code into text).
    """
    for name in ("index.md", "concepts.md", "guide.md"):
        assert python_blocks((DOCS / name).read_text()), name


def test_api_reference_is_complete():
    """Every public name of `speculax` (and of `speculax.testing`) has an entry
    (`::: name`) in the API reference, so that cross references to it resolve.
    """
    import speculax

    documented = set(re.findall(r"^:::\s*(\S+)", _api_text(), re.M))
    public = {
        f"speculax.{name}"
        for name in vars(speculax)
        if not name.startswith("_") and not inspect.ismodule(getattr(speculax, name))
    }
    missing = sorted(public - documented)
    assert not missing, f"add these to a page under docs/api/: {missing}"
    assert "speculax.testing" in documented


def _api_text() -> str:
    return "\n".join(page.read_text() for page in sorted((DOCS / "api").glob("*.md")))


def test_nav_pages_exist():
    nav = re.findall(r":\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert nav
    for page in nav:
        assert (DOCS / page).exists(), page


def test_figure_is_small():
    figure = DOCS / "images/lossless.svg"
    assert figure.exists()
    assert figure.stat().st_size < 100_000


def test_signatures_name_only_public_types():
    """Every speculax type named in a public signature (an alias such as
    `speculax.InputArray` included) is public, so that the API reference links it
    instead of showing a private path. Read with griffe, as mkdocstrings reads it."""
    griffe = pytest.importorskip("griffe")

    loader = griffe.GriffeLoader(search_paths=[str(ROOT / "src")])
    package = loader.load("speculax")
    loader.load("speculax.testing")
    loader.resolve_aliases(implicit=False, external=False)
    modules = [package, package["testing"]]
    members = [
        member
        for module in modules
        for name, member in module.members.items()
        if not name.startswith("_")
        # Imports of other packages (`importlib`) are no part of the API.
        and not (member.is_alias and not member.target_path.startswith("speculax."))
        and not member.is_module
    ]
    public = {member.canonical_path for member in members}
    functions = [member for member in members if member.is_function]
    for cls in (member for member in members if member.is_class):
        functions += [
            method
            for name, method in cls.members.items()
            if method.is_function and (name == "__call__" or not name.startswith("_"))
        ]
    private = set()
    for function in functions:
        annotations = [p.annotation for p in function.parameters] + [function.returns]
        for annotation in annotations:
            if not isinstance(annotation, griffe.Expr):
                continue
            for part in annotation.iterate(flat=True):
                if not isinstance(part, griffe.ExprName):
                    continue
                path = part.canonical_path
                if path.startswith("speculax.") and path not in public:
                    private.add(f"{function.path}: {path}")
    assert functions and not private, sorted(private)


def test_search_splits_dotted_names():
    """The site's search splits words where its separator matches (the browser
    test types into it): at a dot, so that `TreeStep` finds `speculax.TreeStep`,
    but not at a decimal point."""
    yaml = pytest.importorskip("yaml")

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    (search,) = [p["search"] for p in config["plugins"] if "search" in p]
    words = [w for w in re.split(search["separator"], "speculax.TreeStep() 0.5") if w]
    assert words == ["speculax", "TreeStep", "0.5"]
