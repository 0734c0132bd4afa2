"""The rejection kernels (``benchmarks/tools/compile_rejection.py``), the sampled-token race and the n-gram proposal
compile for an H100 (sm_90) on this machine, without a GPU.

The interpreter that runs the kernels in the CPU tests never calls Triton's compiler, so an error only the compiler
raises (a jit helper called without a constexpr argument, a type mismatch between branches) would first show up on
the GPU machine. Triton's front end and its NVIDIA back end (the bundled ``ptxas``) run on the CPU, so the kernel
variants of the shipped launch plans are compiled here, in a subprocess without ``TRITON_INTERPRET``.
"""

import os
import re
import subprocess
import sys

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


RACE_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from specdec.kernels.exponential_race import _race_kernel

signature = {"scores_ptr": "*fp32", "row_stride": "i32", "seeds_ptr": "*i64", "positions_ptr": "*i64",
             "best_ptr": "*fp32", "arg_ptr": "*i64", "V": "i32", "S": "i32", "CHUNK": "constexpr",
             "BLOCK": "constexpr"}
for chunk, block, warps in [(1024, 1024, 4), (65536, 1024, 4), (256, 256, 1)]:
    constexprs = {"CHUNK": chunk, "BLOCK": block}
    source = triton.compiler.ASTSource(fn=_race_kernel, signature=signature, constexprs=constexprs)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    print("ok", chunk, block, warps)
"""


def test_race_kernel_compiles_for_sm90() -> None:
    """The sampled-token race (``kernels/exponential_race.py``): one tile a chunk, many tiles, a one-warp tile."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", RACE_COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == ["ok 1024 1024 4", "ok 65536 1024 4", "ok 256 256 1"], done.stdout


NGRAM_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from specdec.kernels.ngram_propose import _ngram_kernel

signature = {"tokens_ptr": "*i64", "row_stride": "i32", "lengths_ptr": "*i64", "out_ptr": "*i64", "N": "i32",
             "MAX_NGRAM": "constexpr", "MIN_NGRAM": "constexpr", "NP2": "constexpr", "BLOCK": "constexpr"}
for max_ngram, min_ngram, block, warps in [(3, 1, 512, 4), (1, 1, 512, 4), (4, 2, 64, 1)]:
    constexprs = {"MAX_NGRAM": max_ngram, "MIN_NGRAM": min_ngram, "NP2": triton.next_power_of_2(max_ngram),
                  "BLOCK": block}
    source = triton.compiler.ASTSource(fn=_ngram_kernel, signature=signature, constexprs=constexprs)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    print("ok", max_ngram, min_ngram, block)
"""


def test_ngram_kernel_compiles_for_sm90() -> None:
    """The n-gram proposal (``kernels/ngram_propose.py``): the default 3..1, unigrams, a narrow range in small tiles."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", NGRAM_COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == ["ok 3 1 512", "ok 1 1 512", "ok 4 2 64"], done.stdout
