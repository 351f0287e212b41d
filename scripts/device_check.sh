#!/usr/bin/env bash
# The device check (scripts/device_check.py): the bench table of every variant and
# the batch-invariance and exactness tests of every step, on JAX's default device.
#
#   scripts/device_check.sh [OUTDIR] [--quick] [--repeats N] [--workers N]
#
# OUTDIR defaults to $OUT, else device_check. $PYTHON names the interpreter with jax
# and the test dependencies (default: python); this checkout's src/ comes first on
# its path, so the sources checked are these, whatever speculax it has installed.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" "$root/scripts/device_check.py" "$@"
