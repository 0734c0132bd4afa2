"""What a round of speculative decoding emits and counts, shared by the static and the eager path.

A round yields ``tokens`` [B, K+1]: the row's accepted drafts, then its recovered or bonus token. A row emits
``tokens[:, :n + 1]`` (n accepted drafts) cut at its first eos and at its remaining budget. Acceptance tests count up
to an emitted eos (none after it) and also past the budget (they were decided). The rule is defined once, in
:func:`specdec.kernels.round_commit_reference.round_emission`; the eager path applies it here, the static path in
its one-launch round commit (:mod:`specdec.kernels.round_commit`).
"""

from __future__ import annotations

import torch

from specdec.kernels.round_commit_reference import round_emission as emission

__all__ = ["add_position_counts", "emission"]


def add_position_counts(accepted_per_position: torch.Tensor, attempted_per_position: torch.Tensor,
                        accepted: torch.Tensor, attempted: torch.Tensor, num_drafts: int) -> None:
    """Adds a round's counts to the [B, K_max] per-position counters in place (position j < accepted / attempted)."""
    position = torch.arange(num_drafts, device=accepted.device)
    accepted_per_position[:, :num_drafts] += position < accepted[:, None]
    attempted_per_position[:, :num_drafts] += position < attempted[:, None]
