"""The native runner's KV cache: one preallocated buffer per model, indexed by layer, with the slot semantics of
:mod:`specdec.decoding.slot_cache` (per-row slots; rollback is moving a row's length; stale slots never attended)."""

from __future__ import annotations

import torch

__all__ = ["NativeKVCache"]


class NativeKVCache:
    """Keys and values of every layer in one buffer.

    ``kv`` [L, 2, B, H_kv, S, D] in the model's dtype: ``kv[l, 0]`` the keys and ``kv[l, 1]`` the values of layer
    ``l``, each [B, H_kv, S, D] with D contiguous and slot stride D, so that one (row, KV head) reads S x D contiguous
    elements. Kernels take the strides of the per-layer views. Zero-filled at allocation (never-written slots hold
    finite values; they are masked anyway).
    """

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.capacity = capacity
        self.kv = torch.zeros((num_layers, 2, batch, num_kv_heads, capacity, head_dim), dtype=dtype, device=device)

    def keys(self, layer: int) -> torch.Tensor:
        """[B, H_kv, S, D] view of layer ``layer``'s keys."""
        return self.kv[layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        """[B, H_kv, S, D] view of layer ``layer``'s values."""
        return self.kv[layer, 1]
