"""Per-head norms (Qwen3), rotary embedding and the slot-cache write of a decode step, in one launch.

Computes :func:`~specdec.kernels.rotary_cache_write_reference.rotary_cache_write_reference` (terms and formula
there) with HF's cast order: the optional per-head RMS norm in float32 rounded to the dtype, then ``x cos`` and
``rotate_half(x) sin`` each rounded to the dtype and their sum rounded again, as the separate torch operations do.
``rotate_half`` reads the partner feature ``(d + D/2) mod D`` of the same head (negated in the first half).

Launches: one program per token (B T) and ``block_h`` heads of the ``H + H_kv`` query and key heads; a key-head
program also copies its value head into the cache. Tiles are ``[block_h, D_block]`` (D padded to a power of two).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._device import DECODE_PDL, INTERPRETER, launching_on, major_capability

__all__ = ["RotaryCacheWritePlan", "rotary_cache_write_plan", "rotary_cache_write_triton"]


@dataclass(frozen=True)
class RotaryCacheWritePlan:
    """One :func:`rotary_cache_write_triton` launch: ``block_h`` heads per program (a power of two), ``num_warps``,
    ``pdl``: programmatic dependent launch (sm_90+)."""

    block_h: int
    num_warps: int
    pdl: bool = False


def rotary_cache_write_plan(num_heads: int, num_kv_heads: int, head_dim: int,
                            device: torch.device) -> RotaryCacheWritePlan:
    """The only place the rotary step's tiles are chosen."""
    if INTERPRETER or device.type != "cuda":
        # NOTE: two heads a program in the interpreter, so that head tiles cross the query/key boundary.
        return RotaryCacheWritePlan(block_h=2, num_warps=1)
    # NOTE: all heads of a token in one program: the work is a few KiB, a second program would only add latency.
    block_h = triton.next_power_of_2(num_heads + num_kv_heads)
    return RotaryCacheWritePlan(block_h=block_h, num_warps=4 if block_h * head_dim >= 2048 else 1,
                                pdl=DECODE_PDL and major_capability(device) >= 9)


@triton.jit
def _rotary_cache_write_kernel(qkv_ptr, positions_ptr, slots_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr,
                               q_out_ptr, k_cache_ptr, v_cache_ptr, T, H, H_KV, D, stride_qkv, stride_table,
                               stride_cb, stride_ch, stride_cs, stride_vb, stride_vh, stride_vs, eps,
                               HAS_NORM: tl.constexpr, PDL: tl.constexpr, BLOCK_H: tl.constexpr,
                               BLOCK_D: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    token = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # 0 .. H - 1 queries, H .. H + H_kv - 1 keys
    d = tl.arange(0, BLOCK_D)
    half = D // 2
    partner = tl.where(d < half, d + half, d - half)
    head_ok = heads < H + H_KV
    d_ok = d < D
    ok = head_ok[:, None] & d_ok[None, :]
    row = qkv_ptr + token.to(tl.int64) * stride_qkv + heads[:, None] * D
    x = tl.load(row + d[None, :], mask=ok, other=0.0)
    x_partner = tl.load(row + partner[None, :], mask=ok, other=0.0)
    dtype = x.dtype
    is_query = heads < H
    if HAS_NORM:
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / D + eps)
        w = tl.where(is_query[:, None], tl.load(q_norm_ptr + d, mask=d_ok, other=0.0)[None, :],
                     tl.load(k_norm_ptr + d, mask=d_ok, other=0.0)[None, :])
        w_partner = tl.where(is_query[:, None], tl.load(q_norm_ptr + partner, mask=d_ok, other=0.0)[None, :],
                             tl.load(k_norm_ptr + partner, mask=d_ok, other=0.0)[None, :])
        x = (w.to(tl.float32) * (xf * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype)
        x_partner = (w_partner.to(tl.float32)
                     * (x_partner.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype)
    position = tl.load(positions_ptr + token)
    c = tl.load(cos_ptr + position * stride_table + d, mask=d_ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + position * stride_table + d, mask=d_ok, other=0.0).to(tl.float32)
    rotated = tl.where((d < half)[None, :], -x_partner.to(tl.float32), x_partner.to(tl.float32))
    out = ((x.to(tl.float32) * c[None, :]).to(dtype).to(tl.float32)
           + (rotated * s[None, :]).to(dtype).to(tl.float32)).to(dtype)
    q_ok = ok & is_query[:, None]
    tl.store(q_out_ptr + token.to(tl.int64) * H * D + heads[:, None] * D + d[None, :], out, mask=q_ok)
    b = token // T
    slot = tl.load(slots_ptr + token).to(tl.int64)
    kv_head = tl.maximum(heads - H, 0)
    k_ok = ok & (~is_query)[:, None]
    tl.store(k_cache_ptr + b.to(tl.int64) * stride_cb + kv_head[:, None] * stride_ch + slot * stride_cs + d[None, :],
             out, mask=k_ok)
    v = tl.load(row + H_KV * D + d[None, :], mask=k_ok, other=0.0)
    tl.store(v_cache_ptr + b.to(tl.int64) * stride_vb + kv_head[:, None] * stride_vh + slot * stride_vs + d[None, :],
             v, mask=k_ok)


def rotary_cache_write_triton(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
                              sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                              q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                              eps: float = 0.0, plan: RotaryCacheWritePlan | None = None) -> torch.Tensor:
    """:func:`~specdec.kernels.rotary_cache_write_reference.rotary_cache_write_reference` in one launch.

    Parameters
    ----------
    qkv : torch.Tensor
        [B T, (H + 2 H_kv) D] float32, float16 or bfloat16, the last dimension contiguous.
    positions, slots : torch.Tensor
        [B, T] int64, contiguous: rope positions in [0, P) and cache slots in [0, S) (not checked: the caller's).
    cos, sin : torch.Tensor
        [P, D], the dtype of ``qkv``, rows contiguous, one row stride for both.
    k_cache, v_cache : torch.Tensor
        [B, H_kv, S, D], the dtype of ``qkv``, the last dimension contiguous; written in place.
    num_heads : int
        H.
    q_norm, k_norm : torch.Tensor, optional
        [D] contiguous per-head RMS norm weights (Qwen3), both or neither; ``eps`` their epsilon.
    plan : RotaryCacheWritePlan, optional
        Forces the tiles (tests); default :func:`rotary_cache_write_plan`.

    Returns
    -------
    torch.Tensor
        [B T, H, D] rotated queries, contiguous.
    """
    batch, steps = positions.shape
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    width = (num_heads + 2 * kv_heads) * head_dim
    if qkv.shape != (batch * steps, width) or head_dim % 2 or cos.shape[-1] != head_dim:
        raise ValueError(f"rotary_cache_write_triton: qkv must be [B T, (H + 2 H_kv) D] = [{batch * steps}, {width}] "
                         f"with D = {head_dim} even and cos [P, D], got qkv {tuple(qkv.shape)}, cos "
                         f"{tuple(cos.shape)}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("rotary_cache_write_triton: pass both q_norm and k_norm or neither")
    if cos.stride() != sin.stride():
        raise ValueError("rotary_cache_write_triton: cos and sin must share their strides")
    plan = plan or rotary_cache_write_plan(num_heads, kv_heads, head_dim, qkv.device)
    q_out = torch.empty((batch * steps, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if batch * steps == 0:
        return q_out
    grid = (batch * steps, triton.cdiv(num_heads + kv_heads, plan.block_h))
    with launching_on(qkv.device):
        _rotary_cache_write_kernel[grid](
            qkv, positions, slots, cos, sin, q_norm if q_norm is not None else cos,
            k_norm if k_norm is not None else cos, q_out, k_cache, v_cache, steps, num_heads, kv_heads, head_dim,
            qkv.stride(0), cos.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3], float(eps),
            HAS_NORM=q_norm is not None, PDL=plan.pdl, BLOCK_H=plan.block_h, BLOCK_D=triton.next_power_of_2(head_dim),
            num_warps=plan.num_warps, **(dict(launch_pdl=True) if plan.pdl else {}),
        )
    return q_out
