"""Reference of the round commit: what one round of speculative decoding emits, and how it advances every row.

This is the definition :func:`specdec.kernels.round_commit.round_commit_triton` computes in one launch. It is the
static decoding path's bookkeeping (``specdec.decoding.static``) written as plain tensor operations, with no host
synchronisation.

Terms:
    row ``b``: one request; ``B`` rows. ``K``: drafts this round (0 for a plain round). ``S``: cache slots.
    round tokens ``tokens[b, :n_b + 1]``: the ``n_b = num_accepted[b]`` accepted drafts, then the recovered or bonus
    token (entries past ``n_b`` are ignored, ``-1`` allowed there).
    active: a row that has not finished before this round.

Formula (per row ``b``, ``t = 0 .. K``)::

    emit[t]    = active and t <= n_b and t < max_new - generated_b and t <= first_eos_b
    first_eos  = the first t with emit-before-eos-cut[t] and tokens[t] in eos (K + 1 if none)
    accepted   = active * min(n_b, first_eos + 1);  attempted = active * min(min(n_b + 1, K), first_eos + 1)
    seq[b, slot_len_b + t] = tokens[t]           where emit[t]
    count      = sum_t emit[t];  generated += count;  slot_len += count
    finished  |= hit_eos or generated >= max_new
    prev, pending = (pending, tokens)[n_b], (pending, tokens)[n_b + 1]    (active rows; ``-1`` read as 0)
    stream_pos += K + 1;  verifier_calls += active;  drafted += K active;  drafter_calls += K active
    accepted_per_position[b, j] += j < accepted;  attempted_per_position[b, j] += j < attempted   (j < K)
    flags = [all rows finished, bad or any emitted token < 0, sum accepted, sum attempted, sum count]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RoundState", "add_position_counts", "round_commit_reference", "round_emission"]


@dataclass
class RoundState:
    """The per-row device state a round advances (every tensor int64 on one device unless said otherwise).

    Attributes:
        seq: [B, S] tokens by slot (prompt, then emitted tokens).
        slot_len: [B] committed tokens of the row, prompt padding included (``L + generated``).
        prev, pending: [B] the last two committed tokens (``pending`` is not yet in the verifier's cache).
        generated: [B] tokens emitted so far. finished: [B] bool.
        stream_pos: [B] position of the row's random stream.
        drafted, accepted, verifier_calls, drafter_calls: [B] counters.
        accepted_per_position, attempted_per_position: [B, K_max] counters (K_max >= every round's K).
        flags: [5] this round's all finished, bad, accepted, attempted, emitted.
    """

    seq: torch.Tensor
    slot_len: torch.Tensor
    prev: torch.Tensor
    pending: torch.Tensor
    generated: torch.Tensor
    finished: torch.Tensor
    stream_pos: torch.Tensor
    drafted: torch.Tensor
    accepted: torch.Tensor
    verifier_calls: torch.Tensor
    drafter_calls: torch.Tensor
    accepted_per_position: torch.Tensor
    attempted_per_position: torch.Tensor
    flags: torch.Tensor


def round_emission(tokens: torch.Tensor, num_accepted: torch.Tensor, num_drafts: int, remaining: torch.Tensor,
                   active: torch.Tensor, eos: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``emit`` [B, K+1] bool, ``hit_eos`` [B] bool, ``accepted`` and ``attempted`` [B] int64 of one round.

    ``remaining``: [B] tokens each row may still emit; ``eos``: [E] int64 ids (E may be 0; ids < 0 never match).
    Acceptance tests count up to an emitted eos (none after it) and also past the budget (they were decided).
    """
    index = torch.arange(num_drafts + 1, device=tokens.device)
    emit = (index <= num_accepted[:, None]) & (index < remaining[:, None]) & active[:, None]
    is_eos = (tokens[..., None] == eos).any(dim=-1) & emit
    hit_eos = is_eos.any(dim=1)
    first_eos = torch.where(hit_eos, is_eos.to(torch.int64).argmax(dim=1), num_drafts + 1)
    emit = emit & (index <= first_eos[:, None])
    accepted = torch.minimum(num_accepted, first_eos + 1) * active
    attempted = torch.minimum(torch.clamp(num_accepted + 1, max=num_drafts), first_eos + 1) * active
    return emit, hit_eos, accepted, attempted


def add_position_counts(accepted_per_position: torch.Tensor, attempted_per_position: torch.Tensor,
                        accepted: torch.Tensor, attempted: torch.Tensor, num_drafts: int) -> None:
    """Adds a round's counts to the [B, K_max] int64 per-position counters in place: position ``j < K`` gains one
    where ``j < accepted`` ([B] int64) and where ``j < attempted`` ([B] int64)."""
    position = torch.arange(num_drafts, device=accepted.device)
    accepted_per_position[:, :num_drafts] += position < accepted[:, None]
    attempted_per_position[:, :num_drafts] += position < attempted[:, None]


def round_commit_reference(state: RoundState, tokens: torch.Tensor, num_accepted: torch.Tensor, bad: torch.Tensor,
                           max_new: torch.Tensor, eos: torch.Tensor, num_drafts: int) -> None:
    """Commits one round into ``state`` in place (the formula in the module docstring).

    Args:
        state: the rows' :class:`RoundState`.
        tokens: [B, K+1] int64 round tokens. num_accepted: [B] int64 in 0..K.
        bad: 0-dim bool, a NaN seen in this round's logits. max_new: [1] int64 budget. eos: [E] int64 (-2 pads).
        num_drafts: K.
    """
    active = ~state.finished
    emit, hit_eos, accepted, attempted = round_emission(tokens, num_accepted, num_drafts,
                                                        max_new - state.generated, active, eos)
    count = emit.sum(dim=1)
    write = state.slot_len[:, None] + torch.arange(num_drafts + 1, device=tokens.device)
    state.seq.scatter_(1, write, torch.where(emit, tokens, state.seq.gather(1, write)))
    bad = bad | (emit & (tokens < 0)).any()
    state.generated.add_(count)
    state.finished.copy_(state.finished | hit_eos | (state.generated >= max_new))
    committed = torch.cat([state.pending[:, None], tokens.clamp(min=0)], dim=1)
    state.prev.copy_(torch.where(active, committed.gather(1, num_accepted[:, None])[:, 0], state.prev))
    state.pending.copy_(torch.where(active, committed.gather(1, num_accepted[:, None] + 1)[:, 0], state.pending))
    state.slot_len.add_(count)  # (count is 0 for finished rows; a cut round ends its row)
    state.stream_pos.add_(num_drafts + 1)
    state.verifier_calls.add_(active)
    state.drafted.add_(active * num_drafts)
    state.drafter_calls.add_(active * num_drafts)
    state.accepted.add_(accepted)
    add_position_counts(state.accepted_per_position, state.attempted_per_position, accepted, attempted, num_drafts)
    state.flags.copy_(torch.stack([state.finished.all().to(torch.int64), bad.to(torch.int64), accepted.sum(),
                                   attempted.sum(), count.sum()]))
