"""Instruction count of the rejection race kernel's level-1 loop in sm_90a SASS, compiled offline (no GPU needed).

Compiles ``_race_kernel`` for sm_90 as the launcher does for fp32 logits with B >= 32 (one warp, one 256-id race tile
per loop iteration, fused finalize, no greedy rows) and prints every loop's instruction and MUFU counts; the race
loop is the long one (8 fp32 ids per thread per iteration). ``--no-ftz`` compiles ``tl.exp`` instead of the
``ex2.approx.ftz`` exponentials (``tune={"ftz": False}``); ``--no-fast-log`` compiles libdevice's ``logf`` instead
of ``lg2.approx`` for the race scores (``tune={"fast_log": False}``); ``--evict-first`` marks the race loads
``evict_first`` as the L2 plan does (``tune['l2_keep']``).

    python benchmarks/sass_rejection.py                          # session 11, triton 3.9: 299 instructions per tile
    python benchmarks/sass_rejection.py --no-fast-log            # 376 (17 MUFU; sessions 9-10)
    python benchmarks/sass_rejection.py --no-fast-log --no-ftz   # 426
"""

from __future__ import annotations

import argparse
import os
import sys

import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.sass_divergence import LINE, disassemble, loops  # noqa: E402
from kernels import rejection_sampling as rs  # noqa: E402

POINTER_TYPES = dict(target_ptr="*fp32", draft_ptr="*fp32", draft_tokens_ptr="*i64", num_drafts_ptr="*i64",
                     greedy_ptr="*i64", seeds_ptr="*i64", offsets_ptr="*i64", argmax_ptr="*i32", counter_ptr="*i32",
                     tokens_ptr="*i64", num_accepted_ptr="*i64")


def compile_sass(tiles: int, warps: int, ftz: bool, evict_first: bool = False, fast_log: bool = True) -> str:
    names = rs._race_kernel.arg_names
    constexprs = dict(HAS_COUNTS=False, HAS_MASK=False, ALL_GREEDY=False, COMPUTE_SCORES=False, KP2=1, JP2=2, SP2=4,
                      TILES=tiles, RACE_TILE=rs.RACE_TILE, TILE_BASE=rs.TILE_INDEX_BASE, SINGLE=False, FUSE=True,
                      SP2B=16, MASS_EPS=rs.RESIDUAL_MASS_EPS, PDL_WAIT=False, FTZ=ftz,
                      RACE_EVICT="evict_first" if evict_first else "", FAST_LOG=fast_log)
    signature = {name: "constexpr" if name in constexprs else
                 POINTER_TYPES.get(name, "*fp32") if name.endswith("_ptr") else
                 "fp32" if name == "inv_t" else "i32" for name in names}
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in ("target_ptr", "draft_ptr", "V", "chunk")}
    source = triton.compiler.ASTSource(fn=rs._race_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return disassemble(triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiles", type=int, default=1, help="race tiles per loop iteration")
    parser.add_argument("--warps", type=int, default=1)
    parser.add_argument("--no-ftz", action="store_true")
    parser.add_argument("--evict-first", action="store_true")
    parser.add_argument("--no-fast-log", action="store_true")
    args = parser.parse_args()
    sass = compile_sass(args.tiles, args.warps, not args.no_ftz, args.evict_first, not args.no_fast_log)
    print(f"# race kernel, {args.tiles} tile(s) x {args.warps} warp(s), ftz {not args.no_ftz}, fast log "
          f"{not args.no_fast_log}, triton "
          f"{triton.__version__}, sm_90a: {len(LINE.findall(sass))} instructions in all")
    for start, end, opcodes in loops(sass):
        mufu = sum(op.startswith("MUFU") for op in opcodes)
        print(f"loop 0x{start:04x}-0x{end:04x}: {len(opcodes):4d} instructions ({mufu} MUFU)")


if __name__ == "__main__":
    main()
