"""Hugging Face ``generate`` options for :func:`specdec.generate`: a ``GenerationConfig`` and HF keywords resolved
into the settings the decoding paths run with, and an error naming every option that is set but not implemented.

Precedence, highest first: the keywords of :func:`specdec.generate` (``max_new_tokens``, ``temperature``, ...), other
HF keywords (``do_sample``, ``max_length``, ``min_length``, ...), the ``generation_config``. A ``generation_config``
is completed as transformers completes it: its unset (None) fields from the verifier's own ``generation_config``,
then transformers' global defaults (``max_length=20``, ``top_k=50``, ...). Without a ``generation_config`` nothing
is read from the model: unset options take specdec's defaults (greedy, ``max_new_tokens=128``, ``top_k=0``, no eos).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdec._validation import check_int_at_least

DEFAULT_MAX_NEW_TOKENS = 128

# transformers' global generation defaults for the options specdec implements (GenerationConfig's own defaults in
# transformers 4, ``GenerationConfig._get_default_generation_params`` in transformers 5)
HF_DEFAULTS: dict[str, Any] = {
    "max_length": 20, "min_length": 0, "do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
    "repetition_penalty": 1.0, "num_return_sequences": 1,
}

IMPLEMENTED = frozenset({
    "max_new_tokens", "max_length", "min_new_tokens", "min_length", "do_sample", "temperature", "top_k", "top_p",
    "repetition_penalty", "num_return_sequences", "eos_token_id", "pad_token_id", "stop_strings",
})

# fields that do not change the tokens of a decoder-only model's generate (caching, compilation, the output
# container, beam-search-only and assistant-only settings, ids of other model families)
NO_EFFECT = frozenset({
    "_from_model_config", "transformers_version", "_commit_hash", "bos_token_id", "decoder_start_token_id",
    "use_cache", "cache_implementation", "cache_config", "max_cache_len", "compile_config", "disable_compile",
    "prefill_chunk_size", "return_dict_in_generate", "renormalize_logits", "num_assistant_tokens",
    "num_assistant_tokens_schedule", "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind",
    "is_assistant", "early_stopping", "length_penalty", "low_memory", "synced_gpus",
})

# arguments of transformers' ``generate`` that are not GenerationConfig fields: allowed only at these values
GENERATE_ARGUMENTS: dict[str, tuple[Any, ...]] = {
    "logits_processor": (None,), "stopping_criteria": (None,), "prefix_allowed_tokens_fn": (None,),
    "assistant_model": (None,), "assistant_tokenizer": (None,), "negative_prompt_ids": (None,),
    "negative_prompt_attention_mask": (None,), "custom_generate": (None,), "use_model_defaults": (None,),
    "synced_gpus": (None, False),
}


@dataclass(frozen=True)
class GenerationOptions:
    """The resolved settings of one :func:`specdec.generate` call.

    ``temperature`` 0 is greedy. ``min_new_tokens`` folds in ``min_length`` (prompt columns included, as in
    transformers). ``repetition_penalty`` None: no penalty. ``stop_strings`` empty: none.
    """

    max_new_tokens: int
    min_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float | None
    num_return_sequences: int
    eos_token_id: Any
    pad_token_id: Any
    stop_strings: tuple[str, ...]


def _global_defaults() -> dict[str, Any]:
    """transformers' default of every GenerationConfig field (unset fields and these values are "at default")."""
    from transformers import GenerationConfig

    defaults = GenerationConfig().to_dict()
    builtin = getattr(GenerationConfig, "_get_default_generation_params", None)
    if builtin is not None:
        defaults.update(builtin())
    defaults.update(HF_DEFAULTS)
    return defaults


def _completed_config(generation_config: Any, verifier: torch.nn.Module) -> dict[str, Any]:
    """The fields of ``generation_config`` with unset ones taken from the verifier's generation_config, then from
    transformers' global defaults."""
    from transformers import GenerationConfig

    if not isinstance(generation_config, GenerationConfig):
        raise TypeError(f"generation_config must be a transformers.GenerationConfig or None, got "
                        f"{type(generation_config).__name__}")
    fields = dict(generation_config.to_dict())
    model_config = getattr(verifier, "generation_config", None)
    if isinstance(model_config, GenerationConfig) and model_config is not generation_config:
        for key, value in model_config.to_dict().items():
            if fields.get(key) is None and value is not None:
                fields[key] = value
    for key, value in _global_defaults().items():
        if fields.get(key) is None:
            fields[key] = value
    return fields


def _is_default(key: str, value: Any, defaults: Mapping[str, Any]) -> bool:
    default = defaults.get(key)
    if value is None or (default is None and value is False):  # (switches such as output_attentions=False)
        return True
    try:
        return bool(value == default)
    except (RuntimeError, ValueError):  # (a tensor value compares element-wise)
        return False


def unsupported_options(fields: Mapping[str, Any]) -> list[str]:
    """``name=value`` of every option in ``fields`` that is set away from its default and not implemented."""
    defaults = _global_defaults()
    problems = []
    for key, value in fields.items():
        if key in IMPLEMENTED or key in NO_EFFECT:
            continue
        allowed = GENERATE_ARGUMENTS.get(key)
        if allowed is not None:
            if not any(value is choice for choice in allowed):
                problems.append(f"{key}={_short(value)}")
        elif not _is_default(key, value, defaults):
            problems.append(f"{key}={_short(value)}")
    return problems


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    return float(value)


def resolve_options(verifier: torch.nn.Module, prompt_len: int, generation_config: Any,
                    explicit: Mapping[str, Any], hf_kwargs: Mapping[str, Any]) -> GenerationOptions:
    """Merges ``explicit`` (the named keywords of :func:`specdec.generate`, None = not given), ``hf_kwargs`` (other
    HF keywords) and ``generation_config`` into :class:`GenerationOptions`.

    Raises:
        TypeError: an unknown keyword, or a ``generation_config`` that is not a ``GenerationConfig``.
        ValueError: an HF option set away from its default that specdec does not implement (all of them named), or
            a length option out of range (``max_length`` not above the prompt's columns).
    """
    from transformers import GenerationConfig

    config_fields = set(GenerationConfig().to_dict()) | set(HF_DEFAULTS)
    unknown = sorted(key for key in hf_kwargs if key not in config_fields and key not in GENERATE_ARGUMENTS
                     and key not in NO_EFFECT)
    if unknown:
        raise TypeError(f"generate() got unexpected keyword argument(s) {', '.join(unknown)} (neither a specdec "
                        "option nor a transformers GenerationConfig field)")
    fields: dict[str, Any] = {} if generation_config is None else _completed_config(generation_config, verifier)
    fields.update(hf_kwargs)
    problems = unsupported_options(fields)
    if problems:
        raise ValueError(f"specdec.generate does not implement {', '.join(problems)}: set "
                         f"{'it' if len(problems) == 1 else 'them'} to the default or drop "
                         f"{'it' if len(problems) == 1 else 'them'} (supported HF options: "
                         f"{', '.join(sorted(IMPLEMENTED))}, generation_config, streamer, tokenizer)")
    for key, value in explicit.items():
        if value is not None:
            fields[key] = value

    def pick(key: str, fallback: Any) -> Any:
        value = fields.get(key)
        return fallback if value is None else value

    temperature = _resolve_temperature(explicit.get("temperature"), hf_kwargs.get("do_sample"),
                                       fields.get("do_sample"), fields.get("temperature"))
    max_new_tokens = explicit.get("max_new_tokens")
    if max_new_tokens is None:
        max_new_tokens = fields.get("max_new_tokens")
    if max_new_tokens is None and fields.get("max_length") is not None:
        max_length = check_int_at_least(fields["max_length"], "max_length", 1)
        if max_length <= prompt_len:
            raise ValueError(f"max_length={max_length} leaves no new token after input_ids' {prompt_len} columns "
                             "(max_length counts the prompt, as in transformers; use max_new_tokens)")
        max_new_tokens = max_length - prompt_len
    if max_new_tokens is None:
        max_new_tokens = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens = check_int_at_least(pick("min_new_tokens", 0), "min_new_tokens", 0)
    min_length = check_int_at_least(pick("min_length", 0), "min_length", 0)
    min_new_tokens = max(min_new_tokens, min_length - prompt_len)
    penalty = _number(pick("repetition_penalty", 1.0), "repetition_penalty")
    if not penalty > 0 or penalty == float("inf"):
        raise ValueError(f"repetition_penalty must be a finite float > 0 (1.0 = no penalty), got {penalty}")
    stop = fields.get("stop_strings")
    if stop is None:
        stop_strings: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stop_strings = (stop,)
    elif isinstance(stop, Sequence) and all(isinstance(s, str) for s in stop):
        stop_strings = tuple(stop)
    else:
        raise TypeError(f"stop_strings must be a str or a list of str, got {_short(stop)}")
    if any(not s for s in stop_strings):
        raise ValueError("stop_strings must not contain an empty string")
    return GenerationOptions(
        max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, temperature=temperature,
        top_k=pick("top_k", 0), top_p=pick("top_p", 1.0),
        repetition_penalty=None if penalty == 1.0 else penalty,
        num_return_sequences=check_int_at_least(pick("num_return_sequences", 1), "num_return_sequences", 1),
        eos_token_id=fields.get("eos_token_id"), pad_token_id=fields.get("pad_token_id"), stop_strings=stop_strings,
    )


def _resolve_temperature(explicit_temperature: Any, do_sample_keyword: Any, do_sample: Any,
                         configured_temperature: Any) -> Any:
    """specdec's temperature (0 = greedy) from ``temperature`` and HF's ``do_sample``.

    An explicit ``temperature`` decides (0 greedy, > 0 sampling) unless ``do_sample`` is passed as a keyword too.
    Otherwise ``do_sample`` (keyword, else the generation_config's) decides, sampling at the configured temperature
    (1.0 when unset), as in transformers; with neither, greedy.
    """
    if explicit_temperature is not None:
        do_sample, configured_temperature = do_sample_keyword, explicit_temperature
        if do_sample is None:
            return explicit_temperature
    if do_sample is None:
        return 0.0
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be True or False, got {_short(do_sample)}")
    if not do_sample:
        return 0.0
    temperature = 1.0 if configured_temperature is None else configured_temperature
    if isinstance(temperature, numbers.Real) and not isinstance(temperature, bool) and float(temperature) <= 0:
        raise ValueError(f"do_sample=True needs temperature > 0, got {temperature} (do_sample=False is greedy)")
    return temperature
