"""The round commit in one launch: emission, eos, budgets, row state and counters of a speculative-decoding round.

Computes exactly what :func:`~specdec.kernels.round_commit_reference.round_commit_reference` computes (integer
arithmetic only, so the two are equal element for element); the terms and the formula are in that module. The
static decoding path runs it inside its captured round, where the torch version is several dozen small kernels.

Launches: one program over the whole batch (``[B_block, T_block]`` tiles, T = K + 1), so the round flags, which
reduce over rows, need no atomics and no second launch. Its plan (:func:`round_commit_plan`) picks the tile sizes and
warps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._device import launching_on
from .round_commit_reference import RoundState

__all__ = ["RoundCommitPlan", "round_commit_plan", "round_commit_triton"]

MAX_BATCH = 1024  # one program holds the batch: past this the tiles would not fit its registers


@dataclass(frozen=True)
class RoundCommitPlan:
    """Tiles of one :func:`round_commit_triton` launch: ``block_b`` rows (>= B), ``block_t`` round tokens
    (>= K + 1), ``block_k`` per-position counters (>= K), all powers of two; ``num_warps`` of the program."""

    block_b: int
    block_t: int
    block_k: int
    num_warps: int


def round_commit_plan(batch: int, num_drafts: int) -> RoundCommitPlan:
    """The only place the round commit's tiles are chosen: the whole batch in one program."""
    block_b = triton.next_power_of_2(max(batch, 1))
    # NOTE: one warp covers 32 rows; more warps only for batches whose [B, T] tiles outgrow a warp's registers.
    return RoundCommitPlan(block_b=block_b, block_t=triton.next_power_of_2(num_drafts + 1),
                           block_k=triton.next_power_of_2(max(num_drafts, 1)), num_warps=1 if block_b <= 32 else 4)


@triton.jit
def _round_commit_kernel(
    tokens_ptr, num_accepted_ptr, bad_ptr, max_new_ptr, eos_ptr,
    seq_ptr, slot_len_ptr, prev_ptr, pending_ptr, generated_ptr, finished_ptr, stream_pos_ptr,
    drafted_ptr, accepted_ptr, verifier_calls_ptr, drafter_calls_ptr, accepted_pos_ptr, attempted_pos_ptr, flags_ptr,
    B, seq_stride, pos_stride,
    K: tl.constexpr, NUM_EOS: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_B)
    row_ok = rows < B
    t = tl.arange(0, BLOCK_T)
    tile_ok = row_ok[:, None] & (t[None, :] < K + 1)
    tokens = tl.load(tokens_ptr + rows[:, None].to(tl.int64) * (K + 1) + t[None, :], mask=tile_ok, other=-1)
    n = tl.load(num_accepted_ptr + rows, mask=row_ok, other=0)
    finished = tl.load(finished_ptr + rows, mask=row_ok, other=1) != 0
    active = (~finished) & row_ok
    generated = tl.load(generated_ptr + rows, mask=row_ok, other=0)
    max_new = tl.load(max_new_ptr)
    slot_len = tl.load(slot_len_ptr + rows, mask=row_ok, other=0)
    pending = tl.load(pending_ptr + rows, mask=row_ok, other=0)
    prev = tl.load(prev_ptr + rows, mask=row_ok, other=0)

    emit = (t[None, :] <= n[:, None]) & (t[None, :] < (max_new - generated)[:, None]) & active[:, None] & tile_ok
    is_eos = tokens < -2  # all False (eos pads are -2; round tokens are >= -1)
    for e in tl.static_range(NUM_EOS):
        is_eos = is_eos | (tokens == tl.load(eos_ptr + e))
    is_eos = is_eos & emit
    first_eos = tl.min(tl.where(is_eos, t[None, :], K + 1), axis=1)
    hit_eos = first_eos <= K
    emit = emit & (t[None, :] <= first_eos[:, None])
    zero = tl.zeros_like(n)
    accepted = tl.where(active, tl.minimum(n, first_eos + 1), zero)
    attempted = tl.where(active, tl.minimum(tl.minimum(n + 1, K), first_eos + 1), zero)
    count = tl.sum(emit.to(tl.int64), axis=1)

    seq_rows = seq_ptr + rows[:, None].to(tl.int64) * seq_stride
    tl.store(seq_rows + slot_len[:, None] + t[None, :], tokens, mask=emit)
    bad = (tl.load(bad_ptr) != 0) | (tl.max(tl.where(emit & (tokens < 0), 1, 0)) > 0)
    generated = generated + count
    finished = finished | hit_eos | (generated >= max_new)
    token_n = tl.sum(tl.where(t[None, :] == (n - 1)[:, None], tokens, 0), axis=1)  # tokens[n - 1]
    token_n1 = tl.sum(tl.where(t[None, :] == n[:, None], tl.maximum(tokens, 0), 0), axis=1)  # tokens[n], -1 read as 0
    new_prev = tl.where(n == 0, pending, tl.maximum(token_n, 0))
    tl.store(prev_ptr + rows, tl.where(active, new_prev, prev), mask=row_ok)
    tl.store(pending_ptr + rows, tl.where(active, token_n1, pending), mask=row_ok)
    tl.store(generated_ptr + rows, generated, mask=row_ok)
    tl.store(finished_ptr + rows, finished.to(tl.int1), mask=row_ok)
    tl.store(slot_len_ptr + rows, slot_len + count, mask=row_ok)
    stream_pos = tl.load(stream_pos_ptr + rows, mask=row_ok, other=0)
    tl.store(stream_pos_ptr + rows, stream_pos + K + 1, mask=row_ok)
    one = active.to(tl.int64)
    calls = tl.load(verifier_calls_ptr + rows, mask=row_ok, other=0)
    tl.store(verifier_calls_ptr + rows, calls + one, mask=row_ok)
    drafted = tl.load(drafted_ptr + rows, mask=row_ok, other=0)
    tl.store(drafted_ptr + rows, drafted + one * K, mask=row_ok)
    drafter_calls = tl.load(drafter_calls_ptr + rows, mask=row_ok, other=0)
    tl.store(drafter_calls_ptr + rows, drafter_calls + one * K, mask=row_ok)
    accepted_total = tl.load(accepted_ptr + rows, mask=row_ok, other=0)
    tl.store(accepted_ptr + rows, accepted_total + accepted, mask=row_ok)
    if K > 0:
        j = tl.arange(0, BLOCK_K)
        pos_ok = row_ok[:, None] & (j[None, :] < K)
        pos_offsets = rows[:, None].to(tl.int64) * pos_stride + j[None, :]
        counts = tl.load(accepted_pos_ptr + pos_offsets, mask=pos_ok, other=0)
        tl.store(accepted_pos_ptr + pos_offsets, counts + (j[None, :] < accepted[:, None]).to(tl.int64), mask=pos_ok)
        counts = tl.load(attempted_pos_ptr + pos_offsets, mask=pos_ok, other=0)
        tl.store(attempted_pos_ptr + pos_offsets, counts + (j[None, :] < attempted[:, None]).to(tl.int64),
                 mask=pos_ok)
    all_finished = tl.min(tl.where(row_ok, finished.to(tl.int64), 1))
    tl.store(flags_ptr + 0, all_finished)
    tl.store(flags_ptr + 1, bad.to(tl.int64))
    tl.store(flags_ptr + 2, tl.sum(accepted))
    tl.store(flags_ptr + 3, tl.sum(attempted))
    tl.store(flags_ptr + 4, tl.sum(count))


def round_commit_triton(state: RoundState, tokens: torch.Tensor, num_accepted: torch.Tensor, bad: torch.Tensor,
                        max_new: torch.Tensor, eos: torch.Tensor, num_drafts: int,
                        plan: RoundCommitPlan | None = None) -> None:
    """:func:`~specdec.kernels.round_commit_reference.round_commit_reference` in one launch (inputs unchecked).

    Parameters
    ----------
    state : RoundState
        Contiguous int64 tensors (``finished`` bool) on one device; ``seq`` [B, S] row-contiguous; per-position
        counters [B, K_max] with K_max >= ``num_drafts``.
    tokens : torch.Tensor
        [B, K + 1] int64 round tokens, contiguous (``-1`` allowed past a row's accepted drafts + 1).
    num_accepted : torch.Tensor
        [B] int64 in 0..K.
    bad : torch.Tensor
        0-dim bool: a NaN was seen in this round's logits.
    max_new : torch.Tensor
        [1] int64 per-row budget of new tokens.
    eos : torch.Tensor
        [E] int64 eos ids (``-2`` pads: never a token), E >= 1.
    num_drafts : int
        K (0 for a plain round).
    plan : RoundCommitPlan, optional
        Forces tile sizes (tests); default :func:`round_commit_plan`.
    """
    batch = tokens.shape[0]
    if batch > MAX_BATCH:
        raise ValueError(f"round_commit_triton holds the batch in one program: B must be <= {MAX_BATCH}, got {batch}")
    plan = plan or round_commit_plan(batch, num_drafts)
    with launching_on(tokens.device):
        _round_commit_kernel[(1,)](
            tokens, num_accepted, bad, max_new, eos,
            state.seq, state.slot_len, state.prev, state.pending, state.generated, state.finished, state.stream_pos,
            state.drafted, state.accepted, state.verifier_calls, state.drafter_calls,
            state.accepted_per_position, state.attempted_per_position, state.flags,
            batch, state.seq.stride(0), state.accepted_per_position.stride(0),
            K=num_drafts, NUM_EOS=eos.shape[0], BLOCK_B=plan.block_b, BLOCK_T=plan.block_t, BLOCK_K=plan.block_k,
            num_warps=plan.num_warps,
        )
