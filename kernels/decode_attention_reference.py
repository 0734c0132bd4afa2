"""Reference of attention over the slot KV cache for the T new tokens of every row (decode, drafts, verification).

This is the definition :func:`specdec.kernels.decode_attention.decode_attention_triton` computes. It attends exactly
the keys the static path's mask allows (``specdec.decoding.slot_cache.slot_attention_mask``), so no mask tensor is
needed: the valid keys of a query are read from ``key_ok`` and its own slot.

Terms:
    ``q`` [B T, H, D]: rotated queries (row b, token t at ``b T + t``). ``k_cache``, ``v_cache`` [B, H_kv, S, D]:
    the layer's slot cache. Query head h reads KV head ``h // G``, G = H / H_kv (HF's ``repeat_kv``).
    ``key_ok`` [B, S] bool: False at prompt padding. ``slots`` [B, T]: the slot of every new token.

Formula (row b, token t, head h; float32 throughout, as SDPA's fused kernels)::

    allowed(s) = (key_ok[b, s] and s <= slots[b, t]) or s == slots[b, t]
    p(s)       = softmax over allowed s of  scale * q[b T + t, h] . k_cache[b, h // G, s]
    out[b T + t, h] = sum_s p(s) v_cache[b, h // G, s]         (rounded to the dtype)

HF's eager attention rounds the scores to the dtype before the softmax; in float32 the two agree to rounding, in
16-bit dtypes within the dtype's rounding of the scores.
"""

from __future__ import annotations

import torch

__all__ = ["decode_attention_reference"]


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_ok: torch.Tensor,
                               slots: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of the new tokens' queries over the allowed slots of their row.

    Parameters
    ----------
    q : torch.Tensor
        [B T, H, D] float32, float16 or bfloat16.
    k_cache, v_cache : torch.Tensor
        [B, H_kv, S, D], the dtype of ``q``; H a multiple of H_kv.
    key_ok : torch.Tensor
        [B, S] bool.
    slots : torch.Tensor
        [B, T] int64 in [0, S).
    scale : float
        Multiplies the scores (the model's ``head_dim ** -0.5``).

    Returns
    -------
    torch.Tensor
        [B T, H, D] in the dtype of ``q``, contiguous.
    """
    batch, steps = slots.shape
    heads, head_dim = q.shape[1], q.shape[2]
    group = heads // k_cache.shape[1]
    keys = k_cache.float().repeat_interleave(group, dim=1)  # [B, H, S, D]
    values = v_cache.float().repeat_interleave(group, dim=1)
    queries = q.float().reshape(batch, steps, heads, head_dim).transpose(1, 2)  # [B, H, T, D]
    scores = scale * queries @ keys.transpose(2, 3)  # [B, H, T, S]
    s = torch.arange(k_cache.shape[2], device=q.device)
    own = s == slots[:, :, None]  # [B, T, S]
    allowed = (key_ok[:, None, :] & (s <= slots[:, :, None])) | own
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ values  # [B, H, T, D]
    return out.transpose(1, 2).reshape(batch * steps, heads, head_dim).to(q.dtype).contiguous()
