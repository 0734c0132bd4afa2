"""The model family: build a Llama or Qwen2 causal LM from a :class:`ModelSpec`, train it on a language mix, and save
and load it as bf16 safetensors files small enough to travel (shards of at most ``max_file_mb``, the model's config
in every file's metadata, so a folder of them is all that is needed to rebuild it).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

MODEL_FORMAT = "specdec-multilingual-model-1"


def build_model(spec: Any, vocab_size: int, max_positions: int, seed: int, *, pad_token_id: int = 0,
                bos_token_id: int | None = 1, eos_token_id: int = 2) -> torch.nn.Module:
    """A freshly initialised causal LM (tied input and output embeddings, sdpa attention) in float32; its config
    names the tokenizer's special ids (default the pipeline's own BPE's)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                  num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                  num_key_value_heads=spec.num_kv_heads, max_position_embeddings=max_positions,
                  tie_word_embeddings=True, pad_token_id=pad_token_id, bos_token_id=bos_token_id,
                  eos_token_id=eos_token_id,
                  attn_implementation="sdpa")
    if spec.arch == "llama":
        config = LlamaConfig(**common)
    elif spec.arch == "qwen2":
        config = Qwen2Config(use_sliding_window=False, **common)
    else:
        raise ValueError(f"arch must be 'llama' or 'qwen2', got {spec.arch!r}")
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).float().eval()


def _model_files(folder: Path, name: str) -> list[Path]:
    single = folder / f"{name}.safetensors"
    shards = sorted(folder.glob(f"{name}-[0-9][0-9]-of-[0-9][0-9].safetensors"))
    return ([single] if single.is_file() else []) + shards


def save_model(model: torch.nn.Module, folder: str | Path, name: str, *, max_file_mb: float = 15.0,
               dtype: torch.dtype = torch.bfloat16) -> list[Path]:
    """Write ``model``'s weights in ``dtype`` as ``<name>.safetensors`` or ``<name>-NN-of-MM.safetensors`` shards of
    at most ``max_file_mb`` MB each (tied weights stored once), its config in every file's metadata. Returns the
    files."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    limit = int(max_file_mb * 1e6) - 64_000  # room for the header
    state, seen = {}, {}
    for key, value in model.state_dict().items():
        ptr = value.data_ptr()
        if ptr in seen:  # a tied weight: rebuilt by tie_weights on load
            continue
        seen[ptr] = key
        state[key] = value.detach().to("cpu", dtype).contiguous().clone()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > limit:
            raise ValueError(f"tensor {key} of {name} has {nbytes / 1e6:.1f} MB, more than max_file_mb="
                             f"{max_file_mb}: use a smaller model or a larger max_file_mb")
        if size + nbytes > limit and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    for old in _model_files(folder, name):
        old.unlink()
    meta = {"format": MODEL_FORMAT, "name": name, "model_type": model.config.model_type,
            "config": model.config.to_json_string(use_diff=False)}
    paths = []
    for index, shard in enumerate(shards, start=1):
        path = folder / (f"{name}.safetensors" if len(shards) == 1 else
                         f"{name}-{index:02d}-of-{len(shards):02d}.safetensors")
        save_file(shard, str(path), metadata={**meta, "shard": f"{index}/{len(shards)}"})
        paths.append(path)
    return paths


def load_model(folder: str | Path, name: str, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> torch.nn.Module:
    """The model :func:`save_model` wrote, in ``dtype`` on ``device``, in eval mode."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    files = _model_files(folder, name)
    if not files:
        raise FileNotFoundError(f"no model {name!r} in {folder} (expected {name}.safetensors or "
                                f"{name}-NN-of-MM.safetensors): run the train stage first")
    state: dict[str, torch.Tensor] = {}
    meta: dict[str, str] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
            if meta.get("format") != MODEL_FORMAT:
                raise ValueError(f"{path} is not a model written by save_model (format {meta.get('format')!r})")
            state.update({key: handle.get_tensor(key) for key in handle.keys()})  # noqa: SIM118
    expected = int(meta["shard"].split("/")[1])
    if len(files) != expected:
        raise ValueError(f"model {name!r} in {folder} has {len(files)} of its {expected} files")
    config_dict = json.loads(meta["config"])
    config_dict.pop("model_type", None)
    config = AutoConfig.for_model(meta["model_type"], **config_dict)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"model {name!r} in {folder}: missing {sorted(set(missing) - tied)}, unexpected "
                         f"{sorted(unexpected)}")
    model.tie_weights()
    return model.to(device=device, dtype=dtype).eval()


class TokenStreams:
    """Every language's training texts as one token stream (``<bos> text <eos>`` after another), to cut training
    windows from at random."""

    def __init__(self, encoded: dict[str, list[list[int]]], seq_len: int):
        self.languages = list(encoded)
        self.seq_len = seq_len
        self.streams = {}
        for lang, docs in encoded.items():
            flat = np.fromiter((t for doc in docs for t in doc), dtype=np.int64)
            if flat.size == 0:
                raise ValueError(f"language {lang!r} has no training tokens")
            while flat.size < seq_len + 2:  # a language with fewer tokens than a window: repeat its text
                flat = np.concatenate([flat, flat])
            self.streams[lang] = flat

    def sample(self, rng: np.random.Generator, weights: dict[str, float], batch_size: int) -> torch.Tensor:
        """[batch_size, seq_len + 1] windows, each from a language drawn by ``weights``."""
        probs = np.array([weights.get(lang, 0.0) for lang in self.languages], dtype=np.float64)
        picks = rng.choice(len(self.languages), size=batch_size, p=probs / probs.sum())
        rows = []
        for index in picks:
            stream = self.streams[self.languages[index]]
            start = int(rng.integers(0, stream.size - self.seq_len))
            rows.append(stream[start:start + self.seq_len + 1])
        return torch.from_numpy(np.stack(rows))

    def fixed_windows(self, lang: str, count: int) -> torch.Tensor:
        """Up to ``count`` evenly spaced windows of one language (the same every call)."""
        stream = self.streams[lang]
        last = stream.size - self.seq_len - 1
        starts = sorted({int(round(i * last / max(count - 1, 1))) for i in range(count)})
        return torch.from_numpy(np.stack([stream[s:s + self.seq_len + 1] for s in starts]))


def _lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, streams: TokenStreams, count: int, batch_size: int,
                 autocast: bool) -> dict[str, float]:
    """Mean next-token loss (nats) of ``model`` on ``count`` fixed held-out windows of every language."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out = {}
    for lang in streams.languages:
        windows = streams.fixed_windows(lang, count)
        total = 0.0
        for start in range(0, len(windows), batch_size):
            batch = windows[start:start + batch_size].to(device)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
                total += float(_lm_loss(model, batch)) * len(batch)
        out[lang] = total / len(windows)
    model.train(was_training)
    return out


def train_language_model(model: torch.nn.Module, streams: TokenStreams, weights: dict[str, float], *, steps: int,
                         batch_size: int, lr: float, warmup_steps: int, weight_decay: float, seed: int,
                         heldout: TokenStreams | None = None, heldout_windows: int = 32, progress: bool = True,
                         name: str = "model", max_seconds: float | None = None) -> dict[str, Any]:
    """Next-token training on windows drawn by ``weights`` (AdamW, linear warm-up then cosine decay to a tenth, grad
    clipping at 1, bf16 autocast on CUDA). With ``max_seconds``, training stops after the step that passes that
    time (the log's ``steps_run`` says where). Returns the training log: losses, held-out loss per language before
    and after, steps run, seconds, tokens."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    autocast = device.type == "cuda"
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95),
                                  **({"fused": True} if device.type == "cuda" else {}))
    warmup = min(warmup_steps, max(steps // 10, 1))

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        progress_ = (step - warmup) / max(steps - warmup, 1)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress_)))

    log: dict[str, Any] = {"name": name, "steps": steps, "batch_size": batch_size, "seq_len": streams.seq_len,
                           "weights": weights, "losses": []}
    if heldout is not None:
        log["heldout_loss_before"] = heldout_loss(model, heldout, heldout_windows, batch_size, autocast)
    model.train()
    start = time.perf_counter()
    running = []
    bar = tqdm(range(steps), desc=f"train[{name}]", disable=not progress)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        batch = streams.sample(rng, weights, batch_size).to(device, non_blocking=True)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = _lm_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        running.append(loss.detach())
        out_of_time = max_seconds is not None and time.perf_counter() - start > max_seconds
        if len(running) == 50 or step == steps - 1 or out_of_time:
            mean = float(torch.stack(running).float().mean())
            log["losses"].append([step + 1, mean])
            bar.set_postfix(loss=f"{mean:.3f}")
            running = []
        log["steps_run"] = step + 1
        if out_of_time:
            break
    bar.close()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    log["seconds"] = time.perf_counter() - start
    log["tokens"] = log.get("steps_run", 0) * batch_size * streams.seq_len
    model.eval()
    if heldout is not None:
        log["heldout_loss"] = heldout_loss(model, heldout, heldout_windows, batch_size, autocast)
    return log
