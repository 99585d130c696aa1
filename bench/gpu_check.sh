#!/usr/bin/env bash
# The device check on a bare GPU machine: bash bench/gpu_check.sh OUT_DIR [extra gpu_check flags]
#
# Uses the machine's python3 and torch and installs nothing; pshard comes from .gpu-carry/site (built
# here by `make gpu-carry`: the installed package with stubs for the device's grpcio). `python3 -P`
# keeps the repository's own pshard/ folder (no stubs, no package-dir mapping) off sys.path; the
# repository root is still on PYTHONPATH, after the carry, for bench/ and tests/.
set -uo pipefail
OUT=${1:?usage: bench/gpu_check.sh OUT_DIR [gpu_check flags]}
shift
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CARRY="$ROOT/.gpu-carry/site"
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if [ ! -d "$CARRY/pshard" ]; then
    echo "gpu-check: $CARRY is missing: run 'make gpu-carry' on the build machine and carry .gpu-carry" >&2
    exit 2
fi
export PYTHONPATH="$CARRY:$ROOT"
export PYTHONNOUSERSITE=1
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-$(mktemp -d)}
echo "gpu-check: carry of tree $(cat "$ROOT/.gpu-carry/COMMIT" 2>/dev/null || echo '?'); $(nvidia-smi -L 2>/dev/null | head -1)"
cd "$ROOT" && "$PY" -P -m bench.gpu_check --out "$OUT/gpu_check.jsonl" "$@" 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
