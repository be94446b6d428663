#!/usr/bin/env bash
# One device call: build for sm_90, run the CUDA tests, run the benchmarks; logs to $OUT.
#   bash bench/gpu_run.sh [pytest -k expr] [bench names...]
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
K=${1:-}; shift || true
t0=$(date +%s); ts() { echo "=== [$(( $(date +%s) - t0 ))s] $*"; }
ts "device"; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" 2>&1 | tail -1
ts "build extension"
# the C++ benches (bench/*.cu) are built by the same CMake run (KVQ_BUILD_BENCH)
python3 -m pip install --no-build-isolation --no-deps -v . -C build-dir=build/gpu \
  -C cmake.define.KVQ_BUILD_BENCH=ON > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
grep -E "kvquant-ext:|CMake Error|Successfully installed" "$OUT/build.log"
ts "CUDA tests"
# one process per test file: a crash loses at most the rest of its file
sel=${K:+($K) and }"not bad_input"
for f in ${TEST_FILES:-tests/test_*.py}; do
  echo "--- $f"; timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q "$f" -k "$sel" -p no:cacheprovider 2>&1 | tee -a "$OUT/tests.log" | tail -3
done
ts "bad-input tests (own process)"
python3 -m pytest -q tests -k "bad_input" -p no:cacheprovider 2>&1 | tee "$OUT/tests_bad_input.log" | tail -8
for b in "$@"; do
  ts "bench $b"
  # shellcheck disable=SC2086
  case "$b" in
    *.py*) python3 bench/$b 2>&1 | tee -a "$OUT/bench.log" ;;
    *) ./build/gpu/bench/$b 2>&1 | tee -a "$OUT/bench.log" ;;
  esac
done
if [ -n "${NCU:-}" ]; then ts "ncu"; bash bench/ncu_decode.sh > "$OUT/ncu.log" 2>&1; grep -E "Duration|Throughput|Registers|Achieved Occupancy|Theoretical Occupancy|Issued Ipc|Warp Cycles Per Issued|Block Limit|Waves|One or More|No Eligible|Stall" "$OUT/ncu.log" | head -40; fi
if [ -n "${SANITIZE:-}" ]; then
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
    ts "compute-sanitizer $tool: $SANITIZE"
    compute-sanitizer --tool $tool --print-limit 20 python3 -m pytest -q -p no:cacheprovider $SANITIZE 2>&1 | tail -6
  done
fi
ts "done"
