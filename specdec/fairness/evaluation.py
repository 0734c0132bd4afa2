"""Per-task disparity of speculative decoding: measurement and bounds.

For each task T (a set of reference texts and/or prompts) :func:`evaluate` measures, with p the verifier and q the
drafter after the same temperature, averaged over all prefixes s of the task's texts (teacher forcing):

* ``alpha_T = E alpha(s)``, ``alpha(s) = sum_x min(p, q) = 1 - TV(p, q)``; the predicted speed-up
  ``speedup_predicted = S(alpha_T)`` with ``S(a) = (1 - a^(K+1)) / ((1 - a)(K c + 1))``;
* ``K_T = E H(p, q)`` (cross-entropy), ``D_T = E KL(p || q)``, ``TV_T = E TV(p, q)``, ``H_T(p) = K_T - D_T``;
* with the text as reference (``pi_T`` one-hot on the observed next token y): ``r_q = 1 - E q(y|s)``,
  ``r_p = 1 - E p(y|s)``, drafter fitness ``1 - r_q``;
* from real :func:`specdec.generate` runs on the prompts: the measured acceptance rate and tokens per verifier call
  (and ``speedup_predicted_generation``, tokens per call over ``K c + 1``), and the measured wall-clock speed-up
  ``speedup_measured`` over the verifier's own ``generate`` (or, ``wall_clock_baseline="specdec"``, over
  ``specdec.generate`` with no drafts) on the same prompts (:func:`measure_wall_clock_speedup`); with the latter
  also ``speedup_measured_decode``, the same after each call's first token (the rounds alone).

The cost ratio c = t_drafter / t_verifier is given or measured on the decoding step that :func:`specdec.generate`
runs (:func:`measure_decode_costs`); the report says which, with the measured spread (:class:`CostRatio`).

Across tasks: ``U = (1/m) sum_i (K_i - Kbar)^2`` on K_T (and on D_T, TV_T), spreads of alpha_T and of the predicted and
measured speed-ups, the Spearman correlation of fitness with the predicted speed-up, and per-character figures when a
tokenizer is given. The speed-up bounds
``E_s S(alpha(s)) >= S(1 - TV_T) >= S(max(0, 1 - sqrt(D_T / 2)))`` and the triangle bounds
``1 - r_q - r_p <= alpha_T <= 1 - r_q + r_p`` are checked; violations are recorded, never raised.

The per-prefix measurements live in :mod:`specdec.fairness.teacher_forcing` and the report (:class:`FairnessReport`,
:class:`TaskFairness`, markdown, JSON, PNG) in :mod:`specdec.fairness.report`; their public names are importable from
here too.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdec._models import check_model_pair, pair_in_eval_mode
from specdec._validation import check_backend, check_int_at_least, check_int_range, check_temperature
from specdec.compat import SpecdecWarning, check_task_texts, pair_positions, shared_vocab_size, special_token_ids
from specdec.decoding.ngram import as_ngram_drafter, drafter_model
from specdec.fairness.metrics import expected_tokens_per_call, speedup, speedup_lower_bounds
from specdec.fairness.report import FairnessReport, TaskFairness
from specdec.fairness.speed import (
    WALL_CLOCK_BASELINES,
    CostRatio,
    SpeculativeRun,
    WallClockSpeedup,
    check_plain_generate,
    measure_decode_costs,
    measure_wall_clock_speedup,
    resolve_cost_ratio,
    run_speculative,
)
from specdec.fairness.teacher_forcing import (
    decoded_length,
    divergences_from_logits,
    encode_items,
    pad_batch,
    task_divergences,
)

__all__ = [
    "CostRatio",
    "FairnessReport",
    "TaskData",
    "TaskFairness",
    "divergences_from_logits",
    "encode_items",
    "evaluate",
    "measure_decode_costs",
    "measure_wall_clock_speedup",
    "pad_batch",
    "spearman",
    "task_divergences",
    "unfairness",
    "WallClockSpeedup",
]

_BOUND_TOL = 1e-5


# ----------------------------------------------------------------------------------------------------------- inputs
@dataclass
class TaskData:
    """One task: ``prompts`` for real speculative-decoding runs, ``texts`` for teacher-forced divergences.

    Each is a list of strings (needs a tokenizer) or of token-id lists, or None; an empty list counts as None when
    the other is given (a task with prompts alone is measured on generation alone). A plain sequence given as a task
    to :func:`evaluate` is taken as ``texts``; a mapping may have the keys ``"prompts"`` and ``"texts"``.
    """

    prompts: list[str] | list[list[int]] | None = None
    texts: list[str] | list[list[int]] | None = None


def _as_task_data(name: str, value: object) -> TaskData:
    if isinstance(value, TaskData):
        data = value
    elif isinstance(value, Mapping):
        unknown = set(value) - {"prompts", "texts"}
        if unknown:
            raise ValueError(f"tasks[{name!r}] may only have the keys 'prompts' and 'texts', got {sorted(unknown)}")
        data = TaskData(prompts=value.get("prompts"), texts=value.get("texts"))
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        data = TaskData(texts=list(value))
    else:
        raise TypeError(f"tasks[{name!r}] must be a TaskData, a mapping with 'prompts'/'texts' or a sequence of texts, "
                        f"got {type(value).__name__}")
    for field_name in ("prompts", "texts"):
        items = getattr(data, field_name)
        if items is None:
            continue
        if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
            raise TypeError(f"tasks[{name!r}].{field_name} must be a list of strings or token-id lists, "
                            f"got {type(items).__name__}")
    prompts = list(data.prompts) if data.prompts else None
    texts = list(data.texts) if data.texts else None
    if prompts is None and texts is None:
        raise ValueError(f"tasks[{name!r}] has neither prompts nor texts (both are missing or empty)")
    return TaskData(prompts=prompts, texts=texts)


# ------------------------------------------------------------------------------------------------- aggregates
def unfairness(values: Sequence[float] | torch.Tensor | Mapping[str, float]) -> float:
    """U = (1/m) sum_i (v_i - vbar)^2: population variance of per-task values (uniform task weights).

    ``values``: one number per task (a 1-D sequence or tensor, or a mapping task -> value). NaN raises ValueError; an
    infinite value (e.g. an infinite cross-entropy) gives ``inf``."""
    if isinstance(values, Mapping):
        values = list(values.values())
    if isinstance(values, torch.Tensor):
        if values.dim() > 1:
            raise ValueError(f"values must be 1-D (one value per task), got shape {tuple(values.shape)}")
        values = values.detach().double().flatten().tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"values must be a sequence of per-task numbers, got {type(values).__name__}")
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError) as exc:
        raise TypeError(f"values must hold numbers (one per task): {exc}") from None
    if not values:
        raise ValueError("values must contain at least one per-task value")
    if any(math.isnan(v) for v in values):
        raise ValueError(f"values must not contain NaN, got {values}")
    if any(math.isinf(v) for v in values):
        return math.inf  # e.g. a task with infinite cross-entropy (p > 0 where q = 0): unbounded dispersion
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / len(values)


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman rank correlation (average ranks for ties); None with fewer than 2 points or a constant input."""
    if len(x) != len(y):
        raise ValueError(f"x and y must have the same length, got {len(x)} and {len(y)}")
    if len(x) < 2:
        return None
    rx, ry = _ranks(x), _ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return None
    return sxy / math.sqrt(sxx * syy)


def _spread(values: Sequence[float], prefix: str) -> dict[str, float | None]:
    if not values:
        return {}
    low, high = min(values), max(values)
    return {f"{prefix}_mean": sum(values) / len(values), f"{prefix}_min": low, f"{prefix}_max": high,
            f"{prefix}_max_over_min": high / low if low > 0 else None,
            f"{prefix}_std": statistics.pstdev(values) if len(values) > 1 else 0.0}



def _generation_figures(runs: Sequence[SpeculativeRun], tokenizer: Any) -> dict[str, float | int | None]:
    """Acceptance, tokens and characters per verifier call of a task's :func:`specdec.generate` runs; the characters
    per token of the generated text (``gen_chars_per_token``) count its text tokens only (an emitted eos is none)."""
    drafted = accepted = generated = calls = tested = accepted_tested = prompts = 0
    chars = text_tokens = 0
    special = special_token_ids(tokenizer)
    for run in runs:
        stats = run.output.stats
        prompts += run.output.sequences.shape[0]
        drafted += int(stats.drafted.sum())
        accepted += int(stats.accepted.sum())
        generated += int(stats.generated.sum())
        calls += int(stats.verifier_calls.sum())
        tested += int(stats.attempted_per_position.sum())
        accepted_tested += int(stats.accepted_per_position.sum())
        if tokenizer is not None:  # one copy to the host per run
            width, sequences = run.prompt_width, run.output.sequences.tolist()
            for row, length in zip(sequences, stats.generated.tolist(), strict=True):
                chars += decoded_length(tokenizer, row[width:width + length])  # an emitted eos is no text
                text_tokens += sum(1 for t in row[width:width + length] if t not in special)
    # Every row's first verifier call is its prompt pass, which emits one token: per call means per round after it,
    # the measured counterpart of E[N] (as SpecDecodeStats.tokens_per_round).
    rounds = calls - prompts
    tokens_per_call = (generated - prompts) / rounds if rounds > 0 else float("nan")
    # characters per emitted token (an eos among them, with no characters) times emitted tokens per round
    chars_per_emitted = chars / generated if (tokenizer is not None and generated) else None
    return {
        "num_prompts": prompts, "generated_tokens": generated,
        "alpha_measured": accepted_tested / tested if tested else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_call": tokens_per_call,
        "chars_per_call": chars_per_emitted * tokens_per_call if chars_per_emitted is not None else None,
        "gen_chars_per_token": chars / text_tokens if (tokenizer is not None and text_tokens) else None,
    }


def _used_texts(name: str, tokens: list[list[int]], max_length: int | None) -> tuple[list[list[int]], list[int]]:
    """The texts of task ``name`` that are teacher-forced, cut to ``max_length`` tokens, and their indices: those of
    at least 2 tokens (a prefix and its next token). A :class:`SpecdecWarning` names the task and how many were left
    out; ValueError when none is left."""
    cut = [list(t)[:max_length] if max_length else list(t) for t in tokens]
    used = [index for index, ids in enumerate(cut) if len(ids) >= 2]
    if not used:
        raise ValueError(f"tasks[{name!r}].texts has no text of at least 2 tokens (nothing to teacher-force)")
    if len(used) < len(cut):
        warnings.warn(f"task {name!r}: {len(cut) - len(used)} of its {len(cut)} texts have fewer than 2 tokens and are "
                      f"left out of its figures (num_texts = {len(used)})", SpecdecWarning, stacklevel=4)
    return [cut[index] for index in used], used


def _chars_per_token(tokens: list[list[int]], kept: list[list[int]], chars: list[int | None],
                     tokenizer: Any) -> float | None:
    """rho = characters / text tokens over the teacher-forced part of each text: ``tokens`` [text] its ids, ``kept``
    the ids left after the cut, ``chars`` its characters (None: unknown, then rho is None). Text tokens leave out the
    tokenizer's special tokens (BOS etc., :func:`specdec.compat.special_token_ids`); a cut text's characters are
    counted pro rata of its text tokens kept."""
    if not chars or any(ch is None for ch in chars):
        return None
    special = special_token_ids(tokenizer)
    total_chars = total_tokens = 0.0
    for ids, part, ch in zip(tokens, kept, chars, strict=True):
        text = sum(1 for t in ids if t not in special)
        text_kept = sum(1 for t in part if t not in special)
        total_tokens += text_kept
        total_chars += ch * text_kept / text if text else 0.0
    return total_chars / total_tokens if total_tokens else None


def _check_bounds(row: TaskFairness, temperature: float) -> list[str]:
    violations = []
    if row.alpha is None or temperature == 0:
        return violations
    if row.speedup_predicted_prefix_mean < row.bound_tv - _BOUND_TOL * max(1.0, row.bound_tv):
        violations.append(f"{row.name}: E_s S(alpha(s)) = {row.speedup_predicted_prefix_mean:.6g} < S(1 - TV_T) = "
                          f"{row.bound_tv:.6g}")
    if row.bound_tv < row.bound_pinsker - _BOUND_TOL * max(1.0, row.bound_pinsker):
        violations.append(f"{row.name}: S(1 - TV_T) = {row.bound_tv:.6g} < S(1 - sqrt(D_T/2)) = "
                          f"{row.bound_pinsker:.6g} (Pinsker)")
    if row.speedup_predicted < row.bound_tv - _BOUND_TOL * max(1.0, row.bound_tv):
        violations.append(f"{row.name}: S(alpha_T) = {row.speedup_predicted:.6g} < S(1 - TV_T) = "
                          f"{row.bound_tv:.6g}")
    low, high = 1.0 - row.r_q - row.r_p, 1.0 - row.r_q + row.r_p
    if not (low - _BOUND_TOL <= row.alpha <= high + _BOUND_TOL):
        violations.append(f"{row.name}: alpha_T = {row.alpha:.6g} outside the fitness bounds "
                          f"[1 - r_q - r_p, 1 - r_q + r_p] = [{low:.6g}, {high:.6g}]")
    return violations


@pair_in_eval_mode
def evaluate(verifier: torch.nn.Module, drafter: torch.nn.Module,
             tasks: Mapping[str, TaskData | Mapping[str, Any] | Sequence[Any]], *, tokenizer: Any = None,
             num_draft_tokens: int = 4, temperature: float = 1.0, max_new_tokens: int = 32, batch_size: int = 8,
             max_examples: int | None = None, cost_ratio: float | CostRatio | None = None, seed: int = 0,
             progress: bool = True, backend: str = "auto", max_length: int | None = 512,
             eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
             vocab_size: int | None = None, add_special_tokens: bool = False, wall_clock: bool = True,
             wall_clock_repeats: int = 3, wall_clock_baseline: str = "hf") -> FairnessReport:
    """Measure how unequally a drafter-verifier pair accelerates each task.

    Both models run in eval mode for the call (no dropout: a model in train mode, such as a freshly built or a
    finetuned one, would give figures that change from call to call) and every submodule's mode is restored after.

    Args:
        verifier, drafter: Hugging Face causal LMs on one device sharing a vocabulary (neither is modified; both run
            under no_grad). The drafter may be :func:`specdec.ngram_drafter` (or ``"ngram"``): its teacher-forced
            alpha is the verifier's probability of the n-gram proposal, TV_T = 1 - alpha_T, and its cross-entropy and
            KL are infinite (a one-hot q), so U on them is too; its cost ratio is measured on its proposal step.
        tasks: name -> :class:`TaskData`, a mapping with ``"prompts"``/``"texts"``, or a sequence of texts.
        tokenizer: HF-style object with ``encode(text, add_special_tokens=False)`` and ``decode(ids)``; needed for
            string inputs and for the per-character figures.
        num_draft_tokens: K drafts per round (>= 1). temperature: >= 0, 0 is greedy (see
            :func:`divergences_from_logits`).
        max_new_tokens: tokens generated per prompt. batch_size: sequences per forward / generate call.
        max_examples: use at most this many prompts and texts per task (the rest are neither checked nor encoded).
        max_length: truncate texts to this many tokens. A text left with fewer than 2 tokens has no prefix to
            teacher-force: it is left out of every figure (``num_texts`` counts the texts used,
            ``num_texts_dropped`` the others) with a :class:`specdec.compat.SpecdecWarning`.
        cost_ratio: c = t_drafter / t_verifier for the predicted speed-ups: a number (reported as given), a
            :class:`CostRatio` (reported with its own source, e.g. one measured once for several evaluations), or
            None to measure it with :func:`measure_decode_costs` on the decoding step of :func:`specdec.generate`
            (batch ``batch_size``, up to 32 new tokens, greedy or sampled like the evaluation).
        seed: seeds the generation runs. backend: divergence and rejection-sampling backend.
        eos_token_id, pad_token_id: for generation (pad default: tokenizer.pad_token_id, else eos, else 0).
        vocab_size: shared id range when the models' output sizes differ.
        wall_clock: for tasks with prompts, also measure the wall-clock speed-up of :func:`specdec.generate` over
            the verifier's own ``generate`` on those prompts with the same ``max_new_tokens`` and eos
            (:func:`measure_wall_clock_speedup`; the verifier needs a ``generate`` method, checked before any task
            runs). The measured acceptance and tokens per call then come from the timed ``specdec.generate`` runs
            (the same calls and seeds as without the wall clock, :func:`run_speculative`); it costs
            ``wall_clock_repeats`` more passes of ``specdec.generate`` and ``wall_clock_repeats + 1`` of the
            verifier's ``generate`` over the prompts. wall_clock_repeats: timed repetitions (>= 1).
        wall_clock_baseline: ``"hf"`` (the verifier's ``generate``) or ``"specdec"`` (``specdec.generate`` with no
            drafts on the same path: the speed-up of speculation alone, what ``speedup_predicted`` predicts).

    Per character (with a tokenizer): ``chars_per_token`` is rho_T = characters of the task's texts (as used, a cut
    text pro rata) over their text tokens, special tokens such as BOS and EOS left out (without texts: those of the
    generated text); ``char_speedup_predicted = rho_T * S(alpha_T)`` and ``char_speedup_predicted_generation = rho_T *
    speedup_predicted_generation``, characters per unit of verifier-step time relative to one token per verifier
    call (each task's figure depends on that task alone).

    Returns:
        :class:`FairnessReport`.
    """

    drafter = as_ngram_drafter(drafter) or drafter
    facts = drafter_model(verifier, drafter)  # an n-gram drafter has the verifier's vocabulary and positions
    check_model_pair(verifier, facts)
    if not isinstance(tasks, Mapping):
        raise TypeError(f"tasks must be a mapping from task name to TaskData, got {type(tasks).__name__}")
    if len(tasks) == 0:
        raise ValueError("tasks must contain at least one task")
    for name, value in (("num_draft_tokens", num_draft_tokens), ("max_new_tokens", max_new_tokens),
                        ("batch_size", batch_size)):
        check_int_at_least(value, name, 1)
    check_int_at_least(max_examples, "max_examples", 1, allow_none=True)
    check_int_at_least(max_length, "max_length", 1, allow_none=True)
    check_int_at_least(wall_clock_repeats, "wall_clock_repeats", 1)
    if not isinstance(wall_clock, bool):
        raise TypeError(f"wall_clock must be True or False, got {wall_clock!r}")
    temperature = check_temperature(temperature)
    check_backend(backend)
    if cost_ratio is not None and not isinstance(cost_ratio, CostRatio):
        cost_ratio = CostRatio(value=cost_ratio, source="given")
    if tokenizer is not None and not (hasattr(tokenizer, "encode") and hasattr(tokenizer, "decode")):
        raise TypeError("tokenizer must have encode(text, add_special_tokens=False) and decode(ids) methods")
    data = {str(name): _as_task_data(str(name), value) for name, value in tasks.items()}
    if max_examples is not None:  # only what is used is checked, encoded and measured
        data = {name: TaskData(prompts=task.prompts[:max_examples] if task.prompts else None,
                               texts=task.texts[:max_examples] if task.texts else None)
                for name, task in data.items()}
    if wall_clock_baseline not in WALL_CLOCK_BASELINES:
        raise ValueError(f"wall_clock_baseline must be one of {WALL_CLOCK_BASELINES}, got {wall_clock_baseline!r}")
    if wall_clock and wall_clock_baseline == "hf" and any(task.prompts is not None for task in data.values()):
        check_plain_generate(verifier)
    # the ids both models take; output sizes that differ must be explained (padding rows of one vocabulary) by
    # vocab_size
    id_limit = shared_vocab_size(verifier, facts, vocab_size, tokenizer=tokenizer)
    if tokenizer is not None:  # unknown tokens, texts cut at the positions: one SpecdecWarning per task and problem
        check_task_texts(data, tokenizer, max_positions=pair_positions(verifier, facts), max_length=max_length,
                         max_new_tokens=max_new_tokens, add_special_tokens=add_special_tokens)
    if pad_token_id is None:
        pad_token_id = getattr(tokenizer, "pad_token_id", None)
        if pad_token_id is None:
            eos = eos_token_id if isinstance(eos_token_id, int) else (eos_token_id[0] if eos_token_id else None)
            pad_token_id = eos if eos is not None else 0
    check_int_range(pad_token_id, "pad_token_id", 0, id_limit)

    cost = resolve_cost_ratio(cost_ratio, verifier, drafter, batch_size=batch_size, max_new_tokens=max_new_tokens,
                              temperature=temperature, seed=seed, vocab_size=id_limit, backend=backend)
    c = float(cost.value)
    K = num_draft_tokens

    from tqdm.auto import tqdm

    rows: list[TaskFairness] = []
    for name, task in tqdm(data.items(), desc="fairness", disable=not progress):
        row = TaskFairness(name=name)
        if task.texts is not None:
            tokens, chars = encode_items(task.texts, tokenizer, f"tasks[{name!r}].texts", add_special_tokens, id_limit)
            kept, used = _used_texts(name, tokens, max_length)
            div = task_divergences(verifier, drafter, {name: kept}, batch_size=batch_size, temperature=temperature,
                                   backend=backend, pad_token_id=pad_token_id, vocab_size=id_limit)[name]
            m = div.means()
            row.num_texts, row.num_texts_dropped, row.num_tokens = len(used), len(tokens) - len(used), div.num_tokens
            row.alpha, row.cross_entropy, row.kl, row.tv, row.entropy = (m["alpha"], m["cross_entropy"], m["kl"],
                                                                        m["tv"], m["entropy"])
            row.r_q, row.r_p, row.fitness = m["r_q"], m["r_p"], 1.0 - m["r_q"]
            alpha_clamped = min(max(row.alpha, 0.0), 1.0)
            row.speedup_predicted = float(speedup(alpha_clamped, K, c))
            row.speedup_predicted_prefix_mean = float(speedup(div.alpha.double().clamp(0, 1), K, c).mean())
            if temperature > 0:  # TV_T and D_T are taken at T = 1 when greedy: they bound no greedy S_T
                row.bound_tv, row.bound_pinsker = speedup_lower_bounds(min(max(row.tv, 0.0), 1.0),
                                                                       max(row.kl, 0.0), K, c)
            row.tokens_per_call_predicted = float(expected_tokens_per_call(alpha_clamped, K))
            row.chars_per_token = _chars_per_token([tokens[i] for i in used], kept, [chars[i] for i in used],
                                                   tokenizer)
        if task.prompts is not None:
            prompt_tokens, _ = encode_items(task.prompts, tokenizer, f"tasks[{name!r}].prompts", add_special_tokens,
                                            id_limit)
            if any(len(p) == 0 for p in prompt_tokens):
                raise ValueError(f"tasks[{name!r}].prompts contains an empty prompt")
            generation = {"num_draft_tokens": K, "temperature": temperature, "max_new_tokens": max_new_tokens,
                          "batch_size": batch_size, "seed": seed, "backend": backend, "eos_token_id": eos_token_id,
                          "pad_token_id": pad_token_id, "vocab_size": id_limit}
            if wall_clock:  # the figures of generation come from the speculative runs that were timed
                timing = measure_wall_clock_speedup(verifier, drafter, prompt_tokens, repeats=wall_clock_repeats,
                                                    baseline=wall_clock_baseline, **generation)
                runs = timing.speculative_runs
                row.speedup_measured = timing.speedup
                row.speedup_measured_min, row.speedup_measured_max = timing.speedup_min, timing.speedup_max
                row.speculative_seconds, row.plain_seconds = timing.speculative_s, timing.plain_s
                row.speedup_measured_decode, row.first_token_seconds = (timing.decode_speedup,
                                                                        timing.plain_first_token_s)
            else:
                runs = run_speculative(verifier, drafter, prompt_tokens, **generation)
            gen = _generation_figures(runs, tokenizer)
            row.num_prompts = gen["num_prompts"]
            row.alpha_measured, row.tokens_per_call = gen["alpha_measured"], gen["tokens_per_call"]
            row.acceptance_rate = gen["acceptance_rate"]
            row.speedup_predicted_generation = row.tokens_per_call / (K * c + 1.0)
            row.chars_per_call = gen["chars_per_call"]
            if row.chars_per_token is None and gen["gen_chars_per_token"] is not None:
                row.chars_per_token = gen["gen_chars_per_token"]
        rows.append(row)

    summary: dict[str, Any] = {"num_tasks": len(rows), "num_draft_tokens": K, **cost.summary(),
                               "temperature": temperature, "max_new_tokens": max_new_tokens,
                               "wall_clock_measured": any(r.speedup_measured is not None for r in rows)}
    if summary["wall_clock_measured"]:
        summary["wall_clock_baseline"] = wall_clock_baseline
    scored = [r for r in rows if r.alpha is not None]
    if scored:
        summary["U_ce"] = unfairness([r.cross_entropy for r in scored])
        summary["U_kl"] = unfairness([r.kl for r in scored])
        summary["U_tv"] = unfairness([r.tv for r in scored])
        summary.update(_spread([r.alpha for r in scored], "alpha"))
        summary.update(_spread([r.speedup_predicted for r in scored], "speedup_predicted"))
        summary["worst_task"] = min(scored, key=lambda r: r.alpha).name
        summary["spearman_fitness_speedup_predicted"] = spearman([r.fitness for r in scored],
                                                                 [r.speedup_predicted for r in scored])
    generated = [r for r in rows if r.alpha_measured is not None]
    if generated:
        summary.update(_spread([r.alpha_measured for r in generated], "alpha_measured"))
        summary.update(_spread([r.tokens_per_call for r in generated], "tokens_per_call"))
    timed = [r for r in rows if r.speedup_measured is not None]
    if timed:
        summary.update(_spread([r.speedup_measured for r in timed], "speedup_measured"))
        decode = [r.speedup_measured_decode for r in timed if r.speedup_measured_decode is not None]
        summary.update(_spread(decode, "speedup_measured_decode"))
    # Per-character figures (DESIGN.md): char_speedup_predicted = rho_T S(alpha_T), rho_T = characters per text token:
    # characters per unit of verifier-step time relative to one token per verifier call. Each task's figure depends
    # on that task alone.
    for r in rows:
        if r.chars_per_token is None:
            continue
        if r.speedup_predicted is not None:
            r.char_speedup_predicted = r.chars_per_token * r.speedup_predicted
        if r.speedup_predicted_generation is not None:
            r.char_speedup_predicted_generation = r.chars_per_token * r.speedup_predicted_generation
    rho = [r.chars_per_token for r in rows if r.chars_per_token is not None]
    if rho:
        summary["chars_per_token_mean"] = sum(rho) / len(rho)
    char_s = [r.char_speedup_predicted for r in rows if r.char_speedup_predicted is not None]
    if char_s:
        summary.update(_spread(char_s, "char_speedup_predicted"))
    cpc = [r.chars_per_call for r in rows if r.chars_per_call is not None]
    if cpc:
        summary.update(_spread(cpc, "chars_per_call"))
    violations: list[str] = []
    for r in rows:
        violations += _check_bounds(r, temperature)
    summary["bounds_checked"] = bool(scored) and temperature > 0
    summary["bound_violations"] = violations
    return FairnessReport(tasks=rows, summary=summary)
