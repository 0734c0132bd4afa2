"""Launch floor of a thread-block cluster on Hopper, under CUDA-graph replay (session 14, GPU only).

Why the one-launch cluster rejection sampler (``results/rejection_cluster_attempt_s14.diff``) lost to the two-launch
"split" plan at B = 1: times one call of a kernel of ``C`` CTAs launched as plain CTAs or as one cluster (the launch
metadata patched as ``kernels/divergence_cluster.py`` does), empty, with two cluster barriers, and with a 2 KB load
per CTA plus a global-memory exchange through the barrier (the cluster kernel's skeleton: load, store partials,
barrier, read every CTA's partial with ``ld.global.cg``, barrier, store).

Usage: python benchmarks/probe_cluster_floor.py [--out results/cluster_floor_<gpu>.csv]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import environment, time_graph, write_csv  # noqa: E402
from benchmarks.probe_cluster_kernels import _cluster_barrier  # noqa: E402
from kernels.divergence_cluster import _patch_cluster  # noqa: E402


@triton.jit
def _floor_kernel(x_ptr, scratch_ptr, out_ptr, C: tl.constexpr, N: tl.constexpr, LOAD: tl.constexpr,
                  BARRIERS: tl.constexpr):
    pid = tl.program_id(0)
    s = 0.0
    if LOAD:
        s = tl.sum(tl.load(x_ptr + pid * N + tl.arange(0, N)), axis=0)
    if BARRIERS > 0:
        tl.store(scratch_ptr + pid, s)
        _cluster_barrier()
        first = pid // C * C
        s = tl.sum(tl.load(scratch_ptr + first + tl.arange(0, C), cache_modifier=".cg"), axis=0)
        for _ in tl.static_range(BARRIERS - 1):
            _cluster_barrier()
    if pid % C == 0:
        tl.store(out_ptr + pid // C, s)


def floor_call(ctas: int, cluster: int, warps: int, load: bool, barriers: int):
    x = torch.randn(ctas * 512, device="cuda")
    scratch = torch.zeros(ctas, device="cuda")
    out = torch.zeros(ctas, device="cuda")
    meta = dict(C=max(cluster, 1), N=512, LOAD=load, BARRIERS=barriers)
    compiled = _floor_kernel.warmup(x, scratch, out, grid=(ctas,), **meta, num_warps=warps)
    compiled._init_handles()
    if cluster > 1:
        triton.runtime.driver.active.utils.cuOccupancyMaxActiveClusters(compiled.function, compiled.metadata.shared,
                                                                       cluster)  # allows clusters of 16
        _patch_cluster(compiled, cluster, compiled.metadata.shared)
        grid = (ctas // cluster, 1, 1)
    else:
        grid = (ctas, 1, 1)
    return lambda: compiled[grid](x, scratch, out, *meta.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    env = environment()
    rows = []
    configs = [(16, 1, 16, False, 0), (16, 16, 16, False, 0), (16, 16, 16, False, 2), (16, 16, 16, True, 2),
               (16, 16, 8, True, 2), (16, 8, 8, True, 2), (16, 1, 8, True, 0), (1, 1, 4, False, 0)]
    for ctas, cluster, warps, load, barriers in configs:
        med, p20, p80 = time_graph([floor_call(ctas, cluster, warps, load, barriers)] * 8)
        print(f"ctas={ctas:3d} cluster={cluster:2d} warps={warps:2d} load={int(load)} barriers={barriers}: "
              f"{med:6.2f} us [{p20:.2f}, {p80:.2f}]", flush=True)
        rows.append(dict(ctas=ctas, cluster=cluster, warps=warps, load_2kb=int(load), barriers=barriers,
                         median_us=f"{med:.2f}", p20_us=f"{p20:.2f}", p80_us=f"{p80:.2f}", **env))
    gpu = env["gpu"].replace(" ", "_")
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"cluster_floor_{gpu}.csv")
    write_csv(out, rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
