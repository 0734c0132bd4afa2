"""The native decode step: a Llama-family decoder on specdec's kernels over one preallocated slot KV cache.

``NativeModel.step(ids, slots, positions, key_ok)`` runs the decoder on T new tokens per row and returns hidden
states; ``NativeModel.logits(hidden, keep)`` the final norm and head on the last ``keep`` of them. A decoder layer
is eight launches (nine when the attention splits its keys); with :data:`FUSED_NORMS` the two RMS norms run in the
prologue of the projection that follows them (six launches)::

    rms_norm -> gemv qkv_proj (+ bias) -> rotary_cache_write (q/k norms, rope, cache write) -> decode_attention
    -> gemv o_proj (+ residual) -> rms_norm -> gemv gate_up_proj (SiLU(gate) * up) -> gemv down_proj (+ residual)

The same step serves the drafter's steps (T = 1, 2), the verifier's (K + 1)-token step and plain decoding; the
prompt pass (``NativeModel.prefill``) runs the same operations in plain torch with SDPA over the prompt's slots (not
captured, prompt lengths vary). Every operation matches HF's cast order (see each kernel's reference), so float32
logits equal the HF model's to float32 rounding and 16-bit logits to the dtype's rounding.

:class:`NativeModelSlot` puts the model under the static path's model contract (``specdec.decoding.static``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional

from specdec.decoding.native.cache import NativeKVCache
from specdec.decoding.native.config import NativeConfig
from specdec.decoding.native.weights import NativeWeights, load_weights
from specdec.decoding.slot_cache import slot_attention_mask
from specdec.kernels.decode_attention import decode_attention_triton
from specdec.kernels.decode_attention_reference import decode_attention_reference
from specdec.kernels.gemv import gemv_triton
from specdec.kernels.gemv_reference import gemv_reference
from specdec.kernels.rms_norm import rms_norm_triton
from specdec.kernels.rms_norm_reference import rms_norm_reference
from specdec.kernels.rotary_cache_write import rotary_cache_write_triton
from specdec.kernels.rotary_cache_write_reference import rotary_cache_write_reference

__all__ = ["FUSED_NORMS", "NativeModel", "NativeModelSlot", "StepOps"]

# NOTE: a norm in the projection's prologue saves a launch but delays every program's first weight load by its
# statistics pass; measured no faster (H200, batch 1: llama-1b 1.33 against 1.30 ms, 24x1024 0.81 against 0.81 ms).
FUSED_NORMS = False


@dataclass(frozen=True)
class StepOps:
    """The four operations of a decode step (each kernel launcher and its reference share a signature)."""

    rms_norm: Callable[..., torch.Tensor]
    gemv: Callable[..., torch.Tensor]
    rotary_cache_write: Callable[..., torch.Tensor]
    decode_attention: Callable[..., torch.Tensor]


KERNEL_OPS = StepOps(rms_norm_triton, gemv_triton, rotary_cache_write_triton, decode_attention_triton)
REFERENCE_OPS = StepOps(rms_norm_reference, gemv_reference, rotary_cache_write_reference, decode_attention_reference)


def rotary_tables(model: torch.nn.Module, positions: int, dtype: torch.dtype,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` [positions, D] in ``dtype`` from the HF model's own ``rotary_emb`` (its ``inv_freq`` and
    ``attention_scaling``, so every static rope-scaling type matches)."""
    index = torch.arange(positions, device=device)[None]
    with torch.no_grad():
        cos, sin = model.base_model.rotary_emb(torch.zeros((), dtype=dtype, device=device), index)
    return cos[0].to(dtype).contiguous(), sin[0].to(dtype).contiguous()


class NativeModel:
    """A Llama-family decoder over a :class:`NativeKVCache` of ``batch`` rows and ``capacity`` slots.

    ``use_kernels``: the decode step runs the Triton kernels (on CUDA; on the CPU under ``TRITON_INTERPRET=1``);
    False runs each kernel's torch reference (the same function). The weights are the HF model's (fused copies
    refreshed by :meth:`refresh`).
    """

    def __init__(self, model: torch.nn.Module, batch: int, capacity: int, use_kernels: bool):
        self.config = config = NativeConfig.from_hf(model)
        device = model.get_output_embeddings().weight.device
        self.weights: NativeWeights = load_weights(model, config)
        self.cache = NativeKVCache(config.num_layers, batch, config.num_kv_heads, capacity, config.head_dim,
                                   config.dtype, device)
        self.cos, self.sin = rotary_tables(model, capacity, config.dtype, device)  # [S, D] each
        self.ops = KERNEL_OPS if use_kernels else REFERENCE_OPS
        self.scale = config.head_dim ** -0.5
        self.fused_norms = FUSED_NORMS

    def _normed_gemv(self, ops: StepOps, x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None, epilogue: str = "none") -> torch.Tensor:
        """``rms_norm(x) @ weight^T`` with its epilogue: the norm in the projection's prologue, or its own launch."""
        eps = self.config.rms_norm_eps
        if self.fused_norms:
            return ops.gemv(x, weight, bias, epilogue, norm_weight=norm_weight, eps=eps)
        return ops.gemv(ops.rms_norm(x, norm_weight, eps), weight, bias, epilogue)

    def refresh(self) -> int:
        """Rewrites the fused weight copies whose HF sources changed in place; returns how many."""
        return self.weights.refresh()

    def step(self, ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
             key_ok: torch.Tensor) -> torch.Tensor:
        """The decoder on T new tokens per row (their keys and values written at ``slots``).

        Parameters
        ----------
        ids : torch.Tensor
            [B, T] int64 token ids in [0, V).
        slots : torch.Tensor
            [B, T] int64 cache slots in [0, S), contiguous.
        positions : torch.Tensor
            [B, T] int64 rope positions in [0, S), contiguous.
        key_ok : torch.Tensor
            [B, S] bool: False at prompt padding (see :func:`~specdec.decoding.slot_cache.slot_attention_mask`).

        Returns
        -------
        torch.Tensor
            [B, T, hidden] hidden states after the last layer (before the final norm), the model's dtype.
        """
        config, ops, cache = self.config, self.ops, self.cache
        batch, steps = ids.shape
        eps = config.rms_norm_eps
        h = functional.embedding(ids.reshape(-1), self.weights.embed_tokens)  # [B T, hidden]
        for index, w in enumerate(self.weights.layers):
            k_cache, v_cache = cache.keys(index), cache.values(index)
            qkv = self._normed_gemv(ops, h, w["input_layernorm"], w["qkv_proj.weight"], w["qkv_proj.bias"])
            q = ops.rotary_cache_write(qkv, positions, slots, self.cos, self.sin, k_cache, v_cache,
                                       config.num_heads, w["q_norm"], w["k_norm"], eps)
            attention = ops.decode_attention(q, k_cache, v_cache, key_ok, slots, self.scale)
            h = ops.gemv(attention.reshape(batch * steps, -1), w["o_proj.weight"], w["o_proj.bias"], "residual", h)
            x = self._normed_gemv(ops, h, w["post_attention_layernorm"], w["gate_up_proj.weight"],
                                  w["gate_up_proj.bias"], "silu_mul")
            h = ops.gemv(x, w["down_proj.weight"], w["down_proj.bias"], "residual", h)
        return h.reshape(batch, steps, -1)

    def prefill(self, ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                key_ok: torch.Tensor) -> torch.Tensor:
        """:meth:`step` in plain torch for any T (the prompt pass): the operations' references, with attention by
        SDPA under the slot mask (a query attends its row's valid slots up to its own). Same arguments and result."""
        config, cache = self.config, self.cache
        batch, steps = ids.shape
        eps = config.rms_norm_eps
        group = config.num_heads // config.num_kv_heads
        mask = slot_attention_mask(key_ok, slots, config.dtype, additive=False)  # [B, 1, T, S]
        h = functional.embedding(ids.reshape(-1), self.weights.embed_tokens)
        for index, w in enumerate(self.weights.layers):
            k_cache, v_cache = cache.keys(index), cache.values(index)
            x = rms_norm_reference(h, w["input_layernorm"], eps)
            qkv = gemv_reference(x, w["qkv_proj.weight"], w["qkv_proj.bias"])
            q = rotary_cache_write_reference(qkv, positions, slots, self.cos, self.sin, k_cache, v_cache,
                                             config.num_heads, w["q_norm"], w["k_norm"], eps)
            q = q.reshape(batch, steps, config.num_heads, config.head_dim).transpose(1, 2)
            attention = functional.scaled_dot_product_attention(q, k_cache.repeat_interleave(group, dim=1),
                                                       v_cache.repeat_interleave(group, dim=1), attn_mask=mask,
                                                       scale=self.scale)
            attention = attention.transpose(1, 2).reshape(batch * steps, -1)
            h = gemv_reference(attention, w["o_proj.weight"], w["o_proj.bias"], "residual", h)
            x = rms_norm_reference(h, w["post_attention_layernorm"], eps)
            x = gemv_reference(x, w["gate_up_proj.weight"], w["gate_up_proj.bias"], "silu_mul")
            h = gemv_reference(x, w["down_proj.weight"], w["down_proj.bias"], "residual", h)
        return h.reshape(batch, steps, -1)

    def logits(self, hidden: torch.Tensor, keep: int, vocab: int | None = None, kernels: bool = True) -> torch.Tensor:
        """Final norm and head on the last ``keep`` tokens of ``hidden`` [B, T, hidden]: [B, keep, vocab] logits in
        the model's dtype (``vocab``: the head's first rows only, default all V). ``kernels=False`` uses the
        references (the prompt pass)."""
        ops = self.ops if kernels else REFERENCE_OPS
        batch, steps = hidden.shape[:2]
        head = self.weights.head if vocab is None else self.weights.head[:vocab]
        if keep == 1:
            rows = hidden[:, -1]  # [B, hidden], row stride T hidden
        elif keep == steps:
            rows = hidden.reshape(batch * steps, -1)
        else:
            rows = hidden[:, -keep:].reshape(batch * keep, -1)
        return self._normed_gemv(ops, rows, self.weights.norm, head, None).reshape(batch, keep, -1)


class NativeModelSlot:
    """The static path's model contract on the native runner: ``forward(ids [B, T], slots [B, T], keep) -> [B, keep,
    vocab]`` logits over its own slot cache.

    The constructor takes :class:`specdec.decoding.static._ModelSlot`'s arguments: ``key_ok`` [B, S] bool (False at
    prompt padding) and ``slot_positions`` [B, S] int64 (the rope position of every slot) are the engine's tensors,
    refilled in place for each call. ``compile_model`` has no effect (the step is already fused kernels).
    ``use_kernels``: Triton kernels for the decode step (default: on CUDA); else their torch references.
    """

    def __init__(self, model: torch.nn.Module, batch: int, capacity: int, vocab: int, key_ok: torch.Tensor,
                 slot_positions: torch.Tensor, compile_model: bool = False, *, use_kernels: bool | None = None):
        self.model = weakref.ref(model)  # cached engines must not keep a deleted model alive
        self.vocab = vocab
        self.key_ok, self.slot_positions = key_ok, slot_positions
        device = model.get_output_embeddings().weight.device
        self.use_kernels = device.type == "cuda" if use_kernels is None else use_kernels
        self.native = NativeModel(model, batch, capacity, self.use_kernels)

    @property
    def cache(self) -> NativeKVCache:
        return self.native.cache

    def forward(self, ids: torch.Tensor, slots: torch.Tensor, keep: int, eager: bool = False) -> torch.Tensor:
        """Logits [B, keep, vocab] of the last ``keep`` of the T tokens ``ids`` [B, T] int64 written at ``slots``
        [B, T] int64. ``eager``: the prompt pass (plain torch, any T, fused weights refreshed first); otherwise the
        decode step (kernels; captured in the static path's CUDA graphs)."""
        slots = slots.contiguous()
        positions = self.slot_positions.gather(1, slots)
        if eager:
            self.native.refresh()
            hidden = self.native.prefill(ids, slots, positions, self.key_ok)
            return self.native.logits(hidden, keep, self.vocab, kernels=False)
        hidden = self.native.step(ids, slots, positions, self.key_ok)
        return self.native.logits(hidden, keep, self.vocab)
