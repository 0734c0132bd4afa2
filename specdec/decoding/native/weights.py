"""The native runner's view of a Hugging Face model's weights: one table from fused names to HF parameter names.

Per decoder layer the runner reads one ``qkv_proj`` ``[(H + 2 H_kv) D, hidden]`` (q, k, v stacked) and one
``gate_up_proj`` ``[2 I, hidden]`` (gate, then up), as vLLM's ``QKVParallelLinear`` and ``MergedColumnParallelLinear``;
every other tensor (embedding, norms, ``o_proj``, ``down_proj``, head) is the HF parameter itself, never a copy.

Fused copies are cached per HF decoder-layer module, so a layer-skip drafter (whose layers are its verifier's
modules) reads its verifier's copies, and refreshed in place (``copy_``, addresses kept for captured CUDA graphs)
when a source's version counter has moved, e.g. after an optimiser step on the drafter. In-place updates through
``.data`` bypass the version counter and are not seen; reassigned parameters (new tensors) are.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specdec.decoding.native.config import NativeConfig

__all__ = ["LAYER_TABLE", "MODEL_TABLE", "LayerWeights", "NativeWeights", "load_weights", "weight_table_problem"]

# (native name, HF names relative to the decoder layer in concatenation order, concatenation dim, required)
LAYER_TABLE: tuple[tuple[str, tuple[str, ...], int, bool], ...] = (
    ("input_layernorm", ("input_layernorm.weight",), 0, True),
    ("qkv_proj.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), 0, True),
    ("qkv_proj.bias", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), 0, False),
    ("q_norm", ("self_attn.q_norm.weight",), 0, False),
    ("k_norm", ("self_attn.k_norm.weight",), 0, False),
    ("o_proj.weight", ("self_attn.o_proj.weight",), 0, True),
    ("o_proj.bias", ("self_attn.o_proj.bias",), 0, False),
    ("post_attention_layernorm", ("post_attention_layernorm.weight",), 0, True),
    ("gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), 0, True),
    ("gate_up_proj.bias", ("mlp.gate_proj.bias", "mlp.up_proj.bias"), 0, False),
    ("down_proj.weight", ("mlp.down_proj.weight",), 0, True),
    ("down_proj.bias", ("mlp.down_proj.bias",), 0, False),
)
# (native name, HF name relative to the base model or, for the head, to the causal LM; required)
MODEL_TABLE: tuple[tuple[str, str, bool], ...] = (
    ("embed_tokens", "embed_tokens.weight", True),
    ("norm", "norm.weight", True),
)


def _expected_shapes(config: NativeConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every HF tensor the tables name, relative to its decoder layer or base model."""
    hidden, heads, kv_heads, dim = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    inner = config.intermediate_size
    shapes = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
              "self_attn.q_norm.weight": (dim,), "self_attn.k_norm.weight": (dim,),
              "self_attn.o_proj.weight": (hidden, heads * dim), "self_attn.o_proj.bias": (hidden,),
              "mlp.down_proj.weight": (hidden, inner), "mlp.down_proj.bias": (hidden,),
              "embed_tokens.weight": (config.vocab_size, hidden), "norm.weight": (hidden,)}
    for name, rows in (("q", heads * dim), ("k", kv_heads * dim), ("v", kv_heads * dim)):
        shapes[f"self_attn.{name}_proj.weight"] = (rows, hidden)
        shapes[f"self_attn.{name}_proj.bias"] = (rows,)
    for name in ("gate", "up"):
        shapes[f"mlp.{name}_proj.weight"] = (inner, hidden)
        shapes[f"mlp.{name}_proj.bias"] = (inner,)
    return shapes


@dataclass
class _Placement:
    """Where every table entry of a model comes from: HF full names (None for an absent optional entry)."""

    layers: list[dict[str, tuple[str, ...] | None]]
    model: dict[str, str | None]
    head: str | None  # the head's HF name; None when tied to the embedding
    consumed: list[str]


def _place(model: torch.nn.Module, config: NativeConfig, params: dict[str, torch.Tensor]) -> _Placement:
    """Resolves the tables against ``params`` (``model.named_parameters()``); ValueError naming the HF key on a
    missing, extra or misshaped tensor."""
    prefix = f"{model.base_model_prefix}." if getattr(model, "base_model_prefix", "") else ""
    if not any(name.startswith(prefix) for name in params):
        prefix = ""
    shapes = _expected_shapes(config)
    consumed: list[str] = []

    def check(full: str, relative: str) -> None:
        expected = shapes[relative]
        if tuple(params[full].shape) != expected:
            raise ValueError(f"{full} has shape {tuple(params[full].shape)}, the native runner expects {expected}")
        consumed.append(full)

    layers = []
    for index in range(config.num_layers):
        layer_prefix = f"{prefix}layers.{index}."
        entries: dict[str, tuple[str, ...] | None] = {}
        for name, sources, _, required in LAYER_TABLE:
            full = tuple(layer_prefix + source for source in sources)
            present = [f in params for f in full]
            if not any(present) and not required:
                entries[name] = None
                continue
            if not all(present):
                missing = full[present.index(False)]
                raise ValueError(f"{missing} is missing (expected shape {shapes[missing[len(layer_prefix):]]})")
            for f, source in zip(full, sources, strict=True):
                check(f, source)
            entries[name] = full
        if (entries["q_norm"] is None) != (entries["k_norm"] is None):
            raise ValueError(f"{layer_prefix}self_attn has one of q_norm and k_norm but not the other")
        layers.append(entries)
    placed: dict[str, str | None] = {}
    for name, source, _ in MODEL_TABLE:
        full = prefix + source
        if full not in params:
            raise ValueError(f"{full} is missing (expected shape {shapes[source]})")
        check(full, source)
        placed[name] = full
    head_weight = model.get_output_embeddings().weight
    head = next((n for n, p in params.items() if p is head_weight), None)
    if head is not None and head != placed["embed_tokens"]:
        if tuple(head_weight.shape) != (config.vocab_size, config.hidden_size):
            raise ValueError(f"{head} has shape {tuple(head_weight.shape)}, the native runner expects "
                             f"{(config.vocab_size, config.hidden_size)}")
        consumed.append(head)
    elif head is None:
        raise ValueError("the output embedding's weight is not among model.named_parameters()")
    else:
        head = None  # tied: named_parameters() lists the shared tensor once, under the embedding's name
    placed_names = set(consumed)
    extra = [name for name in params if name not in placed_names]
    if extra:
        raise ValueError(f"{extra[0]} has no place in the native runner's weight table"
                         + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    return _Placement(layers, placed, head, consumed)


def weight_table_problem(model: torch.nn.Module, config: NativeConfig) -> str | None:
    """The first mismatch between ``model``'s parameters and the weight tables (one line), or None."""
    try:
        _place(model, config, dict(model.named_parameters()))
    except ValueError as error:
        return str(error)
    return None


@dataclass
class _Fused:
    """One fused copy and the state of its sources when it was last written."""

    tensor: torch.Tensor
    sources: tuple[torch.Tensor, ...]
    dim: int
    versions: tuple[int, ...]

    @classmethod
    def build(cls, sources: tuple[torch.Tensor, ...], dim: int) -> _Fused:
        with torch.no_grad():
            tensor = torch.cat([s.detach() for s in sources], dim=dim)
        return cls(tensor, sources, dim, tuple(s._version for s in sources))

    def serves(self, sources: tuple[torch.Tensor, ...]) -> bool:
        return len(sources) == len(self.sources) and all(a is b for a, b in zip(sources, self.sources, strict=True))

    def refresh(self) -> bool:
        """Copies the sources in place when a version counter moved; True if it did."""
        versions = tuple(s._version for s in self.sources)
        if versions == self.versions:
            return False
        with torch.no_grad():
            start = 0
            for source in self.sources:
                width = source.shape[self.dim]
                self.tensor.narrow(self.dim, start, width).copy_(source.detach())
                start += width
        self.versions = versions
        return True


_FUSED: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, _Fused]] = weakref.WeakKeyDictionary()


@dataclass
class LayerWeights:
    """The tensors of one decoder layer, by native name (absent optional entries are None).

    ``qkv_proj.weight`` [(H + 2 H_kv) D, hidden] and ``gate_up_proj.weight`` [2 I, hidden] (and their biases) are
    fused copies; ``input_layernorm`` and ``post_attention_layernorm`` [hidden], ``q_norm``/``k_norm`` [D],
    ``o_proj.weight`` [hidden, H D], ``down_proj.weight`` [hidden, I] (and biases) are the HF tensors.
    """

    tensors: dict[str, torch.Tensor | None]
    fused: list[_Fused] = field(default_factory=list)

    def __getitem__(self, name: str) -> torch.Tensor | None:
        return self.tensors[name]


@dataclass
class NativeWeights:
    """Every tensor a native step reads: ``embed_tokens`` [V, hidden], ``norm`` [hidden], ``head`` [V, hidden] (the
    embedding itself when tied), ``layers``; ``consumed``: the HF parameter names read, each once."""

    embed_tokens: torch.Tensor
    norm: torch.Tensor
    head: torch.Tensor
    layers: list[LayerWeights]
    consumed: list[str]

    def refresh(self) -> int:
        """Brings every fused copy up to date with its sources (in place); returns how many were rewritten."""
        return sum(fused.refresh() for layer in self.layers for fused in layer.fused)


def load_weights(model: torch.nn.Module, config: NativeConfig) -> NativeWeights:
    """Reads ``model.named_parameters()`` into a :class:`NativeWeights` (fused copies cached per decoder layer and
    refreshed; ValueError naming the HF key on any mismatch with the tables)."""
    params = dict(model.named_parameters())
    placement = _place(model, config, params)
    layers = []
    for module, entries in zip(model.base_model.layers, placement.layers, strict=True):
        cached = _FUSED.setdefault(module, {})
        tensors: dict[str, torch.Tensor | None] = {}
        used: list[_Fused] = []
        for name, _, dim, _ in LAYER_TABLE:
            names = entries[name]
            if names is None:
                tensors[name] = None
                continue
            sources = tuple(params[n] for n in names)
            if len(sources) == 1:
                tensors[name] = sources[0].detach()
                continue
            fused = cached.get(name)
            if fused is None or not fused.serves(sources):
                fused = cached[name] = _Fused.build(sources, dim)
            fused.refresh()
            tensors[name] = fused.tensor
            used.append(fused)
        layers.append(LayerWeights(tensors, used))
    embed = params[placement.model["embed_tokens"]].detach()
    head = embed if placement.head is None else params[placement.head].detach()
    return NativeWeights(embed, params[placement.model["norm"]].detach(), head, layers, placement.consumed)
