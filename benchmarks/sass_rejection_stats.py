"""Instruction count of the rejection statistics kernel's tile loop in sm_90a SASS, compiled offline (no GPU needed).

Compiles ``_stats_kernel`` for sm_90 with bf16 logits at three launch plans the launcher uses (B = 128 with live
skip: 4096-id tiles, prefetch, 8 warps; B = 16-32: the same without live skip; B <= 4: 1024-id tiles, 4 warps, PDL
trigger) with the logit-scale fold (``tune['fold_scale']``) and the bf16 unpack (``tune['unpack']``) on and off,
and prints each loop's instruction count and its most frequent opcodes. The tile loop is the first loop listed (16
ids of each row a thread per tile at 4096 / 8 warps, 8 at 1024 / 4 warps); live skip adds a second loop (the
certain-rejection test of the last program of a position).

    python benchmarks/sass_rejection_stats.py      # session 20, triton 3.6: results/sass_rejection_stats_s20.txt
"""

from __future__ import annotations

import collections
import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1: the interpreter replaces the kernels this script compiles")

import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.compile_rejection import ROW_FLAGS, STATS, aligned_attrs, signature  # noqa: E402
from benchmarks.sass_divergence import LINE, disassemble, loops  # noqa: E402
from kernels import rejection_sampling as rs  # noqa: E402

PLANS = {
    "B = 128 (live skip, 4096, prefetch, 8 warps)": (dict(LIVE_SKIP=True, PREFETCH=True), 8),
    "B = 16-32 (4096, prefetch, 8 warps)": (dict(PREFETCH=True), 8),
    "B <= 4 (1024, 4 warps, PDL trigger)": (dict(BLOCK=1024, PREFETCH=False, PDL_TRIGGER=True), 4),
}


def compile_sass(extra: dict, warps: int) -> str:
    constexprs = dict(STATS, **ROW_FLAGS, **extra)
    source = triton.compiler.ASTSource(fn=rs._stats_kernel, signature=signature(rs._stats_kernel, constexprs, "*bf16"),
                                       constexprs=constexprs, attrs=aligned_attrs(rs._stats_kernel))
    return disassemble(triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps)))


def main() -> None:
    print(f"# statistics kernel, bf16 logits, triton {triton.__version__}, sm_90a")
    for plan, (extra, warps) in PLANS.items():
        for fold in (False, True):
            for unpack in (False, True):
                sass = compile_sass(dict(extra, FOLD=fold, UNPACK=unpack), warps)
                print(f"{plan}, fold {fold}, unpack {unpack}: {len(LINE.findall(sass))} instructions in all")
                for start, end, opcodes in loops(sass):
                    common = collections.Counter(op.split(".")[0] for op in opcodes).most_common(8)
                    print(f"  loop 0x{start:04x}-0x{end:04x}: {len(opcodes):4d} instructions  "
                          + " ".join(f"{name} {count}" for name, count in common))


if __name__ == "__main__":
    main()
