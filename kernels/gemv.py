"""Projections of a few rows (the decode step's linear layers) in one launch that reads every weight once.

Computes :func:`~specdec.kernels.gemv_reference.gemv_reference` (terms, prologue, epilogues and cast order there). A
decode step at batch 1-8 is bound by reading its weights, so every program reads a ``[block_n, K]`` slab of the weight
once and applies it to all M = B T rows of the call: the K + 1 token verification step then reads the same bytes as a
one-token step. The RMS norm before the projection runs in the prologue (a first pass over the rows of ``x``, which
are a few KiB, for their statistics), so it costs no launch; the epilogue (bias, residual add, SiLU(gate) * up) runs
on the accumulators before the only store.

Launches: one program per ``block_n`` output features (``"silu_mul"``: the gate and the up rows of those features),
looping over K in ``block_k`` chunks; float32 accumulators, no atomics (the summation order is fixed by the plan).
Two inner products: for one or two rows a broadcast multiply into ``[block_m, block_n, block_k]`` accumulators
reduced once after the loop; for more rows ``tl.dot`` on ``[block_m >= 16, block_k]`` tiles (float32 inputs with
IEEE precision, never TF32; the interpreter's ``tl.dot`` multiplies the raw bits of 16-bit tiles, so there they are
widened to float32 first, which changes no product). With ``pdl`` (sm_90+) the kernel is launched with programmatic
dependent launch: it lets its successor launch at once, loads its first weight chunk, and only then waits for its
predecessor's output. Past :data:`MAX_ROWS` rows the step is no longer bound by weight reads and the plan hands the
call to ``torch.nn.functional.linear`` and the reference epilogue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._device import DECODE_PDL, INTERPRETER, launching_on, major_capability, shared_memory_per_block, sm_count
from .gemv_reference import EPILOGUES, gemv_reference, output_features

__all__ = ["MAX_ROWS", "GemvPlan", "gemv_plan", "gemv_triton", "shared_memory_bytes"]

MAX_ROWS = 64  # rows the kernel serves; past this cuBLAS (torch) reads each weight once too and computes faster
BROADCAST_ELEMENTS = 4096  # float32 accumulators of a broadcast program (4 warps: 32 a thread)
BROADCAST_ROWS = 2  # rows up to which the broadcast inner product beats tensor-core tiles padded to 16 rows
_EPILOGUE_CODES = {name: code for code, name in enumerate(EPILOGUES)}


@dataclass(frozen=True)
class GemvPlan:
    """One :func:`gemv_triton` call.

    Attributes:
        matmul: hand the call to torch (``linear`` and the reference epilogue); the other fields are then unused.
        block_m: rows per tile, a power of two >= M (>= 16 with ``dot``).
        block_n: output features per program (a power of two; >= 16 with ``dot``).
        block_k: reduction chunk (a power of two; >= 16 with ``dot``).
        dot: ``tl.dot`` tiles instead of the broadcast inner product.
        num_warps, num_stages: of the program.
        pdl: programmatic dependent launch (sm_90+; never in the interpreter).
    """

    matmul: bool
    block_m: int
    block_n: int
    block_k: int
    dot: bool
    num_warps: int
    num_stages: int
    pdl: bool = False


def gemv_plan(rows: int, features: int, reduction: int, dtype: torch.dtype, device: torch.device) -> GemvPlan:
    """The only place the projection's tiles are chosen, from M = ``rows``, N = ``features`` (output width),
    K = ``reduction``, the dtype and the device."""
    if rows > MAX_ROWS:
        return GemvPlan(matmul=True, block_m=0, block_n=0, block_k=0, dot=False, num_warps=0, num_stages=0)
    dot = rows > BROADCAST_ROWS
    block_m = max(16, triton.next_power_of_2(rows)) if dot else triton.next_power_of_2(rows)
    if INTERPRETER or device.type != "cuda":
        # NOTE: small tiles in the interpreter so that tails in N and K and several programs run in the CPU tests.
        return GemvPlan(matmul=False, block_m=block_m, block_n=16 if dot else 4, block_k=16, dot=dot, num_warps=1,
                        num_stages=1)
    # NOTE: long chunks: a program's chunks are serial memory round trips, and at batch 1 that latency, not the
    # bandwidth, bounds a projection of a few MiB (H200, llama-1b step: 2 KiB chunks 1.14 ms, 1 KiB 1.33 ms,
    # 512 B 1.55 ms). Tensor-core tiles: 256 (1 KiB) beat 64, 128 and 512 on the 5-row step.
    block_k = 2048 // dtype.itemsize if not dot else 256
    target = 2 * sm_count(device)
    # NOTE: the broadcast accumulators hold block_m x block_n x block_k floats: 32 a thread at most, no spills.
    block_n = 64 if dot else max(1, BROADCAST_ELEMENTS // (block_m * block_k))
    # NOTE: at least two programs per multiprocessor, so that enough loads are in flight to reach HBM bandwidth;
    # tensor-core tiles keep 32 features (16 was 1.36x slower on the 5-row llama-1b step).
    while block_n > (32 if dot else 1) and triton.cdiv(features, block_n) < target:
        block_n //= 2
    num_stages = 3
    # NOTE: tensor-core tiles keep num_stages - 1 buffers of the x tile and the weight tile (gate and up rows for
    # "silu_mul") in shared memory: float32 or 64-row calls shorten the chunk to fit the device
    while dot and block_k > 16 and shared_memory_bytes(block_m, block_n, block_k, num_stages,
                                                      dtype) > shared_memory_per_block(device):
        block_k //= 2
    return GemvPlan(matmul=False, block_m=block_m, block_n=block_n, block_k=block_k, dot=dot, num_warps=4,
                    num_stages=num_stages, pdl=DECODE_PDL and major_capability(device) >= 9)


def shared_memory_bytes(block_m: int, block_n: int, block_k: int, num_stages: int, dtype: torch.dtype) -> int:
    """Shared memory of a tensor-core program, bounded above: ``num_stages - 1`` pipelined buffers of a
    ``[block_m, block_k]`` x tile and the ``[2 block_n, block_k]`` gate and up weight tiles."""
    return (num_stages - 1) * (block_m + 2 * block_n) * block_k * dtype.itemsize


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, res_ptr, norm_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_rm, eps,
                 EPILOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, DOT: tl.constexpr,
                 EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    feats = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # NOTE: clamped indices instead of masks on rows and features (their results are never stored), so that the
    # weight loads stay unmasked and vectorised; only a K tail is masked.
    x_rows = x_ptr + tl.minimum(rows, M - 1).to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + tl.minimum(feats, N - 1).to(tl.int64)[:, None] * stride_wn
    u_rows = w_rows + N.to(tl.int64) * stride_wn  # "silu_mul": the up rows of the same features
    if PDL:
        # the first weight chunk does not depend on the predecessor: in flight before waiting for it
        first_ok = (ks < K)[None, :]
        w_first = tl.load(w_rows + ks[None, :], mask=first_ok, other=0.0)
        if EPILOGUE == 2:
            u_first = tl.load(u_rows + ks[None, :], mask=first_ok, other=0.0)
        tl.extra.cuda.gdc_wait()
    if HAS_NORM:
        squares = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            xs = tl.load(x_rows + (start + ks)[None, :], mask=(start + ks < K)[None, :], other=0.0).to(tl.float32)
            squares += xs * xs
        rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=1) / K + eps)
    if DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc3_u = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + ks
        k_ok = (k < K)[None, :]
        if PDL:
            if start == 0:
                w = w_first
                if EPILOGUE == 2:
                    w_u = u_first
            else:
                w = tl.load(w_rows + k[None, :], mask=k_ok, other=0.0)
                if EPILOGUE == 2:
                    w_u = tl.load(u_rows + k[None, :], mask=k_ok, other=0.0)
        elif EVEN_K:
            w = tl.load(w_rows + k[None, :])
            if EPILOGUE == 2:
                w_u = tl.load(u_rows + k[None, :])
        else:
            w = tl.load(w_rows + k[None, :], mask=k_ok, other=0.0)
            if EPILOGUE == 2:
                w_u = tl.load(u_rows + k[None, :], mask=k_ok, other=0.0)
        if EVEN_K:
            x = tl.load(x_rows + k[None, :])
        else:
            x = tl.load(x_rows + k[None, :], mask=k_ok, other=0.0)
        if HAS_NORM:
            nw = tl.load(norm_ptr + k, mask=k < K, other=0.0)
            h = (x.to(tl.float32) * rstd[:, None]).to(nw.dtype)
            x = (nw.to(tl.float32)[None, :] * h.to(tl.float32)).to(nw.dtype)
        if DOT:
            if UPCAST:
                x, w = x.to(tl.float32), w.to(tl.float32)
                if EPILOGUE == 2:
                    w_u = w_u.to(tl.float32)
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            if EPILOGUE == 2:
                acc_u = tl.dot(x, tl.trans(w_u), acc_u, input_precision="ieee")
        else:
            xf = x.to(tl.float32)[:, None, :]
            acc3 += xf * w.to(tl.float32)[None, :, :]
            if EPILOGUE == 2:
                acc3_u += xf * w_u.to(tl.float32)[None, :, :]
    if not DOT:
        acc = tl.sum(acc3, axis=2)
        if EPILOGUE == 2:
            acc_u = tl.sum(acc3_u, axis=2)
    out_ty = out_ptr.dtype.element_ty
    n_ok = feats < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + feats, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if EPILOGUE == 2:
            acc_u += tl.load(bias_ptr + N + feats, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = acc.to(out_ty).to(tl.float32)
    ok = (rows < M)[:, None] & n_ok[None, :]
    if EPILOGUE == 1:
        residual = tl.load(res_ptr + rows.to(tl.int64)[:, None] * stride_rm + feats[None, :], mask=ok, other=0.0)
        y = residual.to(tl.float32) + y
    if EPILOGUE == 2:
        up = acc_u.to(out_ty).to(tl.float32)
        silu = (y / (1.0 + tl.exp(-y))).to(out_ty).to(tl.float32)
        y = silu * up
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + feats[None, :], y.to(out_ty), mask=ok)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, epilogue: str = "none",
                residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                plan: GemvPlan | None = None) -> torch.Tensor:
    """:func:`~specdec.kernels.gemv_reference.gemv_reference` in one launch (or through torch past the row limit).

    Parameters
    ----------
    x : torch.Tensor
        [M, K], the weight's dtype; the last dimension contiguous.
    weight : torch.Tensor
        [N_w, K] float32, float16 or bfloat16, the last dimension contiguous (for ``"silu_mul"``: gate rows, then up
        rows).
    bias : torch.Tensor, optional
        [N_w] contiguous, the weight's dtype.
    epilogue : str
        ``"none"``, ``"residual"`` or ``"silu_mul"``.
    residual : torch.Tensor, optional
        [M, N] (last dimension contiguous) for ``"residual"``.
    norm_weight : torch.Tensor, optional
        [K] contiguous, the weight's dtype: the rows of ``x`` are RMS-normalised first (epsilon ``eps``).
    plan : GemvPlan, optional
        Forces the tiles (tests); default :func:`gemv_plan`.

    Returns
    -------
    torch.Tensor
        [M, N] in the weight's dtype, contiguous.
    """
    if epilogue not in _EPILOGUE_CODES:
        raise ValueError(f"gemv_triton: epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv_triton takes x [M, K] and weight [N_w, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"gemv_triton: x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    rows, reduction = x.shape
    features = output_features(weight.shape[0], epilogue)
    if epilogue == "silu_mul" and weight.shape[0] % 2:
        raise ValueError(f"gemv_triton: 'silu_mul' needs an even number of weight rows, got {weight.shape[0]}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"gemv_triton: bias must be [N_w] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    if norm_weight is not None and tuple(norm_weight.shape) != (reduction,):
        raise ValueError(f"gemv_triton: norm_weight must be [K] = [{reduction}], got {tuple(norm_weight.shape)}")
    if epilogue == "residual" and (residual is None or tuple(residual.shape) != (rows, features)):
        got = None if residual is None else tuple(residual.shape)
        raise ValueError(f"gemv_triton: 'residual' needs residual [M, N] = [{rows}, {features}], got {got}")
    plan = plan or gemv_plan(rows, features, reduction, weight.dtype, weight.device)
    if plan.matmul:
        return gemv_reference(x, weight, bias, epilogue, residual, norm_weight, eps)
    if plan.block_m < rows:
        raise ValueError(f"gemv_triton: plan.block_m = {plan.block_m} holds fewer than M = {rows} rows")
    out = torch.empty((rows, features), dtype=weight.dtype, device=weight.device)
    if rows == 0 or features == 0:
        return out
    for name, tensor in (("x", x), ("weight", weight), ("residual", residual)):
        if tensor is not None and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
            raise ValueError(f"gemv_triton: the last dimension of {name} must be contiguous")
    res = residual if residual is not None else out
    launch = dict(launch_pdl=True) if plan.pdl else {}
    with launching_on(weight.device):
        _gemv_kernel[(triton.cdiv(features, plan.block_n),)](
            x, weight, bias if bias is not None else weight, res, norm_weight if norm_weight is not None else weight,
            out, rows, features, reduction, x.stride(0), weight.stride(0), res.stride(0), float(eps),
            EPILOGUE=_EPILOGUE_CODES[epilogue], HAS_BIAS=bias is not None, HAS_NORM=norm_weight is not None,
            DOT=plan.dot, EVEN_K=reduction % plan.block_k == 0, UPCAST=INTERPRETER, PDL=plan.pdl,
            BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
            num_warps=plan.num_warps, num_stages=plan.num_stages, **launch,
        )
    return out
