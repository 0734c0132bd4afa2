"""Probe (GPU, session 12): where the cluster loss kernel beats the one-program-per-row loss.

Times ``launch_divergence(..., compute_tv=False, grad_out=...)`` (the loss kernel launch: H(p, q) and the drafter
gradient) with the cluster kernel on (``cluster_min_vocab=0``) and off, alternating, in one process on one card, at
bf16 shapes across vocabularies; checks that both give the same H(p, q). Prints one line per shape and writes
``cluster_loss_rule_<gpu>.csv`` to ``--out``. The rule ``cluster_min_vocab`` in ``kernels/divergence.py`` comes from it.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import environment, time_graph, write_csv  # noqa: E402
from kernels import divergence as kdiv  # noqa: E402
from kernels import divergence_cluster as kc  # noqa: E402


def measure(n: int, v: int, env: dict) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(n + v)
    ver = torch.randn(n, v, device="cuda", generator=g, dtype=torch.bfloat16)
    dra = torch.randn(n, v, device="cuda", generator=g, dtype=torch.bfloat16)
    grad = torch.empty_like(dra)

    def loss(cluster: int):
        kdiv.set_config(cluster=cluster, cluster_min_vocab=0)
        return kdiv.launch_divergence(ver, dra, 1.0, compute_tv=False, grad_out=grad, grad_scale=1.0 / n)[0]

    ce = {c: loss(c).clone() for c in (0, 1)}
    launches = kc._STATE["launches"]
    loss(1)
    used = kc._STATE["launches"] > launches
    err = float(((ce[1] - ce[0]).abs() / (1e-3 + ce[0].abs())).max())
    times = {0: [], 1: []}
    for _ in range(2):
        for c in (0, 1):
            times[c].append(time_graph([lambda c=c: loss(c)], replays=10, target_ms=20.0))
    kdiv.set_config()
    med = {c: min(t[0] for t in times[c]) for c in (0, 1)}
    print(f"{n}x{v}: row {med[0]:.1f} us, cluster {med[1]:.1f} us (x{med[0] / med[1]:.2f}), cluster used {used}, "
          f"max rel diff of H(p, q) {err:.1e}", flush=True)
    rows = []
    for c in (0, 1):
        for rep, (m, p20, p80) in enumerate(times[c]):
            rows.append(dict(kernel="divergence_loss_kernel", provider="cluster" if c else "row", n=n, v=v,
                             dtype="bf16", rep=rep, median_us=round(m, 2), p20_us=round(p20, 2), p80_us=round(p80, 2),
                             max_rel_diff_ce=err, **env))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--shapes", default="1024:32000,16384:32000,1024:65536,16384:65536,1024:128256,"
                        "16384:128256,1024:151936,4096:151936,16384:151936")
    args = parser.parse_args()
    env = environment()
    rows = []
    for shape in args.shapes.split(","):
        n, v = (int(x) for x in shape.split(":"))
        rows += measure(n, v, env)
        torch.cuda.empty_cache()
    path = os.path.join(args.out, f"cluster_loss_rule_{env['gpu'].replace(' ', '_')}.csv")
    write_csv(path, rows)


if __name__ == "__main__":
    main()
