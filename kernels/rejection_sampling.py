"""Fused Triton rejection sampler for speculative decoding: verifier scoring, accept test, recovery and bonus token.

:func:`rejection_sample_triton` takes **logits** (fp32, bf16, fp16; computed in fp32) and never materialises a
``[B, K+1, V]`` probability tensor. It computes what
:func:`~specdec.kernels.rejection_sampling_reference.rejection_sample_reference` computes, on the same counter-based
random stream (:mod:`specdec.kernels.rng`), so tokens and accepted counts equal the reference's element for element
(the normalisers are summed in another order, which could flip a decision only on a near-tie of ~1e-6).

Terms:
    row ``b``: one request of the batch; ``B`` rows.
    position ``j``: the ``K`` draft positions ``0 .. K-1`` and the bonus position ``K``.
    ``n_b``: row b's real drafts: its ``num_draft_tokens`` capped at its first ``-1`` draft.
    scale ``s_b``: ``1 / T`` for sampled rows, 1 for greedy rows (``T = 0`` or ``greedy_mask[b]``).
    stop position: the first rejected position ``j < n_b``, else ``n_b`` (block verification: below); it equals
        ``num_accepted[b]``.
    residual: ``w(x) = max(0, p(x) - q(x))`` at the stop position of a rejected row.
    race tile: 256 consecutive vocabulary ids (``RACE_TILE``); split: a vocabulary chunk handled by one program.

Formula (per row ``b`` and position ``j``)::

    L_t[j] = logsumexp_x(s_b target[b, j, x]),  L_d[j] = logsumexp_x(s_b draft[b, j, x])      (fp32, online)
    accept_j = q_j(x_j) > 0 and log u_j + log q_j(x_j) <= log p_j(x_j),  u_j = U(seed_b, off_b + j, ACCEPT)
    w(x)     = max(0, p_stop(x) - q_stop(x))   if rejected and sum_x w(x) > RESIDUAL_MASS_EPS (1e-6)
             = p_stop(x)                       otherwise (bonus token, or p == q up to rounding)
    tile     c* = argmax_c log W_c - log E(seed_b, off_b + stop, TILE_INDEX_BASE + c),  W_c = sum_{x in c} w(x)
    next     = argmax_{x in c*} log w(x) - log E(seed_b, off_b + stop, x)
    greedy rows: accept_j = (x_j == argmax_x target[b, j, x]) (lowest id on ties); next = that arg-max at stop.

Block verification (``verification="block"``, sampled rows; ``docs/rejection_sampling.md``)::

    a_0 = 0,  a_{j+1} = min(0, a_j + log p_j(x_j) - log q_j(x_j))                  (a_j = log P_j, fp32, in order)
    W_j   = sum_x max(0, P_j p_j(x) - q_j(x)),  eta_j = U(seed_b, off_b + j - 1, ACCEPT)
    stop  = max {j in 1..n_b : log eta_j <= a_j and (j = n_b or a_j >= -BLOCK_CERTAIN_EPS
                                                     or eta_j (W_j + 1 - P_j) <= W_j)}, else 0
    w(x)  = max(0, P_stop p_stop(x) - q_stop(x)) at a stop < n_b (p_stop at n_b; p when the mass is <= 1e-6)

The two-level race draws ``x`` with probability ``(W_c / W) (w(x) / W_c) = w(x) / W`` without normalising ``w``:
random numbers per tile for level 1, per id only inside the winning tile. ``E = -log U`` is Exp(1) noise drawn from
32 random bits with float32 relative precision at both ends (:func:`specdec.kernels.rng.bits_to_exponential`);
``U`` of the accept test is a 23-bit uniform. Ties go to the lowest tile and id.
Falling back to ``p`` when the residual mass is at most 1e-6 moves the output law by at most 1e-6 in total
variation, only at positions whose rejection probability was itself at most 1e-6.

Two launches (:mod:`specdec.kernels.rejection_sampling_kernels`): the statistics kernel reduces each vocabulary
chunk of each (row, position) to partial (max, sum-exp) pairs; the race kernel combines them, runs the accept tests
and races over its chunk of the stop row, and the last race program of each row writes its outputs. The launch plan
(tiles, splits, staged or live-skip statistics, fast math) is a :class:`~specdec.kernels.rejection_sampling_plan.
LaunchPlan` chosen by :func:`~specdec.kernels.rejection_sampling_plan.plan_launch`.

On the GPU the per-element exponentials are ``ex2.approx.ftz`` (values below 2**-126 flush to 0: no sum or race
score moves by more than ~1e-38 relative) and the race's logarithms ``lg2.approx`` (absolute error <= 2.3e-6, about
one fp32 ulp of the largest noise terms, so only a near-tie of race scores can move); the accept test keeps
``tl.log``. NaN never wins a comparison; a race or arg-max without a finite candidate (an all ``-inf`` or NaN row)
writes ``-1`` at the stop position, never an id outside ``[0, V)`` (the public wrapper raises on such inputs).
"""

from __future__ import annotations

import torch
import triton

from ._device import launching_on
from .rejection_sampling_kernels import _race_kernel, _stats_kernel
from .rejection_sampling_plan import LaunchPlan, plan_launch, statistics_launches, vocabulary_chunk
from .rejection_sampling_reference import BLOCK_CERTAIN_EPS, RACE_TILE, RESIDUAL_MASS_EPS, TILE_INDEX_BASE

__all__ = ["LaunchPlan", "plan_launch", "rejection_sample_triton"]

MAX_VOCAB = 1 << 24  # tile and id indices travel through fp32 partials: exact below 2**24


def _combine_width(splits: int) -> int:
    """Width of a combine tile over ``splits`` partials: the next power of two, at least 2."""
    return max(2, triton.next_power_of_2(splits))


def rejection_sample_triton(target_logits: torch.Tensor, draft_logits: torch.Tensor, draft_tokens: torch.Tensor,
                            seeds: torch.Tensor, offsets: torch.Tensor, temperature: float, *,
                            greedy_mask: torch.Tensor | None = None, num_draft_tokens: torch.Tensor | None = None,
                            compute_scores: bool = False, verification: str = "token",
                            plan: LaunchPlan | None = None,
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Fused rejection sampling from logits; the contract and results of ``rejection_sample_reference``.

    Inputs are assumed validated (see :func:`specdec.rejection_sample`).

    Parameters
    ----------
    target_logits : torch.Tensor
        ``[B, K+1, V]`` fp32 / bf16 / fp16 verifier logits at the K draft positions and the bonus position,
        ``V < 2**24``.
    draft_logits : torch.Tensor
        ``[B, K, V]`` logits the drafts were sampled from (any of those dtypes).
    draft_tokens : torch.Tensor
        ``[B, K]`` int64 draft ids; ``-1`` ends a row's drafts.
    seeds, offsets : torch.Tensor
        ``[B]`` int64 keys of the counter-based random stream (per-row seed, position offset).
    temperature : float
        ``T >= 0``; ``0`` decodes every row greedily.
    greedy_mask : torch.Tensor, optional
        ``[B]`` bool, rows decoded greedily although ``T > 0``.
    num_draft_tokens : torch.Tensor, optional
        ``[B]`` int64 per-row draft counts ``<= K``.
    compute_scores : bool
        Also return ``log p(draft)`` and ``alpha = sum_x min(p, q)`` per position (at ``T = 1`` for greedy rows);
        one more read of the logits.
    verification : str
        ``"token"`` or ``"block"``: the drafts of a sampled row decided jointly (block verification; greedy rows
        keep the arg-max rule), as ``rejection_sample_reference(..., verification=)``.
    plan : LaunchPlan, optional
        The launch plan; default :func:`plan_launch` of the call's shape, dtype and device. Results do not depend
        on it; what a call cannot use (live skip or no bonus statistics with greedy rows, stages with scores, stages
        or live skip under block verification) is turned off, and its ``verification`` set to the call's.

    Returns
    -------
    tokens : torch.Tensor
        ``[B, K+1]`` int64: accepted drafts, then the recovered or bonus token, then ``-1``. A row whose race has
        no finite candidate (NaN or all ``-inf`` logits) gets ``-1`` at its stop position.
    num_accepted : torch.Tensor
        ``[B]`` int64 drafts accepted before the first rejection.
    draft_logprob, alpha : torch.Tensor or None
        ``[B, K]`` fp32 with ``compute_scores`` (``draft_logprob`` is ``-inf`` where there is no draft), else None.
    """
    batch, num_positions, vocab = target_logits.shape
    num_drafts = num_positions - 1
    device = target_logits.device
    if vocab >= MAX_VOCAB:
        raise ValueError(f"vocabulary size {vocab} >= 2**24 is not supported by the Triton rejection sampler")
    tokens = torch.empty((batch, num_positions), dtype=torch.int64, device=device)
    num_accepted = torch.empty((batch,), dtype=torch.int64, device=device)
    if batch == 0:
        empty = torch.empty((0, num_drafts), dtype=torch.float32, device=device)
        return tokens, num_accepted, (empty if compute_scores else None), (empty if compute_scores else None)
    all_greedy = temperature == 0
    greedy_rows = all_greedy or greedy_mask is not None
    if plan is None:
        plan = plan_launch(batch, num_drafts, vocab, target_logits.dtype, device, greedy_rows=greedy_rows,
                           scores=compute_scores, verification=verification)
    else:
        plan = plan.restricted(batch=batch, num_drafts=num_drafts, greedy_rows=greedy_rows, scores=compute_scores,
                               verification=verification)
    block = plan.verification == "block"

    target = target_logits.contiguous()
    draft = draft_logits.contiguous()
    tokens_in = draft_tokens.to(torch.int64).contiguous()
    seeds = seeds.to(torch.int64).contiguous()
    offsets = offsets.to(torch.int64).contiguous()
    inv_t = 1.0 / temperature if temperature > 0 else 1.0
    has_mask = greedy_mask is not None and not all_greedy
    has_counts = num_draft_tokens is not None
    flags = dict(HAS_COUNTS=has_counts, HAS_MASK=has_mask, ALL_GREEDY=all_greedy)
    mask_arg = greedy_mask.contiguous() if has_mask else seeds
    counts_arg = num_draft_tokens.to(torch.int64).contiguous() if has_counts else seeds
    kp2 = triton.next_power_of_2(num_drafts)
    jp2 = triton.next_power_of_2(num_drafts + 1)

    pairs = batch * num_positions
    chunk, splits = vocabulary_chunk(vocab, plan.stats_block, plan.stats_splits)
    chunk2, splits2 = vocabulary_chunk(vocab, plan.race_tiles * RACE_TILE, plan.race_splits)
    launches = statistics_launches(plan, num_drafts)
    stat_positions = launches[-1][0] + launches[-1][1]
    keep_evict, rest_evict = ("evict_last", "evict_first") if plan.l2_keep else ("", "")
    stats = torch.empty((pairs, splits, 4), dtype=torch.float32, device=device)
    argmax = torch.empty((pairs, splits), dtype=torch.int32, device=device)
    race = torch.empty((batch, splits2, num_positions if block else 1, 6), dtype=torch.float32, device=device)
    counter = torch.empty((batch,), dtype=torch.int32, device=device)
    if compute_scores:
        draft_logprob = torch.empty((batch, num_drafts), dtype=torch.float32, device=device)
        alpha = torch.empty((batch, num_drafts), dtype=torch.float32, device=device)
        alpha_part = torch.empty((batch, num_drafts, splits2), dtype=torch.float32, device=device)
    else:
        draft_logprob = alpha = alpha_part = stats  # unused placeholders
    # live skip: an arrival count per (row, position) and a rejection word per row, zeroed
    pair_counter = torch.zeros((pairs + batch,), dtype=torch.int32, device=device) if plan.live_skip else counter

    with launching_on(device):  # Triton launches on the current device
        for index, (pos_lo, pos_count) in enumerate(launches):
            grid = (splits, batch * pos_count) if plan.live_skip else (batch * pos_count, splits)
            _stats_kernel[grid](
                target, draft, tokens_in, counts_arg, mask_arg, stats, argmax, counter, seeds, offsets, inv_t, vocab,
                num_drafts, chunk, splits, pos_lo, pos_count, int(plan.l2_keep), pair_counter, batch,
                COMPUTE_SCORES=compute_scores, KP2=kp2, JP2=jp2, SP2=_combine_width(splits), BLOCK=plan.stats_block,
                ZERO_COUNTERS=index == 0, PDL_TRIGGER=plan.pdl and index == len(launches) - 1, PREFETCH=plan.prefetch,
                STAGED=index > 0, LIVE_SKIP=plan.live_skip, FTZ=plan.fast_math, FOLD=plan.fold_scale,
                UNPACK=plan.unpack_bf16, KEEP_EVICT=keep_evict, REST_EVICT=rest_evict, num_warps=plan.stats_warps,
                **flags,
            )
        launch = dict(launch_pdl=True) if plan.pdl else {}
        _race_kernel[(batch, splits2)](
            target, draft, tokens_in, counts_arg, mask_arg, seeds, offsets, stats, argmax, race, draft_logprob,
            alpha_part, counter, tokens, num_accepted, alpha, inv_t, vocab, num_drafts, splits, chunk2, splits2,
            stat_positions,
            COMPUTE_SCORES=compute_scores, KP2=kp2, JP2=jp2, SP2=_combine_width(splits), SP2B=_combine_width(splits2),
            TILES=plan.race_tiles, RACE_TILE=RACE_TILE, TILE_BASE=TILE_INDEX_BASE,
            SINGLE=chunk2 == plan.race_tiles * RACE_TILE, MASS_EPS=RESIDUAL_MASS_EPS, PDL_WAIT=plan.pdl,
            FTZ=plan.fast_math, FAST_LOG=plan.fast_math, RACE_EVICT=rest_evict, BLOCK_VERIFY=block,
            CERTAIN_EPS=BLOCK_CERTAIN_EPS,
            num_warps=plan.race_warps,
            **launch, **flags,
        )
    if not compute_scores:
        return tokens, num_accepted, None, None
    return tokens, num_accepted, draft_logprob, alpha
