"""Drafter-only finetuning that lowers the disparity of speculative decoding across tasks (s-CDF and baselines).

Each step draws a global minibatch of text windows, runs the frozen verifier (no grad) and the drafter on it, and
minimises a weighted distillation loss ``sum_n omega_n H(p_n, q_n)`` through
:func:`specdec.divergence_loss` (fused Triton kernel on CUDA). The methods differ only in the sampling
and in ``omega`` (``K_i``: task i's mean CE on the minibatch, ``N_i`` its token count, ``N`` the total):

* ``"scdf"``: ``batch_size_per_task`` windows of every task; ``omega_n = w_i / N_i`` with corrective weights
  ``w_i = v_i - min_j v_j + weight_floor`` computed on ``weight_basis`` v in {CE, KL, TV} (see
  :mod:`specdec.training.losses`).
* ``"exact_variance"``: the same with ``w_i = v_i - vbar``, i.e. gradient descent on U itself (levels down).
* ``"balanced"``: equal task sampling, ``w_i = 1`` (the sum of the per-task means, m times their mean: the logged
  loss and the gradient are m times those of a mean).
* ``"uniform_kd"``: DistillSpec-style KD on the natural mixture: ``batch_size_per_task * m`` windows drawn uniformly
  from the pooled texts, ``omega_n = 1 / N``.

Per character (``per_character=True``, with ``"scdf"`` or ``"exact_variance"``): tokens are not the unit a reader
feels, so the weights are taken on nats per character. With ``rho_i`` the characters per token of task i (from its
texts and the tokenizer, or given as ``chars_per_token``), the per-task values become ``v_i / rho_i`` (e.g. the
misfit per character ``D_i / rho_i`` on the KL basis), the corrective weights ``w_i = v_i / rho_i - min_j v_j / rho_j
+ weight_floor`` (``v_i / rho_i - mean_j v_j / rho_j`` for exact variance), and the objective the per-character
cross-entropy ``sum_i w_i K_i / rho_i``, i.e. ``omega_n = w_i / (rho_i N_i)``. With every ``rho_i = 1`` it is the
per-token run exactly.

Mixed with the natural mixture (``mixture_weight`` ``beta`` > 0, with ``"scdf"`` or ``"exact_variance"`` and
``normalize_weights=True``): corrective weights take the place of the data mixture, so the task that dominates it
can lose ground. The mixed run keeps a share ``beta`` of uniform distillation on the same windows:
``omega_n = (beta * pi_i + (1 - beta) * w_i) / N_i`` (per character ``w_i / rho_i`` in place of ``w_i``), with
``pi_i`` task i's share of the training tokens, ``sum_j (min(len_j, seq_len) - 1)`` over its training texts divided
by that sum over all tasks: the share uniform KD's pooled draws give it in expectation. The loss is then
``beta * sum_i pi_i K_i + (1 - beta) * sum_i w_i K_i`` with ``sum_i |w_i| = 1``; it costs no extra model call, and
``beta = 1`` is uniform KD's expected loss estimated on per-task windows (lower variance for the small tasks than
pooled draws), ``beta = 0`` the method alone.

Under ``torch.distributed`` (e.g. ``torchrun``) the drafter is wrapped in DDP; every process draws the same global
minibatch and keeps its slice (rows ``rank::world_size``), per-task sums and counts are all-reduced before the weights
are computed, and each process backpropagates ``world_size * sum_{n local} omega_n H_n``, so the DDP gradient average
equals the one-process gradient of the global objective.

Evaluation texts are held out: without ``eval_tasks``, a seeded split (:func:`held_out_split`, ``eval_fraction`` and
``split_seed`` of the config) sets aside a share of every task's texts for the evaluations, and training never sees
them; pass ``eval_fraction=0`` to evaluate on training texts instead (a measure of fit, not of generalisation).

The training settings are one :class:`FinetuneConfig` (:mod:`specdec.training.config`); checkpoints are written and
read by :mod:`specdec.training.checkpoint` (the public names of both are importable from here too).
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec._models import check_model_pair, eval_mode, float32_logits, model_device
from specdec._validation import check_int_at_least, check_int_range, check_number
from specdec.compat import check_task_texts, pair_positions, shared_vocab_size, special_token_ids
from specdec.fairness import unfairness
from specdec.fairness.divergences import divergence, divergence_loss
from specdec.fairness.teacher_forcing import (
    encode_items,
    pad_batch,
    prefix_logits,
    prefix_rows,
    task_divergences,
)
from specdec.training.checkpoint import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_NAME,
    CheckpointError,
    check_resumable,
    deferred_interrupt,
    drafter_identity,
    load_checkpoint,
    restore_checkpoint,
    save_checkpoint,
    tasks_digest,
)
from specdec.training.config import (
    METHODS,
    PER_CHARACTER_METHODS,
    WEIGHT_BASES,
    FinetuneConfig,
    check_method_tasks,
    resolve_config,
)
from specdec.training.losses import (
    mix_multipliers_unchecked,
    per_character_weights_unchecked,
    token_weights_unchecked,
)

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_NAME",
    "METHODS",
    "WEIGHT_BASES",
    "CheckpointError",
    "FinetuneConfig",
    "FinetuneInterrupted",
    "FinetuneResult",
    "check_seq_len",
    "finetune_drafter",
    "held_out_split",
    "load_checkpoint",
    "save_checkpoint",
]


class FinetuneInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped :func:`finetune_drafter` at the end of a step: ``step`` is the last step run (of
    ``steps``) and ``checkpoint_path`` the checkpoint saved at it, from which the same call resumes (None without a
    ``checkpoint_dir``: nothing was saved). A KeyboardInterrupt, so code that catches those still stops."""

    def __init__(self, step: int, steps: int, checkpoint_path: str | None) -> None:
        self.step, self.steps, self.checkpoint_path = step, steps, checkpoint_path
        saved = (f"checkpoint saved to {checkpoint_path}: the same call resumes from it" if checkpoint_path is not None
                 else "no checkpoint_dir, so nothing was saved")
        super().__init__(f"finetuning interrupted after step {step} of {steps}; {saved}")


@dataclass
class FinetuneResult:
    """Result of :func:`finetune_drafter`.

    drafter: the (in-place updated) drafter. history: one dict per evaluation (step 0 first, the final step last)
    with ``step``, ``U`` (on the weight basis), ``U_ce``, ``U_kl``, ``U_tv``, ``mean_alpha``, ``worst_alpha``,
    ``worst_task``, ``per_task`` (name -> ``{"ce", "kl", "tv", "alpha"}``) and ``train_loss`` (mean objective since
    the previous evaluation). losses: the objective of every step run in this call. steps: the last step reached.
    resumed_from: the step loaded from a checkpoint (0 when starting fresh). checkpoint_path: the checkpoint file.
    config: the settings of the run. held_out: task -> the indices (into that task's texts as given) of the texts
    held out for the evaluations and not trained on; None when ``eval_tasks`` were given or ``eval_fraction`` is 0.
    chars_per_token: task -> ``rho_i``, the characters per token the per-character weights used (given or measured
    on the task's texts); None when neither ``per_character`` nor ``chars_per_token=`` asked for them. With it, every
    history entry also has ``U_char_ce``, ``U_char_kl`` and ``U_char_tv``, the unfairness of ``v_i / rho_i`` over
    every evaluated task, and with ``per_character`` ``U`` is ``U_char`` on the weight basis. Its ``repr`` names the
    drafter's class and summarises the run (the model and the history are left out).
    """

    drafter: torch.nn.Module
    history: list[dict[str, Any]]
    losses: list[float] = field(default_factory=list)
    steps: int = 0
    method: str = "scdf"
    weight_basis: str = "ce"
    resumed_from: int = 0
    checkpoint_path: str | None = None
    config: FinetuneConfig | None = None
    held_out: dict[str, list[int]] | None = None
    chars_per_token: dict[str, float] | None = None

    @property
    def initial(self) -> dict[str, Any]:
        return self.history[0]

    @property
    def final(self) -> dict[str, Any]:
        return self.history[-1]

    def __repr__(self) -> str:
        first, last = (self.history[0], self.history[-1]) if self.history else ({}, {})
        return (f"FinetuneResult(method={self.method!r}, weight_basis={self.weight_basis!r}, steps={self.steps}, "
                f"resumed_from={self.resumed_from}, U={first.get('U')!r} -> {last.get('U')!r}, "
                f"worst_alpha={first.get('worst_alpha')!r} -> {last.get('worst_alpha')!r}, "
                f"evaluations={len(self.history)}, drafter={type(self.drafter).__name__}, "
                f"checkpoint_path={self.checkpoint_path!r})")


def _tokenize_tasks(tasks: object, tokenizer: Any, name: str, add_special_tokens: bool, vocab_size: int,
                    count_chars: bool = True) -> tuple[dict[str, list[tuple[int, list[int]]]], dict[str, float]]:
    """Every text of ``tasks`` encoded once: ``{task: [(index of the text, its token ids), ...]}`` keeping the texts
    of at least 2 tokens, and ``{task: rho}``, the characters per token ``sum len(text) / sum (text tokens)`` over
    the kept texts (text tokens: the ids less the tokenizer's special tokens such as BOS,
    :func:`specdec.compat.special_token_ids`), for the tasks whose characters can be counted (strings, or token-id
    lists with a tokenizer to decode them); ``count_chars=False`` counts none (empty ``{}``, no ``decode`` call).
    Token ids outside
    ``[0, vocab_size)`` raise ValueError naming the text; with a tokenizer, a task whose text it does not cover is
    warned about (:func:`specdec.compat.check_task_texts`)."""
    if not isinstance(tasks, Mapping):
        raise TypeError(f"{name} must be a mapping from task name to a list of texts or token-id lists, "
                        f"got {type(tasks).__name__}")
    if len(tasks) == 0:
        raise ValueError(f"{name} must contain at least one task")
    out: dict[str, list[tuple[int, list[int]]]] = {}
    rho: dict[str, float] = {}
    encoded_tasks: dict[str, list[list[int]]] = {}
    special = special_token_ids(tokenizer)
    for task, items in tasks.items():
        if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
            raise TypeError(f"{name}[{task!r}] must be a list of texts or token-id lists, got {type(items).__name__}")
        encoded, chars = encode_items(items, tokenizer, f"{name}[{task!r}]", add_special_tokens, vocab_size,
                                      count_chars=count_chars)
        kept = [index for index, ids in enumerate(encoded) if len(ids) >= 2]
        if not kept:
            raise ValueError(f"{name}[{task!r}] has no text of at least 2 tokens")
        out[str(task)] = [(index, encoded[index]) for index in kept]
        counted = [chars[index] for index in kept]
        text_tokens = sum(1 for index in kept for t in encoded[index] if t not in special)
        if None not in counted and sum(counted) > 0 and text_tokens > 0:
            rho[str(task)] = sum(counted) / text_tokens
        encoded_tasks[str(task)] = encoded
    if tokenizer is not None:  # a tokenizer that does not cover a task's text: warn, naming the task
        check_task_texts(encoded_tasks, tokenizer)
    return out, rho


def check_seq_len(seq_len: int, verifier: Any, drafter: Any) -> int:
    """``seq_len`` when windows of that many tokens fit both models' positions (:func:`specdec.compat.pair_positions`),
    else ValueError saying how many they have."""
    seq_len = check_int_at_least(seq_len, "seq_len", 2)
    positions = pair_positions(verifier, drafter)
    if positions is not None and seq_len > positions:
        raise ValueError(f"seq_len {seq_len} is more than the models' {positions} positions (max_position_embeddings): "
                         f"use {positions} or less")
    return seq_len


def held_out_split(sizes: Mapping[str, int], eval_fraction: float = 0.1, max_examples: int = 32,
                   seed: int = 0) -> dict[str, list[int]]:
    """The indices of the texts held out for evaluation, per task: ``min(ceil(eval_fraction * n), max_examples)`` of a
    task's ``n`` texts, at least 1, chosen by a shuffle seeded with ``seed`` and the task's name (so one task's split
    does not depend on the others), returned sorted. The rest are the training texts. ValueError for a task with
    fewer than 2 texts (nothing would be left to train on or to evaluate).
    """
    check_number(eval_fraction, "eval_fraction", 0.0, strict=True)
    if eval_fraction >= 1:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    check_int_at_least(max_examples, "max_examples", 1)
    check_int_range(seed, "seed", 0, 2**64)
    split: dict[str, list[int]] = {}
    for task, size in sizes.items():
        check_int_at_least(size, f"sizes[{task!r}]", 0)
        if size < 2:
            raise ValueError(f"tasks[{task!r}] has {size} usable text(s) (of at least 2 tokens): too few to hold out "
                             "evaluation texts and train on the rest; give more texts, pass eval_tasks=, or set "
                             "eval_fraction=0 to evaluate on the training texts")
        count = min(max(1, math.ceil(eval_fraction * size)), max_examples, size - 1)
        order = list(range(size))
        random.Random(f"specdec-held-out/{seed}/{task}").shuffle(order)
        split[str(task)] = sorted(order[:count])
    return split


def _resolve_chars_per_token(given: Mapping[str, float] | None, per_character: bool, names: list[str],
                             measured: Mapping[str, float], eval_measured: Mapping[str, float],
                             eval_names: Sequence[str] = ()) -> dict[str, float] | None:
    """task -> rho (characters per token) for the training and evaluation tasks, or None when not asked for:
    ``given``, else the ``measured`` ones of the training tasks and the ``eval_measured`` ones of the others.
    ValueError naming the first task of ``names`` or ``eval_names`` (the evaluated tasks) without one, since the
    per-character U is taken over every evaluated task."""
    rho = _chars_per_token_of_training_tasks(given, per_character, names, measured, eval_measured)
    if rho is None:
        return None
    missing = [n for n in eval_names if n not in rho]
    if missing:
        source = ("give it in chars_per_token=" if given is not None else
                  "give the texts of eval_tasks as strings with tokenizer=, a tokenizer to decode their token ids, "
                  "or chars_per_token= with an entry for it")
        raise ValueError(f"the per-character U is taken over every evaluated task, and evaluated task {missing[0]!r} "
                         f"(of eval_tasks) has no characters per token: {source}")
    return rho


def _chars_per_token_of_training_tasks(given: Mapping[str, float] | None, per_character: bool, names: list[str],
                                       measured: Mapping[str, float],
                                       eval_measured: Mapping[str, float]) -> dict[str, float] | None:
    """:func:`_resolve_chars_per_token` before the evaluated tasks are checked."""
    if given is None and not per_character:
        return None
    if given is not None:
        if not isinstance(given, Mapping):
            raise TypeError(f"chars_per_token must be a mapping from task name to characters per token, got "
                            f"{type(given).__name__}")
        checked = {str(name): check_number(value, f"chars_per_token[{name!r}]", 0.0, strict=True)
                   for name, value in given.items()}
        missing = [n for n in names if n not in checked]
        if missing:
            raise ValueError(f"chars_per_token has no entry for task(s) {', '.join(map(repr, missing))}: give one "
                             "for every task of tasks")
        return checked
    rho = dict(measured)
    missing = [n for n in names if n not in rho]
    if missing:
        raise ValueError(f"per_character=True needs the characters per token of task {missing[0]!r}: give its texts "
                         f"as strings with tokenizer=, a tokenizer to decode its token ids, or chars_per_token="
                         f"{{{missing[0]!r}: ...}}")
    rho.update({n: value for n, value in eval_measured.items() if n not in rho})
    return rho


def _window(seq: list[int], seq_len: int, generator: torch.Generator) -> list[int]:
    if len(seq) <= seq_len:
        return seq
    start = int(torch.randint(0, len(seq) - seq_len + 1, (1,), generator=generator))
    return seq[start:start + seq_len]


def _draw_global_batch(method: str, corpus: list[list[list[int]]], batch_size_per_task: int, seq_len: int,
                       generator: torch.Generator) -> list[tuple[int, list[int]]]:
    """(task index, token window) rows of one global minibatch; identical on every process (same generator)."""
    rows: list[tuple[int, list[int]]] = []
    if method == "uniform_kd":
        pooled = [(i, j) for i, seqs in enumerate(corpus) for j in range(len(seqs))]
        picks = torch.randint(0, len(pooled), (batch_size_per_task * len(corpus),), generator=generator).tolist()
        for p in picks:
            i, j = pooled[p]
            rows.append((i, _window(corpus[i][j], seq_len, generator)))
    else:
        for i, seqs in enumerate(corpus):
            picks = torch.randint(0, len(seqs), (batch_size_per_task,), generator=generator).tolist()
            rows += [(i, _window(seqs[j], seq_len, generator)) for j in picks]
    return rows


def task_token_shares(corpus: Sequence[Sequence[Sequence[int]]], seq_len: int) -> list[float]:
    """Every task's share of the training tokens under uniform KD's pooled draws: ``sum_j (min(len_j, seq_len) - 1)``
    over task i's texts (the next-token positions of a window), divided by that sum over all tasks; [m] floats that
    sum to 1. ``corpus``: per task, its training texts as token-id lists (each of at least 2 tokens)."""
    positions = [sum(min(len(seq), seq_len) - 1 for seq in seqs) for seqs in corpus]
    total = sum(positions)
    return [count / total for count in positions]


def _evaluate(verifier: torch.nn.Module, drafter: torch.nn.Module, eval_tokens: dict[str, list[list[int]]],
              weight_basis: str, temperature: float, vocab_size: int, batch_size: int, backend: str,
              rho: Mapping[str, float] | None = None, per_character: bool = False) -> dict[str, Any]:
    """One history entry: both models in eval mode, forward passes in float32 (never under autocast: bf16 logits
    bias KL and U upwards), per-task means and the U's over every evaluated task."""
    with torch.autocast(device_type=model_device(drafter).type, enabled=False):
        divs = task_divergences(verifier, drafter, eval_tokens, batch_size=batch_size, temperature=temperature,
                                backend=backend, vocab_size=vocab_size)
    per_task = {}
    for name, div in divs.items():
        m = div.means()
        per_task[name] = {"ce": m["cross_entropy"], "kl": m["kl"], "tv": m["tv"], "alpha": m["alpha"]}
    alphas = {n: v["alpha"] for n, v in per_task.items()}
    worst = min(alphas, key=alphas.get)
    entry = {f"U_{b}": unfairness([v[b] for v in per_task.values()]) for b in WEIGHT_BASES}
    if rho is not None:  # every evaluated task has its rho (checked before the run)
        for b in WEIGHT_BASES:
            entry[f"U_char_{b}"] = unfairness([per_task[n][b] / rho[n] for n in per_task])
    basis_u = entry[f"U_char_{weight_basis}"] if per_character else entry[f"U_{weight_basis}"]
    entry.update({"U": basis_u, "mean_alpha": sum(alphas.values()) / len(alphas),
                  "worst_alpha": alphas[worst], "worst_task": worst, "per_task": per_task})
    return entry


def _check_models(drafter: torch.nn.Module, verifier: torch.nn.Module) -> torch.device:
    """The models' device, after checking that the drafter is a separate, trainable module next to the verifier."""
    check_model_pair(verifier, drafter)
    if verifier is drafter:
        raise ValueError("drafter and verifier must be different modules (the verifier is frozen)")
    verifier_storage = {p.untyped_storage().data_ptr() for p in verifier.parameters()}
    shared = [name for name, p in drafter.named_parameters() if p.untyped_storage().data_ptr() in verifier_storage]
    if shared:
        raise ValueError(f"drafter shares parameters with the verifier ({', '.join(shared[:4])}"
                         f"{', ...' if len(shared) > 4 else ''}): finetuning would modify the frozen verifier; give "
                         "the drafter its own copies")
    if not any(p.requires_grad for p in drafter.parameters()):
        raise ValueError("drafter has no parameter with requires_grad=True: nothing to finetune")
    device = model_device(drafter)
    if model_device(verifier) != device:
        raise ValueError(f"verifier is on {model_device(verifier)} but drafter is on {device}: use one device")
    return device


def _step_weights(cfg: FinetuneConfig, task_ids: torch.Tensor, div: Any, num_tasks: int,
                  distributed: bool, rho: torch.Tensor | None = None, shares: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Per-token weights, per-task weights, per-task basis values and the logged objective of one minibatch.

    Per-task sums and counts of CE, KL and TV are all-reduced under ``torch.distributed`` so every process computes
    the weights of the global minibatch. With ``cfg.per_character``, ``rho`` [m] holds the characters per token of
    every task: the basis values are ``v_i / rho_i``, the weights ``w_i`` the corrective (or exact-variance) formula
    on them, the per-token weights ``w_i / (rho_i N_i)`` and the objective ``sum_i w_i K_i / rho_i``. With
    ``cfg.mixture_weight`` ``beta`` > 0, ``shares`` [m] holds the token shares ``pi_i`` and the multiplier of ``K_i``
    becomes ``beta * pi_i + (1 - beta) * w_i`` (``w_i / rho_i`` per character); the weights returned stay the ``w_i``.
    """
    import torch.distributed as dist

    device = task_ids.device
    stats = torch.zeros(4, num_tasks, dtype=torch.float64, device=device)
    for k, value in enumerate((div.cross_entropy, div.kl, div.tv)):
        stats[k].index_add_(0, task_ids, value.double())
    stats[3].index_add_(0, task_ids, torch.ones_like(task_ids, dtype=torch.float64))
    if distributed:
        dist.all_reduce(stats)
    counts = stats[3]
    values = stats[:3] / counts.clamp_min(1)
    basis = values[WEIGHT_BASES.index(cfg.weight_basis)]
    if cfg.method == "uniform_kd":
        token_weights = torch.full_like(task_ids, 1.0, dtype=torch.float32) / counts.sum().float()
        weights = counts.float() / counts.sum().float()
        return token_weights, weights, basis, float(stats[0].sum() / counts.sum())
    basis, weights, multipliers = per_character_weights_unchecked(
        basis, rho if cfg.per_character else torch.ones_like(counts),
        cfg.method if cfg.method in PER_CHARACTER_METHODS else "uniform", floor=cfg.weight_floor,
        normalize=cfg.normalize_weights, present=counts > 0)
    if cfg.mixture_weight > 0:
        multipliers = mix_multipliers_unchecked(multipliers, shares, cfg.mixture_weight, counts > 0)
    token_weights = token_weights_unchecked(task_ids, multipliers, counts)
    return token_weights, weights, basis, float((multipliers.double() * values[0]).sum())


def finetune_drafter(
    drafter: torch.nn.Module,
    verifier: torch.nn.Module,
    tasks: Mapping[str, Sequence[str] | Sequence[list[int]]],
    *,
    config: FinetuneConfig | None = None,
    tokenizer: Any = None,
    eval_tasks: Mapping[str, Sequence[str] | Sequence[list[int]]] | None = None,
    add_special_tokens: bool = False,
    pad_token_id: int = 0,
    vocab_size: int | None = None,
    progress: bool = True,
    callback: Callable[[int, dict[str, Any]], None] | None = None,
    chars_per_token: Mapping[str, float] | None = None,
    **settings: Any,
) -> FinetuneResult:
    """Finetune ``drafter`` in place toward ``verifier`` with s-CDF or a baseline; the verifier is never modified.

    Modes and precision: the evaluations run both models in eval mode (no dropout) with float32 forward passes, so a
    history entry does not depend on ``autocast`` or on the mode a model arrived in; the training steps run the
    drafter in train mode (dropout, if it has any, is part of training) and, with ``autocast``, the forward passes in
    bf16 with the output heads in float32, so the s-CDF weights and the loss see float32 logits. Every submodule of
    both models gets its own mode back at the end.

    Ctrl-C (outside ``torch.distributed``): the step under way is finished, a checkpoint is saved at it (with a
    ``checkpoint_dir``) and :class:`FinetuneInterrupted` (a KeyboardInterrupt) is raised; the same call then resumes.
    A second Ctrl-C stops at once.

    Args:
        drafter: HF causal LM to train (its parameters are updated in place).
        verifier: HF causal LM on the same device; run in eval mode under no_grad, its parameters untouched.
        tasks: name -> list of texts (needs ``tokenizer``) or of token-id lists; the training data of each task.
        config: the training settings, a :class:`FinetuneConfig` (default: ``FinetuneConfig()``).
        tokenizer: HF-style tokenizer with ``encode(text, add_special_tokens=...)``, for string texts.
        eval_tasks: held-out texts for the evaluations, like ``tasks``, each cut to its first ``seq_len`` tokens
            (the longest window the drafter is trained on). Default: a seeded share of every task's texts
            held out from training (``eval_fraction``, ``eval_examples`` and ``split_seed`` of the config; see
            :func:`held_out_split`), cropped to ``seq_len``; ``eval_fraction=0`` evaluates on the first
            ``eval_examples`` training texts instead.
        add_special_tokens: passed to ``tokenizer.encode`` for string texts (e.g. to prepend BOS).
        pad_token_id: id used to right-pad windows (masked out: a resumed run may change it, as it may change
            ``backend``, without changing a figure). vocab_size: shared id range of the two models;
            needed when their output layers differ in size (see :func:`specdec.compat.resolve_vocab_size`).
        progress: tqdm bar (rank 0 only).
        callback: called as ``callback(step, info)`` after every step (info has ``loss``, ``weights``,
            ``task_values`` (per character with ``per_character``), ``grad_norm``, the global gradient norm before
            clipping, ``chars_per_token``, the ``rho_i`` in task order, or None, and ``task_shares``, the token
            shares ``pi_i`` in task order with ``mixture_weight`` > 0, else None).
        chars_per_token: task -> characters per token ``rho_i`` (> 0) for the per-character weights and figures,
            covering every task of ``tasks`` and of ``eval_tasks`` (the per-character U is taken over every
            evaluated task). Default: measured on the texts as given, ``sum len(text) / sum (text tokens)`` per
            task, special tokens such as BOS left out (token-id lists are decoded with ``tokenizer``), when
            ``per_character`` is on; otherwise no per-character figures.
        **settings: the fields of :class:`FinetuneConfig` as keywords (``method="scdf", steps=100, lr=5e-4, ...``),
            which build the config when ``config`` is not given. Giving both, or a name that is not a field, raises
            TypeError naming the keyword.

    Returns:
        :class:`FinetuneResult`.

    Raises ValueError when the models' output sizes differ and ``vocab_size`` is not given, when ``seq_len`` is more
    than the models' positions, when a task has too few texts to hold some out, when the method trains nothing on
    the tasks given (``"scdf"`` without ``weight_floor`` or ``"exact_variance"`` on one task:
    :func:`specdec.training.config.check_method_tasks`), or when per-character figures are asked for and a training
    or evaluated task's characters per token can be neither measured nor found in ``chars_per_token``; raises
    :class:`CheckpointError` when the checkpoint to resume is another run's (other settings, such as ``vocab_size``
    or ``autocast``, or another drafter: :func:`specdec.training.checkpoint.check_resumable`). Warns
    (:class:`specdec.compat.SpecdecWarning`) for a task whose texts the tokenizer turns into many unknown tokens.
    """
    import torch.distributed as dist
    from tqdm.auto import tqdm


    device = _check_models(drafter, verifier)
    cfg = resolve_config(config, settings)
    vocab_size = shared_vocab_size(verifier, drafter, vocab_size, tokenizer=tokenizer)
    check_int_range(pad_token_id, "pad_token_id", 0, vocab_size)
    check_seq_len(cfg.seq_len, verifier, drafter)
    autocast = device.type == "cuda" if cfg.autocast is None else bool(cfg.autocast)

    count_chars = cfg.per_character and chars_per_token is None  # rho measured on the texts only then
    tokenized, measured = _tokenize_tasks(tasks, tokenizer, "tasks", add_special_tokens, vocab_size, count_chars)
    names = list(tokenized)
    check_method_tasks(cfg, names)
    held_out = None
    eval_measured: dict[str, float] = {}
    if eval_tasks is not None:  # cut to seq_len as the held-out texts are: the windows the drafter is trained on
        corpus_map = {n: [t for _, t in rows] for n, rows in tokenized.items()}
        eval_tokenized, eval_measured = _tokenize_tasks(eval_tasks, tokenizer, "eval_tasks", add_special_tokens,
                                                        vocab_size, count_chars)
        eval_tokens = {n: [t[:cfg.seq_len] for _, t in rows] for n, rows in eval_tokenized.items()}
    elif cfg.eval_fraction == 0:  # evaluated on training texts, as asked
        corpus_map = {n: [t for _, t in rows] for n, rows in tokenized.items()}
        eval_tokens = {n: [s[:cfg.seq_len] for s in corpus_map[n][:cfg.eval_examples]] for n in names}
    else:
        split = held_out_split({n: len(rows) for n, rows in tokenized.items()}, cfg.eval_fraction,
                               cfg.eval_examples, cfg.split_seed)
        held_out = {n: [tokenized[n][i][0] for i in split[n]] for n in names}
        kept = {n: set(range(len(rows))) - set(split[n]) for n, rows in tokenized.items()}
        corpus_map = {n: [t for i, (_, t) in enumerate(rows) if i in kept[n]] for n, rows in tokenized.items()}
        eval_tokens = {n: [tokenized[n][i][1][:cfg.seq_len] for i in split[n]] for n in names}
    corpus = [corpus_map[n] for n in names]
    num_tasks = len(names)
    rho_map = _resolve_chars_per_token(chars_per_token, cfg.per_character, names, measured, eval_measured,
                                       list(eval_tokens))
    rho_list = [rho_map[n] for n in names] if rho_map is not None else None  # [m] in task order
    rho = torch.tensor(rho_list, dtype=torch.float64, device=device) if cfg.per_character else None
    share_list = task_token_shares(corpus, cfg.seq_len) if cfg.mixture_weight > 0 else None  # [m] pi_i
    shares = torch.tensor(share_list, dtype=torch.float64, device=device) if share_list is not None else None

    distributed = dist.is_available() and dist.is_initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    rows_per_step = cfg.batch_size_per_task * num_tasks
    if rows_per_step < world:
        raise ValueError(f"batch_size_per_task * num_tasks = {rows_per_step} is smaller than the world size {world}: "
                         "every process needs at least one sequence")

    # what a checkpoint must match to be resumed (the data included, through its digest); pad_token_id and backend
    # change no figure (padding is masked, both backends compute one function), so a resume may change them
    run_settings = {"method": cfg.method, "weight_basis": cfg.weight_basis, "weight_floor": cfg.weight_floor,
                    "tasks": names, "task_sizes": [len(c) for c in corpus],
                    "batch_size_per_task": cfg.batch_size_per_task, "seq_len": cfg.seq_len, "lr": cfg.lr,
                    "weight_decay": cfg.weight_decay, "max_grad_norm": cfg.max_grad_norm,
                    "temperature": cfg.temperature, "seed": cfg.seed, "normalize_weights": cfg.normalize_weights,
                    "eval_fraction": cfg.eval_fraction, "split_seed": cfg.split_seed,
                    "tasks_digest": tasks_digest(corpus, eval_tokens), "per_character": cfg.per_character,
                    "chars_per_token": rho_list if cfg.per_character else None, "vocab_size": vocab_size,
                    "autocast": autocast, "mixture_weight": cfg.mixture_weight}
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    generator = torch.Generator().manual_seed(cfg.seed)
    ckpt_path = os.path.join(os.fspath(cfg.checkpoint_dir), CHECKPOINT_NAME) if cfg.checkpoint_dir is not None else None
    checkpoint_every = cfg.checkpoint_every or cfg.eval_every
    history: list[dict[str, Any]] = []
    start_step = 0
    since_eval: list[float] = []

    def evaluate_now(step: int, train_loss: float | None) -> None:
        entry = {"step": step, **_evaluate(verifier, drafter, eval_tokens, cfg.weight_basis, cfg.temperature,
                                           vocab_size, cfg.batch_size_per_task, cfg.backend, rho_map,
                                           cfg.per_character)}
        entry["train_loss"] = train_loss
        history.append(entry)

    with eval_mode(verifier, drafter):  # every submodule's mode is restored on the way out
        if ckpt_path is not None:
            identity = drafter_identity(drafter)  # of the drafter the run starts from, kept through resumes
            if cfg.resume and os.path.exists(ckpt_path):
                ckpt = load_checkpoint(ckpt_path)  # CheckpointError on a bad file: nothing is overwritten
                identity = check_resumable(ckpt, run_settings, identity, ckpt_path)
                restore_checkpoint(ckpt, drafter, optimizer, generator, ckpt_path)
                start_step = int(ckpt["meta"]["step"])
                history = list(ckpt["meta"]["history"])
                since_eval = [float(x) for x in ckpt["meta"].get("since_eval", [])]
            run_settings.update(identity)
        if not history:
            evaluate_now(0, None)

        model = drafter
        if distributed:
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(drafter, device_ids=[device.index] if device.type == "cuda" else None)

        def save(step: int) -> None:
            if ckpt_path is None:
                return
            if rank == 0:
                save_checkpoint(ckpt_path, drafter, optimizer, step, generator, history, run_settings, since_eval)
            if distributed:
                dist.barrier()

        losses: list[float] = []
        drafter.train()  # dropout in the training steps only; the evaluations run in eval mode
        bar = tqdm(total=cfg.steps, initial=min(start_step, cfg.steps), desc=f"finetune[{cfg.method}]",
                   disable=not progress or rank != 0)
        try:
            with deferred_interrupt(enabled=not distributed) as interrupt:
                for step in range(start_step + 1, cfg.steps + 1):
                    rows = _draw_global_batch(cfg.method, corpus, cfg.batch_size_per_task, cfg.seq_len,
                                              generator)[rank::world]
                    ids, mask = pad_batch([r[1] for r in rows], pad_token_id, "right", device)
                    row_task = torch.tensor([r[0] for r in rows], dtype=torch.int64, device=device)
                    # bf16 forward under autocast, float32 logits: the weights and the loss see no bf16 rounding
                    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast), \
                            float32_logits(verifier), float32_logits(drafter):
                        with torch.no_grad():
                            v_logits, _ = prefix_logits(verifier, ids, mask, vocab_size)
                        d_logits, _ = prefix_logits(model, ids, mask, vocab_size)
                    task_ids = row_task[prefix_rows(mask)]
                    with torch.no_grad():
                        div = divergence(v_logits, d_logits.detach(), temperature=cfg.temperature,
                                         backend=cfg.backend)
                        token_weights, weights, basis, objective = _step_weights(cfg, task_ids, div, num_tasks,
                                                                                 distributed, rho, shares)
                    loss = divergence_loss(d_logits, v_logits, weights=token_weights, temperature=cfg.temperature,
                                           reduction="sum", backend=cfg.backend)
                    (loss * world).backward()
                    grad_norm = float(torch.nn.utils.clip_grad_norm_(
                        drafter.parameters(), cfg.max_grad_norm if cfg.max_grad_norm is not None else float("inf")))
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    losses.append(objective)
                    since_eval.append(objective)
                    bar.update(1)
                    if callback is not None:
                        callback(step, {"loss": objective, "weights": weights.tolist(), "task_values": basis.tolist(),
                                        "grad_norm": grad_norm,
                                        "chars_per_token": None if rho_list is None else list(rho_list),
                                        "task_shares": share_list})
                    is_last = step == cfg.steps
                    if is_last or (cfg.eval_every is not None and step % cfg.eval_every == 0):
                        evaluate_now(step, sum(since_eval) / len(since_eval))
                        since_eval = []
                        u_now = history[-1]["U"]
                        bar.set_postfix(U="–" if u_now is None else f"{u_now:.4g}",
                                        worst_alpha=f"{history[-1]['worst_alpha']:.3f}")
                    saved = is_last or (checkpoint_every is not None and step % checkpoint_every == 0)
                    if saved:
                        save(step)
                    if interrupt.requested and not is_last:  # Ctrl-C: stop after a whole step, resumable
                        if not saved:
                            save(step)
                        raise FinetuneInterrupted(step, cfg.steps, ckpt_path)
        finally:
            bar.close()
    return FinetuneResult(drafter=drafter, history=history, losses=losses, steps=max(start_step, cfg.steps),
                          method=cfg.method, weight_basis=cfg.weight_basis, resumed_from=start_step,
                          checkpoint_path=ckpt_path, config=cfg, held_out=held_out, chars_per_token=rho_map)
