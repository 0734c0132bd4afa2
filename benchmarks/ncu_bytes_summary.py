"""Bytes read per call (Nsight Compute, ``benchmarks/ncu_bytes_read.sh``) against CUDA-graph times of the same plans
(a ``bench_rejection.py --sweep`` CSV with configs ``default`` and ``live_off``), as a fraction of the copy rate.

Usage: python benchmarks/ncu_bytes_summary.py NCU_DIR SWEEP_CSV [SWEEP_CSV ...] [--out CSV]
The copy rate is each sweep row's own (``gbps_read / frac_copy``).
The first of the three profiled calls is left out (warm-up). The race kernel runs after ncu's cache flush, so its
re-read of the stop row counts as DRAM traffic (as ``gbps_read`` counts it in the benchmark).
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import os
import statistics

PLAN_CONFIG = {"default": "default", "no_live": "live_off"}


def bytes_per_call(path: str, calls: int = 3) -> tuple[list[float], list[str]]:
    """DRAM bytes read by each profiled call after the first, and the kernel names of one call."""
    with open(path) as handle:
        lines = [line for line in handle if line.startswith('"')]
    kernels: dict[int, dict] = {}
    for row in csv.DictReader(io.StringIO("".join(lines))):
        entry = kernels.setdefault(int(row["ID"]), {"name": row["Kernel Name"]})
        entry[row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))
    per_call = len(kernels) // calls
    if per_call * calls != len(kernels):
        raise ValueError(f"{path}: {len(kernels)} kernels is not {calls} calls")
    ordered = [kernels[i] for i in sorted(kernels)]
    totals = [sum(k["dram__bytes_read.sum"] for k in ordered[c * per_call:(c + 1) * per_call])
              for c in range(1, calls)]
    return totals, [k["name"] for k in ordered[:per_call]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ncu_dir")
    parser.add_argument("sweeps", nargs="+")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    times: dict[tuple[str, str, str, str, str], list[float]] = {}
    copy_gbps: dict[tuple[str, str, str, str, str], float] = {}
    for path in args.sweeps:
        with open(path) as handle:
            for row in csv.DictReader(handle):
                key = (row["V"], row["B"], row["K"], row["dtype"], row["config"])
                times.setdefault(key, []).append(float(row["median_us"]))
                copy_gbps[key] = float(row["gbps_read"]) / float(row["frac_copy"])
    rows = []
    for path in sorted(glob.glob(os.path.join(args.ncu_dir, "ncu_bytes_*.csv"))):
        vocab, batch, drafts, dtype, plan = os.path.basename(path)[len("ncu_bytes_"):-4].split("_", 4)
        totals, names = bytes_per_call(path)
        key = (vocab, batch, drafts, dtype, PLAN_CONFIG[plan])
        median_us = statistics.median(times[key])
        esize = 2 if dtype in ("bf16", "fp16") else 4
        logical = int(batch) * (2 * int(drafts) + 1) * int(vocab) * esize
        read = statistics.mean(totals)
        rows.append(dict(V=vocab, B=batch, K=drafts, dtype=dtype, plan=plan, kernels="+".join(names),
                         mbytes_read=f"{read / 1e6:.1f}", frac_of_logits=f"{read / logical:.3f}",
                         median_us=f"{median_us:.1f}", gbps_read=f"{read / median_us / 1e3:.0f}",
                         copy_gbps=f"{copy_gbps[key]:.0f}",
                         frac_copy=f"{read / median_us / 1e3 / copy_gbps[key]:.3f}"))
    for row in rows:
        print(" ".join(f"{k}={v}" for k, v in row.items()))
    if args.out:
        with open(args.out, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
