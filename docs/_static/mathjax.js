// MathJax configuration for pymdownx.arithmatex (generic mode). Loaded before the
// vendored MathJax itself (docs/_static/mathjax, see scripts/vendor_mathjax.sh), so
// that the site renders its formulas offline.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex",
  },
};

// Material emits document$ once on load and again after each instant-navigation page
// swap. The first page is typeset by MathJax's own startup, so only later emissions
// re-typeset, each chained after the work before it. The output's font cache is left
// alone: clearing it mid-typeset left the formulas blank (mkdocs-material #6407,
// #6661).
if (typeof document$ !== "undefined") {
  let firstPage = true;
  document$.subscribe(() => {
    if (firstPage) {
      firstPage = false;
      return;
    }
    if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
      MathJax.startup.promise = MathJax.startup.promise.then(() => {
        MathJax.typesetClear();
        MathJax.texReset();
        return MathJax.typesetPromise();
      });
    }
  });
}
