"""Compile the rejection-sampling kernels for an H100 (sm_90) without a GPU.

Triton's front end and its NVIDIA back end (the bundled ``ptxas``) run on the CPU, so errors that the interpreter
does not raise (a jit helper called without one of its constexpr arguments, a type that only the compiler checks)
show up here instead of on the GPU machine. Every launch-plan branch of the kernels is compiled: the statistics
kernel plain, prefetched, staged and with live skip (eviction hints, greedy rows, scores), the race kernel fused and
not (one-warp fp32 plan, single-block plan, scores, programmatic dependent launch), the finalize kernel and the
one-launch ``seq`` kernel. ``tests/test_kernels_compile.py`` runs this script with the installed Triton. Newer Tritons
accept some code that older ones reject (Triton 3.6, the GPU machine's, rejects a jit helper's defaulted string
constexpr left out by a caller; 3.9 accepts it), so before a GPU run also run it with the GPU machine's Triton: an
offline venv with ``pip download --no-deps --only-binary=:all: --python-version 3.11 --platform
manylinux_2_28_x86_64 triton==3.6.0`` installed next to ``torch==2.13.0`` (CPU) does it.

    python benchmarks/compile_rejection.py        # prints one line per variant; exit status 1 if any failed
"""

from __future__ import annotations

import os
import sys
import time

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1: the interpreter replaces the kernels this script compiles")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kernels import rejection_sampling as rs  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
INT_POINTERS = dict(draft_tokens_ptr="*i64", num_drafts_ptr="*i64", greedy_ptr="*i64", seeds_ptr="*i64",
                    offsets_ptr="*i64", argmax_ptr="*i32", counter_ptr="*i32", pair_counter_ptr="*i32",
                    info_ptr="*i32", tokens_ptr="*i64", num_accepted_ptr="*i64")
ROW_FLAGS = dict(HAS_COUNTS=False, HAS_MASK=False, ALL_GREEDY=False)
GREEDY_FLAGS = dict(HAS_COUNTS=True, HAS_MASK=True, ALL_GREEDY=False)
STATS = dict(COMPUTE_SCORES=False, KP2=8, BLOCK=4096, ZERO_COUNTERS=True, PDL_TRIGGER=False, PREFETCH=True,
             STAGED=False, JP2=16, SP2=16, FTZ=True, KEEP_EVICT="", REST_EVICT="", LIVE_SKIP=False, FOLD=False,
             UNPACK=False)
RACE = dict(COMPUTE_SCORES=False, KP2=8, JP2=16, SP2=16, TILES=4, RACE_TILE=rs.RACE_TILE,
            TILE_BASE=rs.TILE_INDEX_BASE, SINGLE=False, FUSE=True, SP2B=16, MASS_EPS=rs.RESIDUAL_MASS_EPS,
            PDL_WAIT=False, FTZ=True, RACE_EVICT="", FAST_LOG=True)

# (name, kernel, constexprs, num_warps, logit pointer type)
VARIANTS = [
    ("stats default bf16", rs._stats_kernel, dict(STATS, **ROW_FLAGS), 8, "*bf16"),
    ("stats prefetched unpacked bf16", rs._stats_kernel, dict(STATS, **ROW_FLAGS, UNPACK=True), 8, "*bf16"),
    ("stats small-batch folded unpacked bf16", rs._stats_kernel,
     dict(STATS, **ROW_FLAGS, BLOCK=1024, PREFETCH=False, PDL_TRIGGER=True, FOLD=True, UNPACK=True), 4, "*bf16"),
    ("stats prefetched folded greedy fp16", rs._stats_kernel, dict(STATS, **GREEDY_FLAGS, FOLD=True), 8, "*fp16"),
    ("stats staged greedy fp32", rs._stats_kernel,
     dict(STATS, **GREEDY_FLAGS, BLOCK=1024, PREFETCH=False, STAGED=True, FTZ=False), 4, "*fp32"),
    ("stats live skip l2 hints fp32", rs._stats_kernel,
     dict(STATS, **ROW_FLAGS, BLOCK=2048, LIVE_SKIP=True, KEEP_EVICT="evict_last", REST_EVICT="evict_first",
          FOLD=True), 4,
     "*fp32"),
    ("stats live skip no prefetch unpacked bf16", rs._stats_kernel,
     dict(STATS, **ROW_FLAGS, LIVE_SKIP=True, PREFETCH=False, UNPACK=True),
     16, "*bf16"),
    ("stats scores all greedy fp16", rs._stats_kernel,
     dict(STATS, HAS_COUNTS=False, HAS_MASK=False, ALL_GREEDY=True, COMPUTE_SCORES=True), 8, "*fp16"),
    ("race fused pdl bf16", rs._race_kernel, dict(RACE, **ROW_FLAGS, PDL_WAIT=True), 4, "*bf16"),
    ("race one-warp fp32", rs._race_kernel, dict(RACE, **ROW_FLAGS, TILES=1, RACE_EVICT="evict_first"), 1, "*fp32"),
    ("race single scores greedy unfused", rs._race_kernel,
     dict(RACE, **GREEDY_FLAGS, SINGLE=True, FUSE=False, COMPUTE_SCORES=True, FTZ=False, FAST_LOG=False), 2,
     "*fp32"),
    ("finalize", rs._finalize_kernel,
     dict(MASS_EPS=rs.RESIDUAL_MASS_EPS, COMPUTE_SCORES=True, JP2=16, SP2=16, RACE_TILE=rs.RACE_TILE), 4, "*bf16"),
    ("seq", rs._seq_kernel,
     dict(GREEDY_FLAGS, KP2=8, JP2=16, BLOCK=1024, MASS_EPS=rs.RESIDUAL_MASS_EPS, TILES=1, RACE_TILE=rs.RACE_TILE,
          TILE_BASE=rs.TILE_INDEX_BASE), 8, "*fp32"),
]


def signature(kernel, constexprs: dict, logits: str) -> dict[str, str]:
    """Argument types as the launcher passes them: logits ``logits``, statistics fp32, ids and counters int."""
    types = {}
    for name in kernel.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in ("target_ptr", "draft_ptr"):
            types[name] = logits
        elif name.endswith("_ptr"):
            types[name] = INT_POINTERS.get(name, "*fp32")
        else:
            types[name] = "fp32" if name == "inv_t" else "i32"
    return types


def aligned_attrs(kernel) -> dict:
    """Triton's specialisation of the launcher's arguments at the benchmark's vocabularies (V = 32000, 128256,
    151936): logit and statistics pointers, ``V`` and ``chunk`` divisible by 16 (16-byte vector loads)."""
    names = kernel.arg_names
    return {(names.index(name),): [["tt.divisibility", 16]]
            for name in ("target_ptr", "draft_ptr", "stats_ptr", "V", "chunk") if name in names}


def compile_variant(kernel, constexprs: dict, warps: int, logits: str) -> None:
    declared = {param.name for param in kernel.params if param.is_constexpr}
    missing = sorted(declared - set(constexprs))
    if missing:
        raise ValueError(f"constexpr arguments without a value: {missing}")
    source = triton.compiler.ASTSource(fn=kernel, signature=signature(kernel, constexprs, logits),
                                       constexprs=constexprs)
    triton.compile(source, target=TARGET, options=dict(num_warps=warps))


def main() -> int:
    failed = 0
    for name, kernel, constexprs, warps, logits in VARIANTS:
        start = time.time()
        try:
            compile_variant(kernel, constexprs, warps, logits)
            print(f"ok      {name} ({time.time() - start:.1f} s)", flush=True)
        except Exception as exc:  # report every variant, then fail
            failed += 1
            print(f"FAILED  {name}: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
    print(f"# triton {triton.__version__}, sm_90: {len(VARIANTS) - failed}/{len(VARIANTS)} compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
