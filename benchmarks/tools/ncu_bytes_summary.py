"""Bytes read per call (Nsight Compute, ``ncu_bytes_read.sh``) and, for the automatic plan, the rate they are read
at: over the benchmark's median time of the same GPU and shape in ``results/rejection.csv``, as a fraction of the
copy rate measured in that run.

    python benchmarks/tools/ncu_bytes_summary.py NCU_DIR --gpu "NVIDIA H200" [--results RESULTS_CSV]

Of the three profiled calls the first is left out (warm-up).
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import os
import statistics
import sys

from specdec.kernels.rejection_sampling_plan import logit_bytes

CALLS = 3  # ncu_one_call.py --calls in ncu_bytes_read.sh
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results", "rejection.csv")


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
    parser.add_argument("--gpu", required=True, help="the GPU name as in the results' gpu column")
    parser.add_argument("--results", default=RESULTS)
    args = parser.parse_args()
    with open(args.results, newline="") as handle:
        timed = {(r["V"], r["B"], r["K"], r["dtype"]): r for r in csv.DictReader(handle)
                 if r["gpu"] == args.gpu and r["provider"] == "specdec"}
    paths = sorted(glob.glob(os.path.join(args.ncu_dir, "ncu_bytes_*.csv")))
    if not paths:
        print(f"no ncu_bytes_*.csv in {args.ncu_dir}", file=sys.stderr)
        return 1
    for path in paths:
        vocab, batch, drafts, dtype, plan = os.path.basename(path)[len("ncu_bytes_"):-4].split("_", 4)
        totals, names = bytes_per_call(path)
        read = statistics.mean(totals)
        esize = 2 if dtype in ("bf16", "fp16") else 4
        logits = logit_bytes(int(batch), int(drafts), int(vocab), esize)
        line = (f"V={vocab} B={batch} K={drafts} {dtype} {plan}: {read / 1e6:.1f} MB read per call "
                f"({read / logits:.3f} of the logits; {'+'.join(names)})")
        row = timed.get((vocab, batch, drafts, dtype))
        if plan == "default" and row is not None:
            rate = read / float(row["median_us"]) / 1e3
            line += f", {rate:.0f} GB/s in {row['median_us']} us = {rate / float(row['copy_GBps']):.3f} of copy"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
