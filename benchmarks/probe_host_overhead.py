"""Probe: host (CPU) time per call of the divergence loss path, against the GPU time it feeds (issue 4, GPU only).

A training step is host-bound when the Python and launch work of a call takes longer than its kernels: at N = 1024,
V = 151936 the loss kernels take ~0.45 ms on an H200. Times ``reps`` calls without synchronising (host µs per call)
and the same including the final synchronisation (wall µs per call).

Usage: ``python benchmarks/probe_host_overhead.py [--n 1024] [--v 151936]``.
"""

from __future__ import annotations

import argparse
import time

import torch

import specdec.divergences as sd
from specdec.kernels import divergence as kdiv


def per_call_us(fn, reps: int = 200) -> tuple[float, float]:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (issued - start) / reps * 1e6, (done - start) / reps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--v", type=int, default=151936)
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    ver = (torch.randn(args.n, args.v, device="cuda", generator=g) * 2).to(torch.bfloat16)
    dra = (torch.randn(args.n, args.v, device="cuda", generator=g) * 2).to(torch.bfloat16)
    grad = torch.empty_like(dra)
    d_req = dra.clone().requires_grad_()
    one = torch.ones((), device="cuda")

    def fwd_bwd() -> None:
        d_req.grad = None
        sd.divergence_loss(d_req, ver, reduction="mean", check_inputs=False).backward()

    def fwd_only() -> None:
        with torch.no_grad():
            sd.divergence_loss(dra, ver, reduction="mean", check_inputs=False)

    print(torch.cuda.get_device_name(), torch.__version__)
    for name, fn in [("divergence_loss fwd+bwd", fwd_bwd), ("divergence_loss fwd (no grad)", fwd_only),
                     ("launch_divergence", lambda: kdiv.launch_divergence(ver, dra, 1.0, compute_tv=False,
                                                                          grad_out=grad)),
                     ("rescale_gradient (upstream 1)", lambda: kdiv.rescale_gradient(grad, one)),
                     ("divergence fwd", lambda: sd.divergence(ver, dra, check_inputs=False))]:
        host, wall = per_call_us(fn)
        print(f"{name:32s} host {host:8.1f} us/call   wall {wall:8.1f} us/call", flush=True)


if __name__ == "__main__":
    main()
