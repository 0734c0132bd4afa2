"""The stages of the pipeline. Each reads what earlier stages wrote to the work folder and writes its results as JSON
rows (one ``.jsonl`` file per run of a stage) under ``<results>/rows/``; README.md lists what each reads and writes.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import os
import re
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from specdec._seeding import derive_seed
from specdec.compat import special_token_ids

from . import corpus as corpus_module
from .config import PipelineConfig, finetune_config
from .corpus import Corpus, encode, load_tokenizer, special_ids
from .evaluation import encode_prompts, evaluate_pair, mgsm_tasks, report_rows, verifier_fingerprint
from .models import TokenStreams, build_model, heldout_loss, load_model, save_model, train_language_model

EXPERIMENTS = ("languages", "domains")


@dataclass
class Context:
    """What every stage needs: the settings, the folders, the device, and the process's place in a torchrun job."""

    cfg: PipelineConfig
    work: Path
    results: Path
    device: torch.device
    progress: bool = True
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def eval_dtype(self) -> torch.dtype:
        """bf16 on a GPU (the models as saved), float32 on the CPU."""
        return torch.bfloat16 if self.device.type == "cuda" else torch.float32

    def models_dir(self) -> Path:
        return self.work / "models"


def resolve_device(name: str) -> torch.device:
    """``auto``: the GPU of this process (``LOCAL_RANK`` under torchrun) when there is one, else the CPU."""
    if name not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {name!r}")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device cuda was asked for but torch sees no GPU")
    index = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(index)
    torch.backends.cuda.matmul.allow_tf32 = True
    return torch.device("cuda", index)


def init_distributed(device: torch.device) -> tuple[int, int]:
    """(rank, world size): joins the torchrun job (NCCL on GPUs, gloo on the CPU) when ``WORLD_SIZE`` > 1."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(minutes=30))
    return dist.get_rank(), dist.get_world_size()


def barrier(ctx: Context) -> None:
    import torch.distributed as dist

    if ctx.world > 1 and dist.is_initialized():
        dist.barrier()


def write_rows(ctx: Context, name: str, rows: list[dict[str, Any]]) -> Path:
    """``<results>/rows/<name>.jsonl`` (replaced): the rows of one run of a stage."""
    path = ctx.results / "rows" / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False, default=_json_default) + "\n")
    return path


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def load_verifier(ctx: Context) -> torch.nn.Module:
    """The verifier in ``ctx.eval_dtype`` on ``ctx.device``, frozen: the pretrained model the settings name (its
    architecture fields and vocabulary checked against the settings and the tokenizer), else the trained one."""
    spec = ctx.cfg.verifier
    if spec.pretrained is None:
        verifier = load_model(ctx.models_dir(), spec.name, dtype=ctx.eval_dtype, device=ctx.device)
        return verifier.requires_grad_(False)
    from .pretrained import load_pretrained_model

    verifier = load_pretrained_model(spec.pretrained, dtype=ctx.eval_dtype, device=ctx.device)
    config = verifier.config
    for field, actual in (("arch", config.model_type), ("num_layers", config.num_hidden_layers),
                          ("hidden_size", config.hidden_size), ("num_heads", config.num_attention_heads),
                          ("num_kv_heads", config.num_key_value_heads),
                          ("intermediate_size", config.intermediate_size)):
        if getattr(spec, field) != actual:  # the rows report these settings: they must describe the model
            raise ValueError(f"verifier.{field} is {getattr(spec, field)!r} but the pretrained model "
                             f"{spec.pretrained} has {actual!r}: set verifier.{field} to {actual!r}")
    vocab = len(load_tokenizer(ctx.work))
    if verifier.get_output_embeddings().weight.shape[0] < vocab:
        raise ValueError(f"the pretrained verifier's output layer has fewer rows than the tokenizer in "
                         f"{ctx.work / 'tokenizer'} has tokens ({vocab}): prepare with this verifier again")
    return verifier


def _fingerprint(ctx: Context, verifier: torch.nn.Module, tokenizer: Any, prompts: list[list[int]]
                 ) -> dict[str, str]:
    ids = special_ids(tokenizer)
    return verifier_fingerprint(verifier, prompts, ctx.cfg.fingerprint_tokens, pad_token_id=ids.pad,
                                eos_token_id=ids.eos)


class StageClock:
    """The seconds cap of one call of a stage (``stage_max_seconds``; None: no cap), counted from the clock's
    creation. :meth:`allows` says whether the next unit of work (a pair's variant) may start: the first always does,
    a later one only while the time so far plus the longest unit so far stays within the cap. Under torchrun rank
    0's answer is every rank's."""

    def __init__(self, ctx: Context, cap: float | None):
        self.ctx, self.cap = ctx, cap
        self.start = time.perf_counter()
        self.longest = 0.0
        self.units = 0
        self.stopped = False

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def remaining(self) -> float | None:
        """Seconds left before the cap (None without one; at most 0 once it has passed)."""
        return None if self.cap is None else self.cap - self.elapsed()

    def allows(self) -> bool:
        if self.stopped:
            return False
        allowed = self.cap is None or self.units == 0 or self.elapsed() + self.longest <= self.cap
        if self.ctx.world > 1:  # one decision for every rank: they run the same units
            import torch.distributed as dist

            flag = [allowed]
            dist.broadcast_object_list(flag, src=0)
            allowed = bool(flag[0])
        self.stopped = not allowed
        return allowed

    def done(self, seconds: float) -> None:
        """One unit of work finished, taking ``seconds``."""
        self.units += 1
        self.longest = max(self.longest, seconds)

    def stopped_row(self, stage: str, done: list[Any], left_out: list[Any], **extra: Any) -> dict[str, Any]:
        """The row that says a stage call stopped at its cap: what ran and what was left out (``extra``: more
        fields, e.g. the experiment)."""
        print(f"{stage}: stage_max_seconds={self.cap} reached after {self.elapsed():.1f} s; left out {left_out}",
              file=sys.stderr)
        return {"kind": "stopped", "stage": stage, **extra, "time": _now(), "preset": self.ctx.cfg.preset,
                "reason": "stage_max_seconds", "stage_max_seconds": self.cap, "elapsed_seconds": self.elapsed(),
                "longest_unit_seconds": self.longest, "done": done, "left_out": left_out}


# ------------------------------------------------------------------------------------------------------------ prepare
def stage_prepare(ctx: Context, data: str | Path) -> dict[str, Any]:
    """Corpus and tokenizer (see :mod:`corpus`); the settings go to ``<work>/config.json``."""
    from specdec.data import load_tasks

    cfg = ctx.cfg
    start = time.perf_counter()
    loaded = load_tasks(cfg.eval_data, names=cfg.languages, as_task_data=False)
    questions = {lang: {q.strip() for q in entry.prompts} for lang, entry in loaded.items()}
    manifest = corpus_module.prepare(data, ctx.work, cfg, eval_questions=questions, progress=ctx.progress)
    cfg.save(ctx.work)
    seconds = time.perf_counter() - start
    rows = [{"kind": "prepare", "time": _now(), "seconds": seconds, "preset": cfg.preset,
             "vocab_size": manifest["vocab_size"], "tokenizer": manifest["tokenizer"], "tokenizer_chars_per_language":
                 manifest["tokenizer_chars_per_language"], "stats": manifest["stats"],
             "dropped_as_evaluation_questions": manifest["dropped_as_evaluation_questions"],
             "settings": cfg.to_dict()}]
    write_rows(ctx, "prepare", rows)
    return manifest


# -------------------------------------------------------------------------------------------------------------- train
def _streams(ctx: Context, tokenizer: Any, corpus: Corpus, split: str) -> TokenStreams:
    return TokenStreams({lang: encode(tokenizer, corpus.texts(split, lang)) for lang in ctx.cfg.languages},
                        ctx.cfg.seq_len)


def stage_train(ctx: Context, names: list[str] | None = None, export: str | Path | None = None
                ) -> list[dict[str, Any]]:
    """Train the verifier and the drafters from scratch, each on its mix, and distil the self-drafters that ask for
    it (``distill_steps``); write them to ``<work>/models/`` as bf16 safetensors (and a copy of every file to
    ``export`` as soon as it is written, so a device run that is cut short still returns the models it finished). A
    pretrained verifier is loaded, not trained: its row records its fingerprint and held-out loss."""
    cfg = ctx.cfg
    specs = cfg.trained_models + [d for d in cfg.drafters if d.kind == "self" and d.distill_steps]
    if names:
        known = [s.name for s in specs]
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"--models: {unknown} are not trained models; choose from {known} (self-drafters "
                             "are cut from the verifier, and trained only with distill_steps)")
        specs = [s for s in specs if s.name in names]
    clock = StageClock(ctx, cfg.stage_max_seconds)
    tokenizer = load_tokenizer(ctx.work)
    corpus = Corpus(ctx.work)
    train, heldout = _streams(ctx, tokenizer, corpus, "train"), _streams(ctx, tokenizer, corpus, "heldout")
    ids = special_ids(tokenizer)
    verifier = None
    rows = []
    rows_name = "train__" + ".".join(s.name for s in specs)  # file names of letters, digits, '.', '_', '-' only
    for index, spec in enumerate(specs):
        remaining = clock.remaining()
        if index and remaining is not None and remaining <= 0:  # the first model always starts
            rows.append(clock.stopped_row("train", [s.name for s in specs[:index]], [s.name for s in specs[index:]]))
            write_rows(ctx, rows_name, rows)
            break
        # a model trains (or distils) until train_max_seconds or the stage's cap, whichever comes first
        limits = {"train_max_seconds": cfg.train_max_seconds, "stage_max_seconds": remaining}
        limit_name = min((k for k, v in limits.items() if v is not None), key=lambda k: limits[k], default=None)
        max_seconds = None if limit_name is None else max(limits[limit_name], 0.0)
        started = time.perf_counter()
        row = {"kind": "train", "time": _now(), "preset": cfg.preset, "model": spec.name, "arch": spec.arch,
               "hidden_size": spec.hidden_size, "num_layers": spec.num_layers, "device": _device_name(ctx.device)}
        if spec.pretrained is not None:
            verifier = load_verifier(ctx)
            log = _pretrained_log(ctx, verifier, tokenizer, corpus, heldout)
            log["seconds"] = time.perf_counter() - started  # loading, fingerprint and held-out loss
            model, files = verifier, []
        else:
            if spec.kind == "self":
                if verifier is None:
                    verifier = load_verifier(ctx)
                model, log = distill_self_drafter(ctx, verifier, spec, tokenizer, corpus, heldout, max_seconds)
                row.update(arch=verifier.config.model_type, hidden_size=verifier.config.hidden_size,
                           num_layers=spec.self_layers)
            else:
                weights = spec.weights(cfg.languages)
                model = build_model(spec, len(tokenizer), cfg.max_positions, derive_seed(cfg.seed, spec.name),
                                    pad_token_id=ids.pad, bos_token_id=ids.bos, eos_token_id=ids.eos).to(ctx.device)
                log = train_language_model(model, train, weights, steps=spec.steps, batch_size=spec.batch_size,
                                           lr=spec.lr, warmup_steps=cfg.warmup_steps, weight_decay=cfg.weight_decay,
                                           seed=derive_seed(cfg.seed, spec.name, "data"), heldout=heldout,
                                           heldout_windows=cfg.heldout_windows, progress=ctx.progress,
                                           name=spec.name, max_seconds=max_seconds)
            log["max_seconds"] = max_seconds
            log["cut_by"] = limit_name if log.get("steps_run", 0) < log["steps"] else None
            files = save_model(model, ctx.models_dir(), spec.name, max_file_mb=cfg.max_file_mb)
        if export is not None:
            Path(export).mkdir(parents=True, exist_ok=True)
            for path in files:
                shutil.copy2(path, Path(export) / path.name)
        rows.append({**row, "params": model.num_parameters(), "files": {p.name: p.stat().st_size for p in files},
                     "settings": cfg.to_dict(), **log})
        write_rows(ctx, rows_name, rows)  # after every model: a call cut short keeps the rows of those it finished
    return rows


def _pretrained_log(ctx: Context, verifier: torch.nn.Module, tokenizer: Any, corpus: Corpus,
                    heldout: TokenStreams) -> dict[str, Any]:
    """The train row of a pretrained verifier: where it came from, no steps, its fingerprint (on the prompts the
    finetuning stage fingerprints it on) and its held-out loss per language."""
    cfg = ctx.cfg
    prompts = [p for task in mgsm_tasks(cfg, tokenizer, corpus.triggers).values() for p in task.prompts]
    fingerprint = _fingerprint(ctx, verifier, tokenizer, prompts[: cfg.fingerprint_prompts])
    return {"pretrained": cfg.verifier.pretrained, "steps": 0, "steps_run": 0, "weights": {},
            "verifier_weights_sha256": fingerprint["weights_sha256"],
            "verifier_greedy_sha256": fingerprint["greedy_sha256"],
            "heldout_loss": heldout_loss(verifier, heldout, cfg.heldout_windows, cfg.eval_batch_size,
                                         autocast=False)}


def _thinned(losses: list[list[float]], points: int = 50) -> list[list[float]]:
    """About ``points`` evenly spaced entries of ``losses``, always ending with the last one (never twice)."""
    kept = losses[:: max(1, len(losses) // points)]
    return kept if not losses or kept[-1] is losses[-1] else [*kept, losses[-1]]


class _OutOfTimeError(Exception):
    """Raised by the distillation's step callback once its ``max_seconds`` have passed."""


def distill_self_drafter(ctx: Context, verifier: torch.nn.Module, spec: Any, tokenizer: Any, corpus: Corpus,
                         heldout: TokenStreams, max_seconds: float | None = None
                         ) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The verifier's first ``spec.self_layers`` layers (an independent float32 copy) distilled toward it:
    ``spec.distill_steps`` steps of :func:`specdec.finetune_drafter` with ``method="uniform_kd"`` (the natural
    mixture of the training split, ``spec.batch_size`` windows of ``finetune_seq_len`` tokens per language and step,
    learning rate ``spec.lr``), stopped after the step that passes ``max_seconds``. The verifier's fingerprint
    is taken before and after (a change raises RuntimeError). Returns the drafter and its log."""
    from specdec import finetune_drafter, layer_skip_drafter
    from specdec.training.finetune import task_token_shares

    cfg = ctx.cfg
    drafter = layer_skip_drafter(verifier, spec.self_layers, share_weights=False).float().requires_grad_(True)
    data = _task_data(ctx, tokenizer, corpus, "languages")
    tasks = data["train"]
    config = replace(finetune_config(cfg, "uniform_kd"), steps=spec.distill_steps,
                     batch_size_per_task=spec.batch_size, lr=spec.lr, eval_every=None,
                     seed=derive_seed(cfg.seed, spec.name, "distill"))
    prompts = [p for task in data["evaluation"].values() for p in task.prompts]
    before = _fingerprint(ctx, verifier, tokenizer, prompts[: cfg.fingerprint_prompts])
    losses: list[list[float]] = []
    start = time.perf_counter()

    def on_step(step: int, info: dict[str, Any]) -> None:
        losses.append([step, info["loss"]])
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            raise _OutOfTimeError

    log: dict[str, Any] = {"method": "uniform_kd", "steps": spec.distill_steps, "batch_size": spec.batch_size,
                           "seq_len": cfg.finetune_seq_len,
                           # the natural mixture uniform distillation draws from: each language's share of the
                           # windows' next-token positions
                           "weights": dict(zip(tasks, task_token_shares(list(tasks.values()),
                                                                        cfg.finetune_seq_len), strict=True))}
    try:
        result = finetune_drafter(drafter, verifier, tasks, config=config, eval_tasks=data["ft_eval"],
                                  pad_token_id=special_ids(tokenizer).pad, progress=ctx.progress, callback=on_step)
        keys = ("U", "U_kl", "mean_alpha", "worst_alpha", "worst_task")
        log.update(distill_initial={k: result.initial.get(k) for k in keys},
                   distill_final={k: result.final.get(k) for k in keys})
    except _OutOfTimeError:
        pass
    drafter.eval()
    log.update(steps_run=len(losses), seconds=time.perf_counter() - start,
               losses=_thinned(losses))
    after = _fingerprint(ctx, verifier, tokenizer, prompts[: cfg.fingerprint_prompts])
    if after["weights_sha256"] != before["weights_sha256"]:
        raise RuntimeError(f"the verifier's weights changed while distilling {spec.name}")
    log.update(verifier_weights_sha256=after["weights_sha256"], verifier_greedy_sha256=after["greedy_sha256"],
               verifier_greedy_identical=after["greedy_sha256"] == before["greedy_sha256"],
               heldout_loss=heldout_loss(drafter, heldout, cfg.heldout_windows, cfg.eval_batch_size,
                                         autocast=ctx.device.type == "cuda"))
    return drafter, log


# --------------------------------------------------------------------------------------------- finetune and evaluate
def _initial_drafter(ctx: Context, verifier: torch.nn.Module, pair: str) -> Any:
    """The pair's drafter before finetuning, in float32 (the optimizer's master weights): a distilled self-drafter
    as the train stage wrote it; for an n-gram pair the model-free :func:`specdec.ngram_drafter`."""
    from specdec import layer_skip_drafter, ngram_drafter

    spec = ctx.cfg.drafter(pair)
    if spec.kind == "ngram":
        return ngram_drafter(spec.max_ngram, spec.min_ngram)
    if spec.kind == "self" and not spec.distill_steps:
        # a copy of the frozen verifier's first layers: trainable again
        return layer_skip_drafter(verifier, spec.self_layers, share_weights=False).float().requires_grad_(True)
    return load_model(ctx.models_dir(), pair, dtype=torch.float32, device=ctx.device)


def _chars_per_token(tokenizer: Any, texts: list[str], encoded: list[list[int]]) -> float:
    """rho as :func:`specdec.finetune_drafter` measures it: characters over text tokens (``<bos>``, ``<eos>`` and the
    other special tokens left out)."""
    special = special_token_ids(tokenizer)
    return sum(len(t) for t in texts) / sum(1 for ids in encoded for t in ids if t not in special)


def _task_data(ctx: Context, tokenizer: Any, corpus: Corpus, experiment: str) -> dict[str, Any]:
    """The finetuning tasks (token ids of the training split), their ``rho``, the finetuning's own evaluation texts
    (held-out split) and the evaluation tasks of ``experiment``."""
    from specdec.fairness import TaskData

    cfg = ctx.cfg
    if experiment == "languages":
        keys = [(lang, None) for lang in cfg.languages]
    else:
        keys = [(lang, domain) for lang in cfg.domain_languages for domain in corpus_module.DOMAINS]
    train, rho, ft_eval, evaluation = {}, {}, {}, {}
    for lang, domain in keys:
        name = lang if domain is None else f"{lang}/{domain}"
        texts = corpus.texts("train", lang, domain)
        if not texts:
            raise ValueError(f"task {name!r} has no training texts in {ctx.work / 'corpus'}")
        train[name] = encode(tokenizer, texts)
        rho[name] = _chars_per_token(tokenizer, texts, train[name])
        held_texts = corpus.texts("heldout", lang, domain)
        if not held_texts:
            raise ValueError(f"task {name!r} has no held-out texts in {ctx.work / 'corpus'}")
        held = encode(tokenizer, held_texts[: cfg.finetune_eval_examples])
        ft_eval[name] = [ids[: cfg.finetune_seq_len] for ids in held]
        if domain is not None:
            prompts = corpus.texts("heldout", lang, domain, field="prompt")[: cfg.eval_prompts]
            evaluation[name] = TaskData(prompts=encode_prompts(tokenizer, prompts, cfg.max_prompt_tokens),
                                        texts=held_texts[: cfg.eval_texts])
    if experiment == "languages":
        evaluation = mgsm_tasks(cfg, tokenizer, corpus.triggers)
    return {"train": train, "rho": rho, "ft_eval": ft_eval, "evaluation": evaluation}


def _pair_variants(spec: Any, variants: list[str], announce: bool) -> list[str]:
    """The variants that apply to a pair: all of them, or for an n-gram drafter (no weights) ``none`` alone, the
    others skipped with a printed reason."""
    if spec.kind != "ngram":
        return list(variants)
    skipped = [v for v in variants if v != "none"]
    if skipped and announce:
        print(f"{spec.name}: skipping variants {skipped}: an n-gram drafter has no weights to finetune (only 'none' "
              "applies)", file=sys.stderr)
    return [v for v in variants if v == "none"]


def stage_finetune(ctx: Context, pairs: list[str] | None = None, variants: list[str] | None = None,
                   experiment: str = "languages", save_drafters: bool = False) -> list[dict[str, Any]]:
    """For every pair and variant: finetune a copy of the pair's drafter (the same steps and data for every
    variant; ``none`` is the drafter as trained), check that the verifier is unchanged (weights and greedy outputs),
    evaluate, and write one row per task and a summary row. An n-gram pair runs ``none`` alone (the other variants
    are skipped with a printed reason). With ``stage_max_seconds`` a (pair, variant) starts only while it is expected
    to end within the cap (:class:`StageClock`); the rows end with a ``stopped`` row naming what was left out. Runs
    under torchrun (DDP finetuning, evaluation on rank 0)."""
    from tqdm.auto import tqdm

    from specdec import clear_static_caches, finetune_drafter
    from specdec.fairness import measure_decode_costs
    from specdec.training.checkpoint import weights_digest

    cfg = ctx.cfg
    clock = StageClock(ctx, cfg.stage_max_seconds)
    if experiment not in EXPERIMENTS:
        raise ValueError(f"experiment must be one of {EXPERIMENTS}, got {experiment!r}")
    pairs = pairs or ([cfg.domain_pair or cfg.drafters[0].name] if experiment == "domains"
                      else [d.name for d in cfg.drafters])
    for pair in pairs:
        cfg.drafter(pair)  # ValueError naming the drafters for an unknown name
    variants = variants or (cfg.domain_variants if experiment == "domains" else cfg.variants)
    configs = {variant: finetune_config(cfg, variant, "variants") for variant in variants}
    units = [(pair, v) for pair in pairs for v in _pair_variants(cfg.drafter(pair), variants, ctx.main)]
    tokenizer = load_tokenizer(ctx.work)
    corpus = Corpus(ctx.work)
    data = _task_data(ctx, tokenizer, corpus, experiment)
    verifier = load_verifier(ctx)
    pad_token_id = special_ids(tokenizer).pad
    fingerprint_prompts = [p for task in data["evaluation"].values() for p in task.prompts][: cfg.fingerprint_prompts]
    before = _fingerprint(ctx, verifier, tokenizer, fingerprint_prompts) if ctx.main else None
    rows: list[dict[str, Any]] = []
    tag = hashlib.sha256(",".join(variants).encode()).hexdigest()[:8]
    rows_name = f"{experiment}__{'.'.join(pairs)}__{tag}__w{ctx.world}"
    initial: Any = None
    cost = None
    for index, (pair, variant) in enumerate(tqdm(units, desc=f"{experiment}: pairs x variants",
                                                 disable=not (ctx.progress and ctx.main))):
        if not clock.allows():
            if ctx.main:
                rows.append(clock.stopped_row("finetune", [list(u) for u in units[:index]],
                                              [list(u) for u in units[index:]], experiment=experiment))
                write_rows(ctx, rows_name, rows)
            break
        unit_start = time.perf_counter()
        spec = cfg.drafter(pair)
        ngram = spec.kind == "ngram"
        if index == 0 or units[index - 1][0] != pair:  # a pair's first variant: its drafter and c
            initial = _initial_drafter(ctx, verifier, pair)
            cost = None
            if ctx.main:  # c once per pair: finetuning changes the drafter's weights, not its cost
                timed = initial if ngram else copy.deepcopy(initial).to(ctx.eval_dtype)
                cost = measure_decode_costs(verifier, timed, batch_size=cfg.eval_batch_size,
                                            repeats=cfg.cost_repeats, temperature=cfg.temperature, seed=cfg.seed)
        share = spec.weights(cfg.languages) if spec.kind == "trained" and experiment == "languages" else None
        config = configs[variant]
        drafter = initial if ngram else copy.deepcopy(initial)  # an n-gram drafter has no state to copy
        meta: dict[str, Any] = {
            "experiment": experiment, "pair": pair, "variant": variant, "time": _now(), "preset": cfg.preset,
            "seed": cfg.seed, "world_size": ctx.world, "device": _device_name(ctx.device),
            "drafter_kind": spec.kind, "drafter_self_layers": spec.self_layers, "drafter_max_ngram": spec.max_ngram,
            "finetune_steps": 0 if config is None else config.steps,
            "method": "none" if config is None else config.method,
            "weight_basis": None if config is None else config.weight_basis,
            "per_character": config is not None and config.per_character,
            "mixture_weight": None if config is None else config.mixture_weight}
        run: dict[str, Any] = {"settings": cfg.to_dict(), "train_chars_per_token": data["rho"]}  # summary only
        start = time.perf_counter()
        if config is not None:
            result = finetune_drafter(drafter, verifier, data["train"], config=config,
                                      eval_tasks=data["ft_eval"], chars_per_token=data["rho"],
                                      pad_token_id=pad_token_id, progress=ctx.progress and ctx.main)
            keys = ("U", "U_ce", "U_kl", "U_tv", "U_char_kl", "mean_alpha", "worst_alpha", "worst_task")
            run["finetune_final"] = {k: result.final.get(k) for k in keys}
            run["finetune_initial"] = {k: result.initial.get(k) for k in keys}
        meta["finetune_seconds"] = None if config is None else time.perf_counter() - start
        if save_drafters and ctx.main and not ngram:
            save_model(drafter, ctx.work / "finetuned", f"{experiment}__{pair}__{variant}__w{ctx.world}",
                       max_file_mb=cfg.max_file_mb, dtype=torch.float32)
        if ctx.main:
            after = _fingerprint(ctx, verifier, tokenizer, fingerprint_prompts)
            if after["weights_sha256"] != before["weights_sha256"]:
                raise RuntimeError(f"the verifier's weights changed while finetuning {pair} with {variant}")
            if after["greedy_sha256"] != before["greedy_sha256"]:  # same weights: kernel nondeterminism
                warnings.warn(f"the verifier's greedy outputs differ after finetuning {pair} with {variant} "
                              "although its weights are bitwise the same", RuntimeWarning, stacklevel=1)
            meta.update(verifier_greedy_identical=after["greedy_sha256"] == before["greedy_sha256"],
                        verifier_weights_sha256=after["weights_sha256"],
                        verifier_greedy_sha256=after["greedy_sha256"])
            wall_clock = cfg.wall_clock and (cfg.wall_clock_variants is None or variant in cfg.wall_clock_variants)
            start = time.perf_counter()
            evaluated = drafter if ngram else drafter.to(ctx.eval_dtype).eval()
            report = evaluate_pair(verifier, evaluated, data["evaluation"], tokenizer, cfg, cost, wall_clock,
                                   ctx.progress)
            meta["eval_seconds"] = time.perf_counter() - start
            meta["drafter_weights_sha256"] = None if ngram else weights_digest(drafter.state_dict())
            dominant = cfg.dominant_language if experiment == "languages" else None
            rows += report_rows(report, meta, run, share, dominant)
            write_rows(ctx, rows_name, rows)  # after every variant: a run cut short keeps what it finished
        del drafter
        clear_static_caches()
        barrier(ctx)
        clock.done(time.perf_counter() - unit_start)
    return rows


# --------------------------------------------------------------------------------------------------------------- ddp
def stage_ddp_compare(ctx: Context) -> list[dict[str, Any]]:
    """Compare every drafter finetuned by one process with the same run by more (``--save-drafters`` of the
    finetune stage wrote both): the largest absolute and the relative L2 difference of their weights."""
    folder = ctx.work / "finetuned"
    runs: dict[str, dict[int, str]] = {}
    for path in sorted(folder.glob("*__w*.safetensors")) if folder.is_dir() else []:
        match = re.fullmatch(r"(?P<prefix>.+)__w(?P<world>\d+)(?:-\d\d-of-\d\d)?\.safetensors", path.name)
        if match:
            runs.setdefault(match["prefix"], {})[int(match["world"])] = f"{match['prefix']}__w{match['world']}"
    rows = []
    for prefix, by_world in sorted(runs.items()):
        if 1 not in by_world or len(by_world) < 2:
            continue
        one = load_model(folder, by_world[1]).state_dict()
        for world, name in sorted(by_world.items()):
            if world == 1:
                continue
            other = load_model(folder, name).state_dict()
            max_abs = max(float((one[k] - other[k]).abs().max()) for k in one)
            diff = sum(float((one[k] - other[k]).double().pow(2).sum()) for k in one) ** 0.5
            norm = sum(float(one[k].double().pow(2).sum()) for k in one) ** 0.5
            experiment, pair, variant = prefix.split("__")
            rows.append({"kind": "ddp", "time": _now(), "experiment": experiment, "pair": pair, "variant": variant,
                         "world_size": world, "max_abs_weight_difference": max_abs,
                         "relative_l2_weight_difference": diff / norm if norm else None,
                         "settings": ctx.cfg.to_dict()})
    if not rows:
        raise ValueError(f"no pair of drafters finetuned by 1 and by more processes in {folder}: run the finetune "
                         "stage with --save-drafters once as one process and once under torchrun")
    write_rows(ctx, "ddp_compare", rows)
    return rows
