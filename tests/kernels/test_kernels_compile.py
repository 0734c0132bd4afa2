"""The rejection kernels (``benchmarks/tools/compile_rejection.py``), the sampled-token race and the n-gram proposal
compile for an H100 (sm_90) on this machine, without a GPU.

The interpreter that runs the kernels in the CPU tests never calls Triton's compiler, so an error only the compiler
raises (a jit helper called without a constexpr argument, a type mismatch between branches) would first show up on
the GPU machine. Triton's front end and its NVIDIA back end (the bundled ``ptxas``) run on the CPU, so the kernel
variants of the shipped launch plans are compiled here, in a subprocess without ``TRITON_INTERPRET``.
"""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "tools", "compile_rejection.py")


def test_rejection_kernels_compile_for_sm90() -> None:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    summary = re.fullmatch(r"# triton \S+, sm_90: (\d+)/(\d+) compiled \((\d+) distinct variants on the grid\)",
                           lines[-1])
    assert summary, done.stdout
    compiled, total, distinct = (int(x) for x in summary.groups())
    assert 0 < total <= distinct and compiled == total, done.stdout
    assert sum(line.startswith("ok ") for line in lines) == total, done.stdout
    assert not any(line.startswith("FAILED") for line in lines)


COMPILE_VARIANTS = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from specdec.kernels import exponential_race, ngram_propose

kernels = {"race": exponential_race._race_kernel, "ngram": ngram_propose._ngram_kernel}
name, signature, variants = json.loads(sys.argv[1])
for constexprs, warps in variants:
    signature.update({key: "constexpr" for key in constexprs})
    source = triton.compiler.ASTSource(fn=kernels[name], signature=signature, constexprs=constexprs)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    print("ok", *constexprs.values(), warps)
"""
SINGLE_KERNELS = {
    # the sampled-token race: one tile a chunk, many tiles, a one-warp tile
    "race": ({"scores_ptr": "*fp32", "row_stride": "i32", "seeds_ptr": "*i64", "positions_ptr": "*i64",
              "best_ptr": "*fp32", "arg_ptr": "*i64", "V": "i32", "S": "i32"},
             [({"CHUNK": 1024, "BLOCK": 1024}, 4), ({"CHUNK": 65536, "BLOCK": 1024}, 4),
              ({"CHUNK": 256, "BLOCK": 256}, 1)]),
    # the n-gram proposal: the default 3..1, unigrams, a narrow range in small tiles
    "ngram": ({"tokens_ptr": "*i64", "row_stride": "i32", "lengths_ptr": "*i64", "out_ptr": "*i64", "N": "i32"},
              [({"MAX_NGRAM": 3, "MIN_NGRAM": 1, "NP2": 4, "BLOCK": 512}, 4),
               ({"MAX_NGRAM": 1, "MIN_NGRAM": 1, "NP2": 1, "BLOCK": 512}, 4),
               ({"MAX_NGRAM": 4, "MIN_NGRAM": 2, "NP2": 4, "BLOCK": 64}, 1)]),
}


@pytest.mark.parametrize("name", sorted(SINGLE_KERNELS))
def test_single_kernels_compile_for_sm90(name: str) -> None:
    """``kernels/exponential_race.py`` and ``kernels/ngram_propose.py`` at the constexprs their launches take."""
    signature, variants = SINGLE_KERNELS[name]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_VARIANTS, json.dumps([name, signature, variants])], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    expected = [" ".join(["ok", *(str(v) for v in constexprs.values()), str(warps)]) for constexprs, warps in variants]
    assert done.stdout.splitlines() == expected, done.stdout
