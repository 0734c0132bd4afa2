"""A preallocated KV cache with one write position per row, for the static (CUDA-graph) decoding path.

Every row of the batch keeps its own sequence of *slots* ``0 .. S - 1``: the (left-padded) prompt fills slots
``0 .. L - 1`` and generated tokens follow without holes. A forward call writes its T new keys and values at the
slots the caller names (``[B, T]``, a different start per row), so rolling back rejected drafts is moving a row's
write position, not copying: stale entries past a row's length are never attended (the mask is causal in slots) and
the next round overwrites them. Shapes never change, so the forward calls can be captured in CUDA graphs.

The model sees a prepared 4D mask (Hugging Face models use a 4D mask as given), explicit position ids and this
object as ``past_key_values``; its attention layers call :meth:`SlotCache.update` and attend over all S slots.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from specdec._models import cache_argument, sliding_window

SUPPORTED_ATTENTION = ("sdpa", "eager")


class SlotCache(Cache):
    """Per-layer key/value buffers ``[B, H_kv, S, D]`` written at per-row slots.

    ``write_slots`` ([B, T] int64, set by the caller before each forward call) names the slots of the T new tokens.
    Buffers are allocated at the first update (dtype, device and head shapes taken from the model's own states).
    """

    is_compileable = True

    def __init__(self, batch: int, capacity: int):  # noqa: D107 (the base class's constructor is not used)
        self.batch, self.capacity = batch, capacity
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.write_slots: torch.Tensor | None = None
        self.layers = []
        self.layer_class_to_replicate = None
        self.offloading = False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes [B, H, T, D] keys/values at ``write_slots`` and returns the whole [B, H, S, D] buffers."""
        if layer_idx not in self.keys:
            batch, heads, _, k_dim = key_states.shape
            shape = (batch, heads, self.capacity)
            self.keys[layer_idx] = key_states.new_zeros((*shape, k_dim))
            self.values[layer_idx] = value_states.new_zeros((*shape, value_states.shape[-1]))
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        slots = self.write_slots[:, None, :, None]
        keys.scatter_(2, slots.expand(*key_states.shape[:3], keys.shape[-1]), key_states.to(keys.dtype))
        values.scatter_(2, slots.expand(*value_states.shape[:3], values.shape[-1]), value_states.to(values.dtype))
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # position ids and the mask are always given, so the model never derives them from the cache

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.capacity

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.capacity, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)


def slot_attention_mask(key_ok: torch.Tensor, query_slots: torch.Tensor, dtype: torch.dtype,
                        additive: bool) -> torch.Tensor:
    """The [B, 1, T, S] mask of T queries at ``query_slots`` ([B, T]) over the S cache slots.

    Query t of row b attends slot s iff ``key_ok[b, s]`` (False only at prompt padding) and ``s <= query_slots[b,
    t]``, and always its own slot (a padding query then attends only itself instead of nothing, which would put NaN
    into its cached values). ``additive`` gives the float form (0 or the dtype's minimum) for eager attention,
    else a bool mask (True = attend) for SDPA.
    """
    slots = torch.arange(key_ok.shape[1], device=key_ok.device)
    query = query_slots[:, :, None]
    allowed = (key_ok[:, None, :] & (slots <= query)) | (slots == query)
    allowed = allowed[:, None]
    if not additive:
        return allowed
    zero = torch.zeros((), dtype=dtype, device=key_ok.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def fast_path_problem(model: torch.nn.Module, name: str) -> str | None:
    """Why ``model`` cannot run on the slot cache (one line), or None if it can."""
    import inspect

    config = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    if attention not in SUPPORTED_ATTENTION:
        return f"{name} uses attention implementation {attention!r} (the static path supports sdpa and eager)"
    if sliding_window(model) is not None:
        return f"{name} uses sliding-window attention"
    params = inspect.signature(model.forward).parameters
    for arg in ("position_ids", "attention_mask"):
        if arg not in params:
            return f"{name}.forward takes no {arg!r} argument"
    if cache_argument(model) is None:
        return f"{name}.forward takes no cache argument ('cache' or 'past_key_values')"
    if getattr(config, "is_encoder_decoder", False):
        return f"{name} is an encoder-decoder model"
    return None

