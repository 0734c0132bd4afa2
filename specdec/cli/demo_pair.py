"""The demo's built-in verifier/drafter pair: its configuration, training, and the cache that keeps it.

A small Llama-family *verifier* is trained on every task of the built-in suite (:mod:`specdec.data`) in equal
measure, and a smaller *drafter* on a skewed mixture in which ``reverse`` and ``grammar_cyrillic`` are rare, so the
drafter is under-fit exactly there. Both are saved (``save_pretrained`` plus the tokenizer) under the user's cache
folder, keyed by a hash of the training configuration and of the generated data, so a second run starts at once.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec import data
from specdec._paths import PACKAGE_DIR, follow_umask, source_checkout
from specdec._validation import folder_problem
from specdec.fairness.teacher_forcing import pad_batch

CACHE_FORMAT = "specdec-demo-pair-2"
PAIR_META_NAME = "pair.json"
PAIR_META_KEYS = ("format", "cache_key", "config", "verifier_parameters", "drafter_parameters",
                  "verifier_final_loss", "drafter_final_loss", "training_seconds")


class DemoError(ValueError):
    """A user-facing problem with the demo's arguments (e.g. an output folder inside the source tree)."""


@dataclass(frozen=True)
class ModelShape:
    """Size of one Llama-family model built from ``transformers.LlamaConfig``."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int


@dataclass(frozen=True)
class TrainingSpec:
    """How one model of the pair is trained: task mixture, optimizer steps, batch size and peak learning rate."""

    mixture: tuple[tuple[str, float], ...]
    steps: int
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 30


@dataclass(frozen=True)
class PairConfig:
    """Everything that determines the trained pair; its hash keys the cache."""

    verifier: ModelShape
    drafter: ModelShape
    verifier_training: TrainingSpec
    drafter_training: TrainingSpec
    max_length: int = 128
    seed: int = 0

    def cache_key(self) -> str:
        """A short, stable hash of the configuration (and the cache format and vocabulary)."""
        # A fingerprint of the generated data too, so a change to the task generators retrains the pair.
        data_fingerprint = [ex.text for ex in data.sample_mixture(data.UNIFORM_MIXTURE, 60, seed=self.seed)]
        payload = json.dumps({"format": CACHE_FORMAT, "alphabet": data.ALPHABET, "config": asdict(self),
                              "data": data_fingerprint}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]



def _mixture(weights: Mapping[str, float]) -> tuple[tuple[str, float], ...]:
    return tuple(sorted(weights.items()))


def default_pair_config(seed: int = 0, quick: bool = False) -> PairConfig:
    """The demo pair: a 3-layer verifier trained on every task equally, a 2-layer drafter on a skewed mixture.

    ``quick`` gives tiny models and a few steps, for tests only: their numbers mean nothing.
    """
    if quick:
        return PairConfig(
            verifier=ModelShape(32, 1, 2, 64),
            drafter=ModelShape(16, 1, 2, 32),
            verifier_training=TrainingSpec(_mixture(data.UNIFORM_MIXTURE), steps=4, batch_size=8),
            drafter_training=TrainingSpec(_mixture(data.SKEWED_MIXTURE), steps=4, batch_size=8),
            seed=seed,
        )
    return PairConfig(
        verifier=ModelShape(96, 3, 4, 256),
        drafter=ModelShape(64, 2, 4, 192),
        verifier_training=TrainingSpec(_mixture(data.UNIFORM_MIXTURE), steps=500),
        drafter_training=TrainingSpec(_mixture(data.SKEWED_MIXTURE), steps=400),
        seed=seed,
    )



def default_cache_dir() -> Path:
    """``$SPECDEC_CACHE``, else ``$XDG_CACHE_HOME/specdec``, else ``~/.cache/specdec``."""
    if os.environ.get("SPECDEC_CACHE"):
        return Path(os.environ["SPECDEC_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "specdec"
    return Path.home() / ".cache" / "specdec"


def protected_dirs() -> list[Path]:
    """Folders the demo never writes into: the installed package and, for a source checkout, the checkout."""
    checkout = source_checkout()
    return [PACKAGE_DIR] if checkout is None else [PACKAGE_DIR, checkout]


def check_writable_folder(path: Path, option: str) -> None:
    """DemoError naming ``option`` when ``path`` cannot become a folder we write into (checked before any work)."""
    problem = folder_problem(path)
    if problem:
        raise DemoError(f"{option} {problem}")


def check_cache_dir(cache_dir: Path) -> Path:
    """``cache_dir`` resolved, or DemoError when it is inside the source tree or the package, or not writable."""
    cache_dir = cache_dir.expanduser().resolve()
    for folder in protected_dirs():
        if cache_dir.is_relative_to(folder):
            raise DemoError(f"refusing to cache the demo models inside the specdec source tree or package "
                            f"({cache_dir} is inside {folder}); set --cache-dir or $SPECDEC_CACHE elsewhere")
    check_writable_folder(cache_dir, "--cache-dir")  # before minutes of training, not when the pair is saved
    return cache_dir


def build_model(shape: ModelShape, tokenizer: Any, max_length: int, seed: int) -> torch.nn.Module:
    """A randomly initialised ``LlamaForCausalLM`` of ``shape`` over the tokenizer's vocabulary (seeded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=max_length,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)



def _training_batches(tokenizer: Any, spec: TrainingSpec, max_length: int,
                      seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Yield ``(input_ids, attention_mask, labels)`` batches of ``<bos> text <eos>``, right-padded, fresh examples."""
    examples = data.sample_mixture(dict(spec.mixture), spec.steps * spec.batch_size, seed=seed, split="train")
    encoded = tokenizer([ex.text for ex in examples], add_special_tokens=True)["input_ids"]
    for step in range(spec.steps):
        rows = [ids[: max_length - 1] + [tokenizer.eos_token_id]
                for ids in encoded[step * spec.batch_size:(step + 1) * spec.batch_size]]
        input_ids, attention_mask = pad_batch(rows, tokenizer.pad_token_id, "right")
        yield input_ids, attention_mask, input_ids.masked_fill(attention_mask == 0, -100)


def train_language_model(model: torch.nn.Module, tokenizer: Any, spec: TrainingSpec, *, max_length: int, seed: int,
                         description: str, progress: bool = True) -> list[float]:
    """Next-token training with AdamW, linear warm-up then cosine decay, gradient clipping; returns the losses."""
    from tqdm.auto import tqdm

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.98), weight_decay=0.01)

    def schedule(step: int) -> float:
        warmup = min(1.0, (step + 1) / max(spec.warmup_steps, 1))
        return warmup * 0.5 * (1.0 + math.cos(math.pi * step / max(spec.steps, 1)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    losses: list[float] = []
    bar = tqdm(_training_batches(tokenizer, spec, max_length, seed), total=spec.steps, desc=description,
               disable=not progress, leave=True)
    for input_ids, attention_mask, labels in bar:
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses


@dataclass
class DemoPair:
    """The loaded pair: models in eval mode, the shared tokenizer, where they live, and whether the cache was hit."""

    verifier: torch.nn.Module
    drafter: torch.nn.Module
    tokenizer: Any
    path: Path
    cache_hit: bool
    info: dict[str, Any] = field(default_factory=dict)


def load_pair(path: str | os.PathLike) -> DemoPair:
    """Load a cached pair folder (``verifier/``, ``drafter/``, each with the tokenizer, and ``pair.json``) offline."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    meta = json.loads((path / PAIR_META_NAME).read_text(encoding="utf-8"))
    missing = [key for key in PAIR_META_KEYS if key not in meta] if isinstance(meta, dict) else list(PAIR_META_KEYS)
    if missing:
        raise ValueError(f"{path / PAIR_META_NAME} lacks {missing}: not a complete demo pair")
    tokenizer = AutoTokenizer.from_pretrained(path / "verifier", local_files_only=True)
    verifier = AutoModelForCausalLM.from_pretrained(path / "verifier", local_files_only=True).eval()
    drafter = AutoModelForCausalLM.from_pretrained(path / "drafter", local_files_only=True).eval()
    return DemoPair(verifier, drafter, tokenizer, path, cache_hit=True, info=meta)


def get_demo_pair(cache_dir: str | os.PathLike | None = None, *, config: PairConfig | None = None,
                  retrain: bool = False, progress: bool = True) -> DemoPair:
    """The demo pair from the cache, training and caching it first when it is missing (or ``retrain``).

    The pair is written to a temporary folder and renamed into place once complete, so an interrupted run never
    leaves a half-written pair that a later run would trust; ``pair.json`` marks a complete entry.
    """
    config = config or default_pair_config()
    cache_root = check_cache_dir(Path(cache_dir) if cache_dir is not None else default_cache_dir())
    pair_dir = cache_root / f"demo-pair-{config.cache_key()}"
    if (pair_dir / PAIR_META_NAME).is_file() and not retrain:
        try:
            return load_pair(pair_dir)
        except Exception as error:  # noqa: BLE001 - any failure to read our own cache: rebuild, never trust it
            print(f"specdec demo: cached pair at {pair_dir} is unreadable ({error}); retraining", file=sys.stderr)

    tokenizer = data.build_char_tokenizer()
    started = time.perf_counter()
    verifier = build_model(config.verifier, tokenizer, config.max_length, config.seed)
    verifier_losses = train_language_model(verifier, tokenizer, config.verifier_training, max_length=config.max_length,
                                           seed=config.seed, description="training verifier", progress=progress)
    drafter = build_model(config.drafter, tokenizer, config.max_length, config.seed + 1)
    drafter_losses = train_language_model(drafter, tokenizer, config.drafter_training, max_length=config.max_length,
                                          seed=config.seed + 1, description="training drafter", progress=progress)
    info = {
        "format": CACHE_FORMAT,
        "cache_key": config.cache_key(),
        "config": asdict(config),
        "verifier_parameters": sum(p.numel() for p in verifier.parameters()),
        "drafter_parameters": sum(p.numel() for p in drafter.parameters()),
        "verifier_final_loss": sum(verifier_losses[-20:]) / len(verifier_losses[-20:]),
        "drafter_final_loss": sum(drafter_losses[-20:]) / len(drafter_losses[-20:]),
        "training_seconds": time.perf_counter() - started,
    }
    cache_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{pair_dir.name}-", dir=cache_root))
    try:
        for name, model in (("verifier", verifier), ("drafter", drafter)):
            model.save_pretrained(staging / name)
            tokenizer.save_pretrained(staging / name)  # each folder works alone with `specdec generate` and HF
        (staging / PAIR_META_NAME).write_text(json.dumps(info, indent=2), encoding="utf-8")
        follow_umask(staging)  # mkdtemp and safetensors make 0700 / 0600; the cached pair is ordinary files
        if pair_dir.exists():
            shutil.rmtree(pair_dir)
        os.replace(staging, pair_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return DemoPair(verifier.eval(), drafter.eval(), tokenizer, pair_dir, cache_hit=False, info=info)


@dataclass(frozen=True)
class DemoSettings:
    """Evaluation and finetuning settings of one demo run (not part of the cache key)."""

    num_eval_examples: int = 24
    num_finetune_examples: int = 256
    num_draft_tokens: int = 4
    temperature: float = 1.0
    max_new_tokens: int = 32
    batch_size: int = 8
    finetune_steps: int = 150
    finetune_batch_size_per_task: int = 8
    finetune_lr: float = 2e-3
    finetune_seq_len: int = 64
    num_samples_per_task: int = 4
    wall_clock: bool = True
    wall_clock_repeats: int = 2


def default_settings(quick: bool = False) -> DemoSettings:
    """Evaluation/finetuning settings; ``quick`` shrinks everything for tests."""
    if quick:
        return DemoSettings(num_eval_examples=4, num_finetune_examples=16, max_new_tokens=8, batch_size=4,
                            finetune_steps=2, finetune_batch_size_per_task=2, finetune_seq_len=32,
                            num_samples_per_task=1, wall_clock_repeats=1)
    return DemoSettings()
