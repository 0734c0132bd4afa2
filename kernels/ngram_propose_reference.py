"""Reference of the n-gram (prompt-lookup) proposal: the rule :mod:`specdec.decoding.ngram` states, as fixed-shape
tensor operations with no host synchronisation (about fifty small kernels over ``[B, N]`` a proposal).

:func:`~specdec.kernels.ngram_propose.ngram_propose_triton` computes the same in one launch; both are integer
arithmetic, so they are equal element for element.
"""

from __future__ import annotations

import torch

__all__ = ["ngram_propose"]


def ngram_propose(tokens: torch.Tensor, lengths: torch.Tensor, max_ngram: int, min_ngram: int) -> torch.Tensor:
    """The n-gram proposal after each row's tokens, in fixed-shape tensor operations (no host synchronisation).

    Parameters
    ----------
    tokens : torch.Tensor
        [B, N] int64; row b's tokens are ``tokens[b, :lengths[b]]`` (what lies past them is never read).
    lengths : torch.Tensor
        [B] int64 in [1, N].
    max_ngram, min_ngram : int
        The suffix lengths tried, longest first.

    Returns
    -------
    torch.Tensor
        [B] int64: ``t[i + n]`` for the first n (from ``max_ngram`` down) with an occurrence ``t[i : i + n] ==
        t[L - n : L]``, ``i + n < L``, and the largest such i; else ``t[L - 1]``. Always one of the row's tokens.
    """
    width = tokens.shape[1]
    starts = torch.arange(width, device=tokens.device)[None, :]  # [1, N] candidate occurrence starts i
    lengths = lengths[:, None]  # [B, 1]
    proposal = tokens.gather(1, (lengths - 1).clamp(0, width - 1))[:, 0]  # [B] fallback: the last token
    found = torch.zeros_like(proposal, dtype=torch.bool)  # [B]
    # [B, N] t[i + k] at column i (wrapped columns have i + n >= L: never a match)
    shifted = [torch.roll(tokens, -k, dims=1) for k in range(max_ngram)]
    for n in range(max_ngram, min_ngram - 1, -1):
        match = starts + n < lengths  # [B, N] the occurrence has a follower t[i + n] among the row's tokens
        for k in range(n):
            suffix_k = tokens.gather(1, (lengths - n + k).clamp(0, width - 1))  # [B, 1] t[L - n + k]
            match = match & (shifted[k] == suffix_k)
        start = torch.where(match, starts, -1).amax(dim=1)  # [B] most recent occurrence, -1 for none
        follower = tokens.gather(1, (start + n).clamp(0, width - 1)[:, None])[:, 0]
        take = (start >= 0) & ~found
        proposal = torch.where(take, follower, proposal)
        found = found | take
    return proposal
