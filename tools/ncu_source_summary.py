"""Summarise the per-instruction CSV that ``tools/ncu.sh -o OUTDIR`` writes (no GPU needed).

    python tools/ncu_source_summary.py OUTDIR/ncu_DecodeAttentionKernel.sass.csv.gz [--top 30] [--window 100]

Prints the warp-state stall breakdown of the launch, the instructions with the most samples
(and their two main stall reasons), and the address windows that execute the most
instructions — enough to see which part of a kernel's loop the time goes to.
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    hdr = rows[1]
    data = [r for r in rows[2:] if len(r) >= len(hdr)]
    return {h: i for i, h in enumerate(hdr)}, data


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30, help="instructions with the most samples")
    ap.add_argument("--window", type=int, default=100, help="instructions per address window")
    a = ap.parse_args()
    ix, data = load(a.csv)
    stalls = [h for h in ix if h.startswith("stall_") and "Not Issued" not in h]
    num = lambda r, h: int(r[ix[h]] or 0)  # noqa: E731
    samples = [num(r, "Warp Stall Sampling (All Samples)") for r in data]
    execd = [num(r, "Instructions Executed") for r in data]
    src = [r[ix["Source"]].strip() for r in data]
    total, total_ex = sum(samples), sum(execd)
    print(f"samples {total}, warp instructions executed {total_ex:,}")
    per_reason = collections.Counter({h: sum(num(r, h) for r in data) for h in stalls})
    for h, c in per_reason.most_common(12):
        print(f"  {h:28s} {c:8d} {100 * c / max(total, 1):5.1f}%")
    print(f"\ntop {a.top} instructions by samples (index, samples, executed, source, main stalls)")
    for k in sorted(range(len(data)), key=lambda k: -samples[k])[:a.top]:
        top = sorted(((h, num(data[k], h)) for h in stalls), key=lambda x: -x[1])[:2]
        print(f"{k:6d} {samples[k]:7d} {execd[k]:10d}  {src[k][:60]:60s} {top}")
    print(f"\nwindows of {a.window} instructions with >= 1 % of the executed instructions or samples")
    for s0 in range(0, len(data), a.window):
        e, sm = sum(execd[s0:s0 + a.window]), sum(samples[s0:s0 + a.window])
        if e >= 0.01 * total_ex or sm >= 0.01 * total:
            print(f"{s0:6d}-{s0 + a.window:<6d} executed {100 * e / total_ex:5.1f}%  samples {100 * sm / total:5.1f}%")


if __name__ == "__main__":
    main()
