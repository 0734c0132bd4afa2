"""Argument checks shared by the public API. Every error names the argument and what was expected."""

from __future__ import annotations

import torch

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
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {value.dtype}")
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


def check_no_nan(tensor: torch.Tensor, name: str) -> None:
    if torch.isnan(tensor).any():
        raise ValueError(f"{name} contains NaN; refusing to turn NaN logits into tokens or metrics")


def check_temperature(temperature: float, name: str = "temperature", allow_zero: bool = True) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(temperature).__name__}")
    temperature = float(temperature)
    if not temperature == temperature or temperature in (float("inf"),) or temperature < 0 or (
            not allow_zero and temperature == 0):
        raise ValueError(f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, got {temperature}")
    return temperature


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


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
