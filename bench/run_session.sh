#!/usr/bin/env bash
# One device call: build, the CUDA tests of the given files, the benches, the sanitizer on
# the new kernels.  Logs to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export OUT TEST_TIMEOUT=${TEST_TIMEOUT:-280}
export TEST_FILES=${TEST_FILES:-$(ls tests/test_*.py | grep -v test_hqmq.py | tr '\n' ' ')}
export SANITIZE_TOOLS=${SANITIZE_TOOLS:-memcheck racecheck}
export SANITIZE=${SANITIZE-"tests/test_gear.py::test_cuda_gear_keys_fused_matches_cpu[4096-128-2-64-0.02-dtype0] tests/test_gear.py::test_cuda_gear_values_fused_bench_shape tests/test_group_quant.py::test_cuda_kcvt_cluster_chunk_edges[264] tests/test_gear.py::test_cuda_power_iter_degenerate[4-200-128-dtype0]"}
bash bench/gpu_run.sh "" ${BENCHES:-"profile_gear.py" "bench_gear.py" "bench_group_quant.py" "bench_group_quant"}
