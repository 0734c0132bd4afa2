"""Attention of a decode step's T new tokens over the slot KV cache (split-KV, GQA-grouped), in one or two launches.

Computes :func:`~specdec.kernels.decode_attention_reference.decode_attention_reference` (terms and formula there):
the valid keys of a query are read on the device from ``key_ok`` and the query's slot, so there is no mask tensor and
no length on the host. A row's keys are read only up to its largest query slot (later slots hold stale drafts).

Launches: ``_decode_attention_kernel`` on ``(B, H_kv, splits)``: one program reads the keys and values of one KV head
once for all of its ``T G`` queries (a ``[block_q, D]`` tile, G = H / H_kv, ``block_q`` >= 16 for ``tl.dot``; the
interpreter's ``tl.dot`` multiplies the raw bits of 16-bit tiles, so there they are widened to float32 first, which
changes no product), over the slots of its split (``cdiv(cdiv(last slot + 1, splits), block_s)`` key tiles), with
an online softmax in float32. With one split it writes the output; with several it writes float32 partials (running
max, normaliser, unnormalised output) and ``_decode_attention_merge_kernel`` on ``(B T, H)`` combines them by
log-sum-exp. No atomics: a replay gives the same output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._device import DECODE_PDL, INTERPRETER, launching_on, major_capability, sm_count

__all__ = ["DecodeAttentionPlan", "decode_attention_plan", "decode_attention_triton"]

MAX_SPLITS = 64  # key splits a row's KV head is cut into at most (the merge tile holds them)
SPLIT_SLOTS = 256  # cache slots per split at least, so that a split amortises reading its queries and partials


@dataclass(frozen=True)
class DecodeAttentionPlan:
    """One :func:`decode_attention_triton` call: ``block_s`` slots per key tile (a power of two >= 16), ``splits``
    key ranges per (row, KV head) (1 .. :data:`MAX_SPLITS`; more than one adds the merge launch), ``num_warps``,
    ``pdl``: programmatic dependent launch (sm_90+)."""

    block_s: int
    splits: int
    num_warps: int
    pdl: bool = False


def decode_attention_plan(batch: int, num_kv_heads: int, capacity: int, head_dim: int,
                          device: torch.device) -> DecodeAttentionPlan:
    """The only place the attention's tiles and splits are chosen, from B, H_kv, the cache's S, D and the device."""
    if INTERPRETER or device.type != "cuda":
        # NOTE: small tiles and two splits in the interpreter, so that multi-tile loops and the merge run on CPU.
        return DecodeAttentionPlan(block_s=16, splits=2, num_warps=1)
    # NOTE: enough (row, KV head, split) programs to give every multiprocessor one, as long as a split keeps
    # SPLIT_SLOTS slots of a full cache.
    splits = max(1, min(triton.cdiv(sm_count(device), batch * num_kv_heads), capacity // SPLIT_SLOTS, MAX_SPLITS))
    return DecodeAttentionPlan(block_s=64 if head_dim <= 128 else 32, splits=splits, num_warps=4,
                               pdl=DECODE_PDL and major_capability(device) >= 9)


@triton.jit
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, key_ok_ptr, slots_ptr, out_ptr, part_ptr, stats_ptr,
                             T, H, D, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                             stride_okb, scale,
                             G: tl.constexpr, UPCAST: tl.constexpr, SPLITS: tl.constexpr, BLOCK_Q: tl.constexpr,
                             BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    r = tl.arange(0, BLOCK_Q)
    t = r // G
    head = kv_head * G + r % G
    r_ok = r < T * G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    token = b * T + t
    q_offsets = (token.to(tl.int64) * H + head)[:, None] * D + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_slot = tl.load(slots_ptr + token, mask=r_ok, other=-1)
    end_all = tl.max(q_slot, axis=0) + 1  # keys past the last query's slot are never attended
    chunk = tl.cdiv(tl.cdiv(end_all, SPLITS), BLOCK_S) * BLOCK_S
    lo = split * chunk
    hi = tl.minimum(end_all, lo + chunk)
    k_base = k_ptr + b.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    # NOTE: a finite start for the running max: a tile where a query has no allowed key then scales by exp(0).
    m = tl.full([BLOCK_Q], -1.0e30, dtype=tl.float32)
    norm = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)
        s_ok = s < hi
        kt = tl.load(k_base + s.to(tl.int64)[None, :] * stride_ks + d[:, None],
                     mask=s_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_S]
        if UPCAST:
            kt = kt.to(tl.float32)
        scores = tl.dot(q, kt, input_precision="ieee") * scale
        key_ok = tl.load(key_ok_ptr + b.to(tl.int64) * stride_okb + s, mask=s_ok, other=0) != 0
        allowed = (key_ok[None, :] & (s[None, :] <= q_slot[:, None])) | (s[None, :] == q_slot[:, None])
        scores = tl.where(allowed & s_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        norm = norm * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + s.to(tl.int64)[:, None] * stride_vs + d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
        p = p.to(v.dtype)
        if UPCAST:
            p, v = p.to(tl.float32), v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new
    ok = r_ok[:, None] & d_ok[None, :]
    if SPLITS == 1:
        out = acc / tl.where(norm > 0, norm, 1.0)[:, None]
        tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        pair = (token.to(tl.int64) * H + head) * SPLITS + split  # partials [B T, H, SPLITS, D], stats [.., 2]
        tl.store(part_ptr + pair[:, None] * D + d[None, :], acc, mask=ok)
        tl.store(stats_ptr + pair * 2, m, mask=r_ok)
        tl.store(stats_ptr + pair * 2 + 1, norm, mask=r_ok)


@triton.jit
def _decode_attention_merge_kernel(part_ptr, stats_ptr, out_ptr, H, D,
                                   SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
                                   PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pair = tl.program_id(0).to(tl.int64) * H + tl.program_id(1)  # (token, head)
    i = tl.arange(0, BLOCK_SPLITS)
    i_ok = i < SPLITS
    d = tl.arange(0, BLOCK_D)
    m = tl.load(stats_ptr + (pair * SPLITS + i) * 2, mask=i_ok, other=-1.0e30)
    norm = tl.load(stats_ptr + (pair * SPLITS + i) * 2 + 1, mask=i_ok, other=0.0)
    part = tl.load(part_ptr + (pair * SPLITS + i)[:, None] * D + d[None, :], mask=i_ok[:, None] & (d < D)[None, :],
                   other=0.0)
    weight = tl.exp(m - tl.max(m, axis=0))
    total = tl.sum(norm * weight, axis=0)
    out = tl.sum(part * weight[:, None], axis=0) / total
    tl.store(out_ptr + pair * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_ok: torch.Tensor,
                            slots: torch.Tensor, scale: float,
                            plan: DecodeAttentionPlan | None = None) -> torch.Tensor:
    """:func:`~specdec.kernels.decode_attention_reference.decode_attention_reference` in one launch (two with splits).

    Parameters
    ----------
    q : torch.Tensor
        [B T, H, D] float32, float16 or bfloat16, contiguous.
    k_cache, v_cache : torch.Tensor
        [B, H_kv, S, D], the dtype of ``q``, the last dimension contiguous (other strides free); H a multiple of H_kv.
    key_ok : torch.Tensor
        [B, S] bool, the last dimension contiguous.
    slots : torch.Tensor
        [B, T] int64 in [0, S), contiguous (not checked: the caller's).
    scale : float
        Score scale (``head_dim ** -0.5``).
    plan : DecodeAttentionPlan, optional
        Forces tiles and splits (tests); default :func:`decode_attention_plan`.

    Returns
    -------
    torch.Tensor
        [B T, H, D] in the dtype of ``q``, contiguous.
    """
    batch, steps = slots.shape
    kv_heads, capacity, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    heads = q.shape[1]
    if q.shape != (batch * steps, heads, head_dim) or heads % kv_heads or v_cache.shape != k_cache.shape:
        raise ValueError(f"decode_attention_triton: q must be [B T, H, D] = [{batch * steps}, H, {head_dim}] with H a "
                         f"multiple of H_kv = {kv_heads} and v_cache shaped as k_cache {tuple(k_cache.shape)}, got q "
                         f"{tuple(q.shape)}, v_cache {tuple(v_cache.shape)}")
    if key_ok.shape != (batch, capacity) or key_ok.dtype != torch.bool:
        raise ValueError(f"decode_attention_triton: key_ok must be [B, S] = [{batch}, {capacity}] bool, got "
                         f"{tuple(key_ok.shape)} {key_ok.dtype}")
    plan = plan or decode_attention_plan(batch, kv_heads, capacity, head_dim, q.device)
    group = heads // kv_heads
    block_q = max(16, triton.next_power_of_2(steps * group))
    out = torch.empty_like(q)
    if batch * steps == 0:
        return out
    splits = plan.splits
    if splits > 1:
        part = torch.empty((batch * steps, heads, splits, head_dim), dtype=torch.float32, device=q.device)
        stats = torch.empty((batch * steps, heads, splits, 2), dtype=torch.float32, device=q.device)
    else:
        part = stats = out
    block_d = max(16, triton.next_power_of_2(head_dim))  # (tl.dot needs 16)
    launch = dict(launch_pdl=True) if plan.pdl else {}
    with launching_on(q.device):
        _decode_attention_kernel[(batch, kv_heads, splits)](
            q, k_cache, v_cache, key_ok.view(torch.uint8), slots, out, part, stats, steps, heads, head_dim,
            *k_cache.stride()[:3], *v_cache.stride()[:3], key_ok.stride(0), float(scale),
            G=group, UPCAST=INTERPRETER, SPLITS=splits, BLOCK_Q=block_q, BLOCK_S=plan.block_s,
            BLOCK_D=block_d, PDL=plan.pdl, num_warps=plan.num_warps, **launch,
        )
        if splits > 1:
            _decode_attention_merge_kernel[(batch * steps, heads)](
                part, stats, out, heads, head_dim,
                SPLITS=splits, BLOCK_SPLITS=triton.next_power_of_2(splits), BLOCK_D=block_d, PDL=plan.pdl,
                num_warps=1, **launch,
            )
    return out
