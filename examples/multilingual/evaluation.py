"""Evaluation of a pair on the MGSM languages (or other tasks) with :func:`specdec.evaluate`, the per-character
figures it does not give, and the verifier's fingerprint (weights and greedy outputs).

Per task T, evaluate's figures (alpha teacher-forced and in generation, tokens and characters per verifier call,
predicted and measured speed-up, K_T, D_T, TV_T, fitness, ``rho_T`` = characters per token and the per-character rate
``char_speedup_predicted = rho_T * S(alpha_T)``: characters per unit of verifier-step time relative to one token per
verifier call), and besides them:

* ``char_rate_generation = chars_per_call / (K c + 1)``: characters per unit of verifier-step time from the
  characters measured in generation;
* ``char_rate_measured = rho_T * speedup_measured``: the same from the timed wall clock;
* ``kl_per_char = D_T / rho_T``: the misfit per character the drafter can change.

Across tasks (the summary row): evaluate's summary (U on K_T, D_T, TV_T, mean / worst / std / max-min of alpha, of
the speed-ups and of the per-character rate, Spearman(fitness, predicted speed-up)), and besides it the spreads of the
two rates above and of rho_T, U on ``D_T / rho_T``, the task of the lowest rate, Spearman correlations of fitness (and
of the drafter's data share of each language) with the measured speed-up and the rate, and the dominant language's
alpha and rate.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch

from specdec.fairness.evaluation import TaskData, _spread, evaluate, spearman, unfairness

from .corpus import DEFAULT_TRIGGER, cot_prompt, special_ids


def mgsm_tasks(cfg: Any, tokenizer: Any, triggers: dict[str, str]) -> dict[str, TaskData]:
    """The evaluation tasks: one per language of ``cfg.eval_data`` (``"mgsm"``, the built-in set, or a folder in its
    format). Texts (teacher forcing): the first ``eval_texts`` of each language as given (question, newline, answer).
    Prompts (generation): the first ``eval_prompts`` questions, in the chain-of-thought template the models were
    trained on when ``prompt_template`` (``Question:`` / ``Answer:`` and the language's "let's think step by step"),
    encoded with the tokenizer's ``<bos>`` (if it adds one) and cut to their last ``max_prompt_tokens`` tokens."""
    from specdec.data import load_tasks

    languages = list(cfg.languages)
    loaded = load_tasks(cfg.eval_data, names=languages, as_task_data=False)
    tasks = {}
    for lang in languages:
        entry = loaded[lang]
        if not entry.texts or not entry.prompts:
            raise ValueError(f"eval_data {cfg.eval_data!r}: language {lang!r} needs prompts and texts")
        prompts = entry.prompts[: cfg.eval_prompts]
        if cfg.prompt_template:
            prompts = [cot_prompt(q, triggers.get(lang, DEFAULT_TRIGGER)) for q in prompts]
        tasks[lang] = TaskData(prompts=encode_prompts(tokenizer, prompts, cfg.max_prompt_tokens),
                               texts=list(entry.texts[: cfg.eval_texts]))
    return tasks


def encode_prompts(tokenizer: Any, prompts: list[str], most: int) -> list[list[int]]:
    """The tokenizer's ``<bos>`` (when it adds one) and the last tokens of every prompt, ``most`` ids in all at
    most."""
    bos = special_ids(tokenizer).bos
    prefix = [] if bos is None else [bos]
    out = []
    for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]:
        ids = list(ids)
        out.append(prefix + ids[max(0, len(ids) - (most - len(prefix))):])
    return out


def evaluate_pair(verifier: torch.nn.Module, drafter: torch.nn.Module, tasks: dict[str, TaskData], tokenizer: Any,
                  cfg: Any, cost: Any, wall_clock: bool, progress: bool) -> Any:
    """:func:`specdec.evaluate` with the pipeline's settings (the generation runs on ``specdec.generate``'s default
    path: static with CUDA graphs on a GPU; the wall clock against ``cfg.wall_clock_baseline``; pad and EOS ids the
    tokenizer's)."""
    ids = special_ids(tokenizer)
    return evaluate(verifier, drafter, tasks, tokenizer=tokenizer, num_draft_tokens=cfg.num_draft_tokens,
                    temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, batch_size=cfg.eval_batch_size,
                    cost_ratio=cost, seed=cfg.seed, progress=progress, max_length=cfg.max_length,
                    eos_token_id=ids.eos, pad_token_id=ids.pad, add_special_tokens=True, wall_clock=wall_clock,
                    wall_clock_repeats=cfg.wall_clock_repeats, wall_clock_baseline=cfg.wall_clock_baseline)


def report_rows(report: Any, meta: dict[str, Any], run: dict[str, Any], share: dict[str, float] | None,
                dominant: str | None) -> list[dict[str, Any]]:
    """One ``kind="task"`` row per task (``meta``, evaluate's figures of the task and the per-character figures it
    does not give) and one ``kind="summary"`` row (``meta``, ``run``: figures of the whole run, evaluate's summary and
    the figures across tasks it does not give)."""
    summary = report.summary
    c = float(summary.get("cost_ratio") or 0.0)
    K = int(summary.get("num_draft_tokens", 0))
    rows = []
    for task in report.tasks:
        row = {**meta, "kind": "task", "task": task.name, **dataclasses.asdict(task)}
        rho = task.chars_per_token
        row["char_rate_generation"] = (task.chars_per_call / (K * c + 1.0)
                                       if task.chars_per_call is not None else None)
        row["char_rate_measured"] = rho * task.speedup_measured if rho and task.speedup_measured else None
        row["kl_per_char"] = task.kl / rho if rho and task.kl is not None else None
        row["data_share"] = share.get(task.name) if share else None
        rows.append(row)
    out = {**meta, "kind": "summary", **{k: v for k, v in summary.items() if k != "bound_violations"},
           "bound_violations": len(summary.get("bound_violations", [])), **run}

    def column(key: str) -> list[float]:
        return [r[key] for r in rows if r.get(key) is not None]

    for key in ("char_rate_generation", "char_rate_measured", "chars_per_token"):
        out.update({k: v for k, v in _spread(column(key), key).items() if k not in summary})
    per_char = column("kl_per_char")
    out["U_kl_per_char"] = unfairness(per_char) if per_char and len(per_char) == len(rows) else None
    rated = [r for r in rows if r.get("char_speedup_predicted") is not None]
    if rated:
        out["worst_char_rate_task"] = min(rated, key=lambda r: r["char_speedup_predicted"])["task"]

    def rank(x_key: str, y_key: str) -> float | None:
        pairs = [(r[x_key], r[y_key]) for r in rows if r.get(x_key) is not None and r.get(y_key) is not None]
        if len(pairs) < 3:
            return None
        return spearman([p[0] for p in pairs], [p[1] for p in pairs])

    out["spearman_fitness_speedup_measured"] = rank("fitness", "speedup_measured")
    out["spearman_fitness_char_rate"] = rank("fitness", "char_speedup_predicted")
    out["spearman_share_char_rate"] = rank("data_share", "char_speedup_predicted")
    out["spearman_share_alpha"] = rank("data_share", "alpha")
    if dominant is not None:
        for r in rows:
            if r["task"] == dominant:
                out["dominant_task"] = dominant
                out["dominant_alpha"] = r.get("alpha")
                out["dominant_char_rate"] = r.get("char_speedup_predicted")
    rows.append(out)
    return rows


@torch.no_grad()
def verifier_fingerprint(verifier: torch.nn.Module, prompts: list[list[int]], new_tokens: int, *, pad_token_id: int,
                         eos_token_id: int) -> dict[str, str]:
    """SHA-256 of the verifier's weights and of its greedy continuations (Hugging Face ``generate``, ``new_tokens``
    of each of ``prompts``, left-padded with ``pad_token_id``): equal before and after finetuning when the verifier
    is unchanged."""
    from specdec.fairness import pad_batch
    from specdec.training.checkpoint import weights_digest

    device = next(verifier.parameters()).device
    was_training = verifier.training
    verifier.eval()
    ids, mask = pad_batch(prompts, pad_token_id, "left", device)
    out = verifier.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                            pad_token_id=pad_token_id, eos_token_id=eos_token_id)
    verifier.train(was_training)
    greedy = hashlib.sha256(out.cpu().numpy().tobytes()).hexdigest()
    return {"weights_sha256": weights_digest(verifier.state_dict()), "greedy_sha256": greedy}
