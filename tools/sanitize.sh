#!/usr/bin/env bash
# compute-sanitizer (memcheck, then racecheck) over CUDA tests, one pytest process per tool,
# each under a time limit.  Logs to OUTDIR/sanitize_<tool>.log, summary lines to stdout.
#
#   bash tools/sanitize.sh [PYTEST ARGS...]
#
# Default selection: the long-cache and many-tile decode-attention tests of every kernel
# family (KIVI/int/FlexGen, GEAR outlier layouts, HQMQ) and the GEAR key selection.  Narrow it
# with node ids when a tool runs past the limit, e.g.
#   bash tools/sanitize.sh "tests/test_decode_attention.py::test_cuda_long_matches_cpu[5000-kivi-2]"
# Environment: OUTDIR (default /tmp/kvq-sanitize), SANITIZE_TOOLS (default "memcheck racecheck"),
# SANITIZE_LIMIT seconds per tool (default 600).
set -uo pipefail
OUTDIR=${OUTDIR:-/tmp/kvq-sanitize}; mkdir -p "$OUTDIR"
LIMIT=${SANITIZE_LIMIT:-600}
if [ $# -eq 0 ]; then
  set -- tests/test_decode_attention.py tests/test_decode_attention_gear.py tests/test_decode_attention_hqmq.py \
    tests/test_gear.py -k "cuda_long_matches_cpu or cuda_many_tiles_per_warp or cuda_outlier_layouts_match_cpu \
or cuda_gear_keys_fused_matches_cpu"
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
