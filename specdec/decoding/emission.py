"""What a round of speculative decoding emits and counts, shared by the static and the eager path.

A round yields ``tokens`` [B, K+1]: the row's accepted drafts, then its recovered or bonus token. A row emits
``tokens[:, :n + 1]`` (n accepted drafts) cut at its first eos and at its remaining budget. Acceptance tests count up
to an emitted eos (none after it) and also past the budget (they were decided). Pure tensor operations, no host
synchronisation, so the static path can capture them in a CUDA graph.
"""

from __future__ import annotations

import torch


def emission(tokens: torch.Tensor, num_accepted: torch.Tensor, num_drafts: int, remaining: torch.Tensor,
             active: torch.Tensor, eos: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The emitted tokens and the acceptance counts of one round.

    Args:
        tokens: [B, K+1] int64 round tokens (entries past ``num_accepted + 1`` are ignored).
        num_accepted: [B] int64 accepted drafts (0..K). num_drafts: K.
        remaining: [B] int64 tokens each row may still emit. active: [B] bool rows still generating.
        eos: [E] int64 eos ids (E may be 0; ids < 0 never match a token).

    Returns:
        ``emit`` [B, K+1] bool, ``hit_eos`` [B] bool, ``accepted`` [B] and ``attempted`` [B] int64 (draft positions
        accepted and tested, counted for :class:`specdec.SpecDecodeStats`).
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
    """Adds a round's counts to the [B, K_max] per-position counters in place (position j < accepted / attempted)."""
    position = torch.arange(num_drafts, device=accepted.device)
    accepted_per_position[:, :num_drafts] += position < accepted[:, None]
    attempted_per_position[:, :num_drafts] += position < attempted[:, None]
