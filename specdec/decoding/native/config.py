"""What the native decode runner needs to know about a Hugging Face model, and whether it can run it at all.

The four families are flags of one model (as gpt-fast's ``ModelArgs``): Llama and Mistral are the base; Qwen2 adds
biases to the query, key and value projections; Qwen3 adds per-head RMS norms of queries and keys before the rotary
embedding. Optional biases (``attention_bias``, ``mlp_bias``) and a tied head are read from the weights themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec._models import sliding_window
from specdec.decoding.native.weights import weight_table_problem

__all__ = ["NATIVE_DTYPES", "NATIVE_MODEL_TYPES", "NativeConfig", "native_problem", "quantization_method"]

NATIVE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")  # rope types whose frequencies change with the sequence length


@dataclass(frozen=True)
class NativeConfig:
    """The shape and numerics of a Llama-family decoder.

    Attributes:
        model_type: ``config.model_type`` (one of :data:`NATIVE_MODEL_TYPES`).
        hidden_size, intermediate_size (I), num_layers (L), num_heads (H), num_kv_heads (H_kv), head_dim (D).
        vocab_size: rows of the output head (V).
        rms_norm_eps: epsilon of every RMS norm (Qwen3's per-head norms included).
        qk_norm: the attention has per-head ``q_norm`` and ``k_norm`` (Qwen3).
        dtype: the dtype of every parameter.
    """

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    qk_norm: bool
    dtype: torch.dtype

    @classmethod
    def from_hf(cls, model: torch.nn.Module) -> NativeConfig:
        """The configuration of a Hugging Face Llama, Mistral, Qwen2 or Qwen3 causal LM (checked by
        :func:`native_problem` first)."""
        config = model.config
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        attention = _decoder_layers(model)[0].self_attn
        head = model.get_output_embeddings().weight
        return cls(
            model_type=config.model_type, hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size), num_layers=len(_decoder_layers(model)),
            num_heads=heads, num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim), vocab_size=int(head.shape[0]), rms_norm_eps=float(config.rms_norm_eps),
            qk_norm=getattr(attention, "q_norm", None) is not None, dtype=head.dtype,
        )


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.base_model.layers


def quantization_method(quantization: object) -> str:
    """The ``quant_method`` of a transformers quantization config (object or dict) as a lower-case string."""
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(
        quantization, "quant_method", None)
    return str(getattr(method, "value", method)).lower()


def native_problem(model: torch.nn.Module) -> str | None:
    """Why the native runner cannot run ``model`` (one line), or None when it can.

    Refused: a model type other than llama, mistral, qwen2 and qwen3; quantised weights (a GGUF file is not:
    transformers dequantises it on load into plain float tensors); an activation other than SiLU; sliding-window
    attention; a rope type whose frequencies depend on the sequence length (dynamic, longrope);
    parameters of several dtypes or devices, or outside float32, float16 and bfloat16; an odd head dimension; and any
    parameter the weight table of :mod:`specdec.decoding.native.weights` does not place (an adapter, say).
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in NATIVE_MODEL_TYPES:
        return f"model type {model_type!r} has no native decode runner (it has one for {', '.join(NATIVE_MODEL_TYPES)})"
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None and quantization_method(quantization) != "gguf":  # GGUF loads dequantised
        return "quantised weights have no native decode runner"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} has no native decode runner (SiLU only)"
    if sliding_window(model) is not None:
        return "sliding-window attention has no native decode runner"
    base = getattr(model, "base_model", None)
    if base is None or not isinstance(getattr(base, "layers", None), torch.nn.ModuleList) or len(base.layers) == 0:
        return f"{type(model).__name__} keeps no decoder-layer list at base_model.layers"
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None:
        return f"{type(model).__name__} has no rotary_emb module"
    rope_type = str(getattr(rotary, "rope_type", "default"))
    if any(kind in rope_type for kind in LENGTH_DEPENDENT_ROPE):
        return f"rope type {rope_type!r} changes its frequencies with the sequence length"
    parameters = list(model.parameters())
    dtypes = {p.dtype for p in parameters}
    if len(dtypes) != 1 or next(iter(dtypes)) not in NATIVE_DTYPES:
        return f"parameters of dtypes {sorted(map(str, dtypes))} (the native runner needs one of float32, float16, " \
               "bfloat16)"
    if len({p.device for p in parameters}) != 1:
        return "parameters on several devices"
    if model.get_output_embeddings() is None:
        return f"{type(model).__name__} has no output embedding"
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if head_dim % 2:
        return f"head dimension {head_dim} is odd (the rotary embedding pairs features)"
    return weight_table_problem(model, NativeConfig.from_hf(model))
