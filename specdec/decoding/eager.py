"""The eager decoding path of :func:`specdec.generate`: dynamic KV caches and plain forward calls.

It runs any pair of Hugging Face causal LMs (CPU included) and is what the static path falls back to.

Batching with ragged acceptance: all rows share one slot layout. After a round the common length grows by
``max_b n_b + 1``; a row that accepted fewer drafts than the best row gets *holes* (attention-mask zeros) where its
rejected drafts sat, and its recovered token goes into the first slot after the best row's accepted drafts. Position
ids count only real tokens, so every row sees exactly its own sequence. Both KV caches are cropped back to the
common length after every round (rejected tails are rolled back). The verifier's prompt pass samples the first token,
as on the static path, so both paths make the same random draws for the same decisions and count the same calls. The
drafter absorbs every slot it has not seen at its next call, so rounds without drafts (K = 0) need no catch-up step.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec._models import cache_argument
from specdec.decoding.draft_length import DraftLengthController
from specdec.decoding.emission import add_position_counts, emission
from specdec.decoding.ngram import NgramDrafter, NgramRunner
from specdec.decoding.processors import TokenProcessors, draft_contexts, mark_seen, token_logprobs
from specdec.decoding.sampling import filter_logits_unchecked, rejection_sample_unchecked
from specdec.decoding.stop_strings import StopStringChecker
from specdec.kernels.rejection_sampling_reference import exponential_race


@dataclass
class DecodeResult:
    """Output of one decoding path: ``tokens`` [B, max_new_tokens] (pad after each row's ``generated`` [B]),
    per-row counters, per-position acceptance counts [B, K_max], the K of each round, setup seconds, the
    log-probability of each new token [B, max_new_tokens] float32 (0 after a row's end) when asked for, and
    ``first_token_at``, the ``time.perf_counter()`` at which the prompt pass's token was on the host."""

    tokens: torch.Tensor
    generated: torch.Tensor
    counters: dict[str, torch.Tensor]
    accepted_per_position: torch.Tensor
    attempted_per_position: torch.Tensor
    draft_lengths: list[int]
    setup_seconds: float
    logprobs: torch.Tensor | None = None
    first_token_at: float = 0.0


class _ModelRunner:
    """Calls one causal LM with its own KV cache, across transformers versions (cache kwarg name, crop semantics)."""

    def __init__(self, model: torch.nn.Module, vocab_size: int):
        from transformers import DynamicCache

        self.model = model
        self.vocab_size = vocab_size
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = cache_argument(model) or "past_key_values"
        self.has_logits_to_keep = "logits_to_keep" in params
        try:
            self.cache = DynamicCache(config=model.config)
        except TypeError:
            self.cache = DynamicCache()
        self.length = 0  # slots of the shared layout held in the cache

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                num_logits: int) -> torch.Tensor:
        kwargs = {self.cache_kwarg: self.cache, "use_cache": True}
        if self.has_logits_to_keep:
            kwargs["logits_to_keep"] = num_logits
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        self.length += input_ids.shape[1]
        return out.logits[:, -num_logits:, : self.vocab_size]

    def crop(self, new_length: int) -> None:
        if new_length >= self.length:
            return
        # A negative argument removes that many trailing tokens in every transformers version (4.x took an absolute
        # length or a negative count; 5.x takes only the negative count).
        self.cache.crop(new_length - self.length)
        self.length = new_length


class _CallTimes:
    """Exponential averages of the drafter's and the verifier's call times, the eager path's round cost model
    ``t(K) = t_verifier + K t_drafter`` for the automatic K."""

    def __init__(self, device: torch.device, cost_ratio: float):
        self.device, self.cost_ratio = device, cost_ratio
        self.seconds = {"verifier": 1.0, "drafter": cost_ratio}  # parameter ratio until both are measured
        self.measured: set[str] = set()

    def record(self, name: str, elapsed: float) -> None:
        self.seconds[name] = elapsed if name not in self.measured else 0.8 * self.seconds[name] + 0.2 * elapsed
        self.measured.add(name)

    def round_seconds(self, draft_lengths: tuple[int, ...]) -> dict[int, float]:
        drafter = self.seconds["drafter"]
        if self.measured != {"verifier", "drafter"}:
            drafter = self.seconds["verifier"] * self.cost_ratio
        return {k: self.seconds["verifier"] + k * drafter for k in draft_lengths}


def _call(runner: _ModelRunner | NgramRunner, times: _CallTimes | None, name: str, seq: torch.Tensor,
          mask: torch.Tensor, positions: torch.Tensor, start: int, end: int, keep: int) -> torch.Tensor:
    """``runner.forward`` on slots ``start:end``; timed (device synchronised) when ``times`` is given."""
    if times is None:
        return runner.forward(seq[:, start:end], mask[:, :end], positions[:, start:end], keep)
    if times.device.type == "cuda":
        torch.cuda.synchronize(times.device)
    begin = time.perf_counter()
    out = runner.forward(seq[:, start:end], mask[:, :end], positions[:, start:end], keep)
    if times.device.type == "cuda":
        torch.cuda.synchronize(times.device)
    times.record(name, time.perf_counter() - begin)
    return out


def _parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def decode_eager(verifier: torch.nn.Module, drafter: torch.nn.Module | NgramDrafter, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor, *, max_new_tokens: int, draft_lengths: tuple[int, ...], greedy: bool,
                 temperature: float, top_k: int, top_p: float, vocab: int, eos_ids: list[int], pad: int,
                 backend: str, row_seeds: torch.Tensor, draft_seeds: torch.Tensor,
                 on_emit: Callable[[int], None], repetition_penalty: float | None = None, min_new_tokens: int = 0,
                 stop: StopStringChecker | None = None, on_tokens: Callable[[torch.Tensor], None] | None = None,
                 output_logprobs: bool = False, verification: str = "token") -> DecodeResult:
    """Speculative decoding with dynamic caches; ``draft_lengths`` is one K or the set "auto" chooses from.

    ``repetition_penalty`` and ``min_new_tokens`` process both models' logits position by position
    (:mod:`specdec.decoding.processors`); ``stop`` ends rows after a token that completes a stop string;
    ``on_tokens`` receives each round's new tokens of a single row ([1, n] int64 on the CPU);
    ``output_logprobs`` records each new token's log-probability under the law it was drawn from;
    ``verification`` is the rejection sampler's ("token" or "block").
    """
    device = input_ids.device
    batch, prompt_len = input_ids.shape
    max_drafts = max(draft_lengths)
    penalise, ban = repetition_penalty is not None, min_new_tokens > 0 and bool(eos_ids)
    processors = TokenProcessors(batch, vocab, device)
    if penalise or ban:
        processors.reset(input_ids, attention_mask, repetition_penalty, min_new_tokens, eos_ids)

    def process(logits: torch.Tensor, seen: torch.Tensor | None, generated_before: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] as tokens are drawn from them: the token-dependent processors (context ``seen``
        [B, T or 1, V], counts ``generated_before`` [B, T]), then fp32 for greedy, else filter(logits / T)."""
        out = processors.process(logits, seen if penalise else None, generated_before if ban else None)
        return out if greedy else filter_logits_unchecked(out / temperature, top_k, top_p)

    ngram = isinstance(drafter, NgramDrafter)  # model-free: its runner proposes one-hot logits, at about no cost
    controller = times = None
    if len(draft_lengths) > 1:
        cost_ratio = 0.0 if ngram else _parameter_count(drafter) / max(_parameter_count(verifier), 1)
        times = _CallTimes(device, cost_ratio)
        controller = DraftLengthController(times.round_seconds(draft_lengths))

    verifier_run = _ModelRunner(verifier, vocab)
    drafter_run = NgramRunner(drafter, vocab) if ngram else _ModelRunner(drafter, vocab)
    capacity = prompt_len + 2 * (max_new_tokens + max_drafts + 1)
    seq = torch.full((batch, capacity), pad, dtype=torch.int64, device=device)
    mask = torch.zeros((batch, capacity), dtype=torch.int64, device=device)
    positions = torch.zeros((batch, capacity), dtype=torch.int64, device=device)
    seq[:, :prompt_len] = input_ids
    mask[:, :prompt_len] = attention_mask.to(torch.int64)
    positions[:, :prompt_len] = (attention_mask.to(torch.int64).cumsum(dim=1) - 1).clamp(min=0)
    next_position = attention_mask.to(torch.int64).sum(dim=1)  # [B] position id of the next real token

    history = torch.full((batch, prompt_len + max_new_tokens), pad, dtype=torch.int64, device=device)
    history[:, :prompt_len] = input_ids  # [B, L + max_new_tokens] padded prompt, then the new tokens
    out_tokens = history[:, prompt_len:]  # (a view)
    out_logprobs = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device) if output_logprobs \
        else None
    generated = torch.zeros(batch, dtype=torch.int64, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    eos_tensor = torch.tensor(eos_ids, dtype=torch.int64, device=device)
    counters = {name: torch.zeros(batch, dtype=torch.int64, device=device)
                for name in ("drafted", "accepted", "verifier_calls", "drafter_calls")}
    accepted_per_position = torch.zeros((batch, max(max_drafts, 1)), dtype=torch.int64, device=device)
    attempted_per_position = torch.zeros((batch, max(max_drafts, 1)), dtype=torch.int64, device=device)
    rows = torch.arange(batch, device=device)
    rounds: list[int] = []

    # The prompt pass: the verifier encodes the prompts and samples the first token at stream position 0.
    scores = process(verifier_run.forward(seq[:, :prompt_len], mask[:, :prompt_len], positions[:, :prompt_len], 1),
                     processors.seen[:, None, :-1], generated[:, None])
    if bool(torch.isnan(scores).any()):
        raise ValueError("a model produced NaN logits; refusing to turn NaN logits into tokens")
    stream_pos = torch.zeros(batch, dtype=torch.int64, device=device)
    first = torch.argmax(scores[:, 0], dim=-1) if greedy else exponential_race(scores[:, 0], row_seeds, stream_pos)
    stream_pos = stream_pos + 1
    out_tokens[:, 0] = first
    if out_logprobs is not None:
        out_logprobs[:, 0] = token_logprobs(scores, first[:, None])[:, 0]
    if penalise:
        mark_seen(processors.seen, first[:, None], torch.ones_like(first[:, None], dtype=torch.bool))
    generated += 1
    counters["verifier_calls"] += 1
    finished = (first[:, None] == eos_tensor).any(dim=1) | (max_new_tokens <= 1)
    if stop is not None:
        finished = finished | (stop.first_stop(history, torch.full_like(generated, prompt_len), generated, 1) == 0)
    on_emit(batch)
    if on_tokens is not None:
        on_tokens(first[:1, None].cpu())
    seq[:, prompt_len] = first
    mask[:, prompt_len] = 1
    positions[:, prompt_len] = next_position
    next_position = next_position + 1
    cur_len = prompt_len + 1

    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the first token is on the device: the time to it is the call's latency
    first_token_at = time.perf_counter()
    while not bool(finished.all()):
        active = ~finished
        num_drafts = controller.choose() if controller is not None else draft_lengths[0]
        rounds.append(num_drafts)
        draft_index = torch.arange(num_drafts, device=device)
        if cur_len + num_drafts + 1 > seq.shape[1]:
            grow = seq.shape[1]
            seq = torch.cat([seq, torch.full((batch, grow), pad, dtype=torch.int64, device=device)], dim=1)
            mask = torch.cat([mask, torch.zeros((batch, grow), dtype=torch.int64, device=device)], dim=1)
            positions = torch.cat([positions, torch.zeros((batch, grow), dtype=torch.int64, device=device)], dim=1)

        # Draft K tokens; the drafter first absorbs every slot it has not seen yet.
        draft_tokens = torch.empty((batch, num_drafts), dtype=torch.int64, device=device)
        draft_logits = torch.empty((batch, num_drafts, vocab), dtype=torch.float32, device=device)
        draft_seen = processors.seen.clone() if penalise else None  # [B, V + 1] context of the next draft
        for j in range(num_drafts):
            start, end = drafter_run.length, cur_len + j
            logits = _call(drafter_run, times, "drafter", seq, mask, positions, start, end, 1)
            processed = process(logits, None if draft_seen is None else draft_seen[:, None, :-1],
                                (generated + j)[:, None])[:, -1]
            token = torch.argmax(processed, dim=-1) if greedy else exponential_race(processed, draft_seeds,
                                                                                     stream_pos + j)
            draft_tokens[:, j] = token
            draft_logits[:, j] = processed
            if draft_seen is not None:
                mark_seen(draft_seen, token[:, None], torch.ones_like(token[:, None], dtype=torch.bool))
            seq[:, end] = token
            mask[:, end] = active.to(torch.int64)
            positions[:, end] = next_position + j

        # Verify the pending slots and all K drafts in one call.
        start, end = verifier_run.length, cur_len + num_drafts
        target_logits = _call(verifier_run, times, "verifier", seq, mask, positions, start, end, num_drafts + 1)
        position = torch.arange(num_drafts + 1, device=device)
        contexts = draft_contexts(processors.seen, draft_tokens) if penalise else None
        sampler_target_logits = process(target_logits, contexts, generated[:, None] + position)
        # The sampler's inputs are built here (drafts in [0, V), shapes consistent), so only NaN needs checking:
        # one fused reduction and one host sync per round instead of the public wrapper's several.
        if bool(torch.isnan(sampler_target_logits).any() | torch.isnan(draft_logits).any()):
            raise ValueError("a model produced NaN logits; refusing to turn NaN logits into tokens")
        if num_drafts:
            result = rejection_sample_unchecked(
                sampler_target_logits, draft_logits, draft_tokens, 0.0 if greedy else 1.0, backend, row_seeds,
                stream_pos, verification=verification,
            )
            num_accepted, new_tokens = result.num_accepted, result.tokens
        else:
            scores = sampler_target_logits[:, 0]
            token = torch.argmax(scores, dim=-1) if greedy else exponential_race(scores, row_seeds, stream_pos)
            num_accepted, new_tokens = torch.zeros_like(token), token[:, None]
        stream_pos = stream_pos + num_drafts + 1

        # Emit: n + 1 tokens per active row, cut at eos and at max_new_tokens.
        emit, hit_eos, accepted, attempted = emission(new_tokens, num_accepted, num_drafts,
                                                      max_new_tokens - generated, active, eos_tensor)
        emit_rows, emit_cols = emit.nonzero(as_tuple=True)
        out_tokens[emit_rows, generated[emit_rows] + emit_cols] = new_tokens[emit_rows, emit_cols]
        if out_logprobs is not None:
            round_logprobs = token_logprobs(sampler_target_logits, new_tokens)
            out_logprobs[emit_rows, generated[emit_rows] + emit_cols] = round_logprobs[emit_rows, emit_cols]
        if penalise:
            mark_seen(processors.seen, new_tokens, emit)
        if stop is not None:  # cut each row after the first token that completes a stop string
            first_stop = stop.first_stop(history, prompt_len + generated, emit.sum(dim=1), num_drafts + 1)
            hit_stop = first_stop < emit.sum(dim=1)
            emit = emit & (position[None, :] <= first_stop[:, None])
            hit_eos = hit_eos | hit_stop
        emit_count = emit.sum(dim=1)
        if on_tokens is not None and int(emit_count[0]):
            on_tokens(out_tokens[:1, int(generated[0]): int(generated[0] + emit_count[0])].cpu())
        generated += emit_count

        counters["drafted"] += active * num_drafts
        counters["accepted"] += accepted
        counters["verifier_calls"] += active.to(torch.int64)
        counters["drafter_calls"] += active * num_drafts
        add_position_counts(accepted_per_position, attempted_per_position, accepted, attempted, num_drafts)
        if controller is not None:
            if num_drafts:
                controller.observe(*torch.stack([accepted.sum(), attempted.sum()]).tolist())
            controller.round_seconds = times.round_seconds(draft_lengths)
        on_emit(int(emit_count.sum()))

        finished = finished | hit_eos | (generated >= max_new_tokens)
        if bool(finished.all()):
            break

        # New common layout: accepted drafts stay, holes up to the best row, then the recovered/bonus token.
        max_accepted = int(torch.where(active, num_accepted, 0).max())
        hole = (draft_index[None] >= num_accepted[:, None]) & (draft_index[None] < max_accepted)
        mask[:, cur_len: cur_len + num_drafts] *= (~hole).to(torch.int64)
        new_slot = cur_len + max_accepted
        seq[:, new_slot] = new_tokens[rows, num_accepted]
        mask[:, new_slot] = (~finished).to(torch.int64)
        positions[:, new_slot] = next_position + num_accepted
        next_position = next_position + num_accepted + 1
        cur_len = new_slot + 1
        verifier_run.crop(new_slot)
        drafter_run.crop(new_slot)

    written = torch.arange(max_new_tokens, device=device)[None, :] < generated[:, None]
    out_tokens = torch.where(written, out_tokens, pad)  # (tokens a stop string cut are dropped)
    if out_logprobs is not None:
        out_logprobs = torch.where(written, out_logprobs, 0.0)
    return DecodeResult(out_tokens, generated, counters, accepted_per_position, attempted_per_position, rounds, 0.0,
                        out_logprobs, first_token_at)
