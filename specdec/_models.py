"""Small facts about Hugging Face causal LMs, shared by generate, fairness and finetune."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

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


@contextlib.contextmanager
def eval_mode(*models: object) -> Iterator[None]:
    """Every submodule of each torch module in ``models`` in eval mode (no dropout: a measurement follows one fixed
    law) for the block; each submodule's own ``training`` flag is restored afterwards, even on an error."""
    modes = [(module, module.training) for model in models if isinstance(model, torch.nn.Module)
             for module in model.modules()]
    for module, _ in modes:
        module.training = False
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def pair_in_eval_mode(function: Callable) -> Callable:
    """Runs ``function(verifier, drafter, ...)`` with both models in :func:`eval_mode` (each submodule's mode restored
    afterwards)."""

    @functools.wraps(function)
    def wrapper(verifier: Any, drafter: Any, *args: Any, **kwargs: Any) -> Any:
        with eval_mode(verifier, drafter):
            return function(verifier, drafter, *args, **kwargs)

    return wrapper


@contextlib.contextmanager
def float32_logits(model: torch.nn.Module) -> Iterator[None]:
    """The output head of ``model`` (``get_output_embeddings()``) runs in float32 outside autocast for the block, on
    its input cast to float32: under bf16 autocast the body still runs in bf16, but the logits [.., V] come out float32
    instead of rounded to bf16 (their rounding error would bias KL and the s-CDF weights upwards). A model without an
    output head, or whose head's weight is not float32, is left as it is."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if head is None or weight is None or weight.dtype != torch.float32:
        yield
        return
    had_own = "forward" in vars(head)
    original = head.forward

    def forward(hidden: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            return original(hidden.float(), *args, **kwargs)

    head.forward = forward
    try:
        yield
    finally:
        if had_own:
            head.forward = original
        else:
            del head.forward
