"""Run one rejection-sampling shape a few times, for a profiler such as Nsight Compute to attach to (CUDA GPU).

    ncu --kernel-name regex:_race_kernel --launch-skip 3 --launch-count 1 --section SpeedOfLight \\
        python benchmarks/tools/ncu_one_call.py --shape 32000:128:1 --dtype fp32 [--no-live-skip]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_rejection import DTYPES, make_inputs  # noqa: E402

from specdec.kernels.rejection_sampling import plan_launch, rejection_sample_triton  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", required=True, help="V:B:K")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--no-live-skip", action="store_true", help="the automatic plan with live skip off")
    parser.add_argument("--calls", type=int, default=6)
    args = parser.parse_args()
    vocab, batch, num_drafts = (int(x) for x in args.shape.split(":"))
    inputs = make_inputs(batch, num_drafts, vocab, DTYPES[args.dtype], seed=0)
    plan = plan_launch(batch, num_drafts, vocab, DTYPES[args.dtype], torch.device("cuda"))
    if args.no_live_skip:
        plan = replace(plan, live_skip=False)
    for _ in range(args.calls):
        rejection_sample_triton(inputs["target"], inputs["draft"], inputs["drafts"], inputs["seeds"],
                                inputs["offsets"], 1.0, plan=plan)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
