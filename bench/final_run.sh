set -uo pipefail; export PYTHONUNBUFFERED=1; t0=$(date +%s); ts() { echo "=== [$(( $(date +%s) - t0 ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install --no-build-isolation --no-deps -q . -C build-dir=build/gpu > $OUT/build.log 2>&1 || { tail -40 $OUT/build.log; exit 1; }; ts built
for f in tests/test_decode_attention.py tests/test_decode_attention_gear.py tests/test_decode_attention_hqmq.py tests/test_group_quant.py tests/test_gear.py tests/test_cache.py tests/test_hf.py tests/test_cli.py; do echo "--- $f"; timeout 150 python3 -m pytest -q $f -k "not bad_input" -p no:cacheprovider 2>&1 | tee -a $OUT/tests.log | tail -2; done
timeout 60 python3 -m pytest -q tests -k bad_input -p no:cacheprovider 2>&1 | tail -1; ts tests
python3 bench/bench_decode_attention.py --batch 1 8 --len 4096 32768 --presets kivi-2 kivi-4 kcvt-4 int4-per-token flexgen-4 gear-2 gearl-2 outlier-2 hqmq-3.79 hqmq-5 --out $OUT/decode.md > $OUT/decode.log 2>&1; grep -E "^\| (8 \| 32768|1 \| 4096)" $OUT/decode.md; ts bench
python3 bench/bench_group_quant.py 2>&1 | grep -E "KCVT|G=32 2b|copy"
S="tests/test_decode_attention_gear.py::test_cuda_graph_capture tests/test_decode_attention.py::test_cuda_graph_capture tests/test_group_quant.py::test_cuda_per_token_non_contiguous_exact tests/test_hqmq.py::test_cuda_errors_and_opcheck"
for tool in memcheck racecheck; do timeout 100 compute-sanitizer --tool $tool --print-limit 10 python3 -m pytest -q -p no:cacheprovider $S 2>&1 | tail -3; done; ts done
