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
from specdec.decoding.sampling import filter_logits_unchecked, rejection_sample_unchecked
from specdec.kernels.rejection_sampling_reference import exponential_race


@dataclass
class DecodeResult:
    """Output of one decoding path: ``tokens`` [B, max_new_tokens] (pad after each row's ``generated`` [B]),
    per-row counters, per-position acceptance counts [B, K_max], the K of each round, setup seconds."""

    tokens: torch.Tensor
    generated: torch.Tensor
    counters: dict[str, torch.Tensor]
    accepted_per_position: torch.Tensor
    attempted_per_position: torch.Tensor
    draft_lengths: list[int]
    setup_seconds: float


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


def _call(runner: _ModelRunner, times: _CallTimes | None, name: str, seq: torch.Tensor, mask: torch.Tensor,
          positions: torch.Tensor, start: int, end: int, keep: int) -> torch.Tensor:
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


def decode_eager(verifier: torch.nn.Module, drafter: torch.nn.Module, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor, *, max_new_tokens: int, draft_lengths: tuple[int, ...], greedy: bool,
                 temperature: float, top_k: int, top_p: float, vocab: int, eos_ids: list[int], pad: int,
                 backend: str, row_seeds: torch.Tensor, draft_seeds: torch.Tensor,
                 on_emit: Callable[[int], None], verification: str = "token") -> DecodeResult:
    """Speculative decoding with dynamic caches; ``draft_lengths`` is one K or the set "auto" chooses from."""
    device = input_ids.device
    batch, prompt_len = input_ids.shape
    max_drafts = max(draft_lengths)

    def process(logits: torch.Tensor) -> torch.Tensor:
        """Logits as the sampler sees them: raw for greedy, else filter(logits / T) in fp32."""
        return logits.float() if greedy else filter_logits_unchecked(logits.float() / temperature, top_k, top_p)

    controller = times = None
    if len(draft_lengths) > 1:
        times = _CallTimes(device, _parameter_count(drafter) / max(_parameter_count(verifier), 1))
        controller = DraftLengthController(times.round_seconds(draft_lengths))

    verifier_run, drafter_run = _ModelRunner(verifier, vocab), _ModelRunner(drafter, vocab)
    capacity = prompt_len + 2 * (max_new_tokens + max_drafts + 1)
    seq = torch.full((batch, capacity), pad, dtype=torch.int64, device=device)
    mask = torch.zeros((batch, capacity), dtype=torch.int64, device=device)
    positions = torch.zeros((batch, capacity), dtype=torch.int64, device=device)
    seq[:, :prompt_len] = input_ids
    mask[:, :prompt_len] = attention_mask.to(torch.int64)
    positions[:, :prompt_len] = (attention_mask.to(torch.int64).cumsum(dim=1) - 1).clamp(min=0)
    next_position = attention_mask.to(torch.int64).sum(dim=1)  # [B] position id of the next real token

    out_tokens = torch.full((batch, max_new_tokens), pad, dtype=torch.int64, device=device)
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
    scores = process(verifier_run.forward(seq[:, :prompt_len], mask[:, :prompt_len], positions[:, :prompt_len], 1))
    if bool(torch.isnan(scores).any()):
        raise ValueError("a model produced NaN logits; refusing to turn NaN logits into tokens")
    stream_pos = torch.zeros(batch, dtype=torch.int64, device=device)
    first = torch.argmax(scores[:, 0], dim=-1) if greedy else exponential_race(scores[:, 0], row_seeds, stream_pos)
    stream_pos = stream_pos + 1
    out_tokens[:, 0] = first
    generated += 1
    counters["verifier_calls"] += 1
    on_emit(batch)
    finished = (first[:, None] == eos_tensor).any(dim=1) | (max_new_tokens <= 1)
    seq[:, prompt_len] = first
    mask[:, prompt_len] = 1
    positions[:, prompt_len] = next_position
    next_position = next_position + 1
    cur_len = prompt_len + 1

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
        for j in range(num_drafts):
            start, end = drafter_run.length, cur_len + j
            logits = _call(drafter_run, times, "drafter", seq, mask, positions, start, end, 1)[:, -1]
            processed = process(logits)
            token = torch.argmax(processed, dim=-1) if greedy else exponential_race(processed, draft_seeds,
                                                                                     stream_pos + j)
            draft_tokens[:, j] = token
            draft_logits[:, j] = processed
            seq[:, end] = token
            mask[:, end] = active.to(torch.int64)
            positions[:, end] = next_position + j

        # Verify the pending slots and all K drafts in one call.
        start, end = verifier_run.length, cur_len + num_drafts
        target_logits = _call(verifier_run, times, "verifier", seq, mask, positions, start, end, num_drafts + 1)
        sampler_target_logits = process(target_logits)
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
        emit_count = emit.sum(dim=1)
        emit_rows, emit_cols = emit.nonzero(as_tuple=True)
        out_tokens[emit_rows, generated[emit_rows] + emit_cols] = new_tokens[emit_rows, emit_cols]
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

    return DecodeResult(out_tokens, generated, counters, accepted_per_position, attempted_per_position, rounds, 0.0)
