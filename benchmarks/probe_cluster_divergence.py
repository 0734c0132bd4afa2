"""Probe (GPU, session 12): the divergence forward with each row split over a thread-block cluster.

Three designs, each a config string (``--configs``, comma-separated):

* ``r:C:W:H`` register-resident, one row per cluster (``benchmarks/probe_cluster_kernels.py``; H = 1 keeps the raw
  16-bit logits across the barrier instead of the float32 weights);
* ``s:C:W:BLOCK:CTAS_PER_SM:EVICT_LAST[:STAGES]`` persistent clusters streaming their chunk in tiles, pass 2
  re-read from L2 (same file; STAGES: ``tl.range`` pipelining stages of both passes);
* ``g:TILE:W:C:CLUSTERS`` persistent clusters holding their chunk in shared memory, filled by ``cp.async`` one row
  ahead (Gluon, ``benchmarks/probe_cluster_smem.py``; C = 0 / CLUSTERS = 0: chosen by the launcher);
* ``h:K:W:C:CLUSTERS`` the same with three slots (two rows ahead), per-lane online statistics (one shared-memory pass
  for pass 1; K columns per lane per tile) and pass 1 of the next row overlapping the current row's cluster barrier;
* ``v:K:W:C:NSLOT:CLUSTERS`` g's loop with h's per-lane pass 1; NSLOT = 1 issues the next row's copy after pass 2, so
  two CTAs fit per SM;
* ``w:K:W:C:PER_SM`` v with one slot and only the tail tile masked (at most PER_SM CTAs per SM).

Run ``j`` also timed a loss prototype with w's loop (``--loss-configs l:K:W:C:PER_SM``); it became the shipped
``kernels/divergence_cluster.py`` and was removed from the probe. The shipped kernel's own measurements come from
``benchmarks/probe_cluster_loss_rule.py`` and ``benchmarks/bench_divergence.py``.

Each config is first checked against the float64 reference (``check ...`` lines of the log), then timed (CUDA-graph
medians) against the shipped one-program-per-row kernel (``specdec_row``) and a device copy, in one process on one
card, bf16 logits. Writes ``cluster_probe_<gpu>.csv`` and ``cluster_probe_log_<gpu>.txt`` to ``--out``.
NOTES_divergence.md, "Session 12", has the outcome.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import environment, measure_copy_bandwidth, time_graph, write_csv  # noqa: E402
from benchmarks.probe_cluster_kernels import launch_cluster_forward, launch_cluster_stream  # noqa: E402
from kernels.divergence import launch_divergence  # noqa: E402
from kernels.divergence_reference import divergence_reference  # noqa: E402


def make(config: str):
    """The launcher of one config string (see the module doc)."""
    kind, *nums = config.split(':')
    nums = [int(x) for x in nums]
    if kind == 'w':
        from benchmarks.probe_cluster_smem import launch_smem_cluster_v4

        return lambda a, b, t: launch_smem_cluster_v4(a, b, t, k=nums[0], num_warps=nums[1], cluster_size=nums[2],
                                                      per_sm=nums[3])
    if kind == 'v':
        from benchmarks.probe_cluster_smem import launch_smem_cluster_v3

        return lambda a, b, t: launch_smem_cluster_v3(a, b, t, k=nums[0], num_warps=nums[1], cluster_size=nums[2],
                                                      nslot=nums[3], clusters=nums[4])
    if kind == 'h':
        from benchmarks.probe_cluster_smem import launch_smem_cluster_v2

        return lambda a, b, t: launch_smem_cluster_v2(a, b, t, k=nums[0], num_warps=nums[1], cluster_size=nums[2],
                                                      clusters=nums[3])
    if kind == 'g':
        from benchmarks.probe_cluster_smem import launch_smem_cluster

        return lambda a, b, t: launch_smem_cluster(a, b, t, tile=nums[0], num_warps=nums[1], cluster_size=nums[2],
                                                   clusters=nums[3])
    if kind == 'r':
        return lambda a, b, t: launch_cluster_forward(a, b, t, cluster_size=nums[0], num_warps=nums[1],
                                                      hold_raw=bool(nums[2]))
    return lambda a, b, t: launch_cluster_stream(a, b, t, cluster_size=nums[0], num_warps=nums[1], block=nums[2],
                                                 ctas_per_sm=nums[3], evict1='evict_last' if nums[4] else '',
                                                 stages=nums[5] if len(nums) > 5 else 1)


def check(configs, log):
    gen = torch.Generator(device="cuda").manual_seed(0)
    bad = 0
    for n, v, dtype in [(64, 151936, torch.bfloat16), (37, 32000, torch.float32), (5, 1024, torch.bfloat16),
                        (16, 123, torch.float32)]:
        a = (torch.randn(n, v, device="cuda", generator=gen) * 3).to(dtype)
        b = (a.float() + torch.randn(n, v, device="cuda", generator=gen)).to(dtype)
        a[0, : v // 3] = float("-inf")
        b[0, : v // 3] = float("-inf")
        b[1, 7] = float("-inf")
        b[2] = a[2]
        ref = divergence_reference(a, b, 0.8)
        for config in configs:
            if config[0] in "ghvw" and v % 16:
                continue
            try:
                out = make(config)(a, b, 0.8)
            except Exception as exc:  # noqa: BLE001
                log(f"check {n}x{v} {dtype} {config}: FAILED {type(exc).__name__}: {exc}")
                bad += 1
                continue
            torch.cuda.synchronize()
            errs = []
            for name, got, want in zip(("ce", "kl", "tv", "alpha"), out[:4], ref[:4], strict=True):
                want = want.to(torch.float64)
                got = got.to(torch.float64)
                same_inf = (torch.isinf(want) == torch.isinf(got)).all().item()
                fin = torch.isfinite(want)
                err = ((got[fin] - want[fin]).abs() / (1e-3 + want[fin].abs())).max().item() if fin.any() else 0.0
                errs.append(f"{name} {err:.2e}{'' if same_inf else ' INF-MISMATCH'}")
                if err > 2e-3 or not same_inf:
                    bad += 1
            log(f"check {n}x{v} {dtype} {config}: " + ", ".join(errs)
                + f"; status {out[4].tolist()[:3]}")
    return bad


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--shapes", default="16384:151936,4096:151936,16384:32000")
    parser.add_argument("--configs", default="s:8:4:2048:8:0,"
                        "g:2048:8:0:0,g:4096:8:0:0,g:4096:16:0:0,g:2048:4:0:0,g:2048:8:16:0,g:1024:4:0:0")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    env = environment()
    log_path = os.path.join(args.out, f"cluster_probe_log_{env['gpu'].replace(' ', '_')}.txt")
    log_file = open(log_path, "w")

    def log(msg):
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    log(str(env))
    configs = args.configs.split(",")
    log(f"check failures: {check(configs, log)}")
    copy = measure_copy_bandwidth()
    log(f"copy {copy:.0f} GB/s")
    rows = []
    for shape in args.shapes.split(","):
        n, v = (int(x) for x in shape.split(":"))
        gen = torch.Generator(device="cuda").manual_seed(1)
        a = torch.randn(n, v, device="cuda", generator=gen, dtype=torch.bfloat16)
        b = torch.randn(n, v, device="cuda", generator=gen, dtype=torch.bfloat16)
        nbytes = 2 * n * v * 2
        providers = [("specdec_row", lambda a=a, b=b: launch_divergence(a, b, 1.0), None)]
        for config in configs:
            providers.append((f"cluster_{config.replace(':', '_')}",
                              (lambda a=a, b=b, config=config: make(config)(a, b, 1.0)), config))
        for rep in range(2):
            for name, fn, cfg in providers:
                try:
                    med, p20, p80 = time_graph([fn], replays=10, target_ms=30.0)
                except Exception as exc:  # noqa: BLE001
                    log(f"{n}x{v} {name}: FAILED {type(exc).__name__}: {exc}")
                    traceback.print_exc()
                    continue
                regs = spills = ""
                if cfg is not None:
                    compiled = fn()[5]
                    regs, spills = compiled.n_regs, compiled.n_spills
                    if cfg[0] in "ghvw":
                        from benchmarks.probe_cluster_smem import LAST_CLUSTERS

                        spills = f"{spills} shared {compiled.metadata.shared} clusters {dict(LAST_CLUSTERS)}"
                        LAST_CLUSTERS.clear()
                frac = nbytes / (med * 1e-6) / 1e9 / copy
                log(f"{n}x{v} rep{rep} {name}: {med:.1f} us (p20 {p20:.1f}, p80 {p80:.1f}) = {frac:.1%} of copy"
                    f" regs {regs} spills {spills}")
                rows.append(dict(kernel="divergence_forward", provider=name, n=n, v=v, dtype="bf16", rep=rep,
                                 median_us=round(med, 2), p20_us=round(p20, 2), p80_us=round(p80, 2),
                                 fraction_of_copy=round(frac, 4), copy_gbps=round(copy, 1), regs=regs,
                                 spills=spills, **env))
        del a, b
        torch.cuda.empty_cache()
    path = os.path.join(args.out, f"cluster_probe_{env['gpu'].replace(' ', '_')}.csv")
    write_csv(path, rows)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
