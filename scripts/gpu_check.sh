#!/usr/bin/env bash
# Device check of the torch backend (for a session lent a CUDA machine): the checker on every
# committed workload with `--device cuda`, then the GPU benchmarks (decode throughput torch vs
# numpy, K/V write and gather bandwidth against a device copy of the same bytes timed with CUDA
# events, pool memory against the formula). JSON records land in OUTDIR (default: $OUT, else
# results/runs). Exit status 1 when a check fails or the memory figures disagree.
#
#   scripts/gpu_check.sh [OUTDIR] [--device cuda|cuda:N|cpu] [--size full|tiny] [--traces FILE...]
#
# On the device machine (its python3 holds torch):
#   PYTHONUNBUFFERED=1 scripts/gpu_check.sh "$OUT" 2>&1 | tee "$OUT/gpu_check.log"
# Here, on CPU, in about a minute:  scripts/gpu_check.sh /tmp/gpu-check --device cpu --size tiny
# Not yet run on a GPU: budget a few minutes (checker ~1 min, decode and bandwidth ~2 min; each
# NumPy figure stops after 10 s of timed calls). Use timeout_s 540 so a rerun still fits.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-results/runs}"
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  out="$1"
  shift
fi
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
exec "$py" -m kvbench.cli.gpu --out "$out" "$@"
