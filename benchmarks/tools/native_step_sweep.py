"""Where a native decoding step's time goes, and how it moves with the launch plans (GPU).

1. A kernel profile of one eager native step (llama-1b shape, batch 1, T = 1 and T = 5): device time per kernel
   name, and the bytes-per-second of the projections.
2. Step times (CUDA-graph replays, as ``bench_generate.py --step``) of the llama-1b plain and verification steps and
   of the 24x1024 plain and 2-layer drafter steps under variants of the shipped plans: programmatic dependent launch
   on, RMS norms in the projections' prologue, other GEMV tiles for one row (broadcast) and for 5 rows (``tl.dot``),
   more attention splits.

    python benchmarks/tools/native_step_sweep.py [--skip-profile] [--variants NAME,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections import defaultdict

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_generate as bg  # noqa: E402

import specdec.kernels.decode_attention as attention_module  # noqa: E402
import specdec.kernels.gemv as gemv_module  # noqa: E402
import specdec.kernels.rms_norm as rms_module  # noqa: E402
import specdec.kernels.rotary_cache_write as rotary_module  # noqa: E402
from specdec.decoding.native import model as native_model  # noqa: E402
from specdec.decoding.static import clear_engines, get_engine  # noqa: E402

ORIGINAL = {module: module.__dict__[name] for module, name in (
    (gemv_module, "gemv_plan"), (rms_module, "rms_norm_plan"), (rotary_module, "rotary_cache_write_plan"),
    (attention_module, "decode_attention_plan"))}
SHIPPED_FUSED_NORMS = native_model.FUSED_NORMS
PLAN_NAMES = {gemv_module: "gemv_plan", rms_module: "rms_norm_plan", rotary_module: "rotary_cache_write_plan",
              attention_module: "decode_attention_plan"}

# name: (broadcast (block_k, accumulators, warps) or None, dot (block_k, min block_n, stages, warps) or None,
#        one-row dot, pdl (None: as planned), fused norms (None: as shipped), attention split slots or None)
VARIANTS = {
    "default": (None, None, False, None, None, None),
    "pdl": (None, None, False, True, None, None),
    "fused_norms": (None, None, False, None, True, None),
    "fused_norms_pdl": (None, None, False, True, True, None),
    "bc_k512": ((512, 4096, 4), None, False, None, None, None),
    "bc_k2048": ((2048, 4096, 4), None, False, None, None, None),
    "bc_k2048_8w": ((2048, 8192, 8), None, False, None, None, None),
    "bc_k4096_8w": ((4096, 8192, 8), None, False, None, None, None),
    "dot_m1": (None, None, True, None, None, None),
    "dot_k128_n16": (None, (128, 16, 3, 4), False, None, None, None),
    "dot_k512_n32": (None, (512, 32, 3, 4), False, None, None, None),
    "dot_k256_n64": (None, (256, 64, 3, 4), False, None, None, None),
    "dot_k256_n32_s2": (None, (256, 32, 2, 4), False, None, None, None),
    "attn_split64": (None, None, False, None, None, 64),
}


def configure(broadcast, dot, dot_one_row, pdl, fused, split_slots) -> None:
    """Patches the plan functions (and the model's norm placement) for one variant; None keeps what ships."""
    def gemv_plan(rows, features, reduction, dtype, device):
        plan = ORIGINAL[gemv_module](rows, features, reduction, dtype, device)
        if plan.matmul:
            return plan
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
        if (dot is not None and plan.dot) or (dot_one_row and not plan.dot):
            block_k, minimum, stages, warps = dot or (256, 32, 3, 4)
            block_n = 64
            while block_n > minimum and triton.cdiv(features, block_n) < target:
                block_n //= 2
            plan = dataclasses.replace(plan, dot=True, block_m=max(16, plan.block_m), block_k=block_k,
                                       block_n=block_n, num_stages=stages, num_warps=warps)
        elif broadcast is not None and not plan.dot:
            block_k, elements, warps = broadcast
            block_n = max(1, elements // (plan.block_m * block_k))
            while block_n > 1 and triton.cdiv(features, block_n) < target:
                block_n //= 2
            plan = dataclasses.replace(plan, block_k=block_k, block_n=block_n, num_warps=warps)
        return plan if pdl is None else dataclasses.replace(plan, pdl=pdl)

    gemv_module.gemv_plan = gemv_plan
    for module in (rms_module, rotary_module, attention_module):
        def other(*args, module=module, **kwargs):
            plan = ORIGINAL[module](*args, **kwargs)
            if module is attention_module and split_slots is not None:
                batch, kv_heads, capacity = args[:3]
                splits = max(1, min(triton.cdiv(132, batch * kv_heads), capacity // split_slots, 64))
                plan = dataclasses.replace(plan, splits=splits)
            return plan if pdl is None else dataclasses.replace(plan, pdl=pdl)

        setattr(module, PLAN_NAMES[module], other)
    native_model.FUSED_NORMS = SHIPPED_FUSED_NORMS if fused is None else fused


def step_times(verifier, drafter, batch: int, steps: list[tuple[str, str, int]]) -> dict[str, float]:
    vocab = verifier.config.vocab_size
    engine = get_engine(verifier, drafter, batch, 256, vocab, 4, 1, torch.device("cuda"), "auto", True, False,
                        "native")
    ids = torch.randint(0, vocab, (batch, 5), device="cuda")
    slots = 192 + torch.arange(5, device="cuda").expand(batch, -1)
    times = {}
    for name, which, width in steps:
        model = engine.verifier if which == "verifier" else engine.drafter
        step_ids, step_slots = ids[:, :width].contiguous(), slots[:, :width].contiguous()

        def call(model=model, width=width, step_ids=step_ids, step_slots=step_slots):
            return model.forward(step_ids, step_slots, width)

        times[name] = bg.graph_ms(engine._capture(call))
    clear_engines()
    return times


def profile(verifier, drafter) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    vocab = verifier.config.vocab_size
    engine = get_engine(verifier, drafter, 1, 256, vocab, 4, 1, torch.device("cuda"), "auto", False, False, "native")
    weight_bytes = sum(p.numel() * p.element_size() for p in verifier.parameters())
    for width in (1, 5):
        ids = torch.randint(0, vocab, (1, width), device="cuda")
        slots = (192 + torch.arange(width, device="cuda"))[None]
        for _ in range(3):
            engine.verifier.forward(ids, slots, width)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                engine.verifier.forward(ids, slots, width)
            torch.cuda.synchronize()
        totals, counts = defaultdict(float), defaultdict(int)
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                totals[event.name] += event.device_time_total / 5
                counts[event.name] += 1
        total = sum(totals.values())
        print(f"T={width}: kernel time per step {total / 1e3:.3f} ms "
              f"({weight_bytes / (total * 1e-6) / 1e9:.0f} GB/s over the weights)", flush=True)
        for name, us in sorted(totals.items(), key=lambda item: -item[1]):
            print(f"  {us:9.1f} us  {counts[name] // 5:4d}/step  {name[:90]}", flush=True)
    clear_engines()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-profile", action="store_true")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    with torch.no_grad():
        big = bg.build_pair("llama-1b", 2)
        small = bg.build_pair("24x1024", 2)
        if not args.skip_profile:
            profile(*big)
        for name in args.variants.split(","):
            configure(*VARIANTS[name])
            one = step_times(*big, 1, [("plain", "verifier", 1), ("verify", "verifier", 5)])
            two = step_times(*small, 1, [("plain", "verifier", 1), ("drafter", "drafter", 1)])
            print(f"{name:16s} 1b plain {one['plain']:.4f} verify {one['verify']:.4f} "
                  f"({one['verify'] / one['plain']:.2f}x) | 24x1024 plain {two['plain']:.4f} drafter "
                  f"{two['drafter']:.4f} c {two['drafter'] / two['plain']:.3f} "
                  f"layer {(two['plain'] - two['drafter']) / 22 * 1e3:.1f} us", flush=True)


if __name__ == "__main__":
    main()
