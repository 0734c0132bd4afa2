"""Argument checks shared by the public API. Every error names the argument and what was expected."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from specdec.kernels.rejection_sampling_reference import VERIFICATIONS

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
BACKENDS = ("auto", "triton", "torch")


def check_tensor(value: object, name: str, ndim: int | None = None, float_dtype: bool = False,
                 integer_dtype: bool = False, shape_doc: str = "") -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{' of shape ' + shape_doc if shape_doc else ''}, "
                        f"got {type(value).__name__}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions{' (' + shape_doc + ')' if shape_doc else ''}, "
                         f"got shape {tuple(value.shape)}")
    if float_dtype and value.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16, bfloat16 or float64, got {value.dtype}")
    if integer_dtype and (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor (int64), got {value.dtype}")
    return value


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    first_name, first = next(iter(devices.items()))
    for name, device in devices.items():
        if device != first:
            raise ValueError(f"{name} is on {device} but {first_name} is on {first}: all tensors must share a device")
    return first


def check_logit_rows(logits: torch.Tensor, name: str, used_rows: torch.Tensor | None = None) -> None:
    """ValueError if a row of ``logits`` ([..., V]) that is used (``used_rows`` [...] bool; default every row) holds
    NaN or +inf, or has no finite entry (all ``-inf``: no distribution). Rows that are not used are not read by the
    kernels either. One max-reduction over V and one device sync."""
    if logits.numel() == 0:
        return
    row_max = logits.amax(dim=-1)  # NaN propagates; +inf if any +inf; -inf only for an all -inf row
    if used_rows is not None:
        row_max = torch.where(used_rows, row_max, torch.zeros((), dtype=row_max.dtype, device=row_max.device))
    has_nan, has_inf, has_empty = torch.stack([torch.isnan(row_max).any(), (row_max == float("inf")).any(),
                                               (row_max == float("-inf")).any()]).tolist()
    if has_nan:
        raise ValueError(f"{name} contains NaN; refusing to turn NaN logits into tokens or metrics")
    if has_inf:
        raise ValueError(f"{name} contains +inf; logits must be finite or -inf (masked out)")
    if has_empty:
        raise ValueError(f"{name} has a row with every entry -inf where a distribution is needed")


def as_int(value: object) -> int | None:
    """``value`` as a Python int if it is an integer (Python, numpy, a one-element integer tensor; not a bool), else
    None."""
    if isinstance(value, torch.Tensor):
        is_integer = not (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool)
        return int(value) if value.numel() == 1 and is_integer else None
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else None


def eos_id_list(eos_token_id: int | Sequence[int] | torch.Tensor | None, vocab: int) -> list[int]:
    """``eos_token_id`` (None, an int, a list of ints or an integer tensor, e.g. from a generation config) as a list of
    Python ints in ``[0, vocab)``; TypeError for another type, ValueError for an id outside the range."""
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, torch.Tensor):
        eos_token_id = eos_token_id.reshape(-1).tolist()
    single = as_int(eos_token_id)
    if single is not None:
        raw = [eos_token_id]
    elif isinstance(eos_token_id, Sequence) and not isinstance(eos_token_id, (str, bytes)):
        raw = list(eos_token_id)
    else:
        raise TypeError(f"eos_token_id must be an int or a list of ints, got {type(eos_token_id).__name__}")
    ids = [as_int(token) for token in raw]
    if any(token is None or not 0 <= token < vocab for token in ids):
        raise ValueError(f"eos_token_id must be an int or list of ints in [0, {vocab}), got {eos_token_id!r}")
    return ids


_BOUNDS = {2**64: "2**64"}  # upper bounds written as powers in messages


def check_int_range(value: object, name: str, low: int, high: int | None, *, allow_none: bool = False,
                    note: str = "") -> int | None:
    """``value`` as a Python int if it is an integer (Python, numpy, a one-element integer tensor; not a bool) in
    ``[low, high)`` (``high=None``: no upper bound), else ValueError naming ``name`` and the range."""
    if value is None and allow_none:
        return None
    number = as_int(value)
    if number is None or number < low or (high is not None and number >= high):
        expected = (f"an integer >= {low}" if high is None
                    else f"an int in [{low}, {_BOUNDS.get(high, str(high))})")
        raise ValueError(f"{name} must be {'None or ' if allow_none else ''}{expected}{note}, got {value!r}")
    return number


def check_int_at_least(value: object, name: str, minimum: int, *, allow_none: bool = False) -> int | None:
    """``value`` as a Python int if it is an integer >= ``minimum`` (see :func:`check_int_range`; or None when
    allowed), else ValueError naming ``name``."""
    return check_int_range(value, name, minimum, None, allow_none=allow_none)


def check_number(value: object, name: str, minimum: float, *, strict: bool = False) -> float:
    """``value`` as a float if it is a finite number >= ``minimum`` (> with ``strict``); TypeError for a non-number,
    ValueError otherwise, both naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < minimum or (strict and value == minimum):
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {minimum}, got {value}")
    return value


MIN_TEMPERATURE = 1e-6  # below this 1 / T times a logit can overflow float32; use 0 (greedy) instead


def check_temperature(temperature: float, name: str = "temperature", allow_zero: bool = True) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(temperature).__name__}")
    temperature = float(temperature)
    if not temperature == temperature or temperature in (float("inf"),) or temperature < 0 or (
            not allow_zero and temperature == 0):
        raise ValueError(f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, got {temperature}")
    if 0 < temperature < MIN_TEMPERATURE:
        allowed = f"0 (greedy) or >= {MIN_TEMPERATURE:g}" if allow_zero else f">= {MIN_TEMPERATURE:g}"
        raise ValueError(f"{name} must be {allowed} (1 / T scales the logits in float32), got {temperature:g}")
    return temperature


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def check_verification(verification: str) -> str:
    if verification not in VERIFICATIONS:
        raise ValueError(f"verification must be one of {VERIFICATIONS}, got {verification!r}")
    return verification


def use_triton(backend: str, device: torch.device) -> bool:
    """`auto` picks Triton on CUDA tensors and the torch reference elsewhere."""
    import os

    check_backend(backend)
    if backend == "torch":
        return False
    if backend == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 to run the kernels on the CPU "
                f"(tensors are on {device})"
            )
        return True
    return device.type == "cuda"


def folder_problem(path: Path) -> str | None:
    """Why ``path`` cannot become a folder we write into (it is a file, or no writable folder holds it), else None."""
    if path.exists() and not path.is_dir():
        return f"{path} exists and is not a folder"
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        return f"cannot create or write {path} ({parent} is not a writable folder)"
    return None
