"""Reference of the step between a layer's fused ``qkv_proj`` and its attention: per-head norms (Qwen3), rotary
embedding of queries and keys, and the keys and values stored in the slot KV cache.

This is the definition :func:`specdec.kernels.rotary_cache_write.rotary_cache_write_triton` computes in one launch.
It calls Hugging Face's own ``apply_rotary_pos_emb`` (the half-split rotation, computed in the model's dtype) and the
RMS norm reference (HF's ``Qwen3RMSNorm`` cast order).

Terms:
    ``qkv`` [B T, (H + 2 H_kv) D]: the projection output of B rows of T tokens: H query heads, then H_kv key heads,
    then H_kv value heads, D features each. ``positions`` [B, T]: rope positions. ``slots`` [B, T]: cache slots.
    ``cos``, ``sin`` [P, D]: the model's rotary tables (``rotary_emb`` of positions 0 .. P - 1, in the dtype).

Formula (row b, token t, head h)::

    q_h = qkv[b T + t, h D : (h + 1) D]            (q_norm(q_h) when the model has per-head norms)
    k_j, v_j likewise at (H + j) D and (H + H_kv + j) D   (k_norm(k_j))
    c, s = cos[positions[b, t]], sin[positions[b, t]]
    q_out[b T + t, h] = q_h c + rotate_half(q_h) s  (each product and the sum rounded to the dtype, as HF)
    k_cache[b, j, slots[b, t]] = k_j c + rotate_half(k_j) s;  v_cache[b, j, slots[b, t]] = v_j
"""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .rms_norm_reference import rms_norm_reference

__all__ = ["rotary_cache_write_reference"]


def rotary_cache_write_reference(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
                                 sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                                 eps: float = 0.0) -> torch.Tensor:
    """Rotates queries and keys and writes keys and values at their slots; returns the rotated queries.

    Parameters
    ----------
    qkv : torch.Tensor
        [B T, (H + 2 H_kv) D] float32, float16 or bfloat16.
    positions, slots : torch.Tensor
        [B, T] int64: rope positions in [0, P) and cache slots in [0, S).
    cos, sin : torch.Tensor
        [P, D], the dtype of ``qkv``.
    k_cache, v_cache : torch.Tensor
        [B, H_kv, S, D], the dtype of ``qkv`` (any strides); written in place.
    num_heads : int
        H.
    q_norm, k_norm : torch.Tensor, optional
        [D] per-head RMS norm weights (Qwen3), both or neither; ``eps`` their epsilon.

    Returns
    -------
    torch.Tensor
        [B T, H, D] rotated queries, the dtype of ``qkv``, contiguous.
    """
    batch, steps = positions.shape
    head_dim = cos.shape[-1]
    heads = qkv.reshape(batch, steps, -1, head_dim)
    kv_heads = (heads.shape[2] - num_heads) // 2
    q, k, v = heads.split([num_heads, kv_heads, kv_heads], dim=2)
    if q_norm is not None:
        q, k = rms_norm_reference(q, q_norm, eps), rms_norm_reference(k, k_norm, eps)
    # HF's layout: [B, heads, T, D] states and [B, T, D] tables (unsqueezed at dim 1)
    q_rot, k_rot = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos[positions], sin[positions])
    rows = torch.arange(batch, device=qkv.device)[:, None]
    k_cache.transpose(1, 2)[rows, slots] = k_rot.transpose(1, 2)  # [B, T, H_kv, D] at [b, slots[b, t]]
    v_cache.transpose(1, 2)[rows, slots] = v
    return q_rot.transpose(1, 2).reshape(batch * steps, num_heads, head_dim).contiguous()
