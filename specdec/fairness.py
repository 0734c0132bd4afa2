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
  ``speedup_measured`` over the verifier's own ``generate`` on the same prompts (:func:`measure_wall_clock_speedup`).

The cost ratio c = t_drafter / t_verifier is given or measured on the decoding step that :func:`specdec.generate`
runs (:func:`measure_decode_costs`); the report says which, with the measured spread (:class:`CostRatio`).

Across tasks: ``U = (1/m) sum_i (K_i - Kbar)^2`` on K_T (and on D_T, TV_T), spreads of alpha_T and of the predicted and
measured speed-ups, the Spearman correlation of fitness with the predicted speed-up, and per-character figures when a
tokenizer is given. The speed-up bounds
``E_s S(alpha(s)) >= S(1 - TV_T) >= S(max(0, 1 - sqrt(D_T / 2)))`` and the triangle bounds
``1 - r_q - r_p <= alpha_T <= 1 - r_q + r_p`` are checked; violations are recorded, never raised.

The per-prefix measurements live in :mod:`specdec.teacher_forcing` and the report (:class:`FairnessReport`,
:class:`TaskFairness`, markdown, JSON, PNG) in :mod:`specdec.fairness_report`; their public names are importable from
here too.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdec._models import check_model_pair, model_device, model_vocab_size
from specdec.fairness_report import FairnessReport, TaskFairness
from specdec.metrics import expected_tokens_per_call, speedup, speedup_lower_bounds
from specdec.teacher_forcing import (
    TokenDivergences,
    decoded_length,
    divergences_from_logits,
    encode_items,
    pad_batch,
    prefix_logits,
    prefix_rows,
    task_divergences,
    token_divergences,
)

__all__ = [
    "CostRatio",
    "FairnessReport",
    "TaskData",
    "TaskFairness",
    "TokenDivergences",
    "divergences_from_logits",
    "encode_items",
    "evaluate",
    "measure_cost_ratio",
    "measure_decode_costs",
    "measure_wall_clock_speedup",
    "pad_batch",
    "prefix_logits",
    "prefix_rows",
    "spearman",
    "task_divergences",
    "token_divergences",
    "unfairness",
    "WallClockSpeedup",
]

_BOUND_TOL = 1e-5


# ----------------------------------------------------------------------------------------------------------- inputs
@dataclass
class TaskData:
    """One task: ``prompts`` for real speculative-decoding runs, ``texts`` for teacher-forced divergences.

    Each is a list of strings (needs a tokenizer) or of token-id lists, or None. A plain sequence given as a task to
    :func:`evaluate` is taken as ``texts``; a mapping may have the keys ``"prompts"`` and ``"texts"``.
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
        if len(items) == 0:
            raise ValueError(f"tasks[{name!r}].{field_name} is empty")
    if data.prompts is None and data.texts is None:
        raise ValueError(f"tasks[{name!r}] has neither prompts nor texts")
    return data


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


# ------------------------------------------------------------------------------------------------------ timing
COST_RATIO_SOURCES = ("measured", "given")


@dataclass(frozen=True)
class CostRatio:
    """The cost ratio c = t_drafter / t_verifier of :func:`specdec.speedup`, and where it came from.

    ``source`` is ``"given"`` (a number from the caller) or ``"measured"`` (timed by :func:`measure_decode_costs`).
    A measured one also has the median seconds of one decoding step of each model (``drafter_step_s``,
    ``verifier_step_s``), the spread of the per-repetition ratios (``ratio_min``, ``ratio_p20``, ``ratio_p80``,
    ``ratio_max``) over ``repeats`` repetitions, the ``path`` of :func:`specdec.generate` that was timed
    (``"static"`` or ``"eager"``), and the ``batch_size`` and ``new_tokens`` of the timed calls.
    """

    value: float
    source: str = "given"
    drafter_step_s: float | None = None
    verifier_step_s: float | None = None
    ratio_min: float | None = None
    ratio_p20: float | None = None
    ratio_p80: float | None = None
    ratio_max: float | None = None
    repeats: int = 0
    path: str | None = None
    batch_size: int | None = None
    new_tokens: int | None = None

    def __post_init__(self) -> None:
        value = self.value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"cost_ratio must be a finite number >= 0, got {value!r}")
        if self.source not in COST_RATIO_SOURCES:
            raise ValueError(f"CostRatio.source must be one of {COST_RATIO_SOURCES}, got {self.source!r}")

    def summary(self) -> dict[str, Any]:
        """The report's summary keys: ``cost_ratio``, ``cost_ratio_source`` and, when measured, the spread."""
        out: dict[str, Any] = {"cost_ratio": float(self.value), "cost_ratio_source": self.source}
        if self.source == "measured":
            out.update({"cost_ratio_min": self.ratio_min, "cost_ratio_p20": self.ratio_p20,
                        "cost_ratio_p80": self.ratio_p80, "cost_ratio_max": self.ratio_max,
                        "cost_ratio_repeats": self.repeats, "drafter_step_s": self.drafter_step_s,
                        "verifier_step_s": self.verifier_step_s, "cost_ratio_path": self.path,
                        "cost_ratio_batch_size": self.batch_size, "cost_ratio_new_tokens": self.new_tokens})
        return out

    def describe(self) -> str:
        """One line for a report, e.g. ``c = 0.76 (measured: ...)`` or ``c = 0.1 (given)``."""
        if self.source == "given":
            return f"c = {self.value:.4g} (given)"
        return (f"c = {self.value:.4g} (measured: median of {self.repeats} timed repetitions of one decoding step of "
                f"specdec.generate, {self.path} path, batch {self.batch_size}; drafter "
                f"{self.drafter_step_s * 1e3:.3g} ms, verifier {self.verifier_step_s * 1e3:.3g} ms per step; "
                f"per-repetition ratios p20–p80 {self.ratio_p20:.4g}–{self.ratio_p80:.4g}, "
                f"min–max {self.ratio_min:.4g}–{self.ratio_max:.4g})")


@dataclass(frozen=True)
class WallClockSpeedup:
    """Measured wall-clock speed-up of :func:`specdec.generate` over the verifier's own ``generate`` on the same
    prompts with the same ``max_new_tokens`` and eos.

    ``speedup`` is the median over ``repeats`` repetitions of the ratio of generation rates, (speculative_tokens /
    t_speculative) / (plain_tokens / t_plain). Each repetition times every batch once with each method and redoes the
    same work (same seeds), so one pair of token counts serves every repetition. Greedy decoding emits the same
    tokens both ways, so the ratio is then t_plain / t_speculative. ``speculative_s`` and ``plain_s`` are the median
    seconds of one repetition; ``speedup_min`` and ``speedup_max`` the extreme per-repetition ratios. Below 1,
    speculative decoding was slower.
    """

    speedup: float
    speculative_s: float
    plain_s: float
    speedup_min: float
    speedup_max: float
    repeats: int
    speculative_tokens: int
    plain_tokens: int


def _quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile of a non-empty sequence (q in [0, 1])."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, call: Any, *args: Any, **kwargs: Any) -> tuple[float, Any]:
    """Seconds of ``call(*args, **kwargs)`` on ``device`` (synchronised before and after), and its result."""
    _synchronize(device)
    start = time.perf_counter()
    out = call(*args, **kwargs)
    _synchronize(device)
    return time.perf_counter() - start, out


def _max_positions(model: torch.nn.Module) -> int | None:
    value = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


@torch.no_grad()
def measure_decode_costs(verifier: torch.nn.Module, drafter: torch.nn.Module, *, batch_size: int = 1,
                         seq_len: int = 16, new_tokens: int = 32, repeats: int = 10, warmup: int = 1,
                         temperature: float = 0.0, seed: int = 0, vocab_size: int | None = None,
                         backend: str = "auto", static: bool | None = None) -> CostRatio:
    """Measure c = t_drafter / t_verifier on the decoding step that :func:`specdec.generate` runs.

    Each model decodes alone (``specdec.generate(model, model, ids, num_draft_tokens=0)``: plain decoding on the
    path ``generate`` takes on that device, static with CUDA graphs on CUDA, eager on the CPU) from the same random
    ``[batch_size, seq_len]`` prompts, once for ``new_tokens`` new tokens and once for one; the difference over
    ``new_tokens - 1`` is the time of one decoding step without the prompt pass. Every call is device-synchronised;
    ``warmup`` repetitions are run first and dropped. Within a repetition the two models are timed back to back (in
    alternating order), so a change of machine load between repetitions hits both, and each repetition gives one
    ratio; c is their median and the spread of the ratios is kept in the result.

    Args:
        verifier, drafter: Hugging Face causal LMs on one device.
        batch_size: rows per call (>= 1). seq_len: prompt length (>= 1). new_tokens: tokens per long call (>= 2).
        repeats: timed repetitions (>= 1). warmup: untimed repetitions first (>= 0).
        temperature: 0 (greedy, default) or the sampling temperature of the steps. seed: prompts and sampling.
        vocab_size: ids of the random prompts stay below it (default: the smaller output size).
        backend, static: passed to :func:`specdec.generate`.

    Returns:
        :class:`CostRatio` with ``source="measured"``.
    """
    from specdec._validation import check_backend, check_int_at_least, check_int_range, check_temperature
    from specdec.generate import generate

    check_model_pair(verifier, drafter)
    check_int_at_least(batch_size, "batch_size", 1)
    check_int_at_least(seq_len, "seq_len", 1)
    check_int_at_least(new_tokens, "new_tokens", 2)
    check_int_at_least(repeats, "repeats", 1)
    check_int_at_least(warmup, "warmup", 0)
    temperature = check_temperature(temperature)
    check_backend(backend)
    device = model_device(verifier)
    if model_device(drafter) != device:
        raise ValueError(f"drafter is on {model_device(drafter)} but verifier is on {device}: move them to one device")
    vocab = min(model_vocab_size(verifier, "verifier"), model_vocab_size(drafter, "drafter"))
    if vocab_size is not None:
        vocab = check_int_range(vocab_size, "vocab_size", 1, vocab + 1, note=" (the models' output sizes)")
    for name, model in (("verifier", verifier), ("drafter", drafter)):
        positions = _max_positions(model)
        if positions is not None and seq_len + new_tokens > positions:
            raise ValueError(f"seq_len + new_tokens = {seq_len} + {new_tokens} exceeds the {name}'s "
                             f"{positions} positions; lower seq_len or new_tokens")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=gen).to(device)
    paths: set[str] = set()

    def run(model: torch.nn.Module, tokens: int) -> float:
        seconds, out = _timed(device, generate, model, model, ids, max_new_tokens=tokens, num_draft_tokens=0,
                              temperature=temperature, seed=seed, backend=backend, pad_token_id=0, vocab_size=vocab,
                              static=static)
        paths.add(out.stats.path)
        return seconds

    def step_seconds(model: torch.nn.Module) -> float:
        long = run(model, new_tokens)
        short = run(model, 1)
        # never 0 or below: a step that timing noise swamps still yields a finite, positive ratio
        return max((long - short) / (new_tokens - 1), 1e-9, long * 1e-6)

    ratios, drafter_steps, verifier_steps = [], [], []
    for repetition in range(warmup + repeats):
        order = [("drafter", drafter), ("verifier", verifier)]
        if repetition % 2:
            order.reverse()
        steps = {name: step_seconds(model) for name, model in order}
        if repetition >= warmup:
            drafter_steps.append(steps["drafter"])
            verifier_steps.append(steps["verifier"])
            ratios.append(steps["drafter"] / steps["verifier"])
    return CostRatio(value=statistics.median(ratios), source="measured",
                     drafter_step_s=statistics.median(drafter_steps), verifier_step_s=statistics.median(verifier_steps),
                     ratio_min=min(ratios), ratio_p20=_quantile(ratios, 0.2), ratio_p80=_quantile(ratios, 0.8),
                     ratio_max=max(ratios), repeats=repeats, path="/".join(sorted(paths)), batch_size=batch_size,
                     new_tokens=new_tokens)


def measure_cost_ratio(verifier: torch.nn.Module, drafter: torch.nn.Module, *, batch_size: int = 1,
                       seq_len: int = 16, repeats: int = 10, warmup: int = 1, seed: int = 0) -> float:
    """c = t_drafter / t_verifier as a plain number: ``measure_decode_costs(...).value`` (see
    :func:`measure_decode_costs` for how it is timed and for its spread)."""
    return measure_decode_costs(verifier, drafter, batch_size=batch_size, seq_len=seq_len, repeats=repeats,
                                warmup=warmup, seed=seed).value


def _emitted_tokens(new: torch.Tensor, eos_ids: list[int]) -> int:
    """Tokens each row of ``new`` [B, N] emitted: up to and including its first eos (all N without one)."""
    if not eos_ids:
        return new.numel()
    is_eos = torch.isin(new, torch.tensor(eos_ids, device=new.device))
    first = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, new.shape[1])
    return int(first.sum())


@torch.no_grad()
def measure_wall_clock_speedup(verifier: torch.nn.Module, drafter: torch.nn.Module,
                               prompts: Sequence[Sequence[int]], *, num_draft_tokens: int = 4,
                               temperature: float = 0.0, max_new_tokens: int = 32, batch_size: int = 8,
                               repeats: int = 3, warmup: int = 1, seed: int = 0, backend: str = "auto",
                               eos_token_id: int | Sequence[int] | None = None, pad_token_id: int = 0,
                               vocab_size: int | None = None, static: bool | None = None) -> WallClockSpeedup:
    """Time :func:`specdec.generate` against the verifier's own Hugging Face ``generate`` on the same prompts.

    Both decode greedily (``temperature=0``) or sample at ``temperature`` (no top-k, no top-p), from the same
    left-padded batches of ``batch_size`` prompts, with the same ``max_new_tokens`` and ``eos_token_id`` (a row stops
    after its eos; None stops none, so both produce exactly ``max_new_tokens`` per prompt). Batch by batch,
    ``warmup`` untimed calls of each come first (graph capture, allocation), then ``repeats`` timed calls of each,
    alternating which goes first; every call is device-synchronised. Repetition r sums its calls over the batches
    and gives one ratio of generation rates (tokens per second; with greedy decoding both emit the same tokens, so
    this is the ratio of times); the speed-up is their median.

    Args:
        verifier, drafter: Hugging Face causal LMs on one device (the verifier needs a ``generate`` method).
        prompts: token-id lists (non-empty). num_draft_tokens: K >= 1. temperature: >= 0.
        max_new_tokens, batch_size, repeats: >= 1. warmup: >= 0. seed: sampling seeds.
        backend, static: passed to :func:`specdec.generate`. eos_token_id: int, list or None. pad_token_id: left
        padding. vocab_size: the shared id range when the models' output sizes differ.

    Returns:
        :class:`WallClockSpeedup`.
    """
    from specdec._seeding import derive_seed
    from specdec._validation import check_backend, check_int_at_least, check_temperature
    from specdec.generate import generate

    check_model_pair(verifier, drafter)
    if not callable(getattr(verifier, "generate", None)):
        raise TypeError("verifier must have a Hugging Face generate method to time plain decoding against")
    for name, value, low in (("num_draft_tokens", num_draft_tokens, 1), ("max_new_tokens", max_new_tokens, 1),
                             ("batch_size", batch_size, 1), ("repeats", repeats, 1), ("warmup", warmup, 0)):
        check_int_at_least(value, name, low)
    temperature = check_temperature(temperature)
    check_backend(backend)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    if any(isinstance(p, (str, bytes)) or not isinstance(p, Sequence) or len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a list of non-empty token-id lists")
    if eos_token_id is None:
        eos_ids: list[int] = []
    elif isinstance(eos_token_id, int) and not isinstance(eos_token_id, bool):
        eos_ids = [eos_token_id]
    elif isinstance(eos_token_id, Sequence) and all(isinstance(t, int) and not isinstance(t, bool)
                                                    for t in eos_token_id):
        eos_ids = list(eos_token_id)
    else:
        raise TypeError(f"eos_token_id must be an int, a list of ints or None, got {eos_token_id!r}")
    device = model_device(verifier)
    sampled = temperature > 0
    plain_options: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": sampled,
                                     "eos_token_id": eos_ids or None, "pad_token_id": pad_token_id}
    if sampled:
        plain_options.update(temperature=temperature, top_k=0, top_p=1.0)
    batches = [pad_batch(prompts[start:start + batch_size], pad_token_id, "left", device)
               for start in range(0, len(prompts), batch_size)]
    speculative_times, plain_times = [0.0] * repeats, [0.0] * repeats
    speculative_tokens = plain_tokens = 0

    def speculative(index: int, ids: torch.Tensor, mask: torch.Tensor) -> int:
        out = generate(verifier, drafter, ids, mask, max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens,
                       temperature=temperature, eos_token_id=eos_ids or None,
                       seed=derive_seed(seed, "wall_clock", index), backend=backend, pad_token_id=pad_token_id,
                       vocab_size=vocab_size, static=static)
        return int(out.stats.generated.sum())

    def plain(index: int, ids: torch.Tensor, mask: torch.Tensor) -> int:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(derive_seed(seed, "wall_clock", index))
            out = verifier.generate(input_ids=ids, attention_mask=mask, **plain_options)
        return _emitted_tokens(out[:, ids.shape[1]:], eos_ids)

    for index, (ids, mask) in enumerate(batches):
        for _ in range(warmup):
            speculative(index, ids, mask)
            plain(index, ids, mask)
        counts = {}
        for repetition in range(repeats):
            order = [(speculative, speculative_times), (plain, plain_times)]
            if (repetition + index) % 2:
                order.reverse()
            for method, times in order:
                seconds, counts[method] = _timed(device, method, index, ids, mask)
                times[repetition] += seconds
        speculative_tokens += counts[speculative]
        plain_tokens += counts[plain]
    ratios = [(speculative_tokens / max(s, 1e-12)) / (plain_tokens / max(p, 1e-12))
              for p, s in zip(plain_times, speculative_times, strict=True)]
    return WallClockSpeedup(speedup=statistics.median(ratios), speculative_s=statistics.median(speculative_times),
                            plain_s=statistics.median(plain_times), speedup_min=min(ratios), speedup_max=max(ratios),
                            repeats=repeats, speculative_tokens=speculative_tokens, plain_tokens=plain_tokens)


def _generation_figures(verifier: torch.nn.Module, drafter: torch.nn.Module, prompts: list[list[int]], *,
                        tokenizer: Any, num_draft_tokens: int, temperature: float, max_new_tokens: int,
                        batch_size: int, seed: int, backend: str, eos_token_id: int | Sequence[int] | None,
                        pad_token_id: int, vocab_size: int | None) -> dict[str, float | int | None]:
    from specdec._seeding import derive_seed
    from specdec.generate import generate

    device = model_device(verifier)
    drafted = accepted = generated = calls = tested = accepted_tested = 0
    chars = 0
    for batch_index, start in enumerate(range(0, len(prompts), batch_size)):
        chunk = prompts[start:start + batch_size]
        ids, mask = pad_batch(chunk, pad_token_id, "left", device)
        out = generate(verifier, drafter, ids, mask, max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens,
                       temperature=temperature, eos_token_id=eos_token_id, seed=derive_seed(seed, batch_index),
                       backend=backend, pad_token_id=pad_token_id, vocab_size=vocab_size)
        stats = out.stats
        drafted += int(stats.drafted.sum())
        accepted += int(stats.accepted.sum())
        generated += int(stats.generated.sum())
        calls += int(stats.verifier_calls.sum())
        tested += int(stats.attempted_per_position.sum())
        accepted_tested += int(stats.accepted_per_position.sum())
        if tokenizer is not None:
            width = ids.shape[1]
            for row in range(len(chunk)):
                new = out.sequences[row, width:width + int(stats.generated[row])].tolist()
                chars += decoded_length(tokenizer, new)  # an emitted eos is no text
    tokens_per_call = generated / calls if calls else float("nan")
    return {
        "num_prompts": len(prompts), "generated_tokens": generated,
        "alpha_measured": accepted_tested / tested if tested else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_call": tokens_per_call,
        "chars_per_call": chars / calls if (tokenizer is not None and calls) else None,
        "gen_chars_per_token": chars / generated if (tokenizer is not None and generated) else None,
    }


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


def evaluate(verifier: torch.nn.Module, drafter: torch.nn.Module,
             tasks: Mapping[str, TaskData | Mapping[str, Any] | Sequence[Any]], *, tokenizer: Any = None,
             num_draft_tokens: int = 4, temperature: float = 1.0, max_new_tokens: int = 32, batch_size: int = 8,
             max_examples: int | None = None, cost_ratio: float | CostRatio | None = None, seed: int = 0,
             progress: bool = True, backend: str = "auto", max_length: int | None = 512,
             eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
             vocab_size: int | None = None, add_special_tokens: bool = False, wall_clock: bool = True,
             wall_clock_repeats: int = 3) -> FairnessReport:
    """Measure how unequally a drafter-verifier pair accelerates each task.

    Args:
        verifier, drafter: Hugging Face causal LMs on one device sharing a vocabulary (neither is modified; both run
            under no_grad).
        tasks: name -> :class:`TaskData`, a mapping with ``"prompts"``/``"texts"``, or a sequence of texts.
        tokenizer: HF-style object with ``encode(text, add_special_tokens=False)`` and ``decode(ids)``; needed for
            string inputs and for the per-character figures.
        num_draft_tokens: K drafts per round (>= 1). temperature: >= 0, 0 is greedy (see
            :func:`divergences_from_logits`).
        max_new_tokens: tokens generated per prompt. batch_size: sequences per forward / generate call.
        max_examples: use at most this many prompts and texts per task. max_length: truncate texts to this many tokens.
        cost_ratio: c = t_drafter / t_verifier for the predicted speed-ups: a number (reported as given), a
            :class:`CostRatio` (reported with its own source, e.g. one measured once for several evaluations), or
            None to measure it with :func:`measure_decode_costs` on the decoding step of :func:`specdec.generate`
            (batch ``batch_size``, up to 32 new tokens, greedy or sampled like the evaluation).
        seed: seeds the generation runs. backend: divergence and rejection-sampling backend.
        eos_token_id, pad_token_id: for generation (pad default: tokenizer.pad_token_id, else eos, else 0).
        vocab_size: shared id range when the models' output sizes differ.
        wall_clock: for tasks with prompts, also measure the wall-clock speed-up of :func:`specdec.generate` over
            the verifier's own ``generate`` on those prompts with the same ``max_new_tokens`` and eos
            (:func:`measure_wall_clock_speedup`); it costs ``wall_clock_repeats + 1`` more passes of each over the
            prompts. wall_clock_repeats: timed repetitions of that measurement (>= 1).

    Returns:
        :class:`FairnessReport`.
    """
    from specdec._validation import check_backend, check_int_at_least, check_int_range, check_temperature

    check_model_pair(verifier, drafter)
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
        if isinstance(cost_ratio, bool) or not isinstance(cost_ratio, (int, float)):
            raise TypeError(f"cost_ratio must be a number >= 0, a CostRatio or None, got {type(cost_ratio).__name__}")
        if not math.isfinite(cost_ratio) or cost_ratio < 0:
            raise ValueError(f"cost_ratio must be a finite number >= 0, a CostRatio or None, got {cost_ratio!r}")
    if tokenizer is not None and not (hasattr(tokenizer, "encode") and hasattr(tokenizer, "decode")):
        raise TypeError("tokenizer must have encode(text, add_special_tokens=False) and decode(ids) methods")
    data = {str(name): _as_task_data(str(name), value) for name, value in tasks.items()}
    id_limit = min(model_vocab_size(verifier, "verifier"), model_vocab_size(drafter, "drafter"))
    if vocab_size is not None:
        id_limit = check_int_range(vocab_size, "vocab_size", 1, id_limit + 1, note=" (the models' output sizes)")
    if pad_token_id is None:
        pad_token_id = getattr(tokenizer, "pad_token_id", None)
        if pad_token_id is None:
            eos = eos_token_id if isinstance(eos_token_id, int) else (eos_token_id[0] if eos_token_id else None)
            pad_token_id = eos if eos is not None else 0
    check_int_range(pad_token_id, "pad_token_id", 0, id_limit)

    if cost_ratio is None:
        cost = measure_decode_costs(verifier, drafter, batch_size=batch_size,
                                    new_tokens=min(max(max_new_tokens, 8), 32), temperature=temperature, seed=seed,
                                    vocab_size=id_limit, backend=backend)
    elif isinstance(cost_ratio, CostRatio):
        cost = cost_ratio
    else:
        cost = CostRatio(value=float(cost_ratio), source="given")
    c = float(cost.value)
    K = num_draft_tokens

    from tqdm.auto import tqdm

    rows: list[TaskFairness] = []
    for name, task in tqdm(data.items(), desc="fairness", disable=not progress):
        row = TaskFairness(name=name)
        if task.texts is not None:
            texts = list(task.texts)[:max_examples]
            tokens, chars = encode_items(texts, tokenizer, f"tasks[{name!r}].texts", add_special_tokens, id_limit)
            div = task_divergences(verifier, drafter, {name: tokens}, batch_size=batch_size, temperature=temperature,
                                   backend=backend, max_length=max_length, pad_token_id=pad_token_id,
                                   vocab_size=vocab_size)[name]
            m = div.means()
            row.num_texts, row.num_tokens = len(texts), div.num_tokens
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
            if all(ch is not None for ch in chars):
                kept = [min(len(t), max_length) if max_length else len(t) for t in tokens]
                total_tokens = sum(kept)
                # characters of the truncated texts, approximated pro rata when truncation cut a text
                total_chars = sum(ch * k / max(len(t), 1) for ch, k, t in zip(chars, kept, tokens, strict=True))
                row.chars_per_token = total_chars / total_tokens if total_tokens else None
        if task.prompts is not None:
            prompts = list(task.prompts)[:max_examples]
            prompt_tokens, _ = encode_items(prompts, tokenizer, f"tasks[{name!r}].prompts", add_special_tokens)
            if any(len(p) == 0 for p in prompt_tokens):
                raise ValueError(f"tasks[{name!r}].prompts contains an empty prompt")
            gen = _generation_figures(verifier, drafter, prompt_tokens, tokenizer=tokenizer, num_draft_tokens=K,
                                      temperature=temperature, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                      seed=seed, backend=backend, eos_token_id=eos_token_id,
                                      pad_token_id=pad_token_id, vocab_size=vocab_size)
            row.num_prompts = gen["num_prompts"]
            row.alpha_measured, row.tokens_per_call = gen["alpha_measured"], gen["tokens_per_call"]
            row.acceptance_rate = gen["acceptance_rate"]
            row.speedup_predicted_generation = row.tokens_per_call / (K * c + 1.0)
            row.chars_per_call = gen["chars_per_call"]
            if wall_clock:
                timing = measure_wall_clock_speedup(
                    verifier, drafter, prompt_tokens, num_draft_tokens=K, temperature=temperature,
                    max_new_tokens=max_new_tokens, batch_size=batch_size, repeats=wall_clock_repeats, seed=seed,
                    backend=backend, eos_token_id=eos_token_id, pad_token_id=pad_token_id, vocab_size=vocab_size)
                row.speedup_measured = timing.speedup
                row.speedup_measured_min, row.speedup_measured_max = timing.speedup_min, timing.speedup_max
                row.speculative_seconds, row.plain_seconds = timing.speculative_s, timing.plain_s
            if row.chars_per_token is None and gen["gen_chars_per_token"] is not None:
                row.chars_per_token = gen["gen_chars_per_token"]
        rows.append(row)

    summary: dict[str, Any] = {"num_tasks": len(rows), "num_draft_tokens": K, **cost.summary(),
                               "temperature": temperature, "max_new_tokens": max_new_tokens,
                               "wall_clock_measured": any(r.speedup_measured is not None for r in rows)}
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
        summary["slower_tasks_measured"] = [r.name for r in timed if r.speedup_measured < 1.0]
    # Per-character figures: char_speedup = S_T * rho_T / mean(rho), rho_T = characters per token, i.e. the speed-up
    # in characters per unit of verifier time relative to plain decoding at the average characters per token.
    rho = [r.chars_per_token for r in rows if r.chars_per_token is not None]
    if rho and len(rho) == len(rows):
        rho_mean = sum(rho) / len(rho)
        for r in rows:
            if r.speedup_predicted is not None:
                r.char_speedup_predicted = r.speedup_predicted * r.chars_per_token / rho_mean
            if r.speedup_predicted_generation is not None:
                r.char_speedup_predicted_generation = r.speedup_predicted_generation * r.chars_per_token / rho_mean
        summary["chars_per_token_mean"] = rho_mean
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
