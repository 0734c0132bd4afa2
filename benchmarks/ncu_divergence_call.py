"""Run the divergence kernels a few times at one shape, for a profiler such as Nsight Compute to attach to (GPU only).

Usage (session 13's profiles, ``results/ncu_cluster_*_H200_s13.txt``):
    ncu --kernel-name regex:_cluster_forward_kernel --launch-skip 1 --launch-count 1 --section WarpStateStats \
        python benchmarks/ncu_divergence_call.py --shape 4096x151936
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels import divergence as kdiv  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4096x151936", help="NxV (bf16 logits)")
    parser.add_argument("--calls", type=int, default=3, help="forward calls, then as many loss calls")
    args = parser.parse_args()
    n, v = (int(x) for x in args.shape.split("x"))
    g = torch.Generator(device="cuda").manual_seed(0)
    verifier = torch.randn(n, v, device="cuda", generator=g, dtype=torch.bfloat16) * 2
    drafter = (verifier.float() + torch.randn(n, v, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    grad = torch.empty_like(drafter)
    for _ in range(args.calls):
        kdiv.launch_divergence(verifier, drafter, 1.0)
    for _ in range(args.calls):
        kdiv.launch_divergence(verifier, drafter, 1.0, compute_tv=False, grad_out=grad, grad_scale=1.0 / n)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
