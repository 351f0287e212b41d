"""The documentation site in a real browser: every page of the built site, served on
the loopback interface and loaded in headless Chromium, with every formula rendered
by the vendored MathJax, every image loaded and no console error.

Needs the `docs` extra (MkDocs, Selenium) and Debian's `chromium` and
`chromium-driver`, which `.ci/run` installs. Without them the test is skipped, except
under CI (`CI=true`), where a skip would hide a broken site.
"""

import functools
import http.server
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
MISSING = [
    name
    for name, found in [
        ("chromium", CHROMIUM),
        ("chromedriver", CHROMEDRIVER),
        ("mkdocs", importlib.util.find_spec("mkdocs")),
        ("selenium", importlib.util.find_spec("selenium")),
    ]
    if not found
]
if MISSING and os.environ.get("CI") != "true":
    pytest.skip(
        f"needs {', '.join(MISSING)} (installed by .ci/run)", allow_module_level=True
    )

# What the page shows as text, code blocks left out (code may hold a backslash and a
# parenthesis, as in a regular expression).
_VISIBLE_TEXT = """
const body = document.body.cloneNode(true);
body.querySelectorAll("pre, code, script, style").forEach((node) => node.remove());
return body.innerText;
"""
# Waits for MathJax to load (its script may still be running when the page's load
# event has fired) and then for its first typeset to finish.
_AFTER_MATHJAX = """
const done = arguments[arguments.length - 1];
const start = Date.now();
(function wait() {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    MathJax.startup.promise.then(() => done(null), (error) => done(String(error)));
  } else if (Date.now() - start > 20000) {
    done("MathJax did not load");
  } else {
    setTimeout(wait, 50);
  }
})();
"""
_FORMULAS = """
const formulas = Array.from(document.querySelectorAll(".arithmatex"));
return [formulas.length,
        formulas.filter((node) => !node.querySelector("mjx-container")).length,
        document.querySelectorAll("mjx-container").length];
"""
_BROKEN_IMAGES = """
return Array.from(document.images)
  .filter((image) => !(image.complete && image.naturalWidth > 0))
  .map((image) => image.src);
"""

# At the browser's width of 1280 px: the tables (Material wraps each in a scrolling
# box) whose content is wider than the page's text, and the identifiers in tables
# (code without a space) that wrap onto a second line.
_LAYOUT = """
const boxes = Array.from(
  document.querySelectorAll(".md-content .md-typeset__scrollwrap"));
const wide = boxes.filter((box) => box.scrollWidth > box.clientWidth + 1)
  .map((box) => box.querySelector("tr").innerText.slice(0, 60));
const codes = Array.from(document.querySelectorAll(".md-content table code"));
const broken = codes
  .filter((code) => !/\\s/.test(code.textContent))
  .filter((code) => code.getClientRects().length > 1)
  .map((code) => code.textContent);
return [wide, broken, boxes.length, codes.length];
"""
# The theme's script wraps each table in a scroll box after the page loads: the layout
# is read once every table is wrapped, or the check would race it and pass vacuously.
_TABLES_WRAPPED = """
const tables = document.querySelectorAll(".md-content table").length;
const boxes = document.querySelectorAll(".md-content .md-typeset__scrollwrap").length;
return boxes >= tables;
"""


def _layout(browser) -> list:
    """The page's layout as `_LAYOUT` reads it: the tables wider than their box, the
    identifiers in tables broken over lines, and the counts of tables and of
    identifiers in tables."""
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, 20).until(lambda b: b.execute_script(_TABLES_WRAPPED))
    return browser.execute_script(_LAYOUT)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built strictly and served on 127.0.0.1 for the module's tests."""
    directory = tmp_path_factory.mktemp("site")
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet"]
    subprocess.run([*build, "--site-dir", str(directory)], cwd=ROOT, check=True)
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield directory, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu"):
        options.add_argument(argument)
    options.add_argument("--window-size=1280,1024")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


def _pages() -> list[str]:
    """The pages of the navigation, as paths of the built site."""
    import re

    nav = re.findall(r":\s*([\w/.-]+)\.md\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    return ["" if page == "index" else f"{page}/" for page in nav]


@pytest.mark.parametrize("page", _pages())
def test_page_renders_in_a_browser(page, site, browser):
    _, url = site
    browser.get_log("browser")  # drop what earlier pages logged
    browser.get(f"{url}/{page}")
    assert browser.execute_async_script(_AFTER_MATHJAX) is None
    text = browser.execute_script(_VISIBLE_TEXT)
    for raw in ("\\(", "\\)", "\\[", "\\]", "$$"):
        assert raw not in text, f"raw TeX {raw!r} left on {page or 'index'}"
    formulas, unrendered, containers = browser.execute_script(_FORMULAS)
    assert unrendered == 0, f"{unrendered} of {formulas} formulas not rendered"
    assert containers >= formulas
    assert browser.execute_script(_BROKEN_IMAGES) == []
    wide, broken, _, _ = _layout(browser)
    assert wide == [], f"tables wider than the page at 1280 px: {wide}"
    assert broken == [], f"identifiers broken across lines: {broken}"
    errors = [
        entry["message"]
        for entry in browser.get_log("browser")
        if entry["level"] == "SEVERE"
    ]
    assert errors == []


def test_the_pages_with_math_are_checked(site, browser):
    """A guard for the test itself: the pages that hold formulas are visited, and
    MathJax renders them there (a typo in the selectors would pass vacuously)."""
    _, url = site
    browser.get(f"{url}/specification/")
    assert browser.execute_async_script(_AFTER_MATHJAX) is None
    formulas, unrendered, containers = browser.execute_script(_FORMULAS)
    assert formulas > 20 and unrendered == 0 and containers >= formulas


def test_the_layout_check_sees_tables(site, browser):
    """A guard for the layout check: it finds the benchmark tables and the Trees
    page's identifiers in tables (a typo in its selectors would pass vacuously)."""
    _, url = site
    browser.get(f"{url}/benchmarks/")
    _, _, tables, _ = _layout(browser)
    assert tables >= 3
    browser.get(f"{url}/trees/")
    _, _, _, codes = _layout(browser)
    assert codes >= 3


@pytest.mark.parametrize(
    "query, entry",
    [
        ("TreeStep", "api/step/#speculax.TreeStep"),
        ("TypicalAcceptance", "api/pieces/#speculax.TypicalAcceptance"),
        ("speculax.TreeStep", "api/step/#speculax.TreeStep"),
        ("tree_lossless_error", "api/testing/#speculax.testing.tree_lossless_error"),
    ],
)
def test_search_finds_a_name_bare_or_in_full(query, entry, site, browser):
    """The site's search, typed into as a reader does: a public name finds its API
    entry among the first results, whether or not it is written with `speculax.`."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    _, url = site
    browser.get(f"{url}/")
    box = browser.find_element(By.CSS_SELECTOR, "input.md-search__input")
    browser.execute_script(
        "document.getElementById('__search').checked = true; arguments[0].focus();",
        box,
    )
    box.send_keys(query)

    # The results are read in one script, not link by link: the search renders
    # them again as the query's letters arrive, and a link read after its list was
    # replaced is stale. The first three are those of the whole query once the
    # entry is among them; what was last on show is the failure's message.
    shown: list[list[str]] = [[]]

    def entry_among_the_first_three(driver):
        shown[0] = driver.execute_script(
            "return Array.from(document.querySelectorAll("
            "'a.md-search-result__link'), link => link.href).slice(0, 3);"
        )
        return f"{url}/{entry}" in shown[0]

    try:
        WebDriverWait(browser, 20).until(entry_among_the_first_three)
    except TimeoutException:
        pytest.fail(f"{entry} is not among the first three results: {shown[0]}")
