#!/usr/bin/env bash
# Diagnose the H200-only segfault when a TORCH_CHECK message formats an integer.
# Run after bench/gpu_run.sh has built build/gpu; writes to stdout.
so=$(python3 -c "import torch, kvquant_ext._C as c; print(c.__file__)")
echo "## _C: $so"; ldd "$so" | grep -E "stdc|gomp|omp|cudart|c10" ; readelf -d "$so" | grep -E "NEEDED|RUNPATH|FLAGS"
echo "## libstdc++ symbols defined in _C and in each object"
nm -C --defined-only "$so" | grep -E "_M_insert|num_put|locale::id|_S_refcount|__ostream_insert" | head -8
for o in $(find build/gpu -name "*.o" -o -name "*.a" | sort); do
  n=$(nm -C --defined-only "$o" 2>/dev/null | grep -c -E "_M_insert<|num_put<|locale::id")
  [ "$n" != 0 ] && echo "$o: $n"
done
echo "## compile lines"
grep -m1 -E "c\+\+ .*torch_bindings" build/gpu/build.ninja 2>/dev/null | cut -c1-600
grep -m1 -A3 "build _C" build/gpu/build.ninja | cut -c1-800
grep -E "FLAGS|LINK_FLAGS|LINK_LIBRARIES" build/gpu/build.ninja | sort -u | cut -c1-600 | head -12
echo "## gdb"
cat > /tmp/crash.py <<'PY'
import torch, kvquant_ext as kvq
x = torch.randn(2, 2, 64, 128, device="cuda", dtype=torch.float16)
try:
    torch.ops.kvq.quantize(x, 3, 32, True)
    print("no error?")
except Exception as e:
    print("quantize error OK:", str(e).splitlines()[0][:200])
import sys; sys.path.insert(0, "tests")
from test_decode_attention import build_cache
cache = build_cache("kivi-2", 1, 2, 40, 64, torch.float16, "cuda")
q = torch.randn(1, 6, 64, dtype=torch.float16, device="cuda")
kc, ks, kz, kr = cache.layers[0].key.attention_operands()
vc, vs, vz, vr = cache.layers[0].value.attention_operands()
try:
    kvq.ops.decode_attention_gq(q, kc, ks, kz, kr, vc, vs, vz, vr, None, 3, True, 2, False, 0.1)
except Exception as e:
    print("decode_attention_gq error OK:", str(e).splitlines()[0][:200])
PY
G=$(command -v gdb || command -v cuda-gdb)
timeout 120 $G -batch -ex run -ex bt -ex "info symbol \$pc" -ex "x/6i \$pc" -ex "info registers rip" --args python3 /tmp/crash.py 2>&1 \
  | grep -v "^\[New Thread\|^\[Thread\|Detaching\|^warning\|libthread_db" | tail -40
