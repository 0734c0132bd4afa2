"""Registers per thread of the statistics kernel's launch plans, compiled for sm_90 on the CPU (no GPU needed).

Uses ``compile_rejection.py``'s signatures and target and the ``cuobjdump`` bundled with Triton. Registers decide how
many programs of a plan an SM holds at once (65536 per SM; `programs_per_sm` ignores the allocation granularity).
Compiled with the arguments 16-divisible as at the benchmark's vocabularies (``aligned``, what runs there; Nsight
Compute on an H200 gave 64 registers for the B = 128 bf16 live-skip plan, session 20) and without (any V).
Run it with the GPU machine's Triton (see ``compile_rejection.py``) for the GPU's numbers.

    python benchmarks/registers_rejection.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1")

import triton  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compile_rejection as cr  # noqa: E402

# (block, prefetch, warps): the plans the launcher picks (4096 with prefetch at 8 or 16 warps, the fp32 small-vocabulary
# 2048 plan, the 1024 plan)
PLANS = [(4096, True, 8), (4096, True, 16), (2048, True, 4), (1024, False, 4)]


def registers(constexprs: dict, warps: int, logits: str, aligned: bool = True) -> int:
    # without the alignment the tiles load as 16-bit / 32-bit scalars (session 20: the numbers before that session
    # were of this unaligned variant)
    attrs = cr.aligned_attrs(cr.rs._stats_kernel) if aligned else {}
    source = triton.compiler.ASTSource(fn=cr.rs._stats_kernel,
                                       signature=cr.signature(cr.rs._stats_kernel, constexprs, logits),
                                       constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=cr.TARGET, options=dict(num_warps=warps))
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", cubin.name], capture_output=True, text=True, check=True)
    return int(usage.stdout.split("REG:")[1].split()[0])


def main() -> None:
    print(f"# triton {triton.__version__}, sm_90, _stats_kernel registers per thread")
    print("block,prefetch,warps,live_skip,logits,aligned,registers,programs_per_sm")
    for aligned in (True, False):
        for block, prefetch, warps in PLANS:
            for live in (False, True):
                for logits in ("*fp32", "*bf16"):
                    constexprs = dict(cr.STATS, **cr.ROW_FLAGS, BLOCK=block, PREFETCH=prefetch, LIVE_SKIP=live,
                                      KP2=4, JP2=8, SP2=4, UNPACK=logits == "*bf16")
                    regs = registers(constexprs, warps, logits, aligned)
                    print(f"{block},{prefetch},{warps},{live},{logits[1:]},{aligned},{regs},"
                          f"{65536 // (regs * 32 * warps)}", flush=True)


if __name__ == "__main__":
    main()
