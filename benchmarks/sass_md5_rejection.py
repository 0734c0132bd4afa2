"""md5 of the sm_90a SASS of every ``compile_rejection.py`` variant, compiled offline from one source tree.

Checks that a change leaves machine code alone where it should: run it on two trees (e.g. a ``git worktree`` of an
older commit, with this file, ``compile_rejection.py`` and ``sass_divergence.py`` copied into its ``benchmarks/``)
and compare the lists. Arguments are aligned as at the benchmark's vocabularies; ``UNPACK`` is off wherever the
kernel has it, and constexprs a tree's kernel does not declare are dropped.

    python benchmarks/sass_md5_rejection.py /path/to/tree    # session 20: results/sass_md5_rejection_s20.txt
"""

from __future__ import annotations

import hashlib
import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1: the interpreter replaces the kernels this script compiles")


def main() -> None:
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    sys.path.insert(0, root)
    import triton

    from benchmarks import compile_rejection as cr
    from benchmarks.sass_divergence import disassemble

    print(f"# kernels of {root}, triton {triton.__version__}, sm_90, UNPACK off")
    for name, kernel, constexprs, warps, logits in cr.VARIANTS:
        declared = {param.name for param in kernel.params if param.is_constexpr}
        kept = {key: value for key, value in dict(constexprs, UNPACK=False).items() if key in declared}
        source = triton.compiler.ASTSource(fn=kernel, signature=cr.signature(kernel, kept, logits), constexprs=kept,
                                           attrs=cr.aligned_attrs(kernel))
        sass = disassemble(triton.compile(source, target=cr.TARGET, options=dict(num_warps=warps)))
        print(f"{hashlib.md5(sass.encode()).hexdigest()}  {name}", flush=True)


if __name__ == "__main__":
    main()
