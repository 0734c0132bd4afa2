"""The n-gram (prompt-lookup) proposal in one launch: one program per row.

Computes :func:`~specdec.kernels.ngram_propose_reference.ngram_propose`, the definition: with ``t`` a row's ``L``
tokens, for ``n`` from ``max_ngram`` down to ``min_ngram`` the largest ``j < L - 1`` whose last ``n`` tokens
``t[j - n + 1 .. j]`` equal the row's last ``n`` tokens, and the proposal ``t[j + 1]`` for the first ``n`` that has
one; else ``t[L - 1]``. The reference is about fifty small kernels over ``[B, N]`` a proposal (shifted copies,
comparisons and a max-reduction for every ``n``); K drafts of an n-gram drafter make K proposals a round.

A program streams its row's context in tiles of ``BLOCK`` positions ``j``, counts how many of the last
``MAX_NGRAM`` tokens ending at ``j`` agree with the row's suffix (``run(j)``), and keeps for every ``n`` the largest
``j`` with ``run(j) >= n``; integer arithmetic only, so it equals the torch version exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._device import INTERPRETER, launching_on

__all__ = ["ngram_propose_triton"]


@triton.jit
def _ngram_kernel(tokens_ptr, row_stride, lengths_ptr, out_ptr, N,
                  MAX_NGRAM: tl.constexpr, MIN_NGRAM: tl.constexpr, NP2: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = tokens_ptr + row.to(tl.int64) * row_stride
    length = tl.load(lengths_ptr + row)
    sizes = tl.arange(0, NP2) + 1  # n = 1 .. NP2
    best = tl.full([NP2], -1, tl.int64)  # per n: the largest j whose run reaches n
    for start in tl.range(0, N, BLOCK):
        j = start + tl.arange(0, BLOCK).to(tl.int64)
        candidate = j < length - 1  # the follower t[j + 1] is one of the row's tokens
        run = tl.zeros([BLOCK], tl.int64)
        agree = candidate
        for k in tl.static_range(MAX_NGRAM):
            suffix = tl.load(base + tl.maximum(length - 1 - k, 0))
            here = tl.load(base + j - k, mask=candidate & (j - k >= 0), other=-1)
            agree = agree & (j - k >= 0) & (length - 1 - k >= 0) & (here == suffix)
            run = run + agree.to(tl.int64)
        reach = tl.where(run[None, :] >= sizes[:, None], j[None, :], -1)  # [NP2, BLOCK]
        best = tl.maximum(best, tl.max(reach, axis=1))
    proposal = tl.load(base + tl.maximum(length - 1, 0))  # no match: the last token
    found = length < 0  # False
    for step in tl.static_range(MAX_NGRAM - MIN_NGRAM + 1):
        n = MAX_NGRAM - step
        last = tl.max(tl.where(sizes == n, best, -1), axis=0)
        take = (last >= 0) & ~found
        follower = tl.load(base + tl.maximum(last + 1, 0))
        proposal = tl.where(take, follower, proposal)
        found = found | take
    tl.store(out_ptr + row, proposal)


def ngram_propose_triton(tokens: torch.Tensor, lengths: torch.Tensor, max_ngram: int, min_ngram: int) -> torch.Tensor:
    """:func:`~specdec.kernels.ngram_propose_reference.ngram_propose` in one launch (inputs unchecked).

    Parameters
    ----------
    tokens : torch.Tensor
        [B, N] int64, unit stride along N; row b's tokens are ``tokens[b, :lengths[b]]``.
    lengths : torch.Tensor
        [B] int64 in [1, N].
    max_ngram, min_ngram : int
        The suffix lengths tried, longest first (``1 <= min_ngram <= max_ngram``).

    Returns
    -------
    torch.Tensor
        [B] int64 proposals, each one of its row's tokens.
    """
    batch, width = tokens.shape
    if tokens.stride(1) != 1:
        tokens = tokens.contiguous()
    out = torch.empty(batch, dtype=torch.int64, device=tokens.device)
    block = min(64 if INTERPRETER else 512, triton.next_power_of_2(max(width, 1)))
    with launching_on(tokens.device):
        _ngram_kernel[(batch,)](tokens, tokens.stride(0), lengths.contiguous(), out, width, MAX_NGRAM=max_ngram,
                                MIN_NGRAM=min_ngram, NP2=triton.next_power_of_2(max_ngram), BLOCK=block,
                                num_warps=4 if block >= 256 else 1)
    return out
