"""Compile the rejection-sampling kernels for an H100 (sm_90) without a GPU.

Triton's front end and its NVIDIA back end (the bundled ``ptxas``) run on the CPU, so errors that the interpreter
does not raise (a jit helper called without a constexpr argument, a type only the compiler checks) show up here
instead of on the GPU machine. The kernel variants are those the shipped launch plans launch: the launcher runs on
meta tensors with :func:`~specdec.kernels.rejection_sampling_plan.plan_launch` asked for an H100, over a grid of
shapes, dtypes, greedy rows, per-row draft counts, scores and block verification (and the portable arithmetic,
forced), and its kernel
launches are recorded instead of run. By default a set of variants that together take every value of every
constexpr (and every logit dtype and warp count) is compiled; ``--all`` compiles every distinct variant of the grid.
``tests/kernels/test_kernels_compile.py`` runs the default.

    python benchmarks/tools/compile_rejection.py [--all]   # one line per variant; exit status 1 if any failed
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from dataclasses import replace

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1: the interpreter replaces the kernels this script compiles")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

import specdec.kernels.rejection_sampling as launcher  # noqa: E402
from specdec.kernels._device import DeviceFacts  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
H100 = DeviceFacts(sm_count=132, major=9, name="NVIDIA H100 80GB HBM3", interpreter=False)
POINTERS = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int64: "*i64",
            torch.int32: "*i32", torch.bool: "*i1"}
GRID = dict(batch=(1, 4, 8, 16, 32, 48, 128), drafts=(1, 4, 6, 8), vocab=(32000, 128256, 151936),
            dtype=(torch.bfloat16, torch.float32, torch.float16),
            mode=("sampled", "greedy_mask", "greedy", "counts", "scores", "no_fast_math", "block", "block_greedy_mask"))
PAIRED = ("BLOCK_VERIFY", "SINGLE")  # block verification races in both forms of the race loop: covered together
SHAPE_CONSTEXPRS = ("KP2", "JP2", "SP2", "SP2B")  # follow K and the splits: one value per variant is enough


class _Recorder:
    """Stands in for a kernel in the launcher: records ``(kernel, arguments by name, num_warps)``."""

    def __init__(self, kernel, sink: list):
        self.kernel, self.sink = kernel, sink

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            named = dict(zip(self.kernel.arg_names, args, strict=False))
            named.update(kwargs)
            self.sink.append((self.kernel, named))
        return launch


def shipped_variants() -> list[tuple]:
    """Distinct ``(kernel, constexprs, signature, num_warps)`` the automatic plans launch on the grid."""
    sink: list = []
    kernels = {name: getattr(launcher, name) for name in ("_stats_kernel", "_race_kernel")}
    for name, kernel in kernels.items():
        setattr(launcher, name, _Recorder(kernel, sink))
    try:
        for batch, drafts, vocab, dtype, mode in itertools.product(*GRID.values()):
            meta = dict(device="meta")
            target = torch.empty(batch, drafts + 1, vocab, dtype=dtype, **meta)
            draft = torch.empty(batch, drafts, vocab, dtype=dtype, **meta)
            tokens = torch.empty(batch, drafts, dtype=torch.int64, **meta)
            keys = torch.empty(batch, dtype=torch.int64, **meta)
            mask = torch.empty(batch, dtype=torch.bool, **meta) if mode.endswith("greedy_mask") else None
            verification = "block" if mode.startswith("block") else "token"
            counts = keys if mode == "counts" else None
            scores = mode == "scores"
            temperature = 0.0 if mode == "greedy" else 0.8
            plan = launcher.plan_launch(batch, drafts, vocab, dtype, H100, scores=scores,
                                        greedy_rows=mask is not None or temperature == 0, verification=verification)
            if mode == "no_fast_math":  # the portable arithmetic (the interpreter's), forced on a GPU
                plan = replace(plan, fast_math=False, fold_scale=False, unpack_bf16=False)
            launcher.rejection_sample_triton(target, draft, tokens, keys, keys, temperature, greedy_mask=mask,
                                             num_draft_tokens=counts, compute_scores=scores, plan=plan,
                                             verification=verification)
    finally:
        for name, kernel in kernels.items():
            setattr(launcher, name, kernel)
    variants = {}
    for kernel, named in sink:
        declared = [p.name for p in kernel.params if p.is_constexpr]
        constexprs = {name: named[name] for name in declared}
        signature = {}
        for name in kernel.arg_names:
            value = named[name]
            if name in constexprs:
                signature[name] = "constexpr"
            elif isinstance(value, torch.Tensor):
                signature[name] = POINTERS[value.dtype]
            else:
                signature[name] = "fp32" if isinstance(value, float) else "i32"
        key = (kernel.__name__, tuple((k, v) for k, v in constexprs.items() if k not in SHAPE_CONSTEXPRS),
               tuple(signature.items()), named["num_warps"])
        variants.setdefault(key, (kernel, constexprs, signature, named["num_warps"]))
    return list(variants.values())


def covering(variants: list[tuple]) -> list[tuple]:
    """A few variants that together take every value of every constexpr, pointer type and warp count."""
    def features(variant):
        kernel, constexprs, signature, warps = variant
        return {(kernel.__name__, k, str(v)) for k, v in constexprs.items() if k not in SHAPE_CONSTEXPRS} | {
            (kernel.__name__, k, v) for k, v in signature.items() if k in ("target_ptr", "draft_ptr")} | {
            (kernel.__name__, "num_warps", warps)} | ({(kernel.__name__, PAIRED, tuple(constexprs[k] for k in PAIRED))}
                                                     if all(k in constexprs for k in PAIRED) else set())

    left = set().union(*(features(v) for v in variants))
    chosen = []
    while left:
        best = max(variants, key=lambda v: len(features(v) & left))
        chosen.append(best)
        left -= features(best)
    return chosen


def compile_variant(kernel, constexprs: dict, signature: dict, warps: int) -> None:
    names = kernel.arg_names
    # Triton's specialisation of the launcher's arguments at V % 16 == 0 (16-byte vector loads)
    attrs = {(names.index(name),): [["tt.divisibility", 16]]
             for name in ("target_ptr", "draft_ptr", "stats_ptr", "V", "chunk") if name in names}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    triton.compile(source, target=TARGET, options=dict(num_warps=warps))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--all", action="store_true", help="every distinct variant of the grid, not a covering set")
    args = parser.parse_args()
    variants = shipped_variants()
    chosen = variants if args.all else covering(variants)
    failed = 0
    for kernel, constexprs, signature, warps in chosen:
        flags = " ".join(f"{k}={v}" for k, v in constexprs.items() if k not in SHAPE_CONSTEXPRS)
        name = f"{kernel.__name__} {signature['target_ptr']}/{signature['draft_ptr']} warps={warps} {flags}"
        start = time.time()
        try:
            compile_variant(kernel, constexprs, signature, warps)
            print(f"ok      {name} ({time.time() - start:.1f} s)", flush=True)
        except Exception as exc:  # report every variant, then fail
            failed += 1
            print(f"FAILED  {name}: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
    print(f"# triton {triton.__version__}, sm_90: {len(chosen) - failed}/{len(chosen)} compiled "
          f"({len(variants)} distinct variants on the grid)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
