"""RMS normalisation of a batch of rows in one launch (the decode step's input, post-attention and final norms).

Computes :func:`~specdec.kernels.rms_norm_reference.rms_norm_reference` (terms and formula there), with HF's cast
order: float32 statistics, the normalised row rounded to the input dtype, then the weight product in that dtype.

Launches: one program per row of a ``[B, R, N]`` input whose row strides are arbitrary (the final norm reads the
last ``keep`` tokens of every row of ``[B, T, N]`` hidden states without a copy). A row is read in ``block`` chunks:
one chunk holds it on the GPU plans; the interpreter's plan uses small chunks, so the two-pass path (statistics, then
normalise) runs in the CPU tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._device import DECODE_PDL, INTERPRETER, launching_on, major_capability

__all__ = ["RmsNormPlan", "rms_norm_plan", "rms_norm_triton"]

MAX_BLOCK = 8192  # features one chunk holds at most (registers); wider rows are read in several chunks


@dataclass(frozen=True)
class RmsNormPlan:
    """One :func:`rms_norm_triton` launch: ``block`` features per chunk (a power of two), ``num_warps``, ``pdl``:
    programmatic dependent launch (sm_90+)."""

    block: int
    num_warps: int
    pdl: bool = False


def rms_norm_plan(features: int, device: torch.device) -> RmsNormPlan:
    """The only place the norm's chunk and warps are chosen."""
    if INTERPRETER or device.type != "cuda":
        # NOTE: small chunks in the interpreter so that rows of a few dozen features take the multi-chunk path.
        return RmsNormPlan(block=16, num_warps=1)
    block = min(triton.next_power_of_2(features), MAX_BLOCK)
    # NOTE: 8 bf16 features per thread and load; a 2048-wide row then takes 8 warps.
    return RmsNormPlan(block=block, num_warps=max(1, min(16, block // 256)),
                       pdl=DECODE_PDL and major_capability(device) >= 9)


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, R, N, stride_xb, stride_xr, eps,
                     BLOCK: tl.constexpr, ONE_CHUNK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    b = row // R
    r = row % R
    x_row = x_ptr + b.to(tl.int64) * stride_xb + r.to(tl.int64) * stride_xr
    out_row = out_ptr + row.to(tl.int64) * N
    cols = tl.arange(0, BLOCK)
    if ONE_CHUNK:
        ok = cols < N
        x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
        w = tl.load(weight_ptr + cols, mask=ok, other=0.0)
        h = (x * rstd).to(w.dtype)
        tl.store(out_row + cols, (w.to(tl.float32) * h.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)
    else:
        squares = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, N, BLOCK):
            ok = start + cols < N
            x = tl.load(x_row + start + cols, mask=ok, other=0.0).to(tl.float32)
            squares += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / N + eps)
        for start in range(0, N, BLOCK):
            ok = start + cols < N
            x = tl.load(x_row + start + cols, mask=ok, other=0.0).to(tl.float32)
            w = tl.load(weight_ptr + start + cols, mask=ok, other=0.0)
            h = (x * rstd).to(w.dtype)
            tl.store(out_row + start + cols, (w.to(tl.float32) * h.to(tl.float32)).to(out_ptr.dtype.element_ty),
                     mask=ok)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, plan: RmsNormPlan | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`~specdec.kernels.rms_norm_reference.rms_norm_reference` in one launch.

    Parameters
    ----------
    x : torch.Tensor
        [N], [R, N] or [B, R, N] float32, float16 or bfloat16; the last dimension contiguous, the others any stride.
    weight : torch.Tensor
        [N] contiguous, the dtype of ``x``.
    eps : float
        The model's ``rms_norm_eps``.
    plan : RmsNormPlan, optional
        Forces the chunk and warps (tests); default :func:`rms_norm_plan`.
    out : torch.Tensor, optional
        Contiguous output of the shape and dtype of ``x``; allocated when not given.

    Returns
    -------
    torch.Tensor
        The normalised rows, shaped as ``x``, contiguous.
    """
    if x.dim() not in (1, 2, 3) or x.shape[-1] != weight.shape[-1] or weight.dim() != 1:
        raise ValueError(f"rms_norm_triton takes x [..., N] (1 to 3 dims) and weight [N], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"rms_norm_triton: x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError("rms_norm_triton: the last dimension of x must be contiguous")
    x3 = x.reshape(1, 1, -1) if x.dim() == 1 else (x[None] if x.dim() == 2 else x)
    batch, rows, features = x3.shape
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    plan = plan or rms_norm_plan(features, x.device)
    if batch * rows == 0:
        return out
    with launching_on(x.device):
        _rms_norm_kernel[(batch * rows,)](
            x3, weight, out, rows, features, x3.stride(0), x3.stride(1), float(eps),
            BLOCK=plan.block, ONE_CHUNK=plan.block >= features, PDL=plan.pdl, num_warps=plan.num_warps,
            **(dict(launch_pdl=True) if plan.pdl else {}),
        )
    return out
