"""One draw per row from unnormalised log-weights by an exponential race: one launch and a two-op combine.

Computes :func:`~specdec.kernels.rejection_sampling_reference.exponential_race`, the definition::

    token[b] = argmax_x  scores[b, x] - log E(seed_b, position_b, x)

with ``E`` the counter-based Exp(1) noise of :mod:`specdec.kernels.rng`, ties to the lowest id and NaN race scores
never winning. The static decoding path draws every sampled draft and every sampled plain-round token with it. In
torch the same formula is over seventy elementwise kernels over ``[B, V]`` (the 32-bit hash emulated in int64, the
exponential's two branches, the race, the arg-max), each a few microseconds even inside a CUDA graph; here a program
races ``chunk`` ids of one row in registers and stores its best score and id, and the combine takes each row's first
best chunk. The arithmetic is the reference's, so the two agree token for token (a flip needs two race scores within
a rounding error of each other).

Launch: grid ``(B, S)`` with ``S = ceil(V / chunk)``, from :func:`race_plan`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._device import INTERPRETER, launching_on, sm_count
from .rng import exponential_from_keys_tl, stream_keys_tl

__all__ = ["RacePlan", "exponential_race_triton", "race_plan"]


@dataclass(frozen=True)
class RacePlan:
    """``chunk`` ids a program races (a multiple of ``block``), in tiles of ``block`` ids; ``num_warps``."""

    chunk: int
    block: int
    num_warps: int


def race_plan(batch: int, vocab: int, device: torch.device) -> RacePlan:
    """The only place the race's launch is chosen: about two programs per multiprocessor over the batch, each
    streaming whole tiles (1024 ids; 128 in the interpreter, so the CPU tests cross tiles and chunks)."""
    block = min(128 if INTERPRETER else 1024, triton.next_power_of_2(max(vocab, 1)))
    chunks = max(1, 2 * sm_count(device) // max(batch, 1))
    chunk = triton.cdiv(triton.cdiv(vocab, chunks), block) * block
    return RacePlan(chunk=max(chunk, block), block=block, num_warps=4 if block >= 512 else 1)


@triton.jit
def _race_kernel(scores_ptr, row_stride, seeds_ptr, positions_ptr, best_ptr, arg_ptr, V, S,
                 CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    key_a, key_b = stream_keys_tl(tl.load(seeds_ptr + row), tl.load(positions_ptr + row))
    base = scores_ptr + row.to(tl.int64) * row_stride
    best = tl.full((), float("-inf"), tl.float32)
    arg = tl.zeros((), tl.int32) + V
    for offset in tl.range(0, CHUNK, BLOCK):
        ids = part * CHUNK + offset + tl.arange(0, BLOCK)
        ok = ids < V
        scores = tl.load(base + ids, mask=ok, other=float("-inf"))
        race = scores - tl.log(exponential_from_keys_tl(key_a, key_b, ids, False))
        race = tl.where(ok & (race == race), race, float("-inf"))  # NaN never wins
        top = tl.max(race, axis=0)
        first = tl.min(tl.where(race == top, ids, V), axis=0)
        better = (top > best) | (arg >= V)  # strictly better: an earlier tile keeps a tie
        best = tl.where(better, top, best)
        arg = tl.where(better, first, arg)
    tl.store(best_ptr + row * S + part, best)
    tl.store(arg_ptr + row * S + part, arg.to(tl.int64))


def exponential_race_triton(scores: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                            plan: RacePlan | None = None) -> torch.Tensor:
    """:func:`~specdec.kernels.rejection_sampling_reference.exponential_race` in one launch (inputs unchecked).

    Parameters
    ----------
    scores : torch.Tensor
        [B, V] float32 log-weights (``-inf``: weight 0); rows may be strided (copied when V is).
    seeds, positions : torch.Tensor
        [B] int64: each row's random stream and its position in it.
    plan : RacePlan, optional
        Forces the chunking (tests); default :func:`race_plan`.

    Returns
    -------
    torch.Tensor
        [B] int64 ids in [0, V): the race's winners.
    """
    batch, vocab = scores.shape
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    plan = plan or race_plan(batch, vocab, scores.device)
    parts = triton.cdiv(vocab, plan.chunk)
    best = torch.empty((batch, parts), dtype=torch.float32, device=scores.device)
    arg = torch.empty((batch, parts), dtype=torch.int64, device=scores.device)
    with launching_on(scores.device):
        _race_kernel[(batch, parts)](scores, scores.stride(0), seeds.contiguous(), positions.contiguous(), best, arg,
                                     vocab, parts, CHUNK=plan.chunk, BLOCK=plan.block, num_warps=plan.num_warps)
    return arg.gather(1, best.argmax(dim=1, keepdim=True))[:, 0]  # the first best chunk: ties to the lowest id
