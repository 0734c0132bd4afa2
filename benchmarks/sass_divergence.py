"""Instruction count of the divergence kernel's loops in sm_90a SASS, compiled offline (no GPU needed).

Compiles ``_divergence_kernel`` for sm_90 with the launcher's specializations (the vocabulary and the row strides
divisible by 16, as for V = 151936), disassembles it with Triton's bundled ``cuobjdump`` and prints, for every loop
(a backward branch), its instructions per iteration, MUFU (``ex2``) count and instructions per vocabulary column
(both rows): iteration size / (BLOCK / (32 * num_warps)) columns per thread.

    python benchmarks/sass_divergence.py                  # the H200 forward setting: 512 columns, 1 warp, 3 stages
    python benchmarks/sass_divergence.py --loss --block 2048 --warps 4 --stages2 1
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kernels.divergence import _divergence_kernel  # noqa: E402

POINTER_TYPES = dict(v_ptr="*bf16", d_ptr="*bf16", grad_ptr="*bf16", mask_ptr="*i8", task_ptr="*i64",
                     task_count_ptr="*i64", status_ptr="*i32")
DIVISIBLE_BY_16 = ("v_ptr", "d_ptr", "grad_ptr", "stride_v", "stride_d", "stride_g", "vocab", "ce_ptr", "kl_ptr",
                   "tv_ptr", "alpha_ptr", "status_ptr")
LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


def compile_sass(block: int, warps: int, stages2: int, loss: bool) -> str:
    names = _divergence_kernel.arg_names
    signature = {}
    for name in names:
        if name.isupper():
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = POINTER_TYPES.get(name, "*fp64" if name.startswith("task_") else "*fp32")
        else:
            signature[name] = "fp32" if name in ("scale2", "grad_scale") else "i32"
    constexprs = dict(HAS_MASK=False, HAS_TASKS=False, HAS_WEIGHTS=False, COMPUTE_TV=not loss, WRITE_GRAD=loss,
                      BLOCK=block, EVICT_LAST=False, PASS1=2, STAGES1=1, STAGES2=stages2, HAS_COUNT=False)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in DIVISIBLE_BY_16}
    source = triton.compiler.ASTSource(fn=_divergence_kernel, signature=signature, constexprs=constexprs,
                                       attrs=attrs)
    return disassemble(triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps)))


def disassemble(kernel) -> str:
    """SASS of a compiled Triton kernel, through the ``cuobjdump`` bundled with Triton."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        return subprocess.run([tool, "-sass", cubin.name], check=True, capture_output=True, text=True).stdout


def loops(sass: str) -> list[tuple[int, int, list[str]]]:
    """``(start, end, opcodes)`` of every loop: a branch to an earlier address closes one."""
    code = [(int(m[1], 16), m[3], m[4]) for m in LINE.finditer(sass)]
    found = []
    for address, opcode, operands in code:
        target = re.match(r"\s*(0x[0-9a-f]+)", operands) if opcode.startswith("BRA") else None
        if target and int(target[1], 16) < address:
            start = int(target[1], 16)
            found.append((start, address, [op for a, op, _ in code if start <= a <= address]))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block", type=int, default=512)
    parser.add_argument("--warps", type=int, default=1)
    parser.add_argument("--stages2", type=int, default=3)
    parser.add_argument("--loss", action="store_true", help="the loss kernel (gradient pass) instead of TV / alpha")
    args = parser.parse_args()
    columns_per_thread = args.block // (32 * args.warps)
    sass = compile_sass(args.block, args.warps, args.stages2, args.loss)
    print(f"# {'loss' if args.loss else 'forward'} kernel, block {args.block}, {args.warps} warps, pass-2 stages "
          f"{args.stages2}, triton {triton.__version__}, sm_90a; {columns_per_thread} columns per thread per tile")
    found = loops(sass)
    for start, end, opcodes in found:
        if any(start <= inner_start and inner_end <= end and (inner_start, inner_end) != (start, end)
               for inner_start, inner_end, _ in found):
            print(f"loop 0x{start:04x}-0x{end:04x}: the loop over rows (contains the tile loops)")
            continue
        mufu = sum(op.startswith("MUFU") for op in opcodes)
        print(f"loop 0x{start:04x}-0x{end:04x}: {len(opcodes):4d} instructions ({mufu} MUFU) per tile = "
              f"{len(opcodes) / columns_per_thread:5.1f} per column")


if __name__ == "__main__":
    main()
