"""Where the time of a batch-1 rejection-sampling call goes: launch floor and per-kernel device time (GPU only).

1. The launch floor under CUDA-graph replay (``common.time_graph``, as the benchmark times specdec): one empty
   Triton kernel per call, two dependent ones, and two with programmatic dependent launch (the second launched
   with ``launch_pdl=True``, waiting with ``gdc_wait``; the first triggering at its start) -- what the two launches
   of the "split" strategy cost before they read a byte.
2. Each kernel's own device time (``torch.profiler``, CUDA activity, 200 calls, no graph; the race kernel's span
   starts early under programmatic dependent launch, so it includes waiting for the statistics) next to the
   graph-replayed time of the whole call and of the statistics kernel alone, at B = 1 for every (K, V) of the grid.

Usage: python benchmarks/probe_rejection_latency.py [--dtype bf16] [--out results/rejection_latency_<gpu>.csv]
       [--shapes V:B:K,...] [--tunes '{}';'{"race_programs": 32}'] [--skip-floor]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from collections import defaultdict

import torch
import triton
import triton.language as tl
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rejection import DTYPES, make_inputs  # noqa: E402
from common import environment, time_graph  # noqa: E402

from specdec.kernels.rejection_sampling import rejection_sample_triton  # noqa: E402


@triton.jit
def _empty_kernel(out_ptr, TRIGGER: tl.constexpr, WAIT: tl.constexpr):
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    if WAIT:
        tl.extra.cuda.gdc_wait()
    if tl.program_id(0) == 0:
        tl.store(out_ptr, 1)


def launch_floor(programs: int) -> dict[str, tuple[float, float, float]]:
    """(median, p20, p80) µs per call of one, two, and two PDL-chained empty kernels of ``programs`` programs."""
    out = torch.zeros(1, dtype=torch.int32, device="cuda")

    def one():
        _empty_kernel[(programs,)](out, TRIGGER=False, WAIT=False)

    def two():
        _empty_kernel[(programs,)](out, TRIGGER=False, WAIT=False)
        _empty_kernel[(programs,)](out, TRIGGER=False, WAIT=False)

    def two_pdl():
        _empty_kernel[(programs,)](out, TRIGGER=True, WAIT=False)
        _empty_kernel[(programs,)](out, TRIGGER=False, WAIT=True, launch_pdl=True)

    return {name: time_graph([fn] * 8) for name, fn in (("one", one), ("two", two), ("two_pdl", two_pdl))}


def kernel_times(batch: int, num_drafts: int, vocab: int, dtype: torch.dtype, calls: int = 200,
                 tune: dict | None = None) -> dict[str, float]:
    """Mean device µs per call of each kernel the call launches (profiler), plus the graph-replayed call."""
    sets = [make_inputs(batch, num_drafts, vocab, dtype, seed=s) for s in range(4)]
    fns = [lambda s=s: rejection_sample_triton(s["target"], s["draft"], s["drafts"], s["seeds"], s["offsets"], 1.0,
                                               tune=tune) for s in sets]
    stats_only = [lambda s=s: rejection_sample_triton(s["target"], s["draft"], s["drafts"], s["seeds"],
                                                      s["offsets"], 1.0, tune=dict(tune or {}, stats_only=True))
                  for s in sets]
    # graphs first: an active profiler session slows later launches
    graph_call, graph_stats = time_graph(fns)[0], time_graph(stats_only)[0]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fns[i % len(fns)]()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():  # kernels carry their own device time; host-side events carry none
        if event.self_device_time_total > 0:
            totals[event.key] += event.self_device_time_total / calls
    totals["graph_call_median"] = graph_call
    totals["graph_stats_kernel_alone_median"] = graph_stats
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--out", default="")
    parser.add_argument("--shapes", default="", help="V:B:K triples (default: B = 1 at every (K, V) of the grid)")
    parser.add_argument("--tunes", default="{}", help="';'-separated JSON tune dicts, each probed at every shape")
    parser.add_argument("--skip-floor", action="store_true", help="do not time the empty kernels")
    args = parser.parse_args()
    env = environment()
    gpu = torch.cuda.get_device_name()
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for programs in () if args.skip_floor else (1, 4 * sms):
        for name, (med, p20, p80) in launch_floor(programs).items():
            print(f"empty kernels {name:8s} programs={programs:4d}: {med:6.2f} us (p20 {p20:.2f}, p80 {p80:.2f})",
                  flush=True)
            rows.append(dict(what=f"empty_{name}", programs=programs, median_us=f"{med:.2f}", p20_us=f"{p20:.2f}",
                             p80_us=f"{p80:.2f}"))
    shapes = ([tuple(int(x) for x in item.split(":")) for item in args.shapes.split(",")] if args.shapes else
              [(vocab, 1, num_drafts) for vocab in (151936, 128256, 32000) for num_drafts in (1, 4, 8)])
    for tune_text in args.tunes.split(";"):
        tune = json.loads(tune_text)
        for vocab, batch, num_drafts in shapes:
            times = kernel_times(batch, num_drafts, vocab, DTYPES[args.dtype], tune=tune)
            parts = ", ".join(f"{key.split('(')[0][:24]} {value:.2f}" for key, value in sorted(times.items()))
            print(f"B={batch} K={num_drafts} V={vocab} {args.dtype} tune={tune}: {parts}", flush=True)
            for key, value in times.items():
                rows.append(dict(what=key.split("(")[0][:60], B=batch, K=num_drafts, V=vocab, dtype=args.dtype,
                                 tune=json.dumps(tune), median_us=f"{value:.2f}"))
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"rejection_latency_{gpu.replace(' ', '_')}.csv")
    fields = ["what", "programs", "B", "K", "V", "dtype", "tune", "median_us", "p20_us", "p80_us", "gpu", "torch",
              "triton"]
    with open(out, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, **env, "gpu": gpu})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
