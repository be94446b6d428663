#!/usr/bin/env bash
# The test suite on a CUDA machine, one pytest process per test file (a crashed CUDA context
# loses at most the rest of its file), then the bad-input tests in a process of their own.
# Expects kvquant-ext installed with CUDA (pip install --no-build-isolation .).
#
#   bash tools/gpu_tests.sh [PYTEST -k EXPR]
#
# Environment: OUTDIR (default /tmp/kvq-tests; tests.log and tests_bad_input.log),
# TEST_FILES (default tests/test_*.py), TEST_TIMEOUT seconds per file (default 600).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUTDIR=${OUTDIR:-/tmp/kvq-tests}; mkdir -p "$OUTDIR"
K=${1:-}
t0=$(date +%s); ts() { echo "=== [$(( $(date +%s) - t0 ))s] $*"; }
ts "device"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, kvquant_ext; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
sel="${K:+($K) and }not bad_input"
rc=0
: > "$OUTDIR/tests.log"
for f in ${TEST_FILES:-tests/test_*.py}; do
  ts "$f"
  timeout "${TEST_TIMEOUT:-600}" python3 -m pytest -q "$f" -k "$sel" -p no:cacheprovider 2>&1 |
    tee -a "$OUTDIR/tests.log" | tail -3
  r=${PIPESTATUS[0]}
  # 5: nothing selected in this file
  [ "$r" -ne 0 ] && [ "$r" -ne 5 ] && rc=$r
done
ts "bad-input tests"
python3 -m pytest -q tests -k "${K:+($K) and }bad_input" -p no:cacheprovider 2>&1 |
  tee "$OUTDIR/tests_bad_input.log" | tail -8
r=${PIPESTATUS[0]}
[ "$r" -ne 0 ] && [ "$r" -ne 5 ] && rc=$r
ts "done (rc=$rc)"
exit "$rc"
