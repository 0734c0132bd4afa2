"""Bytes read per call (Nsight Compute, ``benchmarks/ncu_bytes_read.sh``) against CUDA-graph times of the same plans,
as a fraction of the device copy rate.

The times come from a same-card sweep of the two plans the ncu script profiles::

    python benchmarks/bench_rejection.py --sweep-only --sweep 151936:128:8 --sweep-configs default,live_off \\
        --dtypes bf16 --tag _bytes_bf16

Usage: python benchmarks/ncu_bytes_summary.py NCU_DIR SWEEP_CSV [SWEEP_CSV ...] [--out CSV]

The copy rate is the sweep's own (its ``copy_gbps`` column; older sweep files without it: ``gbps_read / frac_copy``,
to about 0.1%). Of the profiled calls the first is left out (warm-up). ncu flushes the caches before each kernel, so
the race kernel's re-read of the stop row counts as DRAM traffic (as ``gbps_read`` counts it in the benchmark).
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import os
import statistics
import sys

PLAN_CONFIG = {"default": "default", "no_live": "live_off"}
CALLS = 3  # ncu_one_call.py --calls in ncu_bytes_read.sh


def bytes_per_call(path: str, calls: int = CALLS) -> tuple[list[float], list[str]]:
    """DRAM bytes read by each profiled call after the first, and the kernel names of one call."""
    with open(path) as handle:
        lines = [line for line in handle if line.startswith('"')]
    kernels: dict[int, dict] = {}
    for row in csv.DictReader(io.StringIO("".join(lines))):
        if row["Metric Name"] == "dram__bytes_read.sum" and row["Metric Unit"] != "byte":
            raise ValueError(f"{path}: dram__bytes_read.sum in {row['Metric Unit']!r}, expected 'byte' "
                             f"(run ncu with --print-units base)")
        entry = kernels.setdefault(int(row["ID"]), {"name": row["Kernel Name"]})
        entry[row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))
    per_call = len(kernels) // calls
    if per_call == 0 or per_call * calls != len(kernels):
        raise ValueError(f"{path}: {len(kernels)} profiled kernels is not {calls} calls")
    ordered = [kernels[i] for i in sorted(kernels)]
    names = [[k["name"] for k in ordered[c * per_call:(c + 1) * per_call]] for c in range(calls)]
    if any(call != names[0] for call in names):
        raise ValueError(f"{path}: the calls launched different kernels: {names}")
    totals = [sum(k["dram__bytes_read.sum"] for k in ordered[c * per_call:(c + 1) * per_call])
              for c in range(1, calls)]
    return totals, names[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ncu_dir")
    parser.add_argument("sweeps", nargs="+")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    times: dict[tuple[str, str, str, str, str], list[float]] = {}
    copy_gbps: dict[tuple[str, str, str, str, str], list[float]] = {}
    for path in args.sweeps:
        with open(path) as handle:
            for row in csv.DictReader(handle):
                key = (row["V"], row["B"], row["K"], row["dtype"], row["config"])
                times.setdefault(key, []).append(float(row["median_us"]))
                copy = row.get("copy_gbps") or float(row["gbps_read"]) / float(row["frac_copy"])
                copy_gbps.setdefault(key, []).append(float(copy))
    paths = sorted(glob.glob(os.path.join(args.ncu_dir, "ncu_bytes_*.csv")))
    if not paths:
        print(f"no ncu_bytes_*.csv in {args.ncu_dir}", file=sys.stderr)
        return 1
    rows = []
    for path in paths:
        vocab, batch, drafts, dtype, plan = os.path.basename(path)[len("ncu_bytes_"):-4].split("_", 4)
        key = (vocab, batch, drafts, dtype, PLAN_CONFIG[plan])
        if key not in times:
            print(f"{path}: no sweep row for config {key[-1]!r} at V={vocab} B={batch} K={drafts} {dtype}",
                  file=sys.stderr)
            return 1
        totals, names = bytes_per_call(path)
        median_us = statistics.median(times[key])
        copy = statistics.median(copy_gbps[key])
        esize = 2 if dtype in ("bf16", "fp16") else 4
        logical = int(batch) * (2 * int(drafts) + 1) * int(vocab) * esize
        read = statistics.mean(totals)
        rows.append(dict(V=vocab, B=batch, K=drafts, dtype=dtype, plan=plan, kernels="+".join(names),
                         mbytes_read=f"{read / 1e6:.1f}", frac_of_logits=f"{read / logical:.3f}",
                         median_us=f"{median_us:.1f}", gbps_read=f"{read / median_us / 1e3:.0f}",
                         copy_gbps=f"{copy:.0f}", frac_copy=f"{read / median_us / 1e3 / copy:.3f}"))
    for row in rows:
        print(" ".join(f"{k}={v}" for k, v in row.items()))
    if args.out:
        with open(args.out, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
