"""The static decoding path of :func:`specdec.generate`: slot KV caches, whole rounds replayed from CUDA graphs.

A round is one function of fixed shapes over device state (gpt-fast's design, batched): the drafter absorbs the last
two committed tokens and proposes K drafts, the verifier scores the pending token and the K drafts in one call, the
sampler keeps a prefix of the drafts plus one token, and the bookkeeping (emission, eos, budgets, statistics) runs on
the device. On CUDA each round shape is captured once as a CUDA graph and replayed, so a round costs one graph launch
and one read of its flags (all finished, NaN seen, the acceptance counts the automatic K reads, tokens emitted). With
one K and no stop strings or streaming, the next round is queued before the last one's flags are read, so the device
never waits for the host between rounds; the round queued after the last one changes nothing (below) and is not
counted. The automatic K, stop strings and streaming read each round's outcome before queueing the next.

Per row ``b``: ``slot_len[b]`` committed tokens fill slots ``0 .. slot_len - 1`` of the row (prompt padding
included); the last one, ``pending``, is not yet in the verifier's cache, and ``prev`` (slot ``slot_len - 2``) may
not be in the drafter's. The drafter's first step therefore always takes ``[prev, pending]`` (rewriting a slot it
may already hold changes nothing), which keeps the shapes fixed whether the last round accepted every draft or not.
A round with K = 0 is plain decoding and leaves the drafter behind; a catch-up call over the last ``CATCH_UP``
slots brings it back before the next speculative round.

Finished rows keep riding along (fixed shapes) but neither advance nor emit. A row's ``slot_len`` is always
``L + generated`` (it advances by the tokens it emits, a round cut by eos or the budget included), so with at most
``max_new_tokens`` emitted its reads and writes stay below ``L + max_new_tokens + K + 1``, the cache's capacity.

Rope positions come from a per-row table, ``slot_positions`` [B, S]: for prompt slots ``cumsum(mask) - 1`` (as
transformers' ``generate`` computes them, so a mask with zeros inside the prompt is handled as there), and for
generated slots the prompt's real-token count plus the generated index.
"""

from __future__ import annotations

import contextlib
import inspect
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec._models import cache_argument
from specdec._validation import use_triton
from specdec.decoding.draft_length import DraftLengthController
from specdec.decoding.eager import DecodeResult
from specdec.decoding.native import NativeModelSlot, native_problem
from specdec.decoding.ngram import NgramDrafter, NgramSlot
from specdec.decoding.processors import TokenProcessors, draft_contexts, mark_seen, token_logprobs
from specdec.decoding.sampling import filter_logits_unchecked, rejection_sample_unchecked
from specdec.decoding.slot_cache import SlotCache, slot_attention_mask
from specdec.decoding.stop_strings import StopStringChecker
from specdec.decoding.timing import capture_graph, median_seconds
from specdec.kernels.exponential_race import exponential_race_triton
from specdec.kernels.rejection_sampling_reference import exponential_race
from specdec.kernels.round_commit import MAX_BATCH as ROUND_COMMIT_MAX_BATCH
from specdec.kernels.round_commit import round_commit_triton
from specdec.kernels.round_commit_reference import RoundState, round_commit_reference

CATCH_UP = 16  # drafter catch-up window; the automatic K probes a speculative round at least this often
SLOT_BUCKET = 64  # cache capacities are rounded up to this, so calls of similar length share graphs
MAX_ENGINES = 2  # static engines (caches and graphs) kept per verifier
MAX_SAMPLINGS = 2  # sampling settings whose captured rounds an engine keeps (each: up to 7 K values and a catch-up)


@dataclass(frozen=True)
class Sampling:
    """The sampling settings a captured round depends on (the temperature, the repetition penalty and the minimum
    count are device tensors). ``penalise``: a repetition penalty applies; ``ban_eos``: eos is banned before
    ``min_new_tokens``; ``logprobs``: the round records the log-probability of each emitted token."""

    greedy: bool
    top_k: int
    top_p: float
    penalise: bool = False
    ban_eos: bool = False
    logprobs: bool = False
    verification: str = "token"  # "token" or "block" (rejection_sample's verification)


def _slot_step(model: torch.nn.Module, cache: SlotCache, ids: torch.Tensor, slots: torch.Tensor,
               key_ok: torch.Tensor, slot_positions: torch.Tensor, dtype: torch.dtype, additive: bool, keep: int,
               keep_kwarg: bool, cache_kwarg: str) -> torch.Tensor:
    """One forward call of ``model`` on the slot cache: logits [B, keep, V_model] of the last ``keep`` tokens."""
    cache.write_slots = slots
    mask = slot_attention_mask(key_ok, slots, dtype, additive)
    positions = slot_positions.gather(1, slots)
    extra = {"logits_to_keep": keep} if keep_kwarg else {}
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                **{cache_kwarg: cache}, **extra)
    return out.logits[:, -keep:]


class _ModelSlot:
    """One model with its slot cache: ``forward(ids [B, T], slots [B, T], keep) -> [B, keep, vocab]`` logits.

    ``key_ok`` [B, S] bool (False at prompt padding) and ``slot_positions`` [B, S] int64 (the rope position of every
    slot) are the engine's tensors, refilled in place for each call. ``compile_model``: the step goes through
    ``torch.compile`` (fused kernels; compiled at the first call of each shape, before the round is captured).
    """

    def __init__(self, model: torch.nn.Module, batch: int, capacity: int, vocab: int, key_ok: torch.Tensor,
                 slot_positions: torch.Tensor, compile_model: bool = False):
        self.model = weakref.ref(model)  # cached engines must not keep a deleted model alive
        self.vocab = vocab
        self.cache = SlotCache(batch, capacity)
        self.key_ok, self.slot_positions = key_ok, slot_positions
        self.additive_mask = model.config._attn_implementation == "eager"
        self.dtype = next(model.parameters()).dtype
        self.has_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.cache_kwarg = cache_argument(model)
        self.step = _compiled_slot_step() if compile_model else _slot_step

    def forward(self, ids: torch.Tensor, slots: torch.Tensor, keep: int, eager: bool = False) -> torch.Tensor:
        step = _slot_step if eager else self.step
        logits = step(self.model(), self.cache, ids, slots, self.key_ok, self.slot_positions, self.dtype,
                      self.additive_mask, keep, self.has_logits_to_keep, self.cache_kwarg)
        return logits[..., : self.vocab]


def _slot(model: torch.nn.Module | NgramDrafter, batch: int, capacity: int, vocab: int, key_ok: torch.Tensor,
          slot_positions: torch.Tensor, compile_model: bool, runner: str = "hf",
          use_kernels: bool = False) -> _ModelSlot | NgramSlot | NativeModelSlot:
    """The slot that serves ``model`` in an engine (the one place a slot class is chosen): with ``runner="native"``
    the native decode runner for every model :func:`native_problem` accepts (``use_kernels``: its Triton kernels,
    and the n-gram drafter's proposal kernel, else their torch references)."""
    if isinstance(model, NgramDrafter):
        return NgramSlot(model, batch, capacity, vocab, key_ok, slot_positions, use_kernels=use_kernels)
    if runner == "native" and native_problem(model) is None:
        return NativeModelSlot(model, batch, capacity, vocab, key_ok, slot_positions, use_kernels=use_kernels)
    return _ModelSlot(model, batch, capacity, vocab, key_ok, slot_positions, compile_model)


_COMPILED_STEP = None


def _compiled_slot_step():
    """:func:`_slot_step` through ``torch.compile`` (one compiled function; each model and shape adds an entry)."""
    global _COMPILED_STEP
    if _COMPILED_STEP is None:
        import torch._dynamo

        config = torch._dynamo.config
        if hasattr(config, "recompile_limit"):
            config.recompile_limit = max(config.recompile_limit, 64)
        else:
            config.cache_size_limit = max(config.cache_size_limit, 64)
        _COMPILED_STEP = torch.compile(_slot_step)
    return _COMPILED_STEP


class StaticEngine:
    """Caches, device state and captured rounds for one (verifier, drafter, batch, capacity) combination.

    ``drafter`` is None for plain decoding (``max_drafts == 0``): no drafter cache, no drafter call.
    ``runner``: ``"native"`` runs every model :func:`native_problem` accepts on the native decode runner
    (:class:`NativeModelSlot`), the others through their HF forward; ``"hf"`` runs both through their HF forward.
    """

    def __init__(self, verifier: torch.nn.Module, drafter: torch.nn.Module | NgramDrafter | None, batch: int,
                 capacity: int,
                 vocab: int, max_drafts: int, num_eos: int, device: torch.device, backend: str, use_graphs: bool,
                 compile_models: bool = False, runner: str = "hf"):
        self.device, self.backend, self.use_graphs = device, backend, use_graphs
        self.compile_models = compile_models
        zeros = lambda *shape, dtype=torch.int64: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self.key_ok = torch.ones((batch, capacity), dtype=torch.bool, device=device)  # [B, S] False at padding
        self.slot_positions = zeros(batch, capacity)  # [B, S] rope position of every slot
        kernels = use_triton(backend, device)  # Triton kernels (or their torch references) for every part
        self.verifier = _slot(verifier, batch, capacity, vocab, self.key_ok, self.slot_positions, compile_models,
                              runner, kernels)
        self.drafter = None if drafter is None else _slot(drafter, batch, capacity, vocab, self.key_ok,
                                                          self.slot_positions, compile_models, runner, kernels)
        self.seq = zeros(batch, capacity)  # [B, S] int64 padded prompt, then the generated tokens
        self.logprobs = torch.zeros((batch, capacity), dtype=torch.float32, device=device)  # [B, S] per emitted token
        self.processors = TokenProcessors(batch, vocab, device)
        self.slot_len, self.prev, self.pending = zeros(batch), zeros(batch), zeros(batch)
        self.generated, self.stream_pos = zeros(batch), zeros(batch)
        self.finished = zeros(batch, dtype=torch.bool)
        self.max_new = zeros(1)
        self.eos = torch.full((max(num_eos, 1),), -2, dtype=torch.int64, device=device)
        self.temperature = torch.ones((), dtype=torch.float32, device=device)
        self.row_seeds, self.draft_seeds = zeros(batch), zeros(batch)
        self.counters = {name: zeros(batch) for name in ("drafted", "accepted", "verifier_calls", "drafter_calls")}
        self.accepted_per_position = zeros(batch, max(max_drafts, 1))
        self.attempted_per_position = zeros(batch, max(max_drafts, 1))
        self.flags = zeros(5)  # all finished, bad logits, accepted, attempted, emitted (this round)
        # two host copies of the flags, so a round can be queued before the last one's flags are read
        self.flags_host = torch.zeros((2, 5), dtype=torch.int64, pin_memory=device.type == "cuda")
        self.flags_ready = [torch.cuda.Event() for _ in range(2)] if device.type == "cuda" else None
        self.round_state = RoundState(  # views of the tensors above, advanced by one round-commit launch a round
            self.seq, self.slot_len, self.prev, self.pending, self.generated, self.finished, self.stream_pos,
            self.counters["drafted"], self.counters["accepted"], self.counters["verifier_calls"],
            self.counters["drafter_calls"], self.accepted_per_position, self.attempted_per_position, self.flags)
        # NOTE: the fused commit holds the batch in one program; larger batches commit through the reference
        self.fused_commit = kernels and batch <= ROUND_COMMIT_MAX_BATCH
        self.race = exponential_race_triton if kernels else exponential_race  # draws sampled tokens and drafts
        self.steps: OrderedDict[Sampling, dict[tuple, Callable[[], None]]] = OrderedDict()  # LRU, MAX_SAMPLINGS
        self.step_seconds: dict[tuple, float] = {}
        # NOTE: a MemPool holds the shared graph pool open for the engine's life; a bare pool handle is closed when
        # every graph in it is released (LRU eviction) while blocks outlive them, and the next capture aborts
        with torch.cuda.device(device) if use_graphs else contextlib.nullcontext():
            self.memory_pool = torch.cuda.MemPool() if use_graphs else None
        self.pool = self.memory_pool.id if use_graphs else None
        self._park()
        # one eager call per model allocates the cache buffers before any capture
        ids = zeros(batch, 1)
        slots = zeros(batch, 1)
        for model_slot in self.model_slots():
            model_slot.forward(ids, slots, 1, eager=True)

    def model_slots(self) -> list[_ModelSlot | NgramSlot | NativeModelSlot]:
        return [self.verifier] if self.drafter is None else [self.verifier, self.drafter]

    def serves(self, verifier: torch.nn.Module, drafter: torch.nn.Module | NgramDrafter | None) -> bool:
        """Whether this engine was built for these very model objects (a freed model's id can be reused)."""
        if self.verifier.model() is not verifier:
            return False
        return drafter is None if self.drafter is None else self.drafter.model() is drafter

    def num_captured_rounds(self) -> int:
        return sum(len(rounds) for rounds in self.steps.values())

    # ------------------------------------------------------------------ state
    def _park(self) -> None:
        """A harmless state for warm-up and timing replays: every row finished, indices in range."""
        self.slot_len.fill_(2)
        self.finished.fill_(True)
        self.prev.zero_()
        self.pending.zero_()

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                eos_ids: list[int], sampling: Sampling, temperature: float, row_seeds: torch.Tensor,
                draft_seeds: torch.Tensor, repetition_penalty: float | None = None, min_new_tokens: int = 0) -> None:
        """Encodes the prompts in both caches (eager) and samples the first token from the verifier."""
        batch, prompt_len = input_ids.shape
        mask = attention_mask.to(torch.bool)
        self.key_ok.fill_(True)
        self.key_ok[:, :prompt_len] = mask
        real = mask.to(torch.int64).sum(dim=1, keepdim=True)  # [B, 1] real prompt tokens
        self.slot_positions.copy_(torch.arange(self.slot_positions.shape[1], device=self.device) - prompt_len + real)
        self.slot_positions[:, :prompt_len] = (mask.to(torch.int64).cumsum(dim=1) - 1).clamp(min=0)
        self.seq.zero_()
        self.seq[:, :prompt_len] = input_ids
        self.max_new.fill_(max_new_tokens)
        self.eos.fill_(-2)
        if eos_ids:
            self.eos[: len(eos_ids)] = torch.tensor(eos_ids, dtype=torch.int64, device=self.device)
        self.temperature.fill_(temperature if temperature > 0 else 1.0)
        self.row_seeds.copy_(row_seeds)
        self.draft_seeds.copy_(draft_seeds)
        for counter in (*self.counters.values(), self.accepted_per_position, self.attempted_per_position):
            counter.zero_()
        if sampling.penalise or sampling.ban_eos:
            self.processors.reset(input_ids, attention_mask, repetition_penalty, min_new_tokens, eos_ids)
        self.logprobs.zero_()
        self.generated.zero_()
        slots = torch.arange(prompt_len, device=self.device).expand(batch, prompt_len)
        if self.drafter is not None:
            self.drafter.forward(input_ids, slots, 1, eager=True)  # (prompt lengths vary: never compiled)
        logits = self.verifier.forward(input_ids, slots, 1, eager=True)[:, 0]
        self.stream_pos.zero_()
        first, bad, logprob = self._sample_verifier(logits, sampling)
        self.seq[:, prompt_len] = first
        if logprob is not None:
            self.logprobs[:, prompt_len] = logprob
        if sampling.penalise:
            self.processors.commit(first[:, None], torch.ones_like(first[:, None], dtype=torch.bool))
        self.prev.copy_(input_ids[:, -1])
        self.pending.copy_(first)
        self.slot_len.fill_(prompt_len + 1)
        self.generated.fill_(1)
        self.finished.copy_((first[:, None] == self.eos).any(dim=1) | (max_new_tokens <= 1))
        self.stream_pos.fill_(1)
        self.counters["verifier_calls"].fill_(1)
        self.flags.zero_()
        self.flags[0] = self.finished.all()
        self.flags[1] = bad
        self.flags[4] = batch

    # ------------------------------------------------------------------ sampling helpers
    def _process(self, logits: torch.Tensor, sampling: Sampling, seen: torch.Tensor | None,
                 generated_before: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] as tokens are drawn from them: the token-dependent processors (context ``seen``
        [B, T or 1, V] bool, ``generated_before`` [B, T] int64), then for sampling ``filter(logits / T)`` in fp32.
        Greedy rounds without processors get the logits themselves."""
        if sampling.penalise or sampling.ban_eos:
            logits = self.processors.process(logits, seen if sampling.penalise else None,
                                             generated_before if sampling.ban_eos else None)
        if sampling.greedy:
            return logits
        return filter_logits_unchecked(logits.float() / self.temperature, sampling.top_k, sampling.top_p)

    def _sample_verifier(self, logits: torch.Tensor, sampling: Sampling
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One token per row from [B, V] verifier logits at stream position ``stream_pos``, a NaN flag, and the
        token's log-probability [B] float32 (None unless ``sampling.logprobs``)."""
        processed = self._process(logits[:, None], sampling, self.processors.seen[:, None, :-1],
                                  self.generated[:, None])[:, 0]
        if sampling.greedy:
            token = processed.argmax(dim=-1)
            bad = torch.isnan(processed.gather(1, token[:, None])).any()
        else:
            token = self.race(processed, self.row_seeds, self.stream_pos)
            bad = torch.isnan(processed.amax(dim=-1)).any()
        logprob = token_logprobs(processed[:, None], token[:, None])[:, 0] if sampling.logprobs else None
        return token, bad, logprob

    # ------------------------------------------------------------------ round bodies
    def _speculative_round(self, num_drafts: int, sampling: Sampling) -> None:
        n = self.slot_len
        offsets = torch.arange(-2, 0, device=self.device)
        logits = self.drafter.forward(torch.stack([self.prev, self.pending], dim=1), n[:, None] + offsets, 1)[:, 0]
        drafts, draft_logits, bad = [], [], torch.zeros((), dtype=torch.bool, device=self.device)
        seen = self.processors.seen.clone() if sampling.penalise else None  # [B, V + 1] context of the next draft
        for j in range(num_drafts):
            if j:
                logits = self.drafter.forward(drafts[-1][:, None], (n + j - 1)[:, None], 1)[:, 0]
            processed = self._process(logits[:, None], sampling, None if seen is None else seen[:, None, :-1],
                                      (self.generated + j)[:, None])[:, 0]
            if sampling.greedy:
                drafts.append(processed.argmax(dim=-1))
            else:
                bad = bad | torch.isnan(processed.amax(dim=-1)).any()
                drafts.append(self.race(processed, self.draft_seeds, self.stream_pos + j))
                draft_logits.append(processed)
            if seen is not None:
                mark_seen(seen, drafts[-1][:, None], torch.ones_like(drafts[-1][:, None], dtype=torch.bool))
        draft_tokens = torch.stack(drafts, dim=1)
        verify_ids = torch.cat([self.pending[:, None], draft_tokens], dim=1)
        position = torch.arange(num_drafts + 1, device=self.device)
        target_logits = self.verifier.forward(verify_ids, n[:, None] - 1 + position, num_drafts + 1)
        contexts = draft_contexts(self.processors.seen, draft_tokens) if sampling.penalise else None
        processed = self._process(target_logits, sampling, contexts, self.generated[:, None] + position)
        if sampling.greedy:
            tokens = processed.argmax(dim=-1)
            bad = bad | torch.isnan(processed.gather(2, tokens[..., None])).any()
            num_accepted = (draft_tokens == tokens[:, :num_drafts]).to(torch.int64).cumprod(dim=1).sum(dim=1)
        else:
            bad = bad | torch.isnan(processed.amax(dim=-1)).any()
            result = rejection_sample_unchecked(processed, torch.stack(draft_logits, dim=1), draft_tokens, 1.0,
                                                self.backend, self.row_seeds, self.stream_pos,
                                                verification=sampling.verification)
            tokens, num_accepted = result.tokens, result.num_accepted
        logprobs = token_logprobs(processed, tokens) if sampling.logprobs else None
        self._commit(tokens, num_accepted, num_drafts, bad, sampling, logprobs)

    def _plain_round(self, sampling: Sampling) -> None:
        n = self.slot_len
        logits = self.verifier.forward(self.pending[:, None], (n - 1)[:, None], 1)[:, 0]
        token, bad, logprob = self._sample_verifier(logits, sampling)
        self._commit(token[:, None], torch.zeros_like(token), 0, bad, sampling,
                     None if logprob is None else logprob[:, None])

    def _catch_up(self) -> None:
        """The drafter reads the CATCH_UP slots before ``slot_len - 2`` (after rounds without speculation)."""
        window = (self.slot_len[:, None] - 2 - CATCH_UP + torch.arange(CATCH_UP, device=self.device)).clamp(min=0)
        self.drafter.forward(self.seq.gather(1, window), window, 1)
        self.counters["drafter_calls"].add_(~self.finished)

    def _commit(self, tokens: torch.Tensor, num_accepted: torch.Tensor, num_drafts: int, bad: torch.Tensor,
                sampling: Sampling, logprobs: torch.Tensor | None = None) -> None:
        """Emits ``tokens[:, :n + 1]`` (cut at eos and the budget), advances the rows and counts: one launch of the
        round-commit kernel (its torch reference off CUDA or with ``backend="torch"``). With a repetition penalty
        the emitted tokens join the context; ``logprobs`` [B, K + 1] float32 of the round's tokens are stored beside
        them."""
        extra = sampling.penalise or logprobs is not None
        before = self.generated.clone() if extra else None
        commit = round_commit_triton if self.fused_commit else round_commit_reference
        commit(self.round_state, tokens.contiguous(), num_accepted, bad, self.max_new, self.eos, num_drafts)
        if extra:  # a row emits a prefix of the round's tokens: count = the growth of generated
            count = self.generated - before
            index = torch.arange(num_drafts + 1, device=self.device)
            emit = index < count[:, None]
            if sampling.penalise:
                self.processors.commit(tokens, emit)
            if logprobs is not None:
                write = (self.slot_len - count)[:, None] + index
                self.logprobs.scatter_(1, write, torch.where(emit, logprobs, self.logprobs.gather(1, write)))

    # ------------------------------------------------------------------ capture and replay
    def step(self, kind: str, num_drafts: int, sampling: Sampling) -> Callable[[], None]:
        """The captured (or, without graphs, the plain) callable of one round kind; the rounds of the
        :data:`MAX_SAMPLINGS` most recently used sampling settings are kept."""
        if sampling in self.steps:
            self.steps.move_to_end(sampling)
        else:
            while len(self.steps) >= MAX_SAMPLINGS:
                old_sampling, dropped = self.steps.popitem(last=False)
                for dropped_kind, dropped_drafts in dropped:
                    self.step_seconds.pop((dropped_kind, dropped_drafts, old_sampling), None)
            self.steps[sampling] = {}
        rounds = self.steps[sampling]
        key = (kind, num_drafts)
        if key not in rounds:
            if kind == "catch_up":
                body = self._catch_up
            elif kind != "round":
                raise ValueError(f"unknown round kind {kind!r}")
            elif num_drafts == 0:
                body = lambda: self._plain_round(sampling)  # noqa: E731
            else:
                body = lambda: self._speculative_round(num_drafts, sampling)  # noqa: E731
            rounds[key] = self._capture(body)
        return rounds[key]

    def _capture(self, body: Callable[[], None]) -> Callable[[], None]:
        if not self.use_graphs:
            if self.compile_models:  # compile now, so that its cost is setup time, not decoding time
                self._park()
                body()
            return body
        self._park()
        return capture_graph(body, self.device, self.pool)

    def prepare(self, draft_lengths: tuple[int, ...], sampling: Sampling) -> DraftLengthController | None:
        """Captures every round a call may run before its state is live; for several K (``"auto"``) also the
        drafter's catch-up, and returns a controller fed with each K's measured round time."""
        for num_drafts in draft_lengths:
            self.step("round", num_drafts, sampling)
        if len(draft_lengths) == 1:
            return None
        self.step("catch_up", 0, sampling)
        return DraftLengthController({k: self.round_seconds(k, sampling) for k in draft_lengths})

    def round_seconds(self, num_drafts: int, sampling: Sampling, repeats: int = 5) -> float:
        """Median device time of one round of K = ``num_drafts`` (parked state; measured once, then cached)."""
        key = ("round", num_drafts, sampling)
        if key not in self.step_seconds:
            replay = self.step("round", num_drafts, sampling)
            self._park()  # (timing replays must not advance a live state)
            self.step_seconds[key] = median_seconds(replay, self.device, repeats)
        return self.step_seconds[key]

    def apply_stop(self, checker: StopStringChecker, prompt_len: int, generated_before: torch.Tensor,
                   positions: int) -> None:
        """Cuts every row whose last round (``generated_before`` [B] int64: the counts before it; at most
        ``positions`` tokens a row) completed a stop string after that token and finishes it; the flags follow
        (device operations after the round, outside its capture; read with the flags)."""
        emitted = self.generated - generated_before
        stop = checker.first_stop(self.seq, prompt_len + generated_before, emitted, positions)
        cut = stop < emitted
        dropped = torch.where(cut, emitted - stop - 1, 0)
        self.generated.sub_(dropped)
        self.slot_len.sub_(dropped)
        self.finished.logical_or_(cut)
        self.flags[0] = self.finished.all()
        self.flags[4] = (emitted - dropped).sum()

    def queue_flags(self, copy: int) -> None:
        """Queues a copy of the round flags, as the work queued so far leaves them, into host copy ``copy`` (0 or 1)
        without waiting for it (:meth:`queued_flags` waits)."""
        if self.flags_ready is None:
            self.flags_host[copy].copy_(self.flags)
            return
        self.flags_host[copy].copy_(self.flags, non_blocking=True)
        self.flags_ready[copy].record(torch.cuda.current_stream(self.device))

    def queued_flags(self, copy: int) -> list[int]:
        """The five round flags of host copy ``copy``, once the work queued before its copy has run."""
        if self.flags_ready is not None:
            self.flags_ready[copy].synchronize()
        return self.flags_host[copy].tolist()

    def read_flags(self) -> list[int]:
        """The five round flags (one host synchronisation)."""
        self.queue_flags(0)
        return self.queued_flags(0)


_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def capture_facts(model: torch.nn.Module | NgramDrafter) -> tuple:
    """Everything about ``model`` that a captured round depends on: its parameters and buffers (addresses, dtypes,
    shapes: in-place updates keep a capture valid, reassigned tensors do not), its attention implementation (the
    mask form), whether it takes ``logits_to_keep`` and the name of its cache argument. An n-gram drafter has none
    (its settings never change)."""
    if isinstance(model, NgramDrafter):
        return ()
    tensors = [*model.parameters(), *model.buffers()]
    return (tuple((x.data_ptr(), x.dtype, tuple(x.shape)) for x in tensors),
            getattr(model.config, "_attn_implementation", None),
            "logits_to_keep" in inspect.signature(model.forward).parameters, cache_argument(model))


def get_engine(verifier: torch.nn.Module, drafter: torch.nn.Module | NgramDrafter | None, batch: int,
               needed_slots: int, vocab: int,
               max_drafts: int, num_eos: int, device: torch.device, backend: str, use_graphs: bool,
               compile_models: bool = False, runner: str = "hf") -> StaticEngine:
    """A cached engine for these models and shapes, or a new one (kept, at most :data:`MAX_ENGINES` per verifier).

    The key is (the drafter object, :func:`capture_facts` of both models, batch, capacity bucket, vocabulary, largest
    K, eos slots, device, backend, graphs, compile, runner); plain decoding (``max_drafts == 0``) uses no drafter. An
    engine is dropped when its drafter is freed, and a hit is checked to serve these very objects, so a new object
    that reuses a freed one's id never meets a dead engine.
    """
    if max_drafts == 0:
        drafter = None
    capacity = -(-needed_slots // SLOT_BUCKET) * SLOT_BUCKET
    eos_slots = 1 << max(num_eos - 1, 0).bit_length()
    key = (id(drafter), capture_facts(verifier), None if drafter is None else capture_facts(drafter), batch, capacity,
           vocab, max_drafts, eos_slots, str(device), backend, use_graphs, compile_models, runner)
    engines = _ENGINES.setdefault(verifier, OrderedDict())
    if key in engines and engines[key].serves(verifier, drafter):
        engines.move_to_end(key)
        return engines[key]
    engines.pop(key, None)
    while len(engines) >= MAX_ENGINES:
        engines.popitem(last=False)
    engine = StaticEngine(verifier, drafter, batch, capacity, vocab, max_drafts, eos_slots, device, backend,
                          use_graphs, compile_models, runner)
    engines[key] = engine
    if drafter is not None:  # an engine whose drafter is freed can never match again: drop it then
        weakref.finalize(drafter, _drop_engine, weakref.ref(verifier), key)
    return engine


def _drop_engine(verifier_ref: weakref.ref, key: tuple) -> None:
    verifier = verifier_ref()
    if verifier is not None and verifier in _ENGINES:
        _ENGINES[verifier].pop(key, None)


def clear_engines(verifier: torch.nn.Module | None = None) -> None:
    """Drops the cached static engines (KV caches and captured graphs) of ``verifier``, or of every verifier, so
    their GPU memory can be freed."""
    if verifier is None:
        _ENGINES.clear()
    else:
        _ENGINES.pop(verifier, None)


def decode_static(engine: StaticEngine, controller: DraftLengthController | None, input_ids: torch.Tensor,
                  attention_mask: torch.Tensor, *, max_new_tokens: int, draft_lengths: tuple[int, ...],
                  sampling: Sampling, temperature: float, eos_ids: list[int], pad: int, row_seeds: torch.Tensor,
                  draft_seeds: torch.Tensor, on_emit: Callable[[int], None], repetition_penalty: float | None = None,
                  min_new_tokens: int = 0, stop: StopStringChecker | None = None,
                  on_tokens: Callable[[torch.Tensor], None] | None = None) -> DecodeResult:
    """Runs rounds until every row stops, on an engine whose rounds :meth:`StaticEngine.prepare` captured.

    ``draft_lengths``: one K, or several chosen per round by ``controller``. ``stop``: rows end after a token that
    completes a stop string (checked after each round). With one K and neither ``stop`` nor ``on_tokens``, each
    round is queued before the last one's flags are read. ``on_tokens``: called with each round's new tokens of a
    single row ([1, n] int64 on the CPU). Returns the new tokens [B, max_new_tokens] (``pad`` after each row's end),
    their log-probabilities when ``sampling.logprobs`` and the counters (copies: the engine is reused).
    """
    prompt_len = input_ids.shape[1]
    engine.prefill(input_ids, attention_mask, max_new_tokens, eos_ids, sampling, temperature, row_seeds, draft_seeds,
                   repetition_penalty, min_new_tokens)
    if stop is not None:
        engine.apply_stop(stop, prompt_len, torch.zeros_like(engine.generated), 1)
    flags = engine.read_flags()
    first_token_at = time.perf_counter()  # read_flags waited for the prompt pass
    if controller is None and stop is None and on_tokens is None:
        rounds = _rounds_queued_ahead(engine, draft_lengths[0], sampling, flags, on_emit)
    else:
        rounds = _rounds(engine, controller, prompt_len, draft_lengths, sampling, flags, on_emit, stop, on_tokens)
    index = torch.arange(max_new_tokens, device=input_ids.device)
    written = index < engine.generated[:, None]
    tokens = torch.where(written, engine.seq[:, prompt_len: prompt_len + max_new_tokens], pad)
    logprobs = None
    if sampling.logprobs:
        logprobs = torch.where(written, engine.logprobs[:, prompt_len: prompt_len + max_new_tokens], 0.0)
    return DecodeResult(tokens, engine.generated.clone(), {k: v.clone() for k, v in engine.counters.items()},
                        engine.accepted_per_position.clone(), engine.attempted_per_position.clone(), rounds, 0.0,
                        logprobs, first_token_at)


def _check_flags(flags: list[int]) -> None:
    if flags[1]:
        raise ValueError("a model produced NaN logits; refusing to turn NaN logits into tokens")


def _rounds_queued_ahead(engine: StaticEngine, num_drafts: int, sampling: Sampling, flags: list[int],
                         on_emit: Callable[[int], None]) -> list[int]:
    """Rounds of one K with the next round queued before the last one's flags are read, so the device does not wait
    for the host between rounds. The round queued after the one that finishes every row changes nothing (finished
    rows emit, count and commit nothing) and is not counted. Returns the K of every counted round."""
    _check_flags(flags)
    on_emit(flags[4])
    rounds: list[int] = []
    if flags[0]:
        return rounds
    replay = engine.step("round", num_drafts, sampling)
    replay()
    engine.queue_flags(0)
    copy = 0
    while True:
        replay()  # the next round, queued before this one's flags are read
        engine.queue_flags(1 - copy)
        flags = engine.queued_flags(copy)
        rounds.append(num_drafts)
        _check_flags(flags)
        on_emit(flags[4])
        if flags[0]:
            return rounds
        copy = 1 - copy


def _rounds(engine: StaticEngine, controller: DraftLengthController | None, prompt_len: int,
            draft_lengths: tuple[int, ...], sampling: Sampling, flags: list[int], on_emit: Callable[[int], None],
            stop: StopStringChecker | None, on_tokens: Callable[[torch.Tensor], None] | None) -> list[int]:
    """Rounds one at a time: each round's K (``controller``), stop strings and streamed tokens need the last
    round's outcome on the host before the next round is queued. Returns the K of every round."""
    rounds, drafter_behind, streamed = [], 0, 0
    while True:
        _check_flags(flags)
        on_emit(flags[4])
        if on_tokens is not None and flags[4]:  # (a single row: flags[4] is its count)
            on_tokens(engine.seq[:1, prompt_len + streamed: prompt_len + streamed + flags[4]].cpu())
            streamed += flags[4]
        if flags[0]:
            return rounds
        num_drafts = controller.choose() if controller is not None else draft_lengths[0]
        if num_drafts and drafter_behind:
            engine.step("catch_up", 0, sampling)()
        before = engine.generated.clone() if stop is not None else None
        engine.step("round", num_drafts, sampling)()
        if stop is not None:
            engine.apply_stop(stop, prompt_len, before, num_drafts + 1)
        drafter_behind = drafter_behind + 1 if num_drafts == 0 else 0
        rounds.append(num_drafts)
        flags = engine.read_flags()
        if controller is not None and num_drafts:
            controller.observe(flags[2], flags[3])
