"""The offline demo: a built-in verifier/drafter pair, its per-task disparity, and s-CDF closing the gap.

:func:`run_demo` (``specdec demo`` on the command line) does, on the CPU and without downloading anything:

1. trains a small Llama-family *verifier* on every task of the built-in suite (:mod:`specdec.data`) in equal
   measure, and a smaller *drafter* on a skewed mixture in which ``reverse`` and ``grammar_cyrillic`` are rare, so the
   drafter is under-fit exactly there; both are cached (``save_pretrained`` plus the tokenizer) under the user's cache
   directory, keyed by a hash of the training configuration, so a second run starts at once;
2. runs :func:`specdec.generate` on a few prompts of every task and :func:`specdec.fairness.evaluate` on held-out
   prompts and texts, and prints the fairness table (acceptance, speed-up, cross-entropy per task; U);
3. finetunes a copy of the drafter with s-CDF (:func:`specdec.finetune.finetune_drafter`, verifier frozen), prints
   the table after it and, optionally, the baselines (uniform distillation, data balancing, exact-variance weights);
4. writes ``report.md``, ``report.json`` and PNG plots to the output folder the user chose (never into the source
   tree or the installed package).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec import data
from specdec._validation import folder_problem

CACHE_FORMAT = "specdec-demo-pair-v2"
DEFAULT_OUTPUT_DIR = "specdec-demo-report"
PAIR_META_NAME = "pair.json"
PAIR_META_KEYS = ("format", "cache_key", "config", "verifier_parameters", "drafter_parameters",
                  "verifier_final_loss", "drafter_final_loss", "training_seconds")


class DemoError(ValueError):
    """A user-facing problem with the demo's arguments (e.g. an output folder inside the source tree)."""


# ----------------------------------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------------------------------


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


def default_settings(quick: bool = False) -> DemoSettings:
    """Evaluation/finetuning settings; ``quick`` shrinks everything for tests."""
    if quick:
        return DemoSettings(num_eval_examples=4, num_finetune_examples=16, max_new_tokens=8, batch_size=4,
                            finetune_steps=2, finetune_batch_size_per_task=2, finetune_seq_len=32,
                            num_samples_per_task=1)
    return DemoSettings()


# ----------------------------------------------------------------------------------------------------------------------
# Paths: the cache and the output folder
# ----------------------------------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$SPECDEC_CACHE``, else ``$XDG_CACHE_HOME/specdec``, else ``~/.cache/specdec``."""
    if os.environ.get("SPECDEC_CACHE"):
        return Path(os.environ["SPECDEC_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "specdec"
    return Path.home() / ".cache" / "specdec"


def protected_dirs() -> list[Path]:
    """Folders the demo never writes into: the installed package and, for a source checkout, the checkout."""
    package_dir = Path(__file__).resolve().parent
    dirs = [package_dir]
    checkout = package_dir.parent
    if (checkout / "setup.py").is_file() or (checkout / "pyproject.toml").is_file():
        dirs.append(checkout)
    return dirs


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.relative_to(folder)
    except ValueError:
        return False
    return True


def resolve_output_dir(output_dir: str | os.PathLike | None, cache_dir: Path) -> tuple[Path, str | None]:
    """The folder the report goes to, and a note when the default had to be moved.

    An explicit ``output_dir`` inside the source tree or the installed package is refused (:class:`DemoError`).
    The default ``./specdec-demo-report`` is moved to ``<cache>/specdec-demo-report`` when the current folder is
    inside the source tree (for example when the demo is started from a clone of the repository).
    """
    explicit = output_dir is not None
    target = Path(output_dir if explicit else DEFAULT_OUTPUT_DIR).expanduser().resolve()
    for folder in protected_dirs():
        if _inside(target, folder):
            if explicit:
                raise DemoError(f"refusing to write the demo report into the specdec source tree or package "
                                f"({target} is inside {folder}); choose a folder elsewhere with --output-dir")
            moved = (cache_dir / DEFAULT_OUTPUT_DIR).resolve()
            return moved, (f"the current folder is inside the specdec source tree ({folder}); writing the report to "
                           f"{moved} instead (choose another with --output-dir)")
    return target, None


@contextlib.contextmanager
def _transformers_progress_bars(enabled: bool) -> Iterator[None]:
    """transformers' own progress bars (weights loading / saving) off inside the block unless ``enabled``."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            hf_logging.enable_progress_bar()


def _check_writable_folder(path: Path, option: str) -> None:
    """DemoError naming ``option`` when ``path`` cannot become a folder we write into (checked before any work)."""
    problem = folder_problem(path)
    if problem:
        raise DemoError(f"{option} {problem}")


def _check_cache_dir(cache_dir: Path) -> Path:
    cache_dir = cache_dir.expanduser().resolve()
    for folder in protected_dirs():
        if _inside(cache_dir, folder):
            raise DemoError(f"refusing to cache the demo models inside the specdec source tree or package "
                            f"({cache_dir} is inside {folder}); set --cache-dir or $SPECDEC_CACHE elsewhere")
    _check_writable_folder(cache_dir, "--cache-dir")  # before minutes of training, not when the pair is saved
    return cache_dir


# ----------------------------------------------------------------------------------------------------------------------
# Building and training the pair
# ----------------------------------------------------------------------------------------------------------------------


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


def _training_batches(tokenizer: Any, spec: TrainingSpec, max_length: int, seed: int):
    """Yield ``(input_ids, attention_mask, labels)`` batches of ``<bos> text <eos>``, right-padded, fresh examples."""
    examples = data.sample_mixture(dict(spec.mixture), spec.steps * spec.batch_size, seed=seed, split="train")
    encoded = tokenizer([ex.text for ex in examples], add_special_tokens=True)["input_ids"]
    for step in range(spec.steps):
        rows = [ids[: max_length - 1] + [tokenizer.eos_token_id]
                for ids in encoded[step * spec.batch_size:(step + 1) * spec.batch_size]]
        width = max(len(row) for row in rows)
        input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for index, row in enumerate(rows):
            input_ids[index, : len(row)] = torch.tensor(row)
            attention_mask[index, : len(row)] = 1
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
    cache_root = _check_cache_dir(Path(cache_dir) if cache_dir is not None else default_cache_dir())
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
        if pair_dir.exists():
            shutil.rmtree(pair_dir)
        os.replace(staging, pair_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return DemoPair(verifier.eval(), drafter.eval(), tokenizer, pair_dir, cache_hit=False, info=info)


# ----------------------------------------------------------------------------------------------------------------------
# Running the demo
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class DemoResult:
    """What :func:`run_demo` measured and wrote.

    ``before``/``after``: fairness reports of the original and the s-CDF drafter; ``baselines``: method name →
    report of the drafter finetuned with that baseline; ``comparison``: one row of headline figures per drafter;
    ``samples``: per task, a prompt, the greedy speculative output and its tokens per verifier call;
    ``cache_hit``: the pair came from the cache (no training); ``files``: what was written.
    """

    before: Any
    after: Any
    baselines: dict[str, Any]
    comparison: list[dict[str, Any]]
    samples: dict[str, dict[str, Any]]
    cache_hit: bool
    pair_dir: Path
    output_dir: Path
    report_path: Path
    plot_paths: list[Path]
    timings: dict[str, float]
    pair_info: dict[str, Any]


def generate_samples(pair: DemoPair, suite: Mapping[str, list[data.Example]], settings: DemoSettings, seed: int,
                     progress: bool = True) -> dict[str, dict[str, Any]]:
    """Run :func:`specdec.generate` (greedy) on the first prompts of every task; one decoded sample per task."""
    from tqdm.auto import tqdm

    from specdec.generate import generate

    tokenizer = pair.tokenizer
    samples: dict[str, dict[str, Any]] = {}
    for task, examples in tqdm(suite.items(), desc="specdec.generate per task", disable=not progress):
        prompts = [ex.prompt for ex in examples[: settings.num_samples_per_task]]
        batch = tokenizer(prompts, add_special_tokens=True, padding=True, return_tensors="pt")
        out = generate(pair.verifier, pair.drafter, batch["input_ids"], batch["attention_mask"],
                       max_new_tokens=settings.max_new_tokens, num_draft_tokens=settings.num_draft_tokens,
                       temperature=0.0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       seed=seed)
        width = batch["input_ids"].shape[1]
        stats = out.stats
        first_new = out.sequences[0, width: width + int(stats.generated[0])].tolist()
        samples[task] = {
            "prompt": prompts[0],
            "output": tokenizer.decode(first_new, skip_special_tokens=True),
            "expected": examples[0].continuation,
            "tokens_per_verifier_call": float(stats.total_tokens_per_verifier_call),
            "acceptance_rate": float(stats.total_acceptance_rate),
        }
    return samples


def _headline(name: str, report: Any) -> dict[str, Any]:
    summary = report.summary
    return {
        "drafter": name,
        "U_ce": summary.get("U_ce"),
        "U_kl": summary.get("U_kl"),
        "alpha_mean": summary.get("alpha_mean"),
        "alpha_min": summary.get("alpha_min"),
        "worst_task": summary.get("worst_task"),
        "speedup_min": summary.get("speedup_min"),
        "speedup_max": summary.get("speedup_max"),
        "speedup_max_over_min": summary.get("speedup_max_over_min"),
        "tokens_per_call_max_over_min": summary.get("tokens_per_call_max_over_min"),
    }


def _format_number(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def compact_table(report: Any) -> str:
    """The per-task figures a user needs on a terminal (the full table goes to the report file)."""
    columns = [("task", "name"), ("α_T", "alpha"), ("S_T", "speedup"), ("K_T (CE)", "cross_entropy"),
               ("D_T (KL)", "kl"), ("H_T(p)", "entropy"), ("α gen", "alpha_measured"), ("tok/call", "tokens_per_call")]
    lines = ["| " + " | ".join(title for title, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in report.tasks:
        lines.append("| " + " | ".join(_format_number(getattr(row, key)) for _, key in columns) + " |")
    summary = report.summary
    lines.append("")
    lines.append(f"U (variance of K_T) = {_format_number(summary.get('U_ce'))}, U on D_T = "
                 f"{_format_number(summary.get('U_kl'))}; speed-up max/min = "
                 f"{_format_number(summary.get('speedup_max_over_min'))}; mean α = "
                 f"{_format_number(summary.get('alpha_mean'))}, worst α = {_format_number(summary.get('alpha_min'))} "
                 f"({summary.get('worst_task')})")
    return "\n".join(lines) + "\n"


def comparison_markdown(rows: list[dict[str, Any]]) -> str:
    """A markdown table of the headline figures, one row per drafter (original, s-CDF, baselines)."""
    headers = ["drafter", "U (CE)", "U (KL)", "mean α", "worst α", "worst task", "S min", "S max", "S max/min"]
    keys = ["drafter", "U_ce", "U_kl", "alpha_mean", "alpha_min", "worst_task", "speedup_min", "speedup_max",
            "speedup_max_over_min"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_format_number(row.get(key)) for key in keys) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def plot_comparison(reports: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """PNG: per-task speed-up S_T and acceptance α_T for each drafter side by side, and U (CE) per drafter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(reports)
    tasks = [row.name for row in next(iter(reports.values())).tasks]
    width = 0.8 / len(names)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), gridspec_kw={"width_ratios": [3, 3, 1.4]})
    for panel, (attribute, title) in enumerate((("speedup", "speed-up S_T per task"),
                                                ("alpha", "acceptance α_T per task"))):
        ax = axes[panel]
        for index, name in enumerate(names):
            values = [float(getattr(reports[name].task(task), attribute) or float("nan")) for task in tasks]
            ax.bar([i + (index - (len(names) - 1) / 2) * width for i in range(len(tasks))], values, width, label=name)
        ax.set_xticks(range(len(tasks)))
        ax.set_xticklabels(tasks, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=8)
    axes[1].set_ylim(0, 1)
    ax = axes[2]
    ax.bar(range(len(names)), [float(reports[name].summary.get("U_ce", float("nan"))) for name in names],
           color=[f"C{i}" for i in range(len(names))])
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_title("unfairness U (variance of K_T)")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
    return Path(path)


BASELINE_METHODS = ("uniform_kd", "balanced", "exact_variance")


def run_demo(
    output_dir: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    *,
    quick: bool = False,
    seed: int = 0,
    baselines: bool = False,
    retrain: bool = False,
    finetune_steps: int | None = None,
    cost_ratio: float | None = None,
    progress: bool = True,
    echo: Callable[[str], None] | None = print,
) -> DemoResult:
    """Train (or load) the demo pair, measure its disparity, repair it with s-CDF, and write the report.

    Args:
        output_dir: folder for ``report.md``, ``report.json`` and the PNG plots (default ``./specdec-demo-report``;
            see :func:`resolve_output_dir` for the source-tree rule).
        cache_dir: where the trained pair is cached (default :func:`default_cache_dir`).
        quick: tiny models and a few steps, for tests only (the numbers are meaningless).
        seed: seeds training, the task suite, generation and finetuning.
        baselines: also finetune with uniform distillation, data balancing and exact-variance weights.
        retrain: ignore a cached pair and train again.
        finetune_steps: s-CDF (and baseline) steps; default 150 (2 in quick mode).
        cost_ratio: c = t_drafter / t_verifier for the speed-up S_T; default: the drafter/verifier parameter ratio
            (the cost of a forward pass where it is proportional to the weights read, as on a GPU at small batch).
        progress: tqdm bars. echo: where the printed story goes (None: silent).

    Returns:
        :class:`DemoResult`.
    """
    from specdec.fairness import evaluate
    from specdec.finetune import finetune_drafter

    say = echo or (lambda _text: None)
    timings: dict[str, float] = {}
    started = time.perf_counter()
    cache_root = _check_cache_dir(Path(cache_dir) if cache_dir is not None else default_cache_dir())
    out_dir, note = resolve_output_dir(output_dir, cache_root)
    _check_writable_folder(out_dir, "--output-dir")  # before minutes of training, not after
    if note:
        say(f"note: {note}")
    settings = default_settings(quick)
    if finetune_steps is not None:
        if finetune_steps < 1:
            raise DemoError(f"finetune_steps must be >= 1, got {finetune_steps}")
        settings = DemoSettings(**{**asdict(settings), "finetune_steps": finetune_steps})
    if cost_ratio is not None and (not math.isfinite(cost_ratio) or cost_ratio < 0):
        raise DemoError(f"cost_ratio must be a finite number >= 0, got {cost_ratio}")

    config = default_pair_config(seed=seed, quick=quick)
    with _transformers_progress_bars(progress):  # its own bars when it loads and saves weights
        pair = get_demo_pair(cache_root, config=config, retrain=retrain, progress=progress)
    timings["pair_seconds"] = time.perf_counter() - started
    info = pair.info
    say(f"demo pair: verifier {info['verifier_parameters']:,} parameters, drafter {info['drafter_parameters']:,} "
        f"parameters ({'loaded from cache' if pair.cache_hit else 'trained now'}: {pair.path})")
    cost_ratio_given = cost_ratio is not None
    if cost_ratio is None:
        cost_ratio = info["drafter_parameters"] / info["verifier_parameters"]

    eval_suite = data.synthetic_task_suite(settings.num_eval_examples, seed=seed, split="eval")
    step_started = time.perf_counter()
    samples = generate_samples(pair, eval_suite, settings, seed, progress)
    timings["samples_seconds"] = time.perf_counter() - step_started
    say("\nGreedy speculative decoding, one prompt per task (tokens per verifier call over the task's prompts):")
    for task, sample in samples.items():
        say(f"  {task:17s} {sample['tokens_per_verifier_call']:.2f} tok/call  "
            f"{sample['prompt']!r} -> {sample['output']!r}")

    eval_tasks = data.suite_to_task_data(eval_suite)
    evaluation = {
        "tokenizer": pair.tokenizer, "num_draft_tokens": settings.num_draft_tokens,
        "temperature": settings.temperature, "max_new_tokens": settings.max_new_tokens,
        "batch_size": settings.batch_size, "cost_ratio": cost_ratio, "seed": seed, "progress": progress,
        "eos_token_id": pair.tokenizer.eos_token_id, "add_special_tokens": True,
    }
    step_started = time.perf_counter()
    before = evaluate(pair.verifier, pair.drafter, eval_tasks, **evaluation)
    timings["evaluate_before_seconds"] = time.perf_counter() - step_started
    say("\nFairness of the original drafter (teacher-forced α_T, S_T, K_T on held-out texts; α gen and tok/call "
        "from real generate runs):\n")
    say(compact_table(before))

    train_texts = {task: [ex.text for ex in examples] for task, examples in data.synthetic_task_suite(
        settings.num_finetune_examples, seed=seed, split="finetune").items()}
    held_out_texts = {task: [ex.text for ex in examples] for task, examples in eval_suite.items()}

    def finetuned(method: str) -> tuple[Any, Any]:
        drafter = copy.deepcopy(pair.drafter)
        result = finetune_drafter(
            drafter, pair.verifier, train_texts, tokenizer=pair.tokenizer, method=method, weight_basis="ce",
            steps=settings.finetune_steps, batch_size_per_task=settings.finetune_batch_size_per_task,
            seq_len=settings.finetune_seq_len, lr=settings.finetune_lr, eval_every=None, seed=seed,
            progress=progress, eval_tasks=held_out_texts, add_special_tokens=True,
            pad_token_id=pair.tokenizer.pad_token_id,
        )
        drafter.eval()
        return result, evaluate(pair.verifier, drafter, eval_tasks, **evaluation)

    step_started = time.perf_counter()
    say(f"\nFinetuning the drafter with s-CDF ({settings.finetune_steps} steps, corrective weights on CE; "
        "the verifier is frozen) ...")
    _, after = finetuned("scdf")
    timings["scdf_seconds"] = time.perf_counter() - step_started
    say("\nFairness after s-CDF:\n")
    say(compact_table(after))

    baseline_reports: dict[str, Any] = {}
    if baselines:
        for method in BASELINE_METHODS:
            step_started = time.perf_counter()
            say(f"\nBaseline: {method} ({settings.finetune_steps} steps) ...")
            baseline_reports[method] = finetuned(method)[1]
            timings[f"{method}_seconds"] = time.perf_counter() - step_started

    else:
        say("\n(run with --baselines to compare s-CDF with uniform distillation, data balancing and "
            "exact-variance weights)")

    reports = {"original": before, "s-CDF": after, **baseline_reports}
    comparison = [_headline(name, report) for name, report in reports.items()]
    say("\nSummary (U = variance of the per-task cross-entropies K_T; S = speed-up with "
        f"K = {settings.num_draft_tokens}, c = {cost_ratio:.3g}):\n")
    say(comparison_markdown(comparison))

    out_dir.mkdir(parents=True, exist_ok=True)
    plot_paths = [
        plot_comparison(reports, out_dir / "speedup_by_task.png"),
        Path(before.plot(str(out_dir / "fairness_before.png"))),
        Path(after.plot(str(out_dir / "fairness_after_scdf.png"))),
    ]
    timings["total_seconds"] = time.perf_counter() - started
    report_path = out_dir / "report.md"
    report_path.write_text(_report_markdown(pair, settings, cost_ratio, samples, reports, comparison, plot_paths,
                                            timings, cost_ratio_given=cost_ratio_given), encoding="utf-8")
    (out_dir / "report.json").write_text(json.dumps({
        "pair": pair.info, "settings": asdict(settings), "cost_ratio": cost_ratio,
        "cost_ratio_given": cost_ratio_given, "samples": samples,
        "reports": {name: report.to_dict() for name, report in reports.items()}, "comparison": comparison,
        "timings": timings, "cache_hit": pair.cache_hit,
    }, indent=2, default=str), encoding="utf-8")
    say(f"\nReport: {report_path}\nPlots:  {', '.join(str(p) for p in plot_paths)}")
    say(f"Try the pair yourself: specdec generate --verifier {pair.path / 'verifier'} --drafter "
        f"{pair.path / 'drafter'} --prompt 'count 41:'")
    return DemoResult(before=before, after=after, baselines=baseline_reports, comparison=comparison, samples=samples,
                      cache_hit=pair.cache_hit, pair_dir=pair.path, output_dir=out_dir, report_path=report_path,
                      plot_paths=plot_paths, timings=timings, pair_info=pair.info)


def _report_markdown(pair: DemoPair, settings: DemoSettings, cost_ratio: float, samples: Mapping[str, Any],
                     reports: Mapping[str, Any], comparison: list[dict[str, Any]], plot_paths: list[Path],
                     timings: Mapping[str, float], cost_ratio_given: bool = False) -> str:
    info = pair.info
    drafter_mixture = ", ".join(f"{task} {weight:.0%}" for task, weight in
                                info["config"]["drafter_training"]["mixture"])
    lines = [
        "# specdec demo report",
        "",
        "A small Llama-family verifier trained on every built-in task equally, and a smaller drafter trained on a "
        f"skewed mixture ({drafter_mixture}). The drafter is under-fit on its rare tasks, so speculative decoding "
        "accelerates them less. s-CDF finetunes only the drafter, pulling the tasks behind the best one toward the "
        "verifier; the verifier and therefore the output distribution are unchanged.",
        "",
        f"- verifier: {info['verifier_parameters']:,} parameters; drafter: {info['drafter_parameters']:,} parameters "
        f"({'loaded from the cache' if pair.cache_hit else 'trained in this run'}; `{pair.path}`)",
        f"- K = {settings.num_draft_tokens} drafts per round, temperature {settings.temperature}, cost ratio "
        f"c = {cost_ratio:.3g}; {settings.num_eval_examples} held-out prompts and texts per task. S_T is the "
        + ("speed-up predicted from α_T with the cost ratio c given on the command line (--cost-ratio). "
           if cost_ratio_given else
           "speed-up predicted from α_T with c = the drafter/verifier parameter ratio (a cost model for hardware "
           "where a forward pass costs in proportion to the weights it reads); models this small are overhead-bound "
           "on a CPU, so their wall-clock gains there are smaller. ")
        + "Tokens per verifier call (tok/call) are measured.",
        f"- s-CDF: {settings.finetune_steps} steps, {settings.finetune_batch_size_per_task} windows per task per step, "
        f"lr {settings.finetune_lr}, corrective weights on CE",
        f"- wall time: {timings.get('total_seconds', float('nan')):.0f} s",
        "",
        "## Summary",
        "",
        comparison_markdown(comparison),
        "U alone can be gamed by making the good tasks worse: read it together with the mean and the worst task's α.",
        "",
        "## Samples (greedy `specdec.generate`)",
        "",
        "| task | prompt | output | expected | tok/call |",
        "|---|---|---|---|---|",
    ]
    for task, sample in samples.items():
        cells = [task] + [f"`{sample[key]!r}`" for key in ("prompt", "output", "expected")]
        cells.append(f"{sample['tokens_per_verifier_call']:.2f}")
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    for name, report in reports.items():
        lines += ["", f"## Fairness: {name} drafter", "", report.to_markdown()]
    lines += ["", "## Plots", ""] + [f"![{path.stem}]({path.name})" for path in plot_paths]
    return "\n".join(lines) + "\n"
