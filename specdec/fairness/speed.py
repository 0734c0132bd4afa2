"""Timing on the decoding step of :func:`specdec.generate`: the cost ratio c and the wall-clock speed-up.

:func:`measure_decode_costs` times each model decoding alone through :func:`specdec.generate` with
``num_draft_tokens=0`` (so on the path ``generate`` takes on that device: static with CUDA graphs on CUDA, eager on
the CPU); a step is ``(t(N new tokens) - t(1)) / (N - 1)``, which leaves out the prompt's call, and c is the median
of per-repetition ratios with the two models timed back to back in alternating order. :func:`measure_wall_clock_speedup`
times ``specdec.generate`` against the verifier's own ``generate`` (or against ``specdec.generate`` with no drafts, the
speed-up of speculation alone) on the same prompts, warmed up and synchronised, and
keeps its speculative runs (:class:`SpeculativeRun`), so acceptance and tokens per call can be read from the runs that
were timed. :func:`resolve_cost_ratio` turns a given c, a :class:`CostRatio` or None (measure it) into a
:class:`CostRatio`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec._models import check_model_pair, model_device, pair_in_eval_mode
from specdec._seeding import derive_seed
from specdec._validation import (
    check_backend,
    check_int_at_least,
    check_int_range,
    check_number,
    check_temperature,
    eos_id_list,
)
from specdec.compat import model_positions, shared_vocab_size
from specdec.decoding.generation import generate
from specdec.decoding.ngram import as_ngram_drafter, drafter_model, ngram_step_seconds
from specdec.fairness.report import cost_ratio_line
from specdec.fairness.teacher_forcing import pad_batch

__all__ = ["COST_RATIO_SOURCES", "WALL_CLOCK_BASELINES", "CostRatio", "SpeculativeRun", "WallClockSpeedup",
           "check_plain_generate", "measure_decode_costs", "measure_wall_clock_speedup", "resolve_cost_ratio",
           "run_speculative"]

COST_RATIO_SOURCES = ("measured", "given")
WALL_CLOCK_BASELINES = ("hf", "specdec")
"""What :func:`measure_wall_clock_speedup` times speculative decoding against: the verifier's Hugging Face
``generate``, or ``specdec.generate`` with no drafts on the same path."""


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
        object.__setattr__(self, "value", check_number(self.value, "cost_ratio", 0.0))
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
        """One line for a report: ``cost ratio c = 0.1 (given)``, or the measured c with how it was measured and its
        spread (:func:`specdec.fairness.report.cost_ratio_line`)."""
        return cost_ratio_line(self.summary())


def resolve_cost_ratio(cost_ratio: float | CostRatio | None, verifier: torch.nn.Module, drafter: torch.nn.Module, *,
                       batch_size: int = 1, max_new_tokens: int = 32, temperature: float = 0.0, seed: int = 0,
                       vocab_size: int | None = None, backend: str = "auto") -> CostRatio:
    """``cost_ratio`` as a :class:`CostRatio`: a CostRatio as it is, a number labelled ``"given"``, and None measured
    now with :func:`measure_decode_costs` (``batch_size`` rows, ``max_new_tokens`` clamped to [8, 32] new tokens, at
    ``temperature``, prompt ids below ``vocab_size``)."""
    if isinstance(cost_ratio, CostRatio):
        return cost_ratio
    if cost_ratio is not None:
        return CostRatio(value=cost_ratio, source="given")
    return measure_decode_costs(verifier, drafter, batch_size=batch_size, new_tokens=min(max(max_new_tokens, 8), 32),
                                temperature=temperature, seed=seed, vocab_size=vocab_size, backend=backend)


@dataclass(frozen=True)
class SpeculativeRun:
    """One batch of prompts decoded by :func:`specdec.generate`: ``output`` (its ``GenerateOutput``) and
    ``prompt_width``, the columns of the left-padded prompt batch; row r's new tokens are
    ``output.sequences[r, prompt_width:prompt_width + output.stats.generated[r]]``."""

    prompt_width: int
    output: Any


@dataclass(frozen=True)
class WallClockSpeedup:
    """Measured wall-clock speed-up of :func:`specdec.generate` over plain decoding by the verifier (``baseline``:
    ``"hf"``, its own ``generate``, or ``"specdec"``, ``specdec.generate`` with no drafts) on the same prompts with
    the same ``max_new_tokens`` and eos.

    ``speedup`` is the median over ``repeats`` repetitions of the ratio of generation rates, (speculative_tokens /
    t_speculative) / (plain_tokens / t_plain). Each repetition times every batch once with each method and redoes the
    same work (same seeds), so one pair of token counts serves every repetition. Greedy decoding emits the same
    tokens both ways, so the ratio is then t_plain / t_speculative. ``speculative_s`` and ``plain_s`` are the median
    seconds of one repetition; ``speedup_min`` and ``speedup_max`` the extreme per-repetition ratios. Below 1,
    speculative decoding was slower. ``speculative_runs``: the last timed ``specdec.generate`` call of each batch, in
    prompt order (what :func:`run_speculative` returns for the same arguments).

    With ``baseline="specdec"`` both sides are :func:`specdec.generate` calls, whose stats split each call at its
    first token: ``speculative_first_token_s`` and ``plain_first_token_s`` are the median seconds per repetition up
    to each batch's first token (setup and the prompt pass, the same work on both sides), and ``decode_speedup`` the
    median ratio of the rates after it, (tokens - rows) / (wall - time to first token) per side: the speed-up of the
    rounds alone, the figure S(alpha, K, c) models. None with ``baseline="hf"``.
    """

    speedup: float
    speculative_s: float
    plain_s: float
    speedup_min: float
    speedup_max: float
    repeats: int
    speculative_tokens: int
    plain_tokens: int
    baseline: str = "hf"
    decode_speedup: float | None = None
    speculative_first_token_s: float | None = None
    plain_first_token_s: float | None = None
    speculative_runs: tuple[SpeculativeRun, ...] = field(default=(), repr=False)


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


@pair_in_eval_mode
@torch.no_grad()
def measure_decode_costs(verifier: torch.nn.Module, drafter: torch.nn.Module, *, batch_size: int = 1,
                         seq_len: int = 16, new_tokens: int = 32, repeats: int = 10, warmup: int = 1,
                         temperature: float = 0.0, seed: int = 0, vocab_size: int | None = None,
                         backend: str = "auto", static: bool | None = None) -> CostRatio:
    """Measure c = t_drafter / t_verifier on the decoding step that :func:`specdec.generate` runs.

    Each model decodes alone (``specdec.generate(model, model, ids, num_draft_tokens=0)``: plain decoding on the
    path ``generate`` takes on that device, static with CUDA graphs on CUDA, eager on the CPU) from the same random
    ``[batch_size, seq_len]`` prompts, once for ``new_tokens`` new tokens and once for one; the difference over
    ``new_tokens - 1`` is the time of one decoding step without the prompt pass. An n-gram drafter
    (:func:`specdec.ngram_drafter`, or ``"ngram"``) has no model to decode with: its step is one proposal over
    ``seq_len + new_tokens`` tokens, timed from a CUDA graph replay on CUDA (as the static path runs it) and as a
    plain call elsewhere (:func:`specdec.decoding.ngram.ngram_step_seconds`). Every call is device-synchronised;
    ``warmup`` repetitions are run first and dropped. Within a repetition the two models are timed back to back (in
    alternating order), so a change of machine load between repetitions hits both, and each repetition gives one
    ratio; c is their median and the spread of the ratios is kept in the result.

    Args:
        verifier, drafter: Hugging Face causal LMs on one device (or an n-gram drafter), run in eval mode (modes
            restored after).
        batch_size: rows per call (>= 1). seq_len: prompt length (>= 1). new_tokens: tokens per long call (>= 2).
        repeats: timed repetitions (>= 1). warmup: untimed repetitions first (>= 0).
        temperature: 0 (greedy, default) or the sampling temperature of the steps. seed: prompts and sampling.
        vocab_size: ids of the random prompts stay below it (default: the models' common output size; ValueError
            when their output sizes differ, see :func:`specdec.compat.resolve_vocab_size`).
        backend, static: passed to :func:`specdec.generate`.

    Returns:
        :class:`CostRatio` with ``source="measured"``.
    """

    ngram = as_ngram_drafter(drafter)
    drafter = ngram or drafter
    facts = drafter_model(verifier, drafter)  # an n-gram drafter has the verifier's device and vocabulary
    check_model_pair(verifier, facts)
    check_int_at_least(batch_size, "batch_size", 1)
    check_int_at_least(seq_len, "seq_len", 1)
    check_int_at_least(new_tokens, "new_tokens", 2)
    check_int_at_least(repeats, "repeats", 1)
    check_int_at_least(warmup, "warmup", 0)
    temperature = check_temperature(temperature)
    check_backend(backend)
    device = model_device(verifier)
    if model_device(facts) != device:
        raise ValueError(f"drafter is on {model_device(facts)} but verifier is on {device}: move them to one device")
    vocab = shared_vocab_size(verifier, facts, vocab_size)
    for name, model in (("verifier", verifier), ("drafter", facts)):
        positions = model_positions(model)
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
        if ngram is not None and model is ngram:
            return max(ngram_step_seconds(ngram, batch_size, seq_len + new_tokens, vocab, device), 1e-9)
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


def _emitted_tokens(new: torch.Tensor, eos_ids: list[int]) -> int:
    """Tokens each row of ``new`` [B, N] emitted: up to and including its first eos (all N without one)."""
    if not eos_ids:
        return new.numel()
    is_eos = torch.isin(new, torch.tensor(eos_ids, device=new.device))
    first = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, new.shape[1])
    return int(first.sum())


def check_plain_generate(verifier: torch.nn.Module) -> None:
    """TypeError unless ``verifier`` has the Hugging Face ``generate`` method the wall clock times plain decoding
    with."""
    if not callable(getattr(verifier, "generate", None)):
        raise TypeError("verifier must have a Hugging Face generate method to time plain decoding against (without "
                        "one, leave the wall clock out: evaluate(..., wall_clock=False))")


def _check_prompts(prompts: object, vocab: int) -> list[list[int]]:
    """``prompts`` as lists of ints: TypeError unless a list of int lists, ValueError for an empty list or prompt or
    an id outside ``[0, vocab)``."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    checked = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence) or not all(
                isinstance(token, int) and not isinstance(token, bool) for token in prompt):
            raise TypeError(f"prompts[{index}] must be a list of int token ids, got {prompt!r}")
        if len(prompt) == 0:
            raise ValueError(f"prompts must be a list of non-empty token-id lists; prompts[{index}] is empty")
        if not 0 <= min(prompt) <= max(prompt) < vocab:
            raise ValueError(f"prompts[{index}] has token ids outside [0, {vocab}) (the models' shared vocabulary)")
        checked.append(list(prompt))
    return checked


@dataclass(frozen=True)
class _SpeculativeSetup:
    """Checked arguments of :func:`run_speculative` / :func:`measure_wall_clock_speedup`: the left-padded batches,
    the eos ids and the options of every ``specdec.generate`` call but its seed."""

    device: torch.device
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    eos_ids: list[int]
    options: dict[str, Any]
    seed: int

    def batch_seed(self, index: int) -> int:
        """The seed of batch ``index``, for both methods: ``derive_seed(seed, index)``."""
        return derive_seed(self.seed, index)

    def run(self, verifier: torch.nn.Module, drafter: torch.nn.Module, index: int,
            num_draft_tokens: int | None = None) -> SpeculativeRun:
        """``specdec.generate`` on batch ``index``, seeded with :meth:`batch_seed` (``num_draft_tokens``: in place
        of the options', e.g. 0 for plain decoding on the same path)."""

        ids, mask = self.batches[index]
        options = self.options if num_draft_tokens is None else {**self.options, "num_draft_tokens": num_draft_tokens}
        out = generate(verifier, drafter, ids, mask, seed=self.batch_seed(index), **options)
        return SpeculativeRun(prompt_width=ids.shape[1], output=out)


def _speculative_setup(verifier: torch.nn.Module, drafter: torch.nn.Module, prompts: Sequence[Sequence[int]], *,
                       num_draft_tokens: int, temperature: float, max_new_tokens: int, batch_size: int, seed: int,
                       backend: str, eos_token_id: int | Sequence[int] | None, pad_token_id: int,
                       vocab_size: int | None, static: bool | None) -> _SpeculativeSetup:
    facts = drafter_model(verifier, drafter)  # an n-gram drafter has the verifier's vocabulary
    check_model_pair(verifier, facts)
    for name, value, low in (("num_draft_tokens", num_draft_tokens, 1), ("max_new_tokens", max_new_tokens, 1),
                             ("batch_size", batch_size, 1)):
        check_int_at_least(value, name, low)
    temperature = check_temperature(temperature)
    check_backend(backend)
    vocab = shared_vocab_size(verifier, facts, vocab_size)
    checked = _check_prompts(prompts, vocab)
    eos_ids = eos_id_list(eos_token_id, vocab)
    check_int_range(pad_token_id, "pad_token_id", 0, vocab)
    device = model_device(verifier)
    batches = [pad_batch(checked[start:start + batch_size], pad_token_id, "left", device)
               for start in range(0, len(checked), batch_size)]
    options = {"max_new_tokens": max_new_tokens, "num_draft_tokens": num_draft_tokens, "temperature": temperature,
               "eos_token_id": eos_ids or None, "backend": backend, "pad_token_id": pad_token_id,
               "vocab_size": vocab_size, "static": static}
    return _SpeculativeSetup(device=device, batches=batches, eos_ids=eos_ids, options=options, seed=seed)


@torch.no_grad()
def run_speculative(verifier: torch.nn.Module, drafter: torch.nn.Module, prompts: Sequence[Sequence[int]], *,
                    num_draft_tokens: int = 4, temperature: float = 0.0, max_new_tokens: int = 32, batch_size: int = 8,
                    seed: int = 0, backend: str = "auto", eos_token_id: int | Sequence[int] | None = None,
                    pad_token_id: int = 0, vocab_size: int | None = None,
                    static: bool | None = None) -> list[SpeculativeRun]:
    """:func:`specdec.generate` once on each left-padded batch of ``batch_size`` prompts, batch b seeded with
    ``derive_seed(seed, b)``: the same calls, with the same seeds, that :func:`measure_wall_clock_speedup` times.
    Arguments as there. Returns one :class:`SpeculativeRun` per batch, in prompt order."""
    setup = _speculative_setup(verifier, drafter, prompts, num_draft_tokens=num_draft_tokens, temperature=temperature,
                               max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed, backend=backend,
                               eos_token_id=eos_token_id, pad_token_id=pad_token_id, vocab_size=vocab_size,
                               static=static)
    return [setup.run(verifier, drafter, index) for index in range(len(setup.batches))]


@pair_in_eval_mode
@torch.no_grad()
def measure_wall_clock_speedup(verifier: torch.nn.Module, drafter: torch.nn.Module,
                               prompts: Sequence[Sequence[int]], *, num_draft_tokens: int = 4,
                               temperature: float = 0.0, max_new_tokens: int = 32, batch_size: int = 8,
                               repeats: int = 3, warmup: int = 1, seed: int = 0, backend: str = "auto",
                               eos_token_id: int | Sequence[int] | None = None, pad_token_id: int = 0,
                               vocab_size: int | None = None, static: bool | None = None,
                               baseline: str = "hf") -> WallClockSpeedup:
    """Time :func:`specdec.generate` against plain decoding by the verifier alone on the same prompts.

    ``baseline="hf"`` times the verifier's own Hugging Face ``generate``, the decoding a user replaces;
    ``baseline="specdec"`` times ``specdec.generate`` with ``num_draft_tokens=0`` on the same path (static with CUDA
    graphs on CUDA), so the ratio is the speed-up of speculation alone, the figure S(alpha, K, c) predicts.

    Both decode greedily (``temperature=0``) or sample at ``temperature`` (no top-k, no top-p), from the same
    left-padded batches of ``batch_size`` prompts, with the same ``max_new_tokens`` and ``eos_token_id`` (a row stops
    after its eos; None stops none, so both produce exactly ``max_new_tokens`` per prompt). Batch by batch,
    ``warmup`` untimed calls of each come first (graph capture, allocation), then ``repeats`` timed calls of each,
    alternating which goes first; every call is device-synchronised. Repetition r sums its calls over the batches
    and gives one ratio of generation rates (tokens per second; with greedy decoding both emit the same tokens, so
    this is the ratio of times); the speed-up is their median.

    Args:
        verifier, drafter: Hugging Face causal LMs on one device (the verifier needs a ``generate`` method), run
            in eval mode (every submodule's mode restored after).
        prompts: a non-empty list of non-empty lists of int token ids. num_draft_tokens: K >= 1. temperature: >= 0.
        max_new_tokens, batch_size, repeats: >= 1. warmup: >= 0. seed: sampling seeds.
        backend, static: passed to :func:`specdec.generate`. eos_token_id: int, list or None. pad_token_id: left
        padding. vocab_size: the shared id range when the models' output sizes differ.

    Returns:
        :class:`WallClockSpeedup`, with the last timed speculative run of each batch (``speculative_runs``).
    """
    if baseline not in WALL_CLOCK_BASELINES:
        raise ValueError(f"baseline must be one of {WALL_CLOCK_BASELINES}, got {baseline!r}")
    if baseline == "hf":
        check_plain_generate(verifier)
    check_int_at_least(repeats, "repeats", 1)
    check_int_at_least(warmup, "warmup", 0)
    setup = _speculative_setup(verifier, drafter, prompts, num_draft_tokens=num_draft_tokens, temperature=temperature,
                               max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed, backend=backend,
                               eos_token_id=eos_token_id, pad_token_id=pad_token_id, vocab_size=vocab_size,
                               static=static)
    device, eos_ids = setup.device, setup.eos_ids
    temperature = setup.options["temperature"]
    sampled = temperature > 0
    plain_options: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": sampled,
                                     "eos_token_id": eos_ids or None, "pad_token_id": pad_token_id}
    if sampled:
        plain_options.update(temperature=temperature, top_k=0, top_p=1.0)
    speculative_times, plain_times = [0.0] * repeats, [0.0] * repeats
    # per repetition and side: seconds up to the first token, and seconds after it (specdec's stats; "specdec" only)
    first_token = {True: [0.0] * repeats, False: [0.0] * repeats}
    after_first = {True: [0.0] * repeats, False: [0.0] * repeats}
    speculative_tokens = plain_tokens = rows = 0
    runs: list[SpeculativeRun] = []

    def plain(index: int) -> tuple[int, Any]:
        if baseline == "specdec":
            stats = setup.run(verifier, drafter, index, num_draft_tokens=0).output.stats
            return int(stats.generated.sum()), stats
        ids, mask = setup.batches[index]
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(setup.batch_seed(index))
            out = verifier.generate(input_ids=ids, attention_mask=mask, **plain_options)
        return _emitted_tokens(out[:, ids.shape[1]:], eos_ids), None

    for index in range(len(setup.batches)):
        for _ in range(warmup):
            setup.run(verifier, drafter, index)
            plain(index)
        last: SpeculativeRun | None = None
        plain_count = 0
        for repetition in range(repeats):
            speculative_first = (repetition + index) % 2 == 0
            for speculative in (speculative_first, not speculative_first):
                if speculative:
                    seconds, last = _timed(device, setup.run, verifier, drafter, index)
                    speculative_times[repetition] += seconds
                    stats = last.output.stats
                else:
                    seconds, (plain_count, stats) = _timed(device, plain, index)
                    plain_times[repetition] += seconds
                if stats is not None:
                    first_token[speculative][repetition] += stats.time_to_first_token_s
                    after_first[speculative][repetition] += stats.wall_time_s - stats.time_to_first_token_s
        runs.append(last)  # every timed call redoes the same work with the same seed: the last stands for all
        speculative_tokens += int(last.output.stats.generated.sum())
        plain_tokens += plain_count
        rows += int(setup.batches[index][0].shape[0])
    ratios = [(speculative_tokens / max(s, 1e-12)) / (plain_tokens / max(p, 1e-12))
              for p, s in zip(plain_times, speculative_times, strict=True)]
    decoding: dict[str, float | None] = {"decode_speedup": None, "speculative_first_token_s": None,
                                         "plain_first_token_s": None}
    if baseline == "specdec" and plain_tokens > rows:  # the prompt pass emits each row's first token on both sides
        decode_ratios = [((speculative_tokens - rows) / max(s, 1e-12)) / ((plain_tokens - rows) / max(p, 1e-12))
                         for p, s in zip(after_first[False], after_first[True], strict=True)]
        decoding = {"decode_speedup": statistics.median(decode_ratios),
                    "speculative_first_token_s": statistics.median(first_token[True]),
                    "plain_first_token_s": statistics.median(first_token[False])}
    return WallClockSpeedup(speedup=statistics.median(ratios), speculative_s=statistics.median(speculative_times),
                            plain_s=statistics.median(plain_times), speedup_min=min(ratios), speedup_max=max(ratios),
                            repeats=repeats, speculative_tokens=speculative_tokens, plain_tokens=plain_tokens,
                            baseline=baseline, **decoding, speculative_runs=tuple(runs))
