"""Small facts about Hugging Face causal LMs, shared by generate, fairness and finetune."""

from __future__ import annotations

import inspect

import torch

from specdec._validation import as_int


def check_model_pair(verifier: object, drafter: object) -> None:
    """TypeError unless both are torch modules with a ``.config`` (Hugging Face causal LMs)."""
    for name, model in (("verifier", verifier), ("drafter", drafter)):
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise TypeError(f"{name} must be a Hugging Face causal LM (torch.nn.Module with .config), "
                            f"got {type(model).__name__}")


def model_device(model: torch.nn.Module) -> torch.device:
    """Device of the model's first parameter (CPU for a model without parameters)."""
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def model_vocab_size(model: torch.nn.Module, name: str = "model") -> int:
    """Rows of the output embedding, falling back to ``config.vocab_size``; TypeError naming ``name`` if neither."""
    embeddings = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embeddings is not None and getattr(embeddings, "weight", None) is not None:
        return int(embeddings.weight.shape[0])
    config = getattr(model, "config", None)
    if config is None or getattr(config, "vocab_size", None) is None:
        raise TypeError(f"{name} must be a Hugging Face causal LM with config.vocab_size")
    return int(config.vocab_size)


def sliding_window(model: torch.nn.Module) -> int | None:
    """The attention window of a model whose config uses sliding-window attention in some layer, else None."""
    config = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None)
    if as_int(window) is None or window <= 0 or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and not any("sliding" in str(kind) for kind in layer_types):
        return None
    return int(window)


def cache_argument(model: torch.nn.Module) -> str | None:
    """The name of the KV-cache argument of ``model.forward`` (``cache`` in newer transformers, else
    ``past_key_values``), or None when it takes neither."""
    params = inspect.signature(model.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in params), None)
