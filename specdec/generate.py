"""Lossless speculative decoding for any pair of Hugging Face causal LMs that share a vocabulary.

One round: the drafter proposes K tokens autoregressively (K cheap forward calls), the verifier scores the pending
tokens and all K drafts in one forward call, and :func:`specdec.rejection_sample` keeps a prefix of the drafts plus
one recovered/bonus token, so the output follows the verifier's own distribution exactly.

Batching with ragged acceptance: all rows share one slot layout. After a round the common length grows by
``max_b n_b + 1``; a row that accepted fewer drafts than the best row gets *holes* (attention-mask zeros) where its
rejected drafts sat, and its recovered token goes into the first slot after the best row's accepted drafts. Position
ids count only real tokens, so every row sees exactly its own sequence. Both KV caches are cropped back to the
common length after every round (rejected tails are rolled back); the prompt is encoded once.
"""

from __future__ import annotations

import inspect
import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from specdec._models import check_model_pair, model_device, model_vocab_size
from specdec._validation import as_int, check_backend, check_int_range, check_temperature, check_tensor
from specdec.kernels.rejection_sampling_reference import exponential_race
from specdec.sampling import filter_logits_unchecked, rejection_sample_unchecked

_DRAFT_STREAM_SALT = 0x5DEECE66D  # separates the drafter's random stream from the sampler's


@dataclass
class SpecDecodeStats:
    """Counters of a :func:`generate` call, per row ([B] or [B, K] int64 tensors on the CPU) and aggregated.

    drafted: drafts proposed while the row was active. accepted: drafts the verifier accepted.
    generated: tokens emitted into the output. verifier_calls / drafter_calls: forward calls while active.
    accepted_per_position / attempted_per_position: [B, K] counts of acceptance tests at draft position j.
    wall_time_s: wall-clock time of the whole call (device synchronised).
    """

    drafted: torch.Tensor
    accepted: torch.Tensor
    generated: torch.Tensor
    verifier_calls: torch.Tensor
    drafter_calls: torch.Tensor
    accepted_per_position: torch.Tensor
    attempted_per_position: torch.Tensor
    wall_time_s: float = 0.0
    num_draft_tokens: int = field(default=1)

    @property
    def acceptance_rate(self) -> torch.Tensor:
        """[B] float: accepted / drafted (NaN for a row that drafted nothing)."""
        return self.accepted.double() / self.drafted.double()

    @property
    def acceptance_per_position(self) -> torch.Tensor:
        """[B, K] float: P(accept draft j | draft j was tested); NaN where never tested."""
        return self.accepted_per_position.double() / self.attempted_per_position.double()

    @property
    def tokens_per_verifier_call(self) -> torch.Tensor:
        """[B] float: generated tokens per verifier forward call."""
        return self.generated.double() / self.verifier_calls.double()

    @property
    def total_acceptance_rate(self) -> float:
        return float(self.accepted.sum()) / max(int(self.drafted.sum()), 1)

    @property
    def total_acceptance_per_position(self) -> torch.Tensor:
        """[K] float: acceptance at draft position j pooled over rows (0 where no row ever tested position j, so
        that summaries stay JSON numbers; :attr:`acceptance_per_position` gives NaN there)."""
        return self.accepted_per_position.sum(0).double() / self.attempted_per_position.sum(0).clamp(min=1).double()

    @property
    def total_tokens_per_verifier_call(self) -> float:
        """Pooled generated tokens per verifier call (a batched call counts once per active row)."""
        return float(self.generated.sum()) / max(int(self.verifier_calls.sum()), 1)

    def summary(self) -> dict[str, float | list[float]]:
        """Aggregated figures as plain Python numbers."""
        return {
            "drafted": int(self.drafted.sum()),
            "accepted": int(self.accepted.sum()),
            "generated": int(self.generated.sum()),
            "verifier_calls": int(self.verifier_calls.max()) if self.verifier_calls.numel() else 0,
            "drafter_calls": int(self.drafter_calls.max()) if self.drafter_calls.numel() else 0,
            "acceptance_rate": self.total_acceptance_rate,
            "acceptance_per_position": self.total_acceptance_per_position.tolist(),
            "tokens_per_verifier_call": self.total_tokens_per_verifier_call,
            "wall_time_s": self.wall_time_s,
        }


@dataclass
class GenerateOutput:
    """sequences: [B, prompt_len + generated] int64, the prompt as given then the new tokens, right-padded with
    ``pad_token_id`` after a row ends. stats: :class:`SpecDecodeStats`."""

    sequences: torch.Tensor
    stats: SpecDecodeStats


class _ModelRunner:
    """Calls one causal LM with its own KV cache, across transformers versions (cache kwarg name, crop semantics)."""

    def __init__(self, model: torch.nn.Module, vocab_size: int):
        from transformers import DynamicCache

        self.model = model
        self.vocab_size = vocab_size
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.has_logits_to_keep = "logits_to_keep" in params
        try:
            self.cache = DynamicCache(config=model.config)
        except TypeError:
            self.cache = DynamicCache()
        self.length = 0  # slots of the shared layout held in the cache
        self.calls = 0

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                num_logits: int) -> torch.Tensor:
        kwargs = {self.cache_kwarg: self.cache, "use_cache": True}
        if self.has_logits_to_keep:
            kwargs["logits_to_keep"] = num_logits
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        self.length += input_ids.shape[1]
        self.calls += 1
        return out.logits[:, -num_logits:, : self.vocab_size]

    def crop(self, new_length: int) -> None:
        if new_length >= self.length:
            return
        # A negative argument removes that many trailing tokens in every transformers version (4.x took an absolute
        # length or a negative count; 5.x takes only the negative count).
        self.cache.crop(new_length - self.length)
        self.length = new_length


def _check_int(value: object, name: str, minimum: int) -> int:
    number = as_int(value)
    if number is None or number < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return number


def _eos_ids(eos_token_id: int | Sequence[int] | None, vocab: int) -> list[int]:
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, torch.Tensor):  # e.g. a tensor from a generation config
        eos_token_id = eos_token_id.reshape(-1).tolist()
    single = as_int(eos_token_id)
    if single is not None:
        raw = [eos_token_id]
    elif isinstance(eos_token_id, Sequence) and not isinstance(eos_token_id, (str, bytes)):
        raw = list(eos_token_id)
    else:
        raise TypeError(f"eos_token_id must be an int or a list of ints, got {type(eos_token_id).__name__}")
    ids = [as_int(token) for token in raw]
    if any(token is None or not 0 <= token < vocab for token in ids):
        raise ValueError(f"eos_token_id must be an int or list of ints in [0, {vocab}), got {eos_token_id!r}")
    return ids


def _sliding_window(model: torch.nn.Module) -> int | None:
    """The attention window of a model whose config uses sliding-window attention in some layer, else None."""
    config = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None)
    if as_int(window) is None or window <= 0 or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and not any("sliding" in str(kind) for kind in layer_types):
        return None
    return int(window)


@torch.no_grad()
def generate(
    verifier: torch.nn.Module,
    drafter: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int = 128,
    num_draft_tokens: int = 4,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | Sequence[int] | None = None,
    seed: int | None = None,
    backend: str = "auto",
    pad_token_id: int | None = None,
    vocab_size: int | None = None,
    progress: bool = False,
) -> GenerateOutput:
    """Speculative decoding whose output follows ``verifier`` exactly (greedy or sampled).

    Args:
        verifier, drafter: Hugging Face causal LMs (``model(input_ids, attention_mask, position_ids, cache)``)
            on the same device, sharing a vocabulary.
        input_ids: [B, L] int64 prompts, left-padded; attention_mask: [B, L] 0/1 (default: all ones).
        max_new_tokens: per-row cap on generated tokens (>= 1).
        num_draft_tokens: K >= 1 drafts per round.
        temperature: 0 is greedy (a draft is accepted iff it is the verifier's argmax, ties to the lowest id);
            > 0 samples from ``softmax(filter(logits / T))`` where ``filter`` applies ``top_k`` then ``top_p``
            identically to both models.
        eos_token_id: int or list; a row stops after emitting one. seed: makes sampling reproducible.
        backend: rejection-sampler backend ("auto", "triton", "torch").
        pad_token_id: right-padding of finished rows (default: the first eos id, else 0).
        vocab_size: the number of real token ids (e.g. ``len(tokenizer)``), required when the two models' vocab
            sizes differ (padding rows); only ids below it are used.
        progress: show a tqdm bar over generated tokens.

    Returns:
        :class:`GenerateOutput` with ``sequences`` [B, L + max generated] and ``stats``.
    """
    check_model_pair(verifier, drafter)
    check_tensor(input_ids, "input_ids", 2, integer_dtype=True, shape_doc="[B, L]")
    batch, prompt_len = input_ids.shape
    if batch == 0 or prompt_len == 0:
        raise ValueError(f"input_ids must be a non-empty [B, L] batch of prompts, got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    check_tensor(attention_mask, "attention_mask", 2, shape_doc="[B, L]")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                         f"got {tuple(attention_mask.shape)}")
    device = input_ids.device
    for name, tensor_or_model in (("attention_mask", attention_mask), ("verifier", verifier), ("drafter", drafter)):
        other = tensor_or_model.device if isinstance(tensor_or_model, torch.Tensor) else model_device(tensor_or_model)
        if other != device:
            raise ValueError(f"{name} is on {other} but input_ids is on {device}: move them to one device")
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError("attention_mask must contain only 0 and 1")
    if bool((attention_mask.sum(dim=1) == 0).any()):
        raise ValueError("input_ids has an empty prompt (a row whose attention_mask is all zeros)")
    if bool((attention_mask[:, -1] == 0).any()):
        raise ValueError("input_ids must be left-padded: attention_mask[:, -1] is 0 in some row (tokenize with "
                         "padding_side='left'); generation continues from the last column")
    max_new_tokens = _check_int(max_new_tokens, "max_new_tokens", 1)
    num_drafts = _check_int(num_draft_tokens, "num_draft_tokens", 1)
    temperature = check_temperature(temperature)
    top_k = _check_int(top_k, "top_k", 0)
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"top_p must be a float in (0, 1], got {top_p!r}")
    top_p = float(top_p)
    # The two caches keep one slot layout for the whole batch: each round appends K + 1 slots and rows that accept
    # fewer drafts leave masked slots behind. A sliding window counts slots, not tokens (and transformers' sliding
    # cache layers cannot roll back past the window), so the window must hold every slot the call can create.
    most_slots = prompt_len + max_new_tokens * (num_drafts + 1)
    for name, model in (("verifier", verifier), ("drafter", drafter)):
        window = _sliding_window(model)
        if window is not None and most_slots >= window:
            raise ValueError(
                f"{name} uses sliding-window attention (window {window}); speculative decoding here needs prompt "
                f"length + max_new_tokens * (num_draft_tokens + 1) = {prompt_len} + {max_new_tokens} * "
                f"{num_drafts + 1} = {most_slots} below the window (shorten the prompt, max_new_tokens or "
                "num_draft_tokens)")
    check_backend(backend)
    verifier_vocab, drafter_vocab = model_vocab_size(verifier, "verifier"), model_vocab_size(drafter, "drafter")
    if vocab_size is None:
        if verifier_vocab != drafter_vocab:
            raise ValueError(
                f"verifier and drafter vocabularies differ ({verifier_vocab} vs {drafter_vocab}); if they differ only "
                "by padding rows pass vocab_size=len(tokenizer) to use the shared id range"
            )
        vocab_size = verifier_vocab
    vocab = _check_int(vocab_size, "vocab_size", 1)
    if vocab > min(verifier_vocab, drafter_vocab):
        raise ValueError(f"vocab_size={vocab} exceeds a model's vocabulary ({verifier_vocab}, {drafter_vocab})")
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
        raise ValueError(f"input_ids must lie in [0, vocab_size={vocab})")
    eos_ids = _eos_ids(eos_token_id, vocab)
    pad_token_id = check_int_range(pad_token_id, "pad_token_id", 0, vocab, allow_none=True, note=" (vocab_size)")
    seed = check_int_range(seed, "seed", 0, 2**64, allow_none=True)
    pad = pad_token_id if pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    greedy = temperature == 0

    def process(logits: torch.Tensor) -> torch.Tensor:
        """Logits as the sampler sees them: raw for greedy, else filter(logits / T) in fp32."""
        return logits.float() if greedy else filter_logits_unchecked(logits.float() / temperature, top_k, top_p)

    generator = torch.Generator(device="cpu")
    if seed is not None:
        generator.manual_seed(seed)
    else:
        generator.seed()
    row_seeds = torch.randint(0, 2**62, (batch,), generator=generator, dtype=torch.int64).to(device)
    draft_seeds = row_seeds ^ _DRAFT_STREAM_SALT

    start_time = time.perf_counter()
    verifier_run, drafter_run = _ModelRunner(verifier, vocab), _ModelRunner(drafter, vocab)
    capacity = prompt_len + 2 * (max_new_tokens + num_drafts + 1)
    seq = torch.full((batch, capacity), pad, dtype=torch.int64, device=device)
    mask = torch.zeros((batch, capacity), dtype=torch.int64, device=device)
    positions = torch.zeros((batch, capacity), dtype=torch.int64, device=device)
    seq[:, :prompt_len] = input_ids
    mask[:, :prompt_len] = attention_mask.to(torch.int64)
    positions[:, :prompt_len] = (attention_mask.to(torch.int64).cumsum(dim=1) - 1).clamp(min=0)
    next_position = attention_mask.to(torch.int64).sum(dim=1)  # [B] position id of the next real token
    cur_len = prompt_len

    out_tokens = torch.full((batch, max_new_tokens), pad, dtype=torch.int64, device=device)
    generated = torch.zeros(batch, dtype=torch.int64, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    eos_tensor = torch.tensor(eos_ids, dtype=torch.int64, device=device)
    stat = {name: torch.zeros(batch, dtype=torch.int64, device=device)
            for name in ("drafted", "accepted", "verifier_calls", "drafter_calls")}
    accepted_per_position = torch.zeros((batch, num_drafts), dtype=torch.int64, device=device)
    attempted_per_position = torch.zeros((batch, num_drafts), dtype=torch.int64, device=device)
    draft_index = torch.arange(num_drafts, device=device)
    emit_index = torch.arange(num_drafts + 1, device=device)
    rows = torch.arange(batch, device=device)
    bar = tqdm(total=batch * max_new_tokens, desc="specdec.generate", unit="tok", disable=not progress)

    round_index = 0
    while True:
        active = ~finished
        if cur_len + num_drafts + 1 > seq.shape[1]:
            grow = seq.shape[1]
            seq = torch.cat([seq, torch.full((batch, grow), pad, dtype=torch.int64, device=device)], dim=1)
            mask = torch.cat([mask, torch.zeros((batch, grow), dtype=torch.int64, device=device)], dim=1)
            positions = torch.cat([positions, torch.zeros((batch, grow), dtype=torch.int64, device=device)], dim=1)
        stream_offset = torch.full((batch,), round_index * (num_drafts + 1), dtype=torch.int64, device=device)

        # Draft K tokens; the drafter first absorbs every slot it has not seen yet.
        draft_tokens = torch.empty((batch, num_drafts), dtype=torch.int64, device=device)
        draft_logits = torch.empty((batch, num_drafts, vocab), dtype=torch.float32, device=device)
        for j in range(num_drafts):
            start, end = drafter_run.length, cur_len + j
            logits = drafter_run.forward(seq[:, start:end], mask[:, :end], positions[:, start:end], 1)[:, -1]
            processed = process(logits)
            if greedy:
                token = torch.argmax(processed, dim=-1)
            else:
                token = exponential_race(processed, draft_seeds, stream_offset + j)
            draft_tokens[:, j] = token
            draft_logits[:, j] = processed
            seq[:, end] = token
            mask[:, end] = active.to(torch.int64)
            positions[:, end] = next_position + j

        # Verify the pending slots and all K drafts in one call.
        start, end = verifier_run.length, cur_len + num_drafts
        target_logits = verifier_run.forward(seq[:, start:end], mask[:, :end], positions[:, start:end],
                                             num_drafts + 1)
        sampler_target_logits = process(target_logits)
        # The sampler's inputs are built here (drafts in [0, V), shapes consistent), so only NaN needs checking:
        # one fused reduction and one host sync per round instead of the public wrapper's several.
        if bool(torch.isnan(sampler_target_logits).any() | torch.isnan(draft_logits).any()):
            raise ValueError("a model produced NaN logits; refusing to turn NaN logits into tokens")
        result = rejection_sample_unchecked(
            sampler_target_logits, draft_logits, draft_tokens, 0.0 if greedy else 1.0, backend, row_seeds,
            stream_offset,
        )
        num_accepted, new_tokens = result.num_accepted, result.tokens

        # Emit: n + 1 tokens per active row, cut at eos and at max_new_tokens.
        remaining = max_new_tokens - generated
        emit = (emit_index[None] <= num_accepted[:, None]) & (emit_index[None] < remaining[:, None]) & active[:, None]
        if eos_ids:
            is_eos = torch.isin(new_tokens, eos_tensor) & emit
            first_eos = torch.where(is_eos.any(dim=1), is_eos.to(torch.int64).argmax(dim=1), num_drafts + 1)
            emit &= emit_index[None] <= first_eos[:, None]
            hit_eos = is_eos.any(dim=1)
        else:
            hit_eos = torch.zeros_like(finished)
        emit_count = emit.sum(dim=1)
        emit_rows, emit_cols = emit.nonzero(as_tuple=True)
        out_tokens[emit_rows, generated[emit_rows] + emit_cols] = new_tokens[emit_rows, emit_cols]
        generated += emit_count

        stat["drafted"] += active * num_drafts
        stat["accepted"] += torch.where(active, num_accepted, 0)
        stat["verifier_calls"] += active.to(torch.int64)
        stat["drafter_calls"] += active * num_drafts
        accepted_per_position += (draft_index[None] < num_accepted[:, None]) & active[:, None]
        attempted_per_position += (draft_index[None] <= num_accepted[:, None]) & active[:, None]
        bar.update(int(emit_count.sum()))

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
        round_index += 1

    bar.close()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall_time = time.perf_counter() - start_time
    max_generated = int(generated.max())
    sequences = torch.cat([input_ids.to(torch.int64), out_tokens[:, :max_generated]], dim=1)
    stats = SpecDecodeStats(
        drafted=stat["drafted"].cpu(), accepted=stat["accepted"].cpu(), generated=generated.cpu(),
        verifier_calls=stat["verifier_calls"].cpu(), drafter_calls=stat["drafter_calls"].cpu(),
        accepted_per_position=accepted_per_position.cpu(), attempted_per_position=attempted_per_position.cpu(),
        wall_time_s=wall_time, num_draft_tokens=num_drafts,
    )
    return GenerateOutput(sequences=sequences, stats=stats)
