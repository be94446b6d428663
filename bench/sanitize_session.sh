#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over the CUDA tests of the decode-attention kernels
# (KIVI/int/FlexGen mma + generic paths, fused and two-launch split combine, GEAR outlier
# layouts, HQMQ) and the GEAR key selection; one pytest process per tool, each under a time
# limit.  Logs to $OUT/sanitize_<tool>.log.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LIMIT=${SANITIZE_LIMIT:-170}
NODES=(
  "tests/test_decode_attention.py::test_cuda_fused_combine_matches_two_launch"
  "tests/test_decode_attention.py::test_cuda_long_matches_cpu[5000-kivi-2]"
  "tests/test_decode_attention.py::test_cuda_long_matches_cpu[5000-kivi-4]"
  "tests/test_decode_attention.py::test_cuda_long_matches_cpu[5000-int4-per-token]"
  "tests/test_decode_attention.py::test_cuda_many_tiles_per_warp"
  "tests/test_decode_attention_gear.py::test_cuda_outlier_layouts_match_cpu"
  "tests/test_decode_attention_gear.py::test_cuda_long_matches_cpu[128-dtype0-gear-2]"
  "tests/test_decode_attention_hqmq.py::test_cuda_long_matches_cpu[5000-128-hqmq-3.79]"
  "tests/test_decode_attention_hqmq.py::test_cuda_long_matches_cpu[5000-64-hqmq-5]"
  "tests/test_gear.py::test_cuda_gear_keys_fused_matches_cpu[4096-128-2-64-0.02-dtype0]"
)
for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
  echo "=== compute-sanitizer $tool (limit ${LIMIT}s)"
  timeout "$LIMIT" compute-sanitizer --tool "$tool" --print-limit 20 \
    python3 -m pytest -q -p no:cacheprovider "${NODES[@]}" > "$OUT/sanitize_$tool.log" 2>&1
  echo "rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed|Error" "$OUT/sanitize_$tool.log" | tail -5
done
