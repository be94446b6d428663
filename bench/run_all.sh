#!/usr/bin/env bash
# Run every benchmark of kvquant-ext on a CUDA machine and collect the results.
#
#   bash bench/run_all.sh OUTDIR [--quick] [--bin DIR]
#
# Expects kvquant-ext installed with CUDA (pip install --no-build-isolation .); building it is
# not this script's job.  Runs, in this order, each with its output tee'd to OUTDIR/<name>.log:
#   decode_attention         bench_decode_attention.py: B x L sweep, every preset, vs FP16 SDPA
#                            (table also in OUTDIR/decode_attention.md)
#   decode_attention_stream  the same at B = 8, L = 32k on caches built as a 4k-token prefill
#                            plus decode blocks (GEAR presets and kivi-2)
#   group_quant              bench_group_quant.py: quantize / dequantize vs a device copy
#   gear                     bench_gear.py: gear_compress vs KIVI quantize and torch ops (+ .json)
#   hqmq                     bench_hqmq.py: HQMQ encode / decode vs brute force and a copy
#   e2e                      bench_e2e.py: model.generate, FP16 DynamicCache vs every preset
#                            (needs transformers; table also in OUTDIR/e2e.md, + .json)
#   cpp_group_quant, cpp_decode_attention
#                            the C++ binaries bench_group_quant / bench_decode_attention, when
#                            built (cmake -DKVQ_BUILD_BENCH=ON, or -DKVQ_KERNELS_ONLY=ON): looked
#                            for in --bin DIR, else build/*/bench, build-*/bench, build/bench
# --quick: B in {1, 8}, L in {4k, 32k}, the e2e run at 2 layers, B 1 and 8, 32 new tokens, 4k prompt.
# OUTDIR/env.txt records the GPU, driver, torch and transformers versions and the commit.
# A failing benchmark does not stop the others; the exit status is non-zero if any failed.
set -uo pipefail
usage() { sed -n '2,23p' "$0"; exit 2; }
[ $# -ge 1 ] || usage
OUT=$1; shift
quick=0; bin=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --bin) bin=${2:-}; [ -n "$bin" ] || usage; shift ;;
    *) usage ;;
  esac
  shift
done
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

{
  date -u +"date %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" 2>&1
  "$PY" -c "import transformers; print('transformers', transformers.__version__)" 2>&1 | tail -1
  "$PY" -c "import kvquant_ext; print('kvquant_ext', kvquant_ext.__version__)" 2>&1 | tail -1
  git -C "$root" rev-parse HEAD 2>/dev/null | sed 's/^/commit /'
} > "$OUT/env.txt"
cat "$OUT/env.txt"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "run_all.sh: torch sees no CUDA device"; exit 1
fi

failed=()
step() {  # step NAME COMMAND...: run, tee to OUT/NAME.log, remember failures
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc, $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || failed+=("$name")
}

if [ "$quick" -eq 1 ]; then
  sweep=(--batch 1 8 --len 4096 32768)
  e2e=(--layers 2 --batch 1,8 --prompt 4096 --new 32)
else
  sweep=()
  e2e=(--presets kivi-2,gear-2,hqmq-3.79 --static kivi-2,hqmq-3.79)
fi
step decode_attention "$PY" "$here/bench_decode_attention.py" "${sweep[@]}" --out "$OUT/decode_attention.md"
step decode_attention_stream "$PY" "$here/bench_decode_attention.py" --batch 8 --len 32768 \
  --stream-prefill 4096 --presets kivi-2 gear-2 gearl-2 outlier-2 --out "$OUT/decode_attention_stream.md"
step group_quant "$PY" "$here/bench_group_quant.py"
step gear "$PY" "$here/bench_gear.py" --json "$OUT/gear.json"
step hqmq "$PY" "$here/bench_hqmq.py"
if "$PY" -c "import transformers" 2>/dev/null; then
  step e2e "$PY" "$here/bench_e2e.py" "${e2e[@]}" --out "$OUT/e2e.md" --json "$OUT/e2e.json"
else
  echo "=== e2e: skipped (transformers is not installed: pip install '.[eval]')"
fi

find_bin() {  # find_bin NAME: path of a built C++ benchmark, or nothing
  local d
  for d in ${bin:+"$bin"} "$root"/build/*/bench "$root"/build-*/bench "$root"/build/bench; do
    [ -x "$d/$1" ] && { echo "$d/$1"; return; }
  done
}
for b in group_quant decode_attention; do
  exe=$(find_bin "bench_$b")
  if [ -n "$exe" ]; then
    step "cpp_$b" "$exe"
  else
    echo "=== cpp_$b: skipped (bench_$b not built; see docs/performance.md)"
  fi
done

echo "results in $OUT"
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]}"
  exit 1
fi
