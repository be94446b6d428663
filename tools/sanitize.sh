#!/usr/bin/env bash
# compute-sanitizer (memcheck, then racecheck) over CUDA tests, one pytest process per tool,
# each under a time limit.  Logs to OUTDIR/sanitize_<tool>.log, summary lines to stdout.
#
#   bash tools/sanitize.sh [PYTEST ARGS...]
#
# Default selection (16 tests): long-cache and many-tile decode-attention tests of every kernel
# family (KIVI / int mma and generic paths, GEAR outlier layouts, HQMQ) and the GEAR key
# selection.  Any pytest arguments replace it, e.g.
#   bash tools/sanitize.sh tests/test_decode_attention_gear.py -k cuda_decode_heavy
# Environment: OUTDIR (default /tmp/kvq-sanitize), SANITIZE_TOOLS (default "memcheck racecheck"),
# SANITIZE_LIMIT seconds per tool (default 300).
set -uo pipefail
OUTDIR=${OUTDIR:-/tmp/kvq-sanitize}; mkdir -p "$OUTDIR"
LIMIT=${SANITIZE_LIMIT:-300}
if [ $# -eq 0 ]; then
  set -- "tests/test_decode_attention.py::test_cuda_long_matches_cpu[5000-kivi-2]" \
    "tests/test_decode_attention.py::test_cuda_long_matches_cpu[5000-kivi-4]" \
    "tests/test_decode_attention.py::test_cuda_long_matches_cpu[5000-int4-per-token]" \
    "tests/test_decode_attention.py::test_cuda_many_tiles_per_warp" \
    "tests/test_decode_attention_gear.py::test_cuda_outlier_layouts_match_cpu" \
    "tests/test_decode_attention_gear.py::test_cuda_long_matches_cpu[128-dtype0-gear-2]" \
    "tests/test_decode_attention_hqmq.py::test_cuda_long_matches_cpu[5000-128-hqmq-3.79]" \
    "tests/test_decode_attention_hqmq.py::test_cuda_long_matches_cpu[5000-64-hqmq-5]" \
    "tests/test_gear.py::test_cuda_gear_keys_fused_matches_cpu[4096-128-2-64-0.02-dtype0]"
fi
rc=0
for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
  echo "=== compute-sanitizer $tool (limit ${LIMIT}s)"
  timeout "$LIMIT" compute-sanitizer --tool "$tool" --print-limit 20 --error-exitcode 1 \
    python3 -m pytest -q -p no:cacheprovider "$@" > "$OUTDIR/sanitize_$tool.log" 2>&1
  r=$?; echo "rc=$r"; [ "$r" -ne 0 ] && rc=$r
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed|Error" "$OUTDIR/sanitize_$tool.log" | tail -5
done
exit "$rc"
