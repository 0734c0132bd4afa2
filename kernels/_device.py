"""Cached facts about the device a kernel launches on (the CUDA property queries cost microseconds per call)."""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch

CPU_PROGRAMS = 4  # "multiprocessors" off CUDA (the interpreter): a few programs, so grid-stride loops are exercised
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter runs the kernels (no PTX)
# NOTE: programmatic dependent launch between the decode step's kernels (sm_90+) measured slower on every step
# (H200, llama-1b batch 1: 1.33 against 1.11 ms for one token, 4.06 against 2.13 ms for five): off by default.
DECODE_PDL = False


@functools.cache
def _cuda_properties(index: int):
    """``torch.cuda.get_device_properties`` of device ``index``, read once per process."""
    return torch.cuda.get_device_properties(index)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; ``CPU_PROGRAMS`` elsewhere."""
    return _cuda_properties(_index(device)).multi_processor_count if device.type == "cuda" else CPU_PROGRAMS


def device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` of a CUDA device; ``""`` elsewhere."""
    return _cuda_properties(_index(device)).name if device.type == "cuda" else ""


def major_capability(device: torch.device) -> int:
    """Major compute capability of a CUDA device (9 on Hopper); 0 elsewhere."""
    return _cuda_properties(_index(device)).major if device.type == "cuda" else 0


def shared_memory_per_block(device: torch.device) -> int:
    """Bytes of shared memory one program may use on a CUDA device (the opt-in maximum; 227 KiB on Hopper); the
    48 KiB every CUDA device has where the property is unknown or off CUDA."""
    if device.type != "cuda":
        return 48 * 1024
    return int(getattr(_cuda_properties(_index(device)), "shared_memory_per_block_optin", 48 * 1024))


def launching_on(device: torch.device) -> contextlib.AbstractContextManager:
    """Make a CUDA ``device`` current for a launch (Triton launches on the current device); a no-op elsewhere."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@dataclass(frozen=True)
class DeviceFacts:
    """What the launch rules read about a device.

    Attributes:
        sm_count: multiprocessors (``CPU_PROGRAMS`` off CUDA).
        major: major compute capability (9 on Hopper; 0 off CUDA).
        name: ``torch.cuda.get_device_name`` (``""`` off CUDA).
        interpreter: the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``): no inline PTX.
    """

    sm_count: int
    major: int
    name: str
    interpreter: bool


def device_facts(device: torch.device | DeviceFacts) -> DeviceFacts:
    """The :class:`DeviceFacts` of ``device`` (a ``DeviceFacts`` is returned as it is)."""
    if isinstance(device, DeviceFacts):
        return device
    return DeviceFacts(sm_count(device), major_capability(device), device_name(device), INTERPRETER)
