"""Checkpoints of :func:`specdec.finetune_drafter`: one safetensors file that resumes a run exactly.

The file holds the drafter's weights, the AdamW state, the step, the random states (minibatch sampler, torch, CUDA),
the evaluation history, the run's settings, the identity of the drafter the run started from (:func:`drafter_identity`)
and a SHA-256 over all of it. It is written atomically (temporary file, read back and verified, then ``os.replace``),
so a failure never leaves a half-written checkpoint in place; its permissions follow the umask like any new file.
A run resumes only with the same settings and the same drafter (:func:`check_resumable`), and Ctrl-C stops it after a
whole step (:func:`deferred_interrupt`) so that the checkpoint saved then resumes exactly.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from specdec._models import model_device
from specdec._paths import follow_umask

CHECKPOINT_NAME = "drafter_checkpoint.safetensors"
CHECKPOINT_FORMAT = "specdec-finetune-checkpoint-1"
CUDA_RNG_PREFIX = "rng.cuda."  # + the device index: one random state per CUDA device


class CheckpointError(ValueError):
    """A checkpoint file is missing pieces, truncated, corrupt or from a different run configuration."""


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def weights_digest(tensors: Mapping[str, torch.Tensor], meta_json: str = "") -> str:
    """SHA-256 over ``meta_json`` and every tensor of ``tensors`` in key order (key, dtype, shape and bytes): e.g.
    ``weights_digest(model.state_dict())`` fingerprints a model's weights."""
    h = hashlib.sha256(meta_json.encode())
    for key in sorted(tensors):
        t = tensors[key]
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def tasks_digest(corpus: list[list[list[int]]], eval_tokens: dict[str, list[list[int]]]) -> str:
    """SHA-256 of the training and evaluation token ids: a resume with other data (same names, same sizes) is
    refused."""
    h = hashlib.sha256()
    for part in (corpus, sorted(eval_tokens.items())):
        h.update(json.dumps(part, separators=(",", ":")).encode("ascii"))
    return h.hexdigest()


def save_checkpoint(path: str, drafter: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    data_generator: torch.Generator, history: list[dict[str, Any]], config: dict[str, Any],
                    since_eval: list[float] | None = None) -> None:
    """Atomically write a safetensors checkpoint: drafter weights, AdamW state, step, RNG states, history, config,
    and the objectives of the steps since the last evaluation (so a resumed run logs the same ``train_loss``).

    The file is written to a temporary file in the same folder, read back and verified (SHA-256 over every tensor and
    the metadata), and only then moved over ``path`` with ``os.replace``; a failure at any point leaves the previous
    checkpoint untouched.
    """
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, value in drafter.state_dict().items():
        tensors[f"drafter.{name}"] = value.detach().cpu().clone().contiguous()
    opt_state = optimizer.state_dict()
    scalar_state: dict[str, dict[str, Any]] = {}
    for index, state in opt_state["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{index}.{key}"] = value.detach().cpu().clone().contiguous()
            else:
                scalar_state.setdefault(str(index), {})[key] = value
    tensors["rng.data"] = data_generator.get_state().clone()
    tensors["rng.torch"] = torch.get_rng_state().clone()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"{CUDA_RNG_PREFIX}{i}"] = state.clone()
    meta = {"format": CHECKPOINT_FORMAT, "step": step, "param_groups": opt_state["param_groups"],
            "scalar_state": scalar_state, "history": history, "config": config, "since_eval": list(since_eval or [])}
    meta_json = json.dumps(meta, sort_keys=True)
    metadata = {"specdec": meta_json, "sha256": weights_digest(tensors, meta_json)}
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=folder)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        follow_umask(tmp)  # mkstemp and save_file make it 0600; a checkpoint is an ordinary file
        load_checkpoint(tmp)  # verify what actually reached the disk before it replaces anything
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_checkpoint(path: str) -> dict[str, Any]:
    """Read and verify a checkpoint written by :func:`save_checkpoint`.

    Returns ``{"tensors": {...}, "meta": {...}}``. Raises :class:`CheckpointError` (a ValueError) naming the file when
    it is missing, truncated, not a safetensors file, not a specdec checkpoint, or its checksum does not match.
    """
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except Exception as exc:  # safetensors raises its own error types for bad headers and short files
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated (cannot be read as safetensors: {exc}); "
                              "delete it or point checkpoint_dir elsewhere") from exc
    if "specdec" not in metadata or "sha256" not in metadata:
        raise CheckpointError(f"checkpoint {path} is not a specdec finetuning checkpoint (metadata missing)")
    if weights_digest(tensors, metadata["specdec"]) != metadata["sha256"]:
        raise CheckpointError(f"checkpoint {path} is corrupt: its SHA-256 checksum does not match its contents")
    meta = json.loads(metadata["specdec"])
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {meta.get('format')!r}, expected {CHECKPOINT_FORMAT!r}")
    return {"tensors": tensors, "meta": meta}


def restore_checkpoint(ckpt: dict[str, Any], drafter: torch.nn.Module, optimizer: torch.optim.Optimizer,
                       data_generator: torch.Generator, path: str) -> None:
    """Load a checkpoint read by :func:`load_checkpoint` into the drafter, the optimizer and the random states."""
    tensors, meta = ckpt["tensors"], ckpt["meta"]
    weights = {k[len("drafter."):]: v for k, v in tensors.items() if k.startswith("drafter.")}
    own = drafter.state_dict()
    if set(weights) != set(own) or any(weights[k].shape != own[k].shape for k in own):
        raise CheckpointError(f"checkpoint {path} holds weights of a different drafter architecture")
    drafter.load_state_dict(weights)
    device = model_device(drafter)
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = value
    for index, values in meta["scalar_state"].items():
        state.setdefault(int(index), {}).update(values)
    groups = meta["param_groups"]
    for group in groups:
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    for param_state in optimizer.state.values():  # load_state_dict casts to the param dtype; keep the device too
        for name, value in param_state.items():
            if isinstance(value, torch.Tensor) and name != "step":
                param_state[name] = value.to(device)
    data_generator.set_state(tensors["rng.data"])
    torch.set_rng_state(tensors["rng.torch"])
    cuda_states = cuda_rng_states(tensors)
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states[: torch.cuda.device_count()])


def cuda_rng_states(tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The CUDA random states of a checkpoint's tensors, in device order (``rng.cuda.<device index>``, ordered by the
    index as a number: device 10 comes after device 2)."""
    keys = [key for key in tensors if key.startswith(CUDA_RNG_PREFIX)]
    return [tensors[key] for key in sorted(keys, key=lambda key: int(key[len(CUDA_RNG_PREFIX):]))]


_VOLATILE_CONFIG_KEYS = ("transformers_version", "dtype", "torch_dtype", "name_or_path", "architectures")
"""Config entries that say where, how or by what class a model was loaded or saved, not what it computes (the
weights digest covers dtypes; ``save_pretrained`` fills in ``architectures``)."""


def drafter_identity(drafter: torch.nn.Module) -> dict[str, str]:
    """``{"drafter_config": ..., "drafter_weights": ...}``: SHA-256 digests of the drafter's config (as JSON, less
    private and :data:`_VOLATILE_CONFIG_KEYS` entries) and of its weights (:func:`weights_digest` of its state dict)."""
    config = getattr(drafter, "config", None)
    entries = config.to_dict() if hasattr(config, "to_dict") else {}
    entries = {k: v for k, v in entries.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}
    config_json = json.dumps(entries, sort_keys=True, default=str)
    return {"drafter_config": hashlib.sha256(config_json.encode()).hexdigest(),
            "drafter_weights": weights_digest(drafter.state_dict())}


_UNRECORDED = object()
_SETTING_DEFAULTS: dict[str, Any] = {"per_character": False, "chars_per_token": None, "vocab_size": _UNRECORDED,
                                     "autocast": _UNRECORDED, "mixture_weight": 0.0}
"""What checkpoints written before a setting was recorded ran with (``_UNRECORDED``: unknown, not compared)."""


def check_resumable(ckpt: dict[str, Any], settings: Mapping[str, Any], identity: Mapping[str, str],
                    path: str) -> dict[str, str]:
    """The drafter identity the resumed run keeps, after checking that checkpoint ``ckpt`` (read by
    :func:`load_checkpoint` from ``path``) was written by a run with these ``settings`` and this drafter.

    ``identity`` is :func:`drafter_identity` of the drafter given now. Its config must be the one the run started
    with, and its weights either those it started from or those of the checkpoint (a drafter kept in memory after an
    interrupted run). Raises :class:`CheckpointError` naming the settings that differ, or saying that the drafter is
    another one. A checkpoint written before a setting or the identity was recorded is not checked for it.
    """
    saved = ckpt["meta"]["config"]
    different = sorted(key for key in settings
                       if saved.get(key, _SETTING_DEFAULTS.get(key)) not in (_UNRECORDED, settings[key]))
    if different:
        raise CheckpointError(f"checkpoint {path} was written by a run with different settings "
                              f"({', '.join(different)}); use another checkpoint_dir or resume=False")
    if "drafter_config" not in saved:
        return dict(identity)
    started = {"drafter_config": saved["drafter_config"], "drafter_weights": saved["drafter_weights"]}
    reached = weights_digest({k[len("drafter."):]: v for k, v in ckpt["tensors"].items() if k.startswith("drafter.")})
    if identity["drafter_config"] != started["drafter_config"] or \
            identity["drafter_weights"] not in (started["drafter_weights"], reached):
        what = "config" if identity["drafter_config"] != started["drafter_config"] else "weights"
        raise CheckpointError(f"checkpoint {path} was written while finetuning another drafter (its {what} differ "
                              "from the drafter given now, which is neither the drafter that run started from nor "
                              "the one it reached): resuming would train and save that run's weights in place of "
                              "this drafter. Use another checkpoint_dir, or resume=False to start afresh")
    return started


@dataclass
class InterruptRequest:
    """Set by the first Ctrl-C inside :func:`deferred_interrupt`."""

    requested: bool = False


@contextlib.contextmanager
def deferred_interrupt(enabled: bool = True) -> Iterator[InterruptRequest]:
    """Inside the block, a first Ctrl-C (SIGINT) only sets ``requested`` (the loop finishes its step, saves and
    stops); a second one raises KeyboardInterrupt at once. The previous handler is restored on the way out. Off
    (``requested`` stays False, Ctrl-C raises as usual) when not ``enabled`` or outside the main thread, where
    signal handlers cannot be set."""
    request = InterruptRequest()
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = signal.getsignal(signal.SIGINT)

    def handle(signum: int, frame: Any) -> None:
        request.requested = True
        signal.signal(signal.SIGINT, previous)
        print("\ninterrupt: finishing this step, then saving a checkpoint (Ctrl-C again to stop at once)",
              file=sys.stderr, flush=True)

    signal.signal(signal.SIGINT, handle)
    try:
        yield request
    finally:
        signal.signal(signal.SIGINT, previous)
