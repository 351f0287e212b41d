#!/usr/bin/env bash
# Vendors MathJax 3 into docs/_static/mathjax, so that the documentation renders its
# formulas offline and needs no CDN: the CommonHTML bundle and the web fonts it loads
# from beside itself. Run from the repository root; needs npm.
set -euo pipefail
version=3.2.2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "mathjax@$version" >/dev/null && tar xzf "mathjax-$version.tgz")
target=docs/_static/mathjax
rm -rf "$target"
mkdir -p "$target/output/chtml/fonts"
cp "$work/package/es5/tex-chtml.js" "$target/"
cp -r "$work/package/es5/output/chtml/fonts/woff-v2" "$target/output/chtml/fonts/"
cp "$work/package/LICENSE" "$target/LICENSE"
echo "MathJax $version vendored into $target"
