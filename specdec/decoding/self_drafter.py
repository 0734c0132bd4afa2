"""A drafter for a model that has none: the verifier's first layers, with its final norm and head (layer skip).

``layer_skip_drafter(verifier, num_layers)`` returns a Hugging Face causal LM that runs the verifier's embedding,
its first ``num_layers`` decoder layers, its final norm and its output head. With ``share_weights=True`` (the
default) every module is the verifier's own, so the drafter costs no memory and follows the verifier when its
weights change; with ``share_weights=False`` it is an independent copy to finetune (``specdec.finetune_drafter``)
without touching the verifier.

It works for decoder-only models whose base model keeps its decoder layers in one ``nn.ModuleList`` of
``config.num_hidden_layers`` entries (Llama, Mistral, Qwen2, Gemma, GPT-2 and most others in transformers).
"""

from __future__ import annotations

import copy

import torch

from specdec._models import check_model_pair
from specdec._validation import as_int


def _decoder_layers(model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """(the base model, the attribute name of its decoder-layer list)."""
    base = getattr(model, "base_model", None)
    total = getattr(model.config, "num_hidden_layers", None)
    if base is None or base is model or total is None:
        raise TypeError(f"verifier must be a Hugging Face causal LM with a base model and config.num_hidden_layers, "
                        f"got {type(model).__name__}")
    for name, child in base.named_children():
        if isinstance(child, torch.nn.ModuleList) and len(child) == total:
            return base, name
    raise TypeError(f"{type(model).__name__} keeps no list of {total} decoder layers in its base model: a layer-skip "
                    "drafter cannot be built from it")


def _shallow_module_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A new module object sharing ``module``'s children, parameters and buffers, with dicts of its own."""
    clone = copy.copy(module)
    clone._modules, clone._parameters, clone._buffers = dict(module._modules), dict(module._parameters), dict(
        module._buffers)
    return clone


def layer_skip_drafter(verifier: torch.nn.Module, num_layers: int, *, share_weights: bool = True) -> torch.nn.Module:
    """The verifier's first ``num_layers`` decoder layers with its embedding, final norm and head, as a causal LM.

    Args:
        verifier: a Hugging Face decoder-only causal LM (e.g. ``LlamaForCausalLM``).
        num_layers: decoder layers the drafter keeps, ``1 <= num_layers < config.num_hidden_layers``.
        share_weights: True (default): the drafter's modules are the verifier's (no extra memory; an update of the
            verifier's weights is seen by both). False: a deep copy, to finetune independently.

    Returns:
        A model of the verifier's class whose ``config.num_hidden_layers`` is ``num_layers``, in the verifier's mode
        (eval/train), device and dtype. With shared weights it is ``verifier`` minus its last layers; pass both to
        :func:`specdec.generate`.
    """
    check_model_pair(verifier, verifier)
    base, layers_name = _decoder_layers(verifier)
    total = len(getattr(base, layers_name))
    count = as_int(num_layers)
    if count is None or not 1 <= count < total:
        raise ValueError(f"num_layers must be an integer in [1, {total - 1}] (the verifier has {total} decoder "
                         f"layers), got {num_layers!r}")
    if not isinstance(share_weights, bool):
        raise TypeError(f"share_weights must be True or False, got {share_weights!r}")
    config = copy.deepcopy(verifier.config)
    config.num_hidden_layers = count
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:count]
    drafter_base = _shallow_module_copy(base)  # a new module object whose children are the verifier's
    drafter_base._modules[layers_name] = torch.nn.ModuleList(list(getattr(base, layers_name))[:count])
    drafter_base.config = config
    drafter = _shallow_module_copy(verifier)
    prefix = verifier.base_model_prefix
    drafter._modules[prefix] = drafter_base
    drafter.config = config
    if getattr(verifier, "generation_config", None) is not None:
        drafter.generation_config = copy.deepcopy(verifier.generation_config)
    return drafter if share_weights else copy.deepcopy(drafter)
