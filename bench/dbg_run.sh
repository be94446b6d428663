set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install --no-build-isolation --no-deps . -C build-dir=build/gpu > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
echo "=== built $(date +%T)"
timeout 120 cuda-gdb -batch -ex run -ex bt --args python3 -m pytest -q -p no:cacheprovider "tests/test_decode_attention.py::test_bad_input[cuda]" 2>&1 | grep -v "^\[New Thread\|^\[Thread\|Detaching\|^warning" | tail -40
echo "=== tests $(date +%T)"
python3 -m pytest -q -p no:cacheprovider tests -k "cuda and not bad_input" 2>&1 | tee $OUT/tests.log | tail -15
echo "=== done $(date +%T)"
