"""Probe (GPU, session 13): the pipelined cluster kernels against the row kernels and session 12's cluster designs.

Kernel launches only (no autograd), bf16, CUDA-graph medians, every provider in one process on one card, each
provider timed twice, alternating:

* forward (H, KL, TV, alpha): ``row`` (``launch_divergence`` with ``cluster=0``), ``cluster`` (the shipped
  ``_cluster_forward_kernel``), ``w`` (session 12's best forward, ``benchmarks/probe_cluster_smem.py``, C = 8, at
  V = 151936 only);
* loss (H(p, q) and the drafter gradient): ``row``, ``cluster``, and ``cluster_s12`` (session 12's loss kernel, read
  from ``.gpu_data/cluster_s12.py`` = ``git show 31c5fad:kernels/divergence_cluster.py`` when that file is there).

``--lane-columns 16`` adds ``cluster_k16`` (K columns per lane; run ``f``). Run ``e`` (``cluster_soft*``) timed
``results/divergence_cluster_fma_exp_attempt_s13.diff`` applied, with a ``--soft`` option since removed.

Each cluster provider is first checked against the row kernel on the same inputs (``check`` lines). Writes
``cluster_pipelined_<gpu>.csv`` to ``--out``; NOTES_divergence.md, "Session 13", has the outcome.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import environment, measure_copy_bandwidth, time_graph, write_csv  # noqa: E402
from kernels import divergence as kdiv  # noqa: E402
from kernels import divergence_cluster as kc  # noqa: E402

DEFAULT_LANE_COLUMNS = kc.LANE_COLUMNS


def _old_cluster_module():
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".gpu_data", "cluster_s12.py")
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location("cluster_s12", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    ok = torch.isfinite(b)
    return float(((a[ok] - b[ok]).abs() / (1e-3 + b[ok].abs())).max())


def measure(n: int, v: int, env: dict, copy_gbs: float, old, kinds: list[str],
            lane_settings: list[int]) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(n + v)
    ver = torch.randn(n, v, device="cuda", generator=g, dtype=torch.bfloat16) * 2
    dra = (ver.float() + torch.randn(n, v, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    grad = torch.empty_like(dra)
    rows = []

    def launch(kind: str, cluster: int, lane_columns: int = DEFAULT_LANE_COLUMNS):
        kdiv.set_config(cluster=cluster, cluster_forward=cluster, cluster_min_vocab=0)
        kc.LANE_COLUMNS, kc.TILE = lane_columns, 32 * kc.NUM_WARPS * lane_columns
        if kind == "forward":
            return kdiv.launch_divergence(ver, dra, 1.0)
        return kdiv.launch_divergence(ver, dra, 1.0, compute_tv=False, grad_out=grad, grad_scale=1.0 / n)

    providers = {}
    for kind in kinds:
        providers[(kind, "row")] = lambda kind=kind: launch(kind, 0)
        providers[(kind, "cluster")] = lambda kind=kind: launch(kind, 1)
        for k in lane_settings:
            providers[(kind, f"cluster_k{k}")] = lambda kind=kind, k=k: launch(kind, 1, k)
    if "forward" in kinds and v == 151936:
        from benchmarks.probe_cluster_smem import launch_smem_cluster_v4

        providers[("forward", "w")] = lambda: launch_smem_cluster_v4(ver, dra, 1.0, k=8, num_warps=4, cluster_size=8,
                                                                     per_sm=2)
    if "loss" in kinds and old is not None:
        providers[("loss", "cluster_s12")] = lambda: old.launch_cluster_loss(ver, dra, 1.0, grad, grad_scale=1.0 / n)
    # correctness against the row kernel on the same inputs
    for kind in ("forward", "loss"):
        if (kind, "row") not in providers:
            continue
        want = [t.clone() if isinstance(t, torch.Tensor) else t for t in providers[(kind, "row")]()]
        want_grad = grad.clone()
        for (k, name), fn in providers.items():
            if k != kind or name == "row":
                continue
            launches = kc._STATE["launches"]
            got = fn()
            used = not name.startswith("cluster") or kc._STATE["launches"] > launches
            if kind == "forward":
                errs = [_rel(got[i], want[i]) for i in range(4)]
                msg = "ce/kl/tv/alpha " + " ".join(f"{e:.1e}" for e in errs)
            else:
                errs = [_rel(got[0], want[0]),
                        float((grad.float() - want_grad.float()).abs().max() / want_grad.float().abs().max())]
                msg = f"ce {errs[0]:.1e} grad {errs[1]:.1e}"
            print(f"check {kind} {name} {n}x{v}: used {used}, {msg}", flush=True)
    times = {key: [] for key in providers}
    for _ in range(2):
        for key, fn in providers.items():
            times[key].append(time_graph([fn], replays=10, target_ms=20.0))
    kdiv.set_config()
    kc.LANE_COLUMNS, kc.TILE = DEFAULT_LANE_COLUMNS, 32 * kc.NUM_WARPS * DEFAULT_LANE_COLUMNS
    for (kind, name), samples in times.items():
        units = 2 if kind == "forward" else 3  # bytes the op must move, in [N, V] bf16 units
        best = min(samples)
        gbs = units * n * v * 2 / (best[0] * 1e-6) / 1e9
        runs = ", ".join(f"{s[0]:.1f}" for s in samples)
        print(f"{kind:8s} {name:12s} {n:6d}x{v:6d}: {best[0]:9.1f} us  {gbs:7.0f} GB/s  "
              f"{100 * gbs / copy_gbs:5.1f}% of copy  (runs: {runs})", flush=True)
        for rep, (m, p20, p80) in enumerate(samples):
            rows.append(dict(kernel=f"divergence_{kind}_kernel", provider=name, n=n, v=v, dtype="bf16", rep=rep,
                             median_us=round(m, 2), p20_us=round(p20, 2), p80_us=round(p80, 2),
                             pct_copy=round(100 * units * n * v * 2 / (m * 1e-6) / 1e9 / copy_gbs, 2),
                             copy_gbs=round(copy_gbs), **env))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--shapes", default="16384:151936,4096:151936,1024:151936,16384:32000")
    parser.add_argument("--passes", default="fwd,loss")
    parser.add_argument("--lane-columns", default="", help="comma-separated LANE_COLUMNS (K) settings to time as well")
    args = parser.parse_args()
    env = environment()
    copy_gbs = measure_copy_bandwidth()
    print(f"gpu={env['gpu']} copy={copy_gbs:.0f} GB/s", flush=True)
    old = _old_cluster_module()
    rows = []
    kinds = [{"fwd": "forward", "loss": "loss"}[p] for p in args.passes.split(",")]
    for shape in args.shapes.split(","):
        n, v = (int(x) for x in shape.split(":"))
        rows += measure(n, v, env, copy_gbs, old, kinds, [int(x) for x in args.lane_columns.split(",") if x])
        torch.cuda.empty_cache()
    path = os.path.join(args.out, f"cluster_pipelined_{env['gpu'].replace(' ', '_')}.csv")
    write_csv(path, rows)


if __name__ == "__main__":
    main()
