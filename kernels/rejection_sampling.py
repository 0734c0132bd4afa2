"""Fused Triton rejection sampler for speculative decoding: verifier scoring, accept test, recovery, bonus.

Takes **logits** (fp32, bf16, fp16 or fp64, loaded and computed in fp32): no ``[B, K+1, V]`` probability tensor is
ever materialised. The function :func:`rejection_sample_triton` computes exactly what
:func:`specdec.kernels.rejection_sampling_reference.rejection_sample_reference` computes, on the same counter-based
random stream (:mod:`specdec.kernels.rng`), so tokens and accepted counts agree with the reference element for
element (up to float rounding in the normaliser, which can only flip a decision on a near-tie of probability
~1e-6 per decision).

Mathematics (per row ``b``, position ``j``; ``s_b = 1/T`` for sampled rows and ``1`` for greedy rows)::

    L_t[j] = logsumexp_x(s_b * target[b, j, x])          online over vocabulary tiles, fp32
    L_d[j] = logsumexp_x(s_b * draft[b, j, x])
    log p_j(x) = s_b * target[b, j, x] - L_t[j],   log q_j(x) = s_b * draft[b, j, x] - L_d[j]
    accept_j  = q_j(x_j) > 0  and  log u_j + log q_j(x_j) <= log p_j(x_j),  u_j = U(seed_b, off_b + j, ACCEPT)
    stop      = first j < n_b that is rejected, else n_b               (= num_accepted)
    w(x)      = max(0, p_stop(x) - q_stop(x))  if rejected and sum_x w(x) > RESIDUAL_MASS_EPS     (residual)
              = p_stop(x)                       otherwise                         (bonus token, or p == q)
    next      = two-level exponential race on w (tiles of RACE_TILE = 256 consecutive ids):
                c*   = argmax_c log W_c - log(-log U(seed_b, off_b + stop, TILE_INDEX_BASE + c))
                       with the tile masses W_c = sum_{x in c} w(x)
                next = argmax_{x in c*} log w(x) - log(-log U(seed_b, off_b + stop, x))
                (inside the tile the p race scores s_b * target[b, stop, x]: the normaliser does not move the argmax)
    greedy rows: accept_j = (x_j == argmax_x target[b, j, x]) (lowest id on ties), next = that argmax at ``stop``.

The race needs no normalised residual. Level 1 costs a sum per element (tile masses; one random number per tile),
level 2 two hashes and two logarithms per element of the winning tile only; P(x) = (W_c / W) (w(x) / W_c) = w(x) / W,
the law of one race over the whole vocabulary (which v6 ran: 2 hashes + 6 MUFU per element, the bottleneck at large
B). Ties go to the lowest tile and the lowest id. The residual mass ``sum_x w(x)`` (= TV(p, q) = P(reject at stop))
is the sum of the tile masses.

**Residual-mass threshold** (:data:`~specdec.kernels.rejection_sampling_reference.RESIDUAL_MASS_EPS` = 1e-6,
shared with the reference): when ``q == p`` up to rounding the residual is fp32 noise whose support depends on the
order of operations, so "fall back to ``p`` only if the residual is exactly 0" made the kernel and the reference
disagree. Both now race on the residual only when its mass exceeds 1e-6, and on ``p`` otherwise. Cost to
losslessness: the output distribution moves by at most ``m <= 1e-6`` in total variation, and only at positions
whose rejection probability ``m`` was ``<= 1e-6``; elsewhere the sampler is exactly lossless.

Two launch strategies compute the same function:

* ``"split"`` (the default for every shape): two launches (three with ``tune={"fuse": False}``); the launch plan
  (tiles, grids, prefetch, programmatic dependent launch) is :data:`TUNE_DEFAULT`, see there.
  (1) ``_stats_kernel``, grid ``(B*(K+1), S)``: every program reduces one vocabulary chunk of one (row, position)
  pair to partial (max, sum-exp) of target and draft and, for greedy rows, the lowest arg-max. Positions past a
  row's last draft are skipped; without greedy rows the bonus position gets no programs at all. For large
  inputs (K >= 6, logits >= 200 MB) it runs as two launches, positions 0-2 then 3-K (fp32 logits with K = 6: 0-1
  then 2-6), and a row that certainly stopped before the second launch's first position reads nothing in it
  (staged statistics, :func:`_rejected_before`; the race kernel still makes every decision). From 500 MB of logits
  with K >= 4 (fp32 logits with B >= 48: from 200 MB) it runs instead as one launch in position-major order whose
  programs stop reading a row as soon as an earlier position of it is certainly rejected (``live_skip``, see
  :func:`_live_skip`).
  (2) ``_race_kernel``, grid ``(B, S2)``: every program combines the partials of its row (vectorised over
  positions), runs the accept tests, finds the stop position, then runs level 1 of the race on its vocabulary
  chunk of the stop row only (blocks of ``race_tiles`` tiles, one warp per tile, so the tile sums are warp
  reductions) and level 2 on its best tile (from registers when the chunk is one block); with
  ``compute_scores`` also partial alpha sums for all positions. (3) the last race program of each row (arrival
  counter), or ``_finalize_kernel`` with grid ``(B,)`` when not fused: picks the winning tile among the programs'
  best ones, takes the level-2 id of the program holding it and writes the outputs (in the rare fallback, rejected
  with residual mass <= RESIDUAL_MASS_EPS, it runs level 2 of the p race itself).
  Splitting the vocabulary keeps every SM busy at B = 1.
  L2 eviction hints (``tune['l2_keep']``, automatic for fp32 with B >= 32, K >= 4, V <= 65536 and at most 32 MiB
  of position-0 rows): the statistics kernel loads the rows of position 0 ``evict_last`` and those of the other
  positions ``evict_first``, and the race kernel's level-1 loads are ``evict_first``, so the row a rejected request
  races on most often is still in L2 when the race kernel reads it again. ``evict_last`` lines outlive the call:
  whatever runs next on the GPU starts with them in L2 (measured only against the next call of this kernel).
  On the GPU the per-element exponentials of both kernels are one ``ex2.approx.ftz`` each (``tune={"ftz": False}``
  restores ``tl.exp``): values below 2**-126 flush to 0, which moves no sum or race score by more than ~1e-38
  relative (16-bit logits at B <= 4 fold the logit scale into that exponent's multiply: ``tune['fold_scale']``); the
  race kernel's logarithms (race scores and the noise ``log(-log u)``, not the accept test's
  ``log u``) are one ``lg2.approx.f32`` each (``tune={"fast_log": False}`` restores ``tl.log``): absolute error
  at most 2.3e-6 (libdevice: 1.0e-6; H100, every 7th fp32 in [2**-24, 16),
  ``benchmarks/results/fastlog_check_s11_H100.txt``), about one fp32 ulp of the largest noise terms, so only a
  near-tie of race scores can move. bf16 statistics tiles become fp32 by a shift and a mask per pair of ids
  (``tune['unpack']``, exact). The interpreter always uses ``tl.exp``, ``tl.log`` and ``.to(float32)``.
* ``"seq"`` (opt-in; never faster on an H200, see ``benchmarks/NOTES_rejection.md``): one launch, one program per
  row, positions in order with **early exit**: rows past the first rejection are never read. Bytes read are about
  ``2 * (stop + 1) * V`` per row plus the re-read of the stop row for the race, instead of ``(2K + 1) * V``;
  the same two-level race (tiles one at a time, then the winning tile again).

Safety: all row offsets are int64; lanes past ``V`` load as ``-inf``; draft ids are clamped to ``[0, V)`` before a
gather; ``-1`` drafts end a row; ``q(draft) = 0`` is always rejected. **NaN / all ``-inf`` rows:** the public
wrapper raises on NaN, +inf and on all ``-inf`` rows a request can reach (``check_nan=True``); in the kernel NaN
never wins a comparison, and when a race or arg-max has no finite candidate (an all ``-inf`` or NaN row) the
kernel writes ``-1`` at the stop position instead of an id, so it never emits an id outside ``[0, V)`` (the
reference would emit id 0 for such rows).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._device import major_capability, sm_count
from .rejection_sampling_reference import RACE_TILE, RESIDUAL_MASS_EPS, TILE_INDEX_BASE
from .rng import stream_keys_tl, uniform_from_keys_tl

__all__ = ["rejection_sample_triton"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------------------------------------------------------------------------
# Shared device helpers


@triton.jit
def _row_setup(draft_tokens_ptr, num_drafts_ptr, greedy_ptr, b, K, inv_t,
               HAS_COUNTS: tl.constexpr, HAS_MASK: tl.constexpr, ALL_GREEDY: tl.constexpr, KP2: tl.constexpr):
    """Per-row draft count n_b (counts capped at the first -1), greedy flag (int32) and logit scale (fp32)."""
    ks = tl.arange(0, KP2)
    toks = tl.load(draft_tokens_ptr + b.to(tl.int64) * K + ks, mask=ks < K, other=0)
    n_b = tl.min(tl.where((toks < 0) & (ks < K), ks, K), axis=0)
    if HAS_COUNTS:
        cnt = tl.load(num_drafts_ptr + b).to(tl.int32)
        n_b = tl.minimum(n_b, tl.minimum(tl.maximum(cnt, 0), K))
    g = n_b * 0
    if HAS_MASK:
        g = tl.load(greedy_ptr + b).to(tl.int32)
    if ALL_GREEDY:
        g = g * 0 + 1
    scale = tl.where(g != 0, 1.0, inv_t)
    return n_b, g, scale


@triton.jit
def _lse_update2(m_t, s_t, t, m_d, s_d, d):
    """:func:`_lse_update` for the target and the draft tile at once (one call: cheaper in the interpreter)."""
    new_t = tl.maximum(m_t, tl.max(t, axis=0))
    safe_t = tl.where(new_t == float("-inf"), 0.0, new_t)
    s_t = s_t * tl.exp(m_t - safe_t) + tl.sum(tl.exp(t - safe_t), axis=0)
    new_d = tl.maximum(m_d, tl.max(d, axis=0))
    safe_d = tl.where(new_d == float("-inf"), 0.0, new_d)
    s_d = s_d * tl.exp(m_d - safe_d) + tl.sum(tl.exp(d - safe_d), axis=0)
    return new_t, s_t, new_d, s_d


@triton.jit
def _argmax_update(best_v, best_i, x, offs, V):
    """Running arg-max with ties to the lowest id (tiles are visited in increasing id order)."""
    tile_max = tl.max(x, axis=0)
    tile_idx = tl.min(tl.where(x == tile_max, offs, V), axis=0)
    upd = tile_max > best_v
    return tl.where(upd, tile_max, best_v), tl.where(upd, tile_idx, best_i)


@triton.jit
def _exp2_ftz(x):
    """``2**x`` as one ``ex2.approx.ftz.f32`` (results below 2**-126 flush to 0)."""
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _bf16_to_f32(x):
    """bf16 -> fp32 (exact), two ids a 32-bit register: the low id shifted up, the high id masked in place (two
    instructions per pair; the compiler's conversion takes three)."""
    return tl.inline_asm_elementwise("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }", "=r,=r,r", [x],
                                     dtype=tl.float32, is_pure=True, pack=2)


@triton.jit
def _to_f32(x, UNPACK: tl.constexpr):
    """``x.to(float32)``; UNPACK (GPU): a bf16 ``x`` through :func:`_bf16_to_f32` (other dtypes as before, so target
    and draft logits of different dtypes each take their own conversion)."""
    if UNPACK and x.dtype == tl.bfloat16:
        return _bf16_to_f32(x)
    else:
        return x.to(tl.float32)


@triton.jit
def _exp(x, FTZ: tl.constexpr):
    """``exp(x)`` in fp32; FTZ: one ``ex2.approx.ftz`` (results below 2**-126 flush to 0) instead of ``tl.exp``'s
    ex2 with its subnormal range fix-up (a compare and two predicated multiplies per element)."""
    if FTZ:
        return _exp2_ftz(x * 1.4426950408889634)
    else:
        return tl.exp(x)


@triton.jit
def _log(x, FAST_LOG: tl.constexpr):
    """``log(x)`` in fp32 for the race scores; FAST_LOG: one ``lg2.approx.f32`` (MUFU, subnormal inputs kept) times
    ln 2 instead of libdevice's ``logf`` (~20 instructions); absolute error at most 2.3e-6 for x in [2**-24, 16)
    (measured on an H100; libdevice 1.0e-6)."""
    if FAST_LOG:
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1) * 0.6931471805599453
    else:
        return tl.log(x)


@triton.jit
def _residual_mass_terms(t, d, p, delta, FTZ: tl.constexpr):
    """max(0, p - q) per element, computed as ``p * (1 - q/p)`` with ``q/p = exp(z)``, ``z = (d - t) - delta``.

    ``delta = L_d - L_t`` is passed as ``(m_d - m_t) + log(S_d / S_t)``: no rounded ``L`` (an fp32 number ~10-40
    whose rounding, up to ~2e-6 relative, would scale all of p against all of q) enters, so when ``q == p`` up to
    rounding the mass is ~1e-7 or less instead of ~1e-6 (see ``RESIDUAL_MASS_EPS``). ``1 - exp(z)`` uses a
    cubic series for ``|z| < 1e-2`` (cancellation). ``z`` NaN (both logits -inf) or ``>= 0`` contributes 0.
    """
    z = (d - t) - delta
    series = -z * (1.0 + z * (0.5 + z * (1.0 / 6.0)))
    one_minus = tl.where(tl.abs(z) < 1e-2, series, 1.0 - _exp(z, FTZ))
    return tl.where(z < 0.0, p * one_minus, 0.0)


@triton.jit
def _tile_race_update(t, d, lt, delta, tile, rk_a, rk_b, best_r, tile_r, best_p, tile_p, mass,
                      TILE_BASE: tl.constexpr, FTZ: tl.constexpr, FAST_LOG: tl.constexpr):
    """Level 1 of the two-level race for ``TILES`` tiles at once (``t``, ``d``: [TILES, RACE_TILE] scaled logits,
    ``tile``: [TILES] tile indices).

    Tile masses of the residual ``W_r = sum max(0, p - q)`` and of p, ``log W_p = log sum exp(t)`` up to the row's
    normaliser (taken from the tile's own maximum: a bonus position has no normaliser, its statistics are never
    computed), race scores ``log W - log(-log u(TILE_BASE + tile))``: no random numbers per element. Lane-wise
    winners with a strict ``>`` (a lane sees its tiles in increasing order: lowest tile on ties; NaN never wins).
    ``mass`` accumulates ``W_r`` per lane; ``lt = -inf`` (no rejection at this row) leaves the residual at 0."""
    m_c = tl.max(t, axis=1)
    safe = tl.where(m_c == float("-inf"), 0.0, m_c)
    e = _exp(t - safe[:, None], FTZ)
    s_e = tl.sum(e, axis=1)
    p = e * tl.where(lt > float("-inf"), tl.exp(safe - lt), 0.0)[:, None]
    w_r = tl.sum(_residual_mass_terms(t, d, p, delta, FTZ), axis=1)
    noise = _log(-_log(uniform_from_keys_tl(rk_a, rk_b, tile.to(tl.uint32) | TILE_BASE), FAST_LOG), FAST_LOG)
    s_r = tl.where(w_r > 0.0, _log(w_r, FAST_LOG), float("-inf")) - noise
    s_p = tl.where(s_e > 0.0, safe + _log(s_e, FAST_LOG), float("-inf")) - noise
    upd_r = s_r > best_r
    upd_p = s_p > best_p
    return (tl.where(upd_r, s_r, best_r), tl.where(upd_r, tile, tile_r),
            tl.where(upd_p, s_p, best_p), tl.where(upd_p, tile, tile_p), mass + w_r)


@triton.jit
def _lanes_winner(best, idx, none):
    """(best score, lowest index holding it) of lane-wise winners; (-inf, none) when no lane has a finite one."""
    top = tl.max(best, axis=0)
    return top, tl.min(tl.where((best == top) & (idx < none), idx, none), axis=0)


@triton.jit
def _block_race(t, d, offs, sel, residual, lt, delta, rk_a, rk_b, V, FTZ: tl.constexpr, FAST_LOG: tl.constexpr):
    """Level 2 over the ids of a loaded block (``t``, ``d``, ``offs`` of any shape; scaled logits) restricted to
    ``sel``: an exponential race on ``log max(0, p - q)`` (``residual``; the per-element weights of the tile masses)
    or on the scaled target logits (``p`` up to its normaliser). Returns the lowest id of the best score, or ``V``
    when no selected id has a finite score (no tile, or NaN / all ``-inf`` logits)."""
    noise = _log(-_log(uniform_from_keys_tl(rk_a, rk_b, offs), FAST_LOG), FAST_LOG)
    if residual:
        w = _residual_mass_terms(t, d, _exp(t - lt, FTZ), delta, FTZ)
        score = tl.where(w > 0.0, _log(w, FAST_LOG), float("-inf")) - noise
    else:
        score = t - noise
    score = tl.where(sel, score, float("-inf"))
    top = tl.max(tl.max(score, axis=1), axis=0)
    return tl.min(tl.min(tl.where(sel & (score == top) & (offs < V), offs, V), axis=1), axis=0)


@triton.jit
def _in_tile_race(t_base, d_base, tile, residual, lt, delta, scale, rk_a, rk_b, V, v_d,
                  RACE_TILE: tl.constexpr, FTZ: tl.constexpr, FAST_LOG: tl.constexpr):
    """:func:`_block_race` on ``tile``, loaded again (``tile * RACE_TILE >= V``: no tile, returns ``V``)."""
    offs = tile * RACE_TILE + tl.arange(0, RACE_TILE)[None, :]
    inb = offs < V
    t = tl.load(t_base + offs, mask=inb, other=float("-inf")).to(tl.float32) * scale
    d = tl.load(d_base + offs, mask=offs < v_d, other=float("-inf")).to(tl.float32) * scale
    return _block_race(t, d, offs, inb, residual, lt, delta, rk_a, rk_b, V, FTZ, FAST_LOG)


# ---------------------------------------------------------------------------------------------------------------
# "split" strategy


@triton.jit
def _draft_logits(target_ptr, draft_ptr, draft_tokens_ptr, b, js, rows, V, K, scale):
    """Per position ``js`` of row ``b``: the draft id ``x`` (0 past K) and the scaled target and draft logits at it
    (0 outside ``rows``; ids clamped to [0, V) before the gather)."""
    pair = b.to(tl.int64) * (K + 1) + js
    x = tl.load(draft_tokens_ptr + b.to(tl.int64) * K + js, mask=js < K, other=0)
    xs = tl.minimum(tl.maximum(x, 0), V - 1)
    t_x = tl.load(target_ptr + pair * V + xs, mask=rows, other=0.0).to(tl.float32) * scale
    d_x = tl.load(draft_ptr + (b.to(tl.int64) * K + tl.minimum(js, K - 1)) * V + xs,
                  mask=rows, other=0.0).to(tl.float32) * scale
    return x, t_x, d_x


@triton.jit
def _position_stats(stats_ptr, argmax_ptr, pair, rows, V, S, SP2: tl.constexpr, CACHE: tl.constexpr):
    """Combine the stats kernel's partials of the positions ``pair`` ([JP2] int64 (row, position) indices; only
    ``rows`` are read): log-sum-exp, max and sum-exp of target and draft, and the greedy arg-max (the partial
    arg-max of the first split holding the row maximum; ``V`` where there is none). CACHE: the loads' cache
    modifier (``".cg"``: from L2, for partials that other programs of the same launch are still writing)."""
    ss = tl.arange(0, SP2)
    st_off = (pair[:, None] * S + ss[None, :]) * 4
    m2 = rows[:, None] & (ss[None, :] < S)
    mpart = tl.load(stats_ptr + st_off, mask=m2, other=float("-inf"), cache_modifier=CACHE)
    lt, mt, st = _combine_lse(mpart, tl.load(stats_ptr + st_off + 1, mask=m2, other=0.0, cache_modifier=CACHE), 1)
    ld, md, sd = _combine_lse(tl.load(stats_ptr + st_off + 2, mask=m2, other=float("-inf"), cache_modifier=CACHE),
                              tl.load(stats_ptr + st_off + 3, mask=m2, other=0.0, cache_modifier=CACHE), 1)
    first_split = tl.min(tl.where((mpart == mt[:, None]) & m2, ss[None, :], SP2), axis=1)
    am = tl.load(argmax_ptr + pair * S + first_split, mask=rows & (first_split < S), other=V, cache_modifier=CACHE)
    return lt, mt, st, ld, md, sd, am


@triton.jit
def _rejected_before(target_ptr, draft_ptr, draft_tokens_ptr, seeds_ptr, offsets_ptr, stats_ptr, argmax_ptr,
                     b, n_b, g, scale, V, K, S, pos_lo, JP2: tl.constexpr, SP2: tl.constexpr):
    """True when row ``b`` certainly stops before position ``pos_lo`` (staged statistics: its later positions
    need no statistics). Every statistic of positions ``< pos_lo`` is complete (earlier launches).

    The race kernel alone decides; this only skips work, so it must never skip a position that kernel could reach:
    a sampled rejection counts only with a margin (``log u + log q > log p + margin``, or ``q(x) = 0``) larger than
    the rounding by which the race kernel's own combine of the same statistics can differ (other reduction
    layouts); a greedy rejection (``x != argmax``) is exact, and so is ``pos_lo > n_b``.
    """
    js = tl.arange(0, JP2)
    stopped = _certainly_rejected(target_ptr, draft_ptr, draft_tokens_ptr, seeds_ptr, offsets_ptr, stats_ptr,
                                  argmax_ptr, b, g, scale, V, K, S, (js < pos_lo) & (js < n_b), JP2, SP2, "")
    return stopped | (pos_lo > n_b)


@triton.jit
def _certainly_rejected(target_ptr, draft_ptr, draft_tokens_ptr, seeds_ptr, offsets_ptr, stats_ptr, argmax_ptr,
                        b, g, scale, V, K, S, real, JP2: tl.constexpr, SP2: tl.constexpr, CACHE: tl.constexpr):
    """True when one of the positions ``real`` ([JP2] bool; their statistics complete) of row ``b`` is certainly
    rejected (the margins of :func:`_rejected_before`)."""
    js = tl.arange(0, JP2)
    x, t_x, d_x = _draft_logits(target_ptr, draft_ptr, draft_tokens_ptr, b, js, real, V, K, scale)
    key_a, key_b = stream_keys_tl(tl.load(seeds_ptr + b), tl.load(offsets_ptr + b) + js)
    u = uniform_from_keys_tl(key_a, key_b, tl.full([JP2], 0xFFFFFFFF, tl.uint32))
    lt, _mt, _st, ld, _md, _sd, am = _position_stats(stats_ptr, argmax_ptr, b.to(tl.int64) * (K + 1) + js, real,
                                                     V, S, SP2, CACHE)
    lp = t_x - lt
    lq = d_x - ld
    margin = 1e-3 + 1e-5 * (tl.abs(t_x) + tl.abs(lt) + tl.abs(d_x) + tl.abs(ld))
    # q(x) = 0 or p(x) = 0 always rejects; otherwise only beyond the margin (NaN compares false: not certain)
    rej_s = (d_x == float("-inf")) | (t_x == float("-inf")) | (tl.log(u) + lq > lp + margin)
    rej_g = x != am
    certain = real & tl.where(g != 0, rej_g, rej_s)
    return tl.sum(certain.to(tl.int32), axis=0) > 0


@triton.jit
def _stats_loads(t_base, d_base, t_nx, d_nx, offs, lim, V, v_d, scale, BLOCK: tl.constexpr, PREFETCH: tl.constexpr,
                 EVICT: tl.constexpr, FOLD: tl.constexpr, UNPACK: tl.constexpr):
    """The statistics loops' tile at ``offs`` as scaled fp32 (target, draft; FOLD: unscaled, the caller folds the
    scale into its exponent) and, with PREFETCH, the next tile's loads issued (``t_nx`` / ``d_nx`` hold this tile,
    loaded by the previous call; ids from ``lim`` on load as ``-inf``, so ``lim = 0`` loads nothing). UNPACK (GPU):
    bf16 tiles converted by :func:`_bf16_to_f32`. Returns (t, d, t_nx, d_nx)."""
    if FOLD:
        scale = 1.0
    if PREFETCH:
        t = _to_f32(t_nx, UNPACK) * scale
        d = _to_f32(d_nx, UNPACK) * scale
        t_nx = tl.load(t_base + offs + BLOCK, mask=offs + BLOCK < lim, other=float("-inf"), eviction_policy=EVICT)
        d_nx = tl.load(d_base + offs + BLOCK, mask=offs + BLOCK < tl.minimum(lim, v_d), other=float("-inf"),
                       eviction_policy=EVICT)
    else:
        t = _to_f32(tl.load(t_base + offs, mask=offs < V, other=float("-inf"), eviction_policy=EVICT), UNPACK) * scale
        d = _to_f32(tl.load(d_base + offs, mask=offs < v_d, other=float("-inf"), eviction_policy=EVICT), UNPACK) * scale
    return t, d, t_nx, d_nx


@triton.jit
def _lane_lse(m, s, x, c, FTZ: tl.constexpr):
    """Lane-wise online (max, sum exp) of the [R, 8] tile ``x``: each term ``2**((x - m) c)`` with FTZ (``c`` is
    log2 e, or ``s log2 e`` on unscaled logits, see :func:`_stats_tile`), else ``exp(x - m)``."""
    new = tl.maximum(m, tl.max(x, axis=1))
    safe = tl.where(new == float("-inf"), 0.0, new)
    if FTZ:
        s = s * _exp2_ftz((m - safe) * c) + tl.sum(_exp2_ftz((x - safe[:, None]) * c), axis=1)
    else:
        s = s * tl.exp(m - safe) + tl.sum(tl.exp(x - safe[:, None]), axis=1)
    return new, s


@triton.jit
def _stats_tile(t, d, offs, m_t, s_t, m_d, s_d, am_v, am_i, g, V, FTZ: tl.constexpr, scale,
                FOLD: tl.constexpr):
    """One [R, 8] tile of the statistics loops: lane-wise online (max, sum exp) of target and draft and, for greedy
    rows, the running arg-max (lowest id of the largest target logit). FOLD (GPU): ``t``, ``d`` are the unscaled
    logits and the running maxima ``m_t``, ``m_d`` unscaled too (:func:`_stats_loop` scales them once at the end);
    each element's exponent is ``(t - m) (s log2 e)`` instead of ``(s t - s m) log2 e``: the scale multiply per
    element goes into the exponential's own. ``t - m`` is exactly 0 at a lane's maximum, so that maximum still
    contributes exactly 1 (what keeps low-temperature calls exact: a fused ``t (s log2 e) - m s log2 e`` was off by
    up to ~|s t| 2**-24 there, and moved decisions at T = 1e-5); greedy rows have ``s = 1``."""
    c = 1.4426950408889634  # log2 e
    if FOLD:
        tl.static_assert(FTZ, "the folded exponent needs the ex2 form (FTZ)")
        c = scale * c
    new_t, s_t = _lane_lse(m_t, s_t, t, c, FTZ)
    new_d, s_d = _lane_lse(m_d, s_d, d, c, FTZ)
    if g != 0:
        tile_max = tl.max(tl.max(t, axis=1), axis=0)
        tile_idx = tl.min(tl.min(tl.where(t == tile_max, offs, V), axis=1), axis=0)
        upd = tile_max > am_v
        am_v = tl.where(upd, tile_max, am_v)
        am_i = tl.where(upd, tile_idx, am_i)
    return new_t, s_t, new_d, s_d, am_v, am_i


@triton.jit
def _stats_loop(t_base, d_base, t_nx, d_nx, lo, hi, V, v_d, scale, g, rows2, reject_ptr, j, K, BLOCK: tl.constexpr,
                PREFETCH: tl.constexpr, FTZ: tl.constexpr, EVICT: tl.constexpr, LIVE: tl.constexpr,
                FOLD: tl.constexpr, UNPACK: tl.constexpr):
    """The statistics kernel's loop over ``[lo, hi)``: lane-wise online log-sum-exp on ``[BLOCK // 8, 8]`` tiles (the
    axis-1 reductions stay inside a thread or a warp, so a tile needs no block-wide barrier; one exp per element plus
    one per 8 elements for the rescale) and, for greedy rows, the arg-max. PREFETCH: ``t_nx`` / ``d_nx`` hold the
    first tile and each tile's successor is loaded before its arithmetic. EVICT: the loads' L2 eviction policy.
    LIVE (live skip): stop early once the row's ``reject_ptr`` word says a position before ``j`` is certainly
    rejected (``K + 1 - word < j``; the word only grows). Each tile issues the word's load and the next tile uses
    it, so the check waits on no round trip. A stopped program's partials cover the tiles it read: only positions
    past a certain rejection stop, and the race kernel never reads those.
    Returns lane-wise (m_t, s_t, m_d, s_d) and the arg-max id (``V`` when none)."""
    R: tl.constexpr = BLOCK // 8
    m_t = tl.full([R], float("-inf"), tl.float32)
    s_t = tl.zeros([R], tl.float32)
    m_d = tl.full([R], float("-inf"), tl.float32)
    s_d = tl.zeros([R], tl.float32)
    am_v = float("-inf")
    am_i = V
    if LIVE:
        word = tl.load(reject_ptr, volatile=True)
        hi = tl.where(K + 1 - word < j, lo, hi)
        start = lo
        while start < hi:
            offs = start + rows2
            lim = tl.where((start + BLOCK < hi) & (K + 1 - word >= j), V, 0)
            t, d, t_nx, d_nx = _stats_loads(t_base, d_base, t_nx, d_nx, offs, lim, V, v_d, scale, BLOCK, PREFETCH,
                                            EVICT, FOLD, UNPACK)
            next_word = tl.load(reject_ptr, volatile=True)
            m_t, s_t, m_d, s_d, am_v, am_i = _stats_tile(t, d, offs, m_t, s_t, m_d, s_d, am_v, am_i, g, V, FTZ,
                                                         scale, FOLD)
            start += BLOCK
            hi = tl.where(K + 1 - word < j, start, hi)
            word = next_word
    else:
        for start in range(lo, hi, BLOCK):
            offs = start + rows2
            t, d, t_nx, d_nx = _stats_loads(t_base, d_base, t_nx, d_nx, offs, tl.where(start + BLOCK < hi, V, 0), V,
                                            v_d, scale, BLOCK, PREFETCH, EVICT, FOLD, UNPACK)
            m_t, s_t, m_d, s_d, am_v, am_i = _stats_tile(t, d, offs, m_t, s_t, m_d, s_d, am_v, am_i, g, V, FTZ,
                                                         scale, FOLD)
    if FOLD:  # the running maxima were unscaled (see _stats_tile)
        m_t = m_t * scale
        m_d = m_d * scale
    return m_t, s_t, m_d, s_d, am_i


@triton.jit
def _stats_kernel(target_ptr, draft_ptr, draft_tokens_ptr, num_drafts_ptr, greedy_ptr, stats_ptr, argmax_ptr,
                  counter_ptr, seeds_ptr, offsets_ptr, inv_t, V, K, chunk, S, pos_lo, pos_count,
                  HAS_COUNTS: tl.constexpr, HAS_MASK: tl.constexpr, ALL_GREEDY: tl.constexpr,
                  COMPUTE_SCORES: tl.constexpr, KP2: tl.constexpr, BLOCK: tl.constexpr,
                  ZERO_COUNTERS: tl.constexpr, PDL_TRIGGER: tl.constexpr, PREFETCH: tl.constexpr,
                  STAGED: tl.constexpr, JP2: tl.constexpr, SP2: tl.constexpr, FTZ: tl.constexpr,
                  keep_positions=0, KEEP_EVICT: tl.constexpr = "", REST_EVICT: tl.constexpr = "",
                  pair_counter_ptr=None, batch=0, LIVE_SKIP: tl.constexpr = False, FOLD: tl.constexpr = False,
                  UNPACK: tl.constexpr = False):
    """Partial (max, sum exp) of target and draft over one vocabulary chunk of one (row, position).

    Grid ``(B * pos_count, S)``: positions ``pos_lo .. pos_lo + pos_count - 1`` of every row. STAGED (a launch
    after the first of a staged plan): a row that certainly stopped before ``pos_lo`` (:func:`_rejected_before`,
    from the statistics of the earlier launches) reads nothing, so rows past their first rejection are mostly
    never read.

    stats: [B*(K+1), S, 4] fp32 (m_t, s_t, m_d, s_d); argmax: [B*(K+1), S] int32 (greedy rows, else V).
    ZERO_COUNTERS: program (row b, position 0, split 0) zeroes ``counter[b]``, the arrival counter of the race
    programs of row b (fused finalize; no separate memset launch). PDL_TRIGGER: let the race kernel (launched with
    programmatic dependent launch) start its prologue now; it waits (``gdc_wait``) before reading anything written here.
    UNPACK (GPU): bf16 tiles converted to fp32 by :func:`_bf16_to_f32` (``tune['unpack']``).
    LIVE_SKIP (one launch over every position): grid ``(S, B * pos_count)`` in position-major order, so the GPU
    starts the programs of position j after those of earlier positions. ``pair_counter`` ([B * (K + 1) + B] int32,
    zeroed by the caller) holds an arrival count per (row, position) and a rejection word per row: the last program
    of a position to store its partials tests that position (:func:`_certainly_rejected`) and, on a certain
    rejection at j, raises the row's word to K + 1 - j; programs of later positions watch the word while they read
    (:func:`_stats_loop`, LIVE) and stop. Which programs stop, and where, depends on timing, never what the race
    kernel computes: only positions past a certain rejection stop, and the race kernel stops at or before it.
    The warps of a program may stop at different tiles (each thread reads the word): the launcher never uses
    LIVE_SKIP with greedy rows, whose arg-max puts block-wide barriers in the loop (:func:`_live_skip`).
    """
    if PDL_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    if LIVE_SKIP:
        b = tl.program_id(1) % batch
        j = pos_lo + tl.program_id(1) // batch
        split = tl.program_id(0)
    else:
        b = tl.program_id(0) // pos_count
        j = pos_lo + tl.program_id(0) % pos_count
        split = tl.program_id(1)
    pair = b * (K + 1) + j
    if ZERO_COUNTERS:
        if (j == 0) & (split == 0):
            tl.store(counter_ptr + b, 0)
    n_b, g, scale = _row_setup(draft_tokens_ptr, num_drafts_ptr, greedy_ptr, b, K, inv_t,
                               HAS_COUNTS, HAS_MASK, ALL_GREEDY, KP2)
    need_t = (j < n_b) | ((j == n_b) & (g != 0))  # sampled rows race on raw logits at the bonus position
    need_d = (j < n_b) & (g == 0)
    if COMPUTE_SCORES:
        need_t = need_t | (j < K)
        need_d = need_d | (j < K)
    t_base = target_ptr + pair.to(tl.int64) * V
    d_base = draft_ptr + (b.to(tl.int64) * K + tl.minimum(j, K - 1)) * V
    lo = split * chunk
    hi = tl.where(need_t, tl.minimum(lo + chunk, V), lo)
    v_d = tl.where(need_d, V, 0)  # (a scalar-bool & vector-bool mask trips Triton's interpreter)
    R: tl.constexpr = BLOCK // 8  # [R, 8] tiles, see _stats_loop
    rows2 = tl.arange(0, R)[:, None] * 8 + tl.arange(0, 8)[None, :]
    # L2 priority of the rows a race may read again (keep) and of the others; uniform over the program, so the
    # branch is taken once, outside the loop (a per-load branch cost 3-7% on the H100)
    keep = j < keep_positions
    t_nx = 0.0
    d_nx = 0.0
    if PREFETCH:  # the next tile's loads are issued before this tile's arithmetic (more bytes in flight)
        # The first tile does not wait for the row's draft ids (n_b, need_t, need_d): it is always in bounds; the
        # loop never reads it when the position needs no statistics, and draft statistics that need_d excludes are
        # never used. (H100, results/rejection_sweep_H100_80GB_HBM3_s9_c_{fp32,bf16}.csv: fp32 calls 0-3% faster.)
        t_nx = tl.zeros([R, 8], t_base.dtype.element_ty)  # (typed for the branches below)
        d_nx = tl.zeros([R, 8], d_base.dtype.element_ty)
        if KEEP_EVICT == REST_EVICT:
            t_nx = tl.load(t_base + lo + rows2, mask=lo + rows2 < V, other=float("-inf"), eviction_policy=KEEP_EVICT)
            d_nx = tl.load(d_base + lo + rows2, mask=lo + rows2 < V, other=float("-inf"), eviction_policy=KEEP_EVICT)
        elif keep:
            t_nx = tl.load(t_base + lo + rows2, mask=lo + rows2 < V, other=float("-inf"), eviction_policy=KEEP_EVICT)
            d_nx = tl.load(d_base + lo + rows2, mask=lo + rows2 < V, other=float("-inf"), eviction_policy=KEEP_EVICT)
        else:
            t_nx = tl.load(t_base + lo + rows2, mask=lo + rows2 < V, other=float("-inf"), eviction_policy=REST_EVICT)
            d_nx = tl.load(d_base + lo + rows2, mask=lo + rows2 < V, other=float("-inf"), eviction_policy=REST_EVICT)
    if STAGED:  # (after the first tile's loads are issued: their latency overlaps the check's)
        if lo < hi:
            stopped = _rejected_before(target_ptr, draft_ptr, draft_tokens_ptr, seeds_ptr, offsets_ptr, stats_ptr,
                                       argmax_ptr, b, n_b, g, scale, V, K, S, pos_lo, JP2, SP2)
            hi = tl.where(stopped, lo, hi)
            v_d = tl.where(stopped, 0, v_d)
    reject_ptr = pair_counter_ptr + batch * (K + 1) + b  # (LIVE_SKIP) the row's rejection word
    if KEEP_EVICT == REST_EVICT:
        m_t, s_t, m_d, s_d, am_i = _stats_loop(t_base, d_base, t_nx, d_nx, lo, hi, V, v_d, scale, g, rows2, reject_ptr,
                                               j, K, BLOCK, PREFETCH, FTZ, KEEP_EVICT, LIVE_SKIP, FOLD,
                                               UNPACK)
    elif keep:
        m_t, s_t, m_d, s_d, am_i = _stats_loop(t_base, d_base, t_nx, d_nx, lo, hi, V, v_d, scale, g, rows2, reject_ptr,
                                               j, K, BLOCK, PREFETCH, FTZ, KEEP_EVICT, LIVE_SKIP, FOLD,
                                               UNPACK)
    else:
        m_t, s_t, m_d, s_d, am_i = _stats_loop(t_base, d_base, t_nx, d_nx, lo, hi, V, v_d, scale, g, rows2, reject_ptr,
                                               j, K, BLOCK, PREFETCH, FTZ, REST_EVICT, LIVE_SKIP, FOLD,
                                               UNPACK)
    mt_all = tl.max(m_t, axis=0)
    safe = tl.where(mt_all == float("-inf"), 0.0, mt_all)
    st_all = tl.sum(s_t * tl.exp(m_t - safe), axis=0)
    md_all = tl.max(m_d, axis=0)
    safe = tl.where(md_all == float("-inf"), 0.0, md_all)
    sd_all = tl.sum(s_d * tl.exp(m_d - safe), axis=0)
    out = (pair.to(tl.int64) * S + split) * 4
    tl.store(stats_ptr + out, mt_all)
    tl.store(stats_ptr + out + 1, st_all)
    tl.store(stats_ptr + out + 2, md_all)
    tl.store(stats_ptr + out + 3, sd_all)
    tl.store(argmax_ptr + pair.to(tl.int64) * S + split, am_i)
    if LIVE_SKIP:
        # the last program of a (row, position) to arrive tests the position: a certain rejection (the margins of
        # _rejected_before) raises the row's word to K + 1 - j, which stops the row's later positions
        tl.debug_barrier()  # every thread's stores above happen before the release below
        arrived = tl.atomic_add(pair_counter_ptr + pair, 1, sem="acq_rel")
        if (arrived == S - 1) & (j < n_b):
            js = tl.arange(0, JP2)
            stopped = _certainly_rejected(target_ptr, draft_ptr, draft_tokens_ptr, seeds_ptr, offsets_ptr,
                                          stats_ptr, argmax_ptr, b, g, scale, V, K, S, js == j, JP2, SP2, ".cg")
            if stopped:
                tl.atomic_max(reject_ptr, K + 1 - j, sem="relaxed")


@triton.jit
def _combine_lse(m, s, axis: tl.constexpr):
    """Combine partial (max, sum-exp) along ``axis``: (log-sum-exp (-inf for an empty row), max, sum-exp)."""
    mm = tl.max(m, axis=axis)
    safe = tl.where(mm == float("-inf"), 0.0, mm)
    if axis == 1:
        tot = tl.sum(s * tl.exp(m - safe[:, None]), axis=1)
    else:
        tot = tl.sum(s * tl.exp(m - safe[None, :]), axis=0)
    return mm + tl.log(tot), mm, tot


@triton.jit
def _race_kernel(target_ptr, draft_ptr, draft_tokens_ptr, num_drafts_ptr, greedy_ptr, seeds_ptr, offsets_ptr,
                 stats_ptr, argmax_ptr, race_ptr, info_ptr, logprob_ptr, alpha_part_ptr,
                 counter_ptr, tokens_ptr, num_accepted_ptr, alpha_ptr,
                 inv_t, V, K, S, chunk, S2, n_stat,
                 HAS_COUNTS: tl.constexpr, HAS_MASK: tl.constexpr, ALL_GREEDY: tl.constexpr,
                 COMPUTE_SCORES: tl.constexpr, KP2: tl.constexpr, JP2: tl.constexpr, SP2: tl.constexpr,
                 TILES: tl.constexpr, RACE_TILE: tl.constexpr, TILE_BASE: tl.constexpr, SINGLE: tl.constexpr,
                 FUSE: tl.constexpr,
                 SP2B: tl.constexpr, MASS_EPS: tl.constexpr, PDL_WAIT: tl.constexpr, FTZ: tl.constexpr,
                 RACE_EVICT: tl.constexpr = "", FAST_LOG: tl.constexpr = False):
    """Accept tests (vectorised over positions), stop position, race over one chunk of the stop row.

    race: [B, S2, 6] fp32 (best residual tile score, its tile, best p tile score, its tile, partial residual
    mass over the chunk, the level-2 winner id inside this program's best tile of the race it ran; tiles and ids
    are exact in fp32 for V < 2**24); info: [B, 4] int32 (stop, greedy next token or -1, greedy flag, rejected
    flag); logprob: [B, K]; alpha_part: [B, K, S2].
    The chunk is a whole number of ``TILES * RACE_TILE`` ids: level 1 (tile masses, one random number per tile)
    runs over every tile of the chunk, level 2 (one random number per id) over this program's best tile only.
    FUSE: the last program of a row to arrive (arrival counter ``counter[b]``, zeroed by the stats kernel) combines
    the row's partial winners and writes the outputs (:func:`_finalize_row`): no third launch. Without FUSE,
    ``_finalize_kernel`` does that. PDL_WAIT: launched with programmatic dependent launch; everything that does not
    read the stats kernel's outputs (row setup, random keys, draft ids and their logits) runs before ``gdc_wait``.
    FAST_LOG: the race scores' logarithms as ``lg2.approx`` (:func:`_log`).
    """
    b = tl.program_id(0)
    split = tl.program_id(1)
    n_b, g, scale = _row_setup(draft_tokens_ptr, num_drafts_ptr, greedy_ptr, b, K, inv_t,
                               HAS_COUNTS, HAS_MASK, ALL_GREEDY, KP2)
    seed = tl.load(seeds_ptr + b)
    off = tl.load(offsets_ptr + b)

    js = tl.arange(0, JP2)
    jmask = js < K + 1
    pair = b.to(tl.int64) * (K + 1) + js
    draft_mask = js < K
    real = js < n_b
    x, t_x, d_x = _draft_logits(target_ptr, draft_ptr, draft_tokens_ptr, b, js, real, V, K, scale)
    key_a, key_b = stream_keys_tl(seed, off + js)
    u = uniform_from_keys_tl(key_a, key_b, tl.full([JP2], 0xFFFFFFFF, tl.uint32))
    if PDL_WAIT:
        tl.extra.cuda.gdc_wait()

    # positions >= n_stat have no statistics (the bonus position of a batch without greedy rows): -inf / 0
    lt, mt, st, ld, md, sd, am = _position_stats(stats_ptr, argmax_ptr, pair, js < n_stat, V, S, SP2, "")

    lp = t_x - lt
    lq = d_x - ld
    # lt > -inf: a position whose statistics were never computed (a wrongly skipped one) stops the row instead
    # of accepting its draft unverified (lp = lq = +inf there)
    acc_s = (lq > float("-inf")) & (lt > float("-inf")) & (tl.log(u) + lq <= lp)
    acc_g = x == am
    acc = real & tl.where(g != 0, acc_g, acc_s)
    stop = tl.min(tl.where(jmask & (js <= n_b) & (~acc), js, JP2), axis=0)
    at_stop = js == stop
    lt_stop = tl.sum(tl.where(at_stop, lt, 0.0), axis=0)
    delta_stop = tl.sum(tl.where(at_stop, (md - mt) + tl.log(sd / st), 0.0), axis=0)  # L_d - L_t, accurately
    am_stop = tl.sum(tl.where(at_stop, am, 0), axis=0)
    rejected = stop < n_b

    if COMPUTE_SCORES:
        if split == 0:
            tl.store(logprob_ptr + b.to(tl.int64) * K + js, tl.where(real, lp, float("-inf")), mask=draft_mask)

    # exponential race over this program's chunk of the stop row (sampled rows only)
    lo = split * chunk
    hi = tl.where(g == 0, tl.minimum(lo + chunk, V), lo)
    t_base = target_ptr + (b.to(tl.int64) * (K + 1) + stop) * V
    d_base = draft_ptr + (b.to(tl.int64) * K + tl.minimum(stop, K - 1)) * V
    rk_a = tl.sum(tl.where(at_stop, key_a, 0), axis=0)  # keys of position `stop` (one RNG call per row)
    rk_b = tl.sum(tl.where(at_stop, key_b, 0), axis=0)
    v_d = tl.where(rejected, V, 0)
    NT = (V + RACE_TILE - 1) // RACE_TILE  # number of tiles; "no tile" is NT
    tiles = tl.arange(0, TILES)
    cols = tl.arange(0, RACE_TILE)
    mass = tl.zeros([TILES], tl.float32)
    # Level 2 runs on this program's best tile of the race the row will most likely use (the residual after a
    # rejection, p for a bonus token); the finalize redoes it only in the rare residual-mass fallback.
    # (the running winners start in each branch: initialised above the branch, the one-warp plans compile to a
    # different instruction schedule than the one measured in session 11)
    if SINGLE:  # the chunk is one block: level 2 on the block still in registers (small B: no second load)
        best_r = tl.full([TILES], float("-inf"), tl.float32)
        tile_r = tl.zeros([TILES], tl.int32) + NT
        best_p = tl.full([TILES], float("-inf"), tl.float32)
        tile_p = tl.zeros([TILES], tl.int32) + NT
        tile = lo // RACE_TILE + tiles
        offs = tile[:, None] * RACE_TILE + cols[None, :]
        lim = tl.where(lo < hi, V, 0)  # (a scalar-bool & vector-bool mask trips Triton's interpreter)
        t = tl.load(t_base + offs, mask=offs < lim, other=float("-inf"),
                    eviction_policy=RACE_EVICT).to(tl.float32) * scale
        d = tl.load(d_base + offs, mask=offs < tl.minimum(lim, v_d), other=float("-inf"),
                    eviction_policy=RACE_EVICT).to(tl.float32) * scale
        best_r, tile_r, best_p, tile_p, mass = _tile_race_update(
            t, d, lt_stop, delta_stop, tile, rk_a, rk_b, best_r, tile_r, best_p, tile_p, mass, TILE_BASE, FTZ,
            FAST_LOG)
        best_r, win_r = _lanes_winner(best_r, tile_r, NT)
        best_p, win_p = _lanes_winner(best_p, tile_p, NT)
        in_win = tile[:, None] == tl.where(rejected, win_r, win_p)
        local_id = _block_race(t, d, offs, in_win, rejected, lt_stop, delta_stop, rk_a, rk_b, V, FTZ, FAST_LOG)
    else:  # loop over blocks with the next block's loads issued before this block's arithmetic
        lim = tl.where(lo < hi, V, 0)
        offs = (lo // RACE_TILE + tiles)[:, None] * RACE_TILE + cols[None, :]
        t_nx = tl.load(t_base + offs, mask=offs < lim, other=float("-inf"), eviction_policy=RACE_EVICT)
        d_nx = tl.load(d_base + offs, mask=offs < tl.minimum(lim, v_d), other=float("-inf"),
                       eviction_policy=RACE_EVICT)
        best_r = tl.full([TILES], float("-inf"), tl.float32)
        tile_r = tl.zeros([TILES], tl.int32) + NT
        best_p = tl.full([TILES], float("-inf"), tl.float32)
        tile_p = tl.zeros([TILES], tl.int32) + NT
        for start in range(lo, hi, TILES * RACE_TILE):
            tile = start // RACE_TILE + tiles
            offs = tile[:, None] * RACE_TILE + cols[None, :]
            t = t_nx.to(tl.float32) * scale
            d = d_nx.to(tl.float32) * scale
            lim = tl.where(start + TILES * RACE_TILE < hi, V, 0)
            nx = offs + TILES * RACE_TILE
            t_nx = tl.load(t_base + nx, mask=nx < lim, other=float("-inf"), eviction_policy=RACE_EVICT)
            d_nx = tl.load(d_base + nx, mask=nx < tl.minimum(lim, v_d), other=float("-inf"),
                           eviction_policy=RACE_EVICT)
            best_r, tile_r, best_p, tile_p, mass = _tile_race_update(
                t, d, lt_stop, delta_stop, tile, rk_a, rk_b, best_r, tile_r, best_p, tile_p, mass, TILE_BASE, FTZ,
                FAST_LOG)
        best_r, win_r = _lanes_winner(best_r, tile_r, NT)
        best_p, win_p = _lanes_winner(best_p, tile_p, NT)
        local_id = _in_tile_race(t_base, d_base, tl.where(rejected, win_r, win_p), rejected, lt_stop, delta_stop,
                                 scale, rk_a, rk_b, V, v_d, RACE_TILE, FTZ, FAST_LOG)
    out = (b.to(tl.int64) * S2 + split) * 6
    tl.store(race_ptr + out, best_r)
    tl.store(race_ptr + out + 1, win_r.to(tl.float32))
    tl.store(race_ptr + out + 2, best_p)
    tl.store(race_ptr + out + 3, win_p.to(tl.float32))
    tl.store(race_ptr + out + 4, tl.sum(mass, axis=0))
    tl.store(race_ptr + out + 5, local_id.to(tl.float32))
    greedy_next = tl.where(am_stop < V, am_stop, -1)
    if not FUSE:
        if split == 0:
            tl.store(info_ptr + b.to(tl.int64) * 4, stop)
            tl.store(info_ptr + b.to(tl.int64) * 4 + 1, greedy_next)
            tl.store(info_ptr + b.to(tl.int64) * 4 + 2, g)
            tl.store(info_ptr + b.to(tl.int64) * 4 + 3, rejected.to(tl.int32))

    if COMPUTE_SCORES:
        # alpha_j = sum_x min(p_j, q_j) for every position j < K (partial over this chunk)
        for jj in range(0, K):
            sel = js == jj
            lt_j = tl.sum(tl.where(sel, lt, 0.0), axis=0)
            ld_j = tl.sum(tl.where(sel, ld, 0.0), axis=0)
            tb = target_ptr + (b.to(tl.int64) * (K + 1) + jj) * V
            db = draft_ptr + (b.to(tl.int64) * K + jj) * V
            a = 0.0
            for a_start in range(lo, tl.minimum(lo + chunk, V), TILES * RACE_TILE):
                a_offs = a_start + tl.arange(0, TILES * RACE_TILE)
                a_in = a_offs < V
                a_t = tl.load(tb + a_offs, mask=a_in, other=float("-inf")).to(tl.float32) * scale
                a_d = tl.load(db + a_offs, mask=a_in, other=float("-inf")).to(tl.float32) * scale
                a += tl.sum(_exp(tl.minimum(a_t - lt_j, a_d - ld_j), FTZ), axis=0)
            tl.store(alpha_part_ptr + (b.to(tl.int64) * K + jj) * S2 + split, a)

    if FUSE:
        # "last one finalises": all of this program's stores happen before its arrival (barrier + release); the
        # program that sees S2 - 1 earlier arrivals (acquire) reads every partial of the row (L2, not L1).
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + b, 1, sem="acq_rel")
        if arrived == S2 - 1:
            _finalize_row(draft_tokens_ptr, race_ptr, tokens_ptr, num_accepted_ptr, alpha_part_ptr, alpha_ptr,
                          t_base, scale, rk_a, rk_b, b, stop, greedy_next, g, rejected, V, K, S2, MASS_EPS,
                          COMPUTE_SCORES, JP2, SP2B, RACE_TILE)


@triton.jit
def _finalize_row(draft_tokens_ptr, race_ptr, tokens_ptr, num_accepted_ptr, alpha_part_ptr, alpha_ptr,
                  t_base, scale, rk_a, rk_b, b, stop, greedy_next, g, rejected, V, K, S2,
                  MASS_EPS: tl.constexpr, COMPUTE_SCORES: tl.constexpr, JP2: tl.constexpr, SP2: tl.constexpr,
                  RACE_TILE: tl.constexpr):
    """Combine the level-1 winners of row ``b``'s programs (ties to the lowest tile) and its partial residual
    masses; take the level-2 id of the program holding the winning tile. The residual race is used only after a
    rejection whose mass exceeds ``MASS_EPS``; in the rare fallback (rejected, mass <= MASS_EPS) the programs ran
    level 2 on the residual, so the p race's level 2 runs here. Writes tokens / num_accepted / alpha."""
    ss = tl.arange(0, SP2)
    smask = ss < S2
    nt = (V + RACE_TILE - 1) // RACE_TILE
    base = (b.to(tl.int64) * S2 + ss) * 6
    r = tl.load(race_ptr + base, mask=smask, other=float("-inf"), cache_modifier=".cg")
    rt = tl.load(race_ptr + base + 1, mask=smask, other=0.0, cache_modifier=".cg").to(tl.int32)
    p = tl.load(race_ptr + base + 2, mask=smask, other=float("-inf"), cache_modifier=".cg")
    pt = tl.load(race_ptr + base + 3, mask=smask, other=0.0, cache_modifier=".cg").to(tl.int32)
    local = tl.load(race_ptr + base + 5, mask=smask, other=0.0, cache_modifier=".cg").to(tl.int32)
    mass = tl.sum(tl.load(race_ptr + base + 4, mask=smask, other=0.0, cache_modifier=".cg"), axis=0)
    use_r = rejected & (mass > MASS_EPS)
    best = tl.where(use_r, r, p)
    tiles = tl.where(use_r, rt, pt)
    top = tl.max(best, axis=0)
    win = tl.min(tl.where(smask & (best == top) & (best > float("-inf")), tiles, nt), axis=0)
    sampled = tl.sum(tl.where(smask & (tiles == win), local, 0), axis=0)  # one program holds the winning tile
    if rejected & (not use_r):
        sampled = _in_tile_race(t_base, t_base, win, False, 0.0, 0.0, scale, rk_a, rk_b, V, 0, RACE_TILE, False,
                                False)
    sampled = tl.where((win < nt) & (sampled < V), sampled, -1)
    nxt = tl.where(g != 0, greedy_next, sampled)

    js = tl.arange(0, JP2)
    x = tl.load(draft_tokens_ptr + b.to(tl.int64) * K + js, mask=js < K, other=-1)
    tok = tl.where(js < stop, x, tl.where(js == stop, nxt, -1)).to(tl.int64)
    tl.store(tokens_ptr + b.to(tl.int64) * (K + 1) + js, tok, mask=js < K + 1)
    tl.store(num_accepted_ptr + b, stop.to(tl.int64))
    if COMPUTE_SCORES:
        for jj in range(0, K):
            a = tl.sum(tl.load(alpha_part_ptr + (b.to(tl.int64) * K + jj) * S2 + ss, mask=smask, other=0.0,
                               cache_modifier=".cg"), axis=0)
            tl.store(alpha_ptr + b.to(tl.int64) * K + jj, a)


@triton.jit
def _finalize_kernel(target_ptr, draft_tokens_ptr, seeds_ptr, offsets_ptr, race_ptr, info_ptr, tokens_ptr,
                     num_accepted_ptr, alpha_part_ptr, alpha_ptr, inv_t, V, K, S2, MASS_EPS: tl.constexpr,
                     COMPUTE_SCORES: tl.constexpr, JP2: tl.constexpr, SP2: tl.constexpr, RACE_TILE: tl.constexpr):
    """Third launch of "split" without the fused finalize: :func:`_finalize_row` for row ``program_id(0)``."""
    b = tl.program_id(0)
    stop = tl.load(info_ptr + b.to(tl.int64) * 4)
    greedy_next = tl.load(info_ptr + b.to(tl.int64) * 4 + 1)
    g = tl.load(info_ptr + b.to(tl.int64) * 4 + 2)
    rejected = tl.load(info_ptr + b.to(tl.int64) * 4 + 3) != 0
    rk_a, rk_b = stream_keys_tl(tl.load(seeds_ptr + b), tl.load(offsets_ptr + b) + stop)
    scale = tl.where(g != 0, 1.0, inv_t)
    t_base = target_ptr + (b.to(tl.int64) * (K + 1) + stop) * V
    _finalize_row(draft_tokens_ptr, race_ptr, tokens_ptr, num_accepted_ptr, alpha_part_ptr, alpha_ptr,
                  t_base, scale, rk_a, rk_b, b, stop, greedy_next, g, rejected, V, K, S2, MASS_EPS,
                  COMPUTE_SCORES, JP2, SP2, RACE_TILE)


# ---------------------------------------------------------------------------------------------------------------
# "seq" strategy: one program per row, positions in order, early exit at the first rejection


@triton.jit
def _seq_kernel(target_ptr, draft_ptr, draft_tokens_ptr, num_drafts_ptr, greedy_ptr, seeds_ptr, offsets_ptr,
                tokens_ptr, num_accepted_ptr, inv_t, V, K,
                HAS_COUNTS: tl.constexpr, HAS_MASK: tl.constexpr, ALL_GREEDY: tl.constexpr, KP2: tl.constexpr,
                JP2: tl.constexpr, BLOCK: tl.constexpr, MASS_EPS: tl.constexpr, TILES: tl.constexpr,
                RACE_TILE: tl.constexpr, TILE_BASE: tl.constexpr):
    """Whole row in one program: reads positions 0..stop only (plus the stop row again for the two-level race)."""
    b = tl.program_id(0)
    n_b, g, scale = _row_setup(draft_tokens_ptr, num_drafts_ptr, greedy_ptr, b, K, inv_t,
                               HAS_COUNTS, HAS_MASK, ALL_GREEDY, KP2)
    seed = tl.load(seeds_ptr + b)
    off = tl.load(offsets_ptr + b)
    js = tl.arange(0, JP2)
    key_a, key_b = stream_keys_tl(seed, off + js)  # all positions at once
    log_u_all = tl.log(uniform_from_keys_tl(key_a, key_b, tl.full([JP2], 0xFFFFFFFF, tl.uint32)))
    going = n_b * 0 + 1
    stop = n_b
    lt_stop = 0.0
    delta_stop = 0.0
    am_stop = V
    for j in range(0, K + 1):
        # statistics of position j: needed while going, for the drafts, and for a greedy row's last token
        need = (going != 0) & ((j < n_b) | (g != 0))
        need_d = (j < n_b) & (g == 0)
        hi = tl.where(need, V, 0)
        v_d = tl.where(need_d, V, 0)
        t_base = target_ptr + (b.to(tl.int64) * (K + 1) + j) * V
        d_base = draft_ptr + (b.to(tl.int64) * K + tl.minimum(j, K - 1)) * V
        m_t = float("-inf")
        s_t = 0.0
        m_d = float("-inf")
        s_d = 0.0
        am_v = float("-inf")
        am_i = V
        for start in range(0, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inb = offs < V
            t = tl.load(t_base + offs, mask=inb, other=float("-inf")).to(tl.float32) * scale
            d = tl.load(d_base + offs, mask=offs < v_d, other=float("-inf")).to(tl.float32) * scale
            m_t, s_t, m_d, s_d = _lse_update2(m_t, s_t, t, m_d, s_d, d)
            if g != 0:
                am_v, am_i = _argmax_update(am_v, am_i, t, offs, V)
        safe_t = tl.where(s_t > 0.0, s_t, 1.0)
        safe_d = tl.where(s_d > 0.0, s_d, 1.0)
        lt = tl.where(s_t > 0.0, m_t + tl.log(safe_t), float("-inf"))
        ld = tl.where(s_d > 0.0, m_d + tl.log(safe_d), float("-inf"))
        real = (going != 0) & (j < n_b)
        x = tl.load(draft_tokens_ptr + b.to(tl.int64) * K + tl.minimum(j, K - 1))
        xs = tl.minimum(tl.maximum(x, 0), V - 1)
        t_x = tl.load(t_base + xs, mask=real, other=0.0).to(tl.float32) * scale
        d_x = tl.load(d_base + xs, mask=real, other=0.0).to(tl.float32) * scale
        lp = t_x - lt
        lq = d_x - ld
        log_u = tl.sum(tl.where(js == j, log_u_all, 0.0), axis=0)
        acc_s = (lq > float("-inf")) & (log_u + lq <= lp)
        acc = real & tl.where(g != 0, x == am_i, acc_s)
        now = (going != 0) & (~acc)
        stop = tl.where(now, j, stop)
        lt_stop = tl.where(now, lt, lt_stop)
        delta_stop = tl.where(now, (m_d - m_t) + tl.log(s_d / safe_t), delta_stop)  # L_d - L_t, accurately
        am_stop = tl.where(now, am_i, am_stop)
        going = tl.where(acc, going, 0)

    rejected = stop < n_b
    hi = tl.where(g == 0, V, 0)
    t_base = target_ptr + (b.to(tl.int64) * (K + 1) + stop) * V
    d_base = draft_ptr + (b.to(tl.int64) * K + tl.minimum(stop, K - 1)) * V
    rk_a = tl.sum(tl.where(js == stop, key_a, 0), axis=0)  # keys of position `stop` (one RNG call per row)
    rk_b = tl.sum(tl.where(js == stop, key_b, 0), axis=0)
    v_d = tl.where(rejected, V, 0)
    NT = (V + RACE_TILE - 1) // RACE_TILE
    tiles = tl.arange(0, TILES)
    cols = tl.arange(0, RACE_TILE)
    best_r = tl.full([TILES], float("-inf"), tl.float32)
    tile_r = tl.zeros([TILES], tl.int32) + NT
    best_p = tl.full([TILES], float("-inf"), tl.float32)
    tile_p = tl.zeros([TILES], tl.int32) + NT
    mass = tl.zeros([TILES], tl.float32)
    for start in range(0, hi, TILES * RACE_TILE):
        tile = start // RACE_TILE + tiles
        offs = tile[:, None] * RACE_TILE + cols[None, :]
        t = tl.load(t_base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * scale
        d = tl.load(d_base + offs, mask=offs < v_d, other=float("-inf")).to(tl.float32) * scale
        best_r, tile_r, best_p, tile_p, mass = _tile_race_update(
            t, d, lt_stop, delta_stop, tile, rk_a, rk_b, best_r, tile_r, best_p, tile_p, mass, TILE_BASE, False,
            False)
    use_r = rejected & (tl.sum(mass, axis=0) > MASS_EPS)
    win = tl.where(use_r, _lanes_winner(best_r, tile_r, NT)[1], _lanes_winner(best_p, tile_p, NT)[1])
    sampled = _in_tile_race(t_base, d_base, win, use_r, lt_stop, delta_stop, scale, rk_a, rk_b, V, v_d, RACE_TILE,
                             False, False)
    nxt = tl.where(g != 0, am_stop, sampled)
    nxt = tl.where(nxt < V, nxt, -1)
    xv = tl.load(draft_tokens_ptr + b.to(tl.int64) * K + js, mask=js < K, other=-1)
    tok = tl.where(js < stop, xv, tl.where(js == stop, nxt, -1)).to(tl.int64)
    tl.store(tokens_ptr + b.to(tl.int64) * (K + 1) + js, tok, mask=js < K + 1)
    tl.store(num_accepted_ptr + b, stop.to(tl.int64))


# ---------------------------------------------------------------------------------------------------------------
# Launcher

def _sp2(splits: int, tight: bool = True) -> int:
    """Width of the combine tiles: the next power of two (at least 2 on the GPU); ``tight=False`` (v4) used the
    fixed maximum on the GPU (one compiled variant, but a [K+1, 256] combine in every race program)."""
    if _INTERPRET:
        return triton.next_power_of_2(splits)
    return max(2, triton.next_power_of_2(splits)) if tight else _MAX_SPLITS


def _split_plan(vocab: int, block: int, rows: int, target_programs: int, max_splits: int | None) -> tuple[int, int]:
    """(chunk, splits): vocabulary chunk per program (a multiple of ``block``) and the number of chunks."""
    tiles = triton.cdiv(vocab, block)
    splits = max(1, min(tiles, triton.cdiv(target_programs, rows)))
    if max_splits is not None:
        splits = max(1, min(splits, max_splits))
    chunk = triton.cdiv(triton.cdiv(vocab, splits), block) * block
    return chunk, triton.cdiv(vocab, chunk)


# At most this many vocabulary chunks per row; on the GPU the combine tiles are this wide (fewer kernel variants).
_MAX_SPLITS = 256

# Batches at least this large would use the one-launch early-exit strategy. On an H200 "seq" lost to "split" at
# every measured shape (one program per row cannot pull enough bandwidth; see NOTES_rejection.md), so "auto" never
# picks it; it stays available (strategy="seq") for GPUs/shapes where it might pay.
SEQ_MIN_BATCH = 1 << 62

# Launch plan of the "split" strategy (GPU; the interpreter uses small tiles, see the launcher). They only move work
# between programs, so results depend on them only through the fp32 summation order of the normalisers, the residual
# mass and alpha (sums of per-program partials; see the module docstring on rounding).
#   fuse            finalize in the race kernel's last program per row (arrival counter): 2 launches instead of 3
#   race_tiles      race tiles of RACE_TILE ids per loop iteration (the race chunk is a multiple of it); with as
#                   many warps, each warp owns one tile of a [race_tiles, RACE_TILE] block (bf16: 8 ids a thread)
#                   and the per-tile sums are warp reductions, no barrier
#   race_warps      race warps
#                   (race_tiles, race_warps) None: (2, 2) for B <= 2 (more, smaller programs: latency), else (4, 4);
#                   fp32 logits with B >= FP32_ONE_WARP_RACE_BATCH: (1, 1), see below
#   race_programs   race grid target, in programs per SM (splits2 = cdiv(race_programs * SMs, B), capped by tiles);
#                   None: 4, or 16 with the fp32 one-warp race, or 1 for 16-bit logits in BF16_FEW_RACE_BATCH
#   stats_programs  stats grid target, in programs per SM; None: 4, or 2 for fp32 logits with V <= FP32_SMALL_VOCAB,
#                   K >= 5 and B <= 8 (see _stats_programs)
#   stats_block/warps  stats tile and warps (None: 4096 / 8 warps when the grid has >= 4 tiles per SM, else 1024 / 4)
#   tight_sp2       combine tiles sized to the real number of splits (v4: always 256 wide on the GPU)
#   pdl             0 off; 1 race kernel launched with programmatic dependent launch (prologue before gdc_wait);
#                   2 also triggers the dependent launch at the start of the stats kernel
#   stats_prefetch  stats loop issues the next tile's loads before the current tile's arithmetic
#   stats_only      (benchmark breakdown) launch the stats kernel only; outputs are not written
#   stages          staged statistics (see _stage_plan): positions where a new stats launch starts, rows that
#                   certainly stopped earlier skip them; None automatic, () one launch
#   skip_bonus      no statistics programs for the bonus position when the batch has no greedy rows (they would
#                   read nothing; H200, results/rejection_sweep_H200_s7_skip2_{bf16,fp32}.csv: (32, 1, 151936)
#                   bf16 34.0 -> 28.5 us, (128, 4, 32000) bf16 43.5 -> 38.7, (128, 1, 32000) fp32 30.7 -> 28.2,
#                   (8, 4, 32000) fp32 14.6 -> 13.1; no measured shape slower by more than 1%), except fp32 logits
#                   with V <= FP32_SMALL_VOCAB, K >= 8 and B = 1 or B >= 16 (their 2048-wide prefetched statistics
#                   plan: (1, 8, 32000) 9.5 -> 10.3 us, results/rejection_sweep_H200_s7_skip_check_fp32.csv), where
#                   None keeps them (see _skip_bonus)
#   ftz             per-element exponentials as one ``ex2.approx.ftz`` (no subnormal fix-up: 3 fewer instructions per
#                   exp; results below 2**-126 flush to 0) in both kernels; None: on (GPU). Race loop 426 -> 376
#                   instructions per 256-id tile at the fp32 one-warp plan (sm_90a SASS); H100 same process
#                   (results/rejection_sweep_H100_80GB_HBM3_s9_{a,b}_*.csv): bf16 (128, 8, 151936) 193.5 -> 185.9 us,
#                   (128, 1, 151936) 81.5 -> 76.4, (8, 4, 151936) 20.7 -> 19.6; fp32 (128, 1, 151936) 112.2 ->
#                   107.1, (32, 1, 32000) 15.7 -> 14.7. One loss: bf16 (8, 8, 32000) 13.3 -> 15.6 us, only with
#                   programmatic dependent launch and only at that shape (its neighbours gain 3-5%;
#                   results/rejection_sweep_H100_80GB_HBM3_s9_{d,e}_bf16.csv)
#   l2_keep         statistics rows of the first n positions loaded ``evict_last``, the other statistics rows and
#                   the race kernel's level-1 loads ``evict_first`` (0: no eviction hints); None: see _l2_keep
#   live_skip       the statistics as one position-major launch whose programs stop reading a row once an earlier
#                   position of it is certainly rejected (the last program of each position tests it and marks the
#                   row); replaces `stages` when on; never with scores or greedy rows; None: see _live_skip
#   fast_log        the race kernel's logarithms (race scores and the exponential noise ``log(-log u)``; not the
#                   accept test) as one ``lg2.approx.f32`` each instead of libdevice's ``logf``; None: on (GPU). Race
#                   loop 376 -> 299 instructions per 256-id tile at the fp32 one-warp plan (sm_90a SASS); H100 same
#                   process (results/rejection_sweep_H100_80GB_HBM3_s11_d_{fp32,bf16}.csv): fp32 (128, 1, 32000)
#                   30.2 -> 27.3 us, (64, 4, 32000) 35.1 -> 32.8; bf16 (128, 1, 151936) 75.9 -> 67.5, (1, 1, 128256)
#                   8.9 -> 7.8, (128, 8, 151936) 186.1 -> 178.9; faster at all 23 shapes timed, by 1.5% (fp32
#                   (128, 8, 32000)) to 12% (bf16 (1, 1, 128256))
#   fold_scale      (with ftz) the statistics loop on unscaled logits, each element's exponent ``(t - m) (s log2 e)``
#                   (the scale multiply per element folded into the exponential's; see _stats_tile); None: 16-bit
#                   logits with B <= FOLD_MAX_BATCH on the GPU (see _fold_scale)
#   unpack          bf16 statistics tiles converted to fp32 two ids a register by a shift and a mask
#                   (:func:`_bf16_to_f32`, exact) instead of the compiler's PRMT + shift for the high id; None: on
#                   for bf16 tiles on the GPU when V % 16 == 0 (see _unpack); other dtypes are never affected.
#                   Statistics loop 328 -> 301 instructions per 4096-id tile at the B = 128 bf16 plan (live skip,
#                   prefetch, 8 warps; Triton 3.6, sm_90 SASS, benchmarks/sass_rejection_stats.py). Same process,
#                   each setting twice, means, off -> on (results/rejection_sweep_{H100_80GB_HBM3,H200}_s20_unpack.csv,
#                   every row exact), H100 / H200: (128, 4, 32000) 42.8 -> 39.0 / 37.3 -> 33.3 us, (128, 8, 151936)
#                   166.8 -> 162.8 / 139.2 -> 136.7, (32, 8, 32000) 23.6 -> 23.3 / 20.1 -> 19.2, (16, 8, 32000)
#                   17.2 -> 17.0 / 15.9 -> 15.4; at B <= 8 no measurable change (-1.1% to +0.7%, while one plan timed
#                   under two names differed by up to 1.4% in the same sweep)
TUNE_DEFAULT = dict(fuse=True, race_tiles=None, race_warps=None, race_programs=None, stats_programs=None,
                    stats_block=None, stats_warps=None, stats_prefetch=None, tight_sp2=True, pdl=None, stats_only=False,
                    stages=None, skip_bonus=None, ftz=None, l2_keep=None, fast_log=None, live_skip=None,
                    fold_scale=None, unpack=None)
# automatic choices (None above), each measured on an H200 unless said otherwise (benchmarks/NOTES_rejection.md):
#   stats_prefetch None: on for B >= 16 with the 4096 tile (B (K+1) tiles >= 4 per SM), with 16 warps when the stats
#                   grid has one program per (row, position) (B (K+1) >= stats_programs * SMs; (128, 8): stats
#                   208 -> 164 us, 96% of copy). v9 sweep: (32, 8, 32000) 24.7 -> 23.2 us, (32, 4, 151936)
#                   49.0 -> 44.9 us, (128, 8, 151936) 261 -> 215 us; but (8, 4, 151936) 22.1 -> 27.1 us (with PDL)
#   pdl None: 2 for B <= 8 (latency-bound) on sm_90+, else 0
#   stats_block None, fp32 logits with V <= FP32_SMALL_VOCAB: a prefetched 2048 tile, 4 warps (v11 sweep,
#                   results/rejection_sweep_H200_v11_fp32_small2.csv: (32, 1, 32000) 21.2 -> 16.7 us, (32, 8) 33.3 ->
#                   30.0, (128, 8) 86.3 -> 75.9, (8, 8) 21.5 -> 19.3; (128, 1) 33.1 -> 34.8 is the one loss; at
#                   V = 151936 the 2048 tile loses, e.g. (32, 8) 90.9 -> 97.5)
FP32_SMALL_VOCAB = 65536
#   race plan None, fp32 logits with B >= FP32_ONE_WARP_RACE_BATCH: one 256-id tile and one warp per race program,
#                   16 programs per SM. A warp covers 128 fp32 ids (16-byte loads), so the [tiles, 256] blocks of the
#                   bf16 plan put two warps on a tile and every per-tile sum crosses warps; with one warp they stay
#                   shuffles. H100 sweep (results/rejection_sweep_H100_80GB_HBM3_s6_fp32.csv, same process):
#                   (128, 1, 151936) 132.9 -> 116.1 us, (128, 1, 32000) 36.5 -> 32.4, (32, 8, 32000) 42.1 -> 36.8,
#                   (128, 4, 32000) 69.8 -> 64.7; (32, 1, 32000) 17.6 -> 18.3 and (32, 4, 32000) 25.9 -> 26.0 the
#                   exceptions; bf16 (one warp per tile already) loses with it at every measured shape. At
#                   V <= FP32_SMALL_VOCAB with B < 128, two tiles per one-warp program and 8 programs per SM did
#                   better on both cards (H200, results/rejection_sweep_H200_s6_fp32_small.csv: (32, 1) 16.5 ->
#                   15.8 us, (32, 4) 22.0 -> 21.2, (32, 8) 30.4 -> 29.1; B = 64 not measured)
FP32_ONE_WARP_RACE_BATCH = 32
#   race_programs None, 16-bit logits with V <= FP32_SMALL_VOCAB (the same bound, whatever the dtype) and B in
#                   BF16_FEW_RACE_BATCH: 1 program per SM (fewer race programs per row: at V = 32000 with 132 SMs,
#                   32 -> 16 at B = 8, 32 -> 8 at B = 16; each combines (K + 1) x S statistics partials and the last
#                   one reads the row's S2 race partials). H200 same process
#                   (results/rejection_sweep_H200_s10_{d,e}_bf16.csv): (8, 8, 32000) 13.9 -> 11.7 us, (8, 1) 8.8 ->
#                   7.7, (16, 4) 14.2 -> 13.5, (8, 8, 65536) 20.6 -> 16.9; (32, 8, 32000) +12% and (8, 4, 151936)
#                   +21% (outside the rule). fp32 gained less and lost at (16, 1, 32000) (+7%): not in the rule.
BF16_FEW_RACE_BATCH = (8, 16)


def _stage_plan(num_positions: int, batch: int, compute_scores: bool, stages, vocab: int = 0,
                element_size: int = 2) -> list[tuple[int, int]]:
    """Launches of the statistics kernel as ``(first position, number of positions)``.

    ``stages``: None (automatic), an empty sequence (one launch over every position) or the positions where a new
    launch starts, e.g. ``(2, 5)``: positions 0-1, then 2-4 for rows that have not certainly stopped, then 5-K.
    Positions past the last one (K) are ignored, so one plan serves every K. Scores need every position, so they
    force one launch.
    """
    if stages is None:
        stages = _auto_stages(num_positions, batch, vocab, element_size)
    if not isinstance(stages, (tuple, list)) or not all(isinstance(p, int) and not isinstance(p, bool)
                                                        for p in stages):
        raise TypeError(f"tune['stages'] must be None or a tuple of positions (ints), got {stages!r}")
    if any(p < 1 for p in stages):
        raise ValueError(f"tune['stages'] positions must be >= 1 (position 0 always starts the first launch), "
                         f"got {tuple(stages)}")
    starts = sorted({p for p in stages if p < num_positions})
    if compute_scores or not starts:
        return [(0, num_positions)]
    bounds = [0, *starts, num_positions]
    return [(lo, hi - lo) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


def _logit_bytes(batch: int, num_positions: int, vocab: int, element_size: int) -> int:
    """Bytes of one call's logits: B (K + 1) target rows and B K draft rows of V entries (the launch rules' size)."""
    return batch * (2 * num_positions - 1) * vocab * element_size


def _live_skip(setting: bool | None, compute_scores: bool, greedy_rows: bool, batch: int, num_positions: int,
               vocab: int, element_size: int) -> bool:
    """Whether the statistics run as one position-major launch whose programs stop reading rows already certainly
    rejected at an earlier position (``tune['live_skip']``, see ``_stats_kernel``; it replaces ``tune['stages']``).
    Never with scores (they need every position), with a batch that may hold greedy rows (their arg-max puts
    block-wide barriers in the statistics loop, so every warp of a program must run the same number of tiles, while
    each thread reads the row's word on its own), or when the grid's second dimension, B * (K + 1) at most, would
    reach 65536. None (automatic): on the GPU with K >= 4 and at least LIVE_SKIP_BYTES of logits, or, for fp32
    logits with B >= LIVE_SKIP_FP32_BATCH, at least LIVE_SKIP_FP32_BYTES (session 16, see there). H100, same process
    (results/rejection_sweep_H100_80GB_HBM3_s15_rule_*.csv), against the plan it replaces (one launch, or positions
    0-2 then 3-K): fp32 (128, 8, 151936) 321 -> 269 us, (128, 8, 128256) 284 -> 238, (128, 6, 151936) 295 -> 250,
    (128, 4, 151936) 264 -> 207, (64, 8, 151936) 182 -> 157, (256, 8, 151936) 680 -> 537; bf16 (128, 8, 151936)
    180 -> 165, (128, 8, 128256) 160 -> 144. Below that it was within the runs' spread or slower: fp32 (32, 8, 151936)
    93-94 -> 95-97 us, (32, 8, 32000) 32 -> 33-36, and below ~15 MB the zeroed counters and the checks cost 2-8 us
    (results/rejection_sweep_H100_80GB_HBM3_s15_live*)."""
    if compute_scores or greedy_rows or batch * num_positions >= 65536:
        return False
    if setting is None:
        logit_bytes = _logit_bytes(batch, num_positions, vocab, element_size)
        large = logit_bytes >= LIVE_SKIP_BYTES or (element_size == 4 and batch >= LIVE_SKIP_FP32_BATCH
                                                   and logit_bytes >= LIVE_SKIP_FP32_BYTES)
        return not _INTERPRET and num_positions >= 5 and large
    return bool(setting)


LIVE_SKIP_BYTES = 500e6
# fp32 logits from B = 48: from 200 MB. H200 with this rule (16 programs per SM) against the plan it replaces, same
# process (results/rejection_sweep_H200_s16_live_rule.csv, every row exact): faster at all 8 shapes, by 6-21%, e.g.
# (48, 4, 128256) 75.6 -> 66.7 us, (64, 4, 151936) 99.3 -> 89.1, (128, 8, 32000) 64.0 -> 59.9, (64, 8, 65536) 79.4 ->
# 62.4. H100, same process (results/rejection_sweep_H100_80GB_HBM3_s17_live_rule.csv, the same 8 shapes, twice each,
# every row exact): faster at all 8, by 6-17%, e.g. (48, 4, 128256) 96.4 -> 80.4 us, (96, 4, 100000) 135.5 -> 112.9,
# (128, 8, 32000) 82.3 -> 77.6.
# At B = 32 it lost on the H200 ((32, 4, 151936) 54.5 -> 58.6 us, (32, 5, 128256) 55.4 -> 57.8, 8 per SM;
# ..._H200_s16_k4_live_b.csv) and at B <= 16 on both cards.
LIVE_SKIP_FP32_BYTES = 200e6
LIVE_SKIP_FP32_BATCH = 48
# statistics programs per SM with live_skip: fp32 logits / 16-bit logits (H100, same sweeps: fp32 16 and 32 within
# 4% of each other at B >= 64; bf16 32 beat 16 by 5-8% at (128, 8))
LIVE_SKIP_STATS_PROGRAMS = (16, 32)


STAGES_BYTES = 200e6  # logits from which the statistics run in two launches (K >= 6), see _auto_stages
# fp32 logits with B < LIVE_SKIP_FP32_BATCH and K >= 4 (K = 6-7 at V <= FP32_SMALL_VOCAB): two launches from 100 MB
STAGES_FP32_BYTES = 100e6


def _auto_stages(num_positions: int, batch: int, vocab: int, element_size: int) -> tuple[int, ...]:
    """Staged statistics where reading fewer rows beats one more launch and its skip checks.

    H200 sweep (``results/rejection_sweep_H200_stages_{bf16,fp32}.csv``): positions 0-2, then 3-K, wins when
    K >= 6 and the logits are >= 200 MB ((32, 8, 151936) fp32 106 -> 91 us, (128, 8, 151936) bf16 214 -> 191 us,
    fp32 375 -> 264 us); below that (bf16 (32, 8): 66 -> 73 us) or with K = 4 the extra launch costs more.
    fp32 logits with K = 6: positions 0-1, then 2-6 (session 17, same process, each plan twice, means; every row
    exact). Against 0-2 / 3-6, H100 (results/rejection_sweep_H100_80GB_HBM3_s17_stages{,_c,_d}.csv):
    (32, 6, 128256) 78.8 -> 73.4 us, (32, 6, 151936) 94.7 -> 85.6 and 95.7 -> 86.3, (40, 6, 128256) 86.8 -> 85.3
    and 89.3 -> 86.9, (40, 6, 100000) 71.0 -> 70.9; H200 (..._H200_s17_stages.csv): (32, 6, 128256) 67.0 -> 57.6.

    fp32 logits with V > FP32_SMALL_VOCAB, K >= 4 and B < LIVE_SKIP_FP32_BATCH from STAGES_FP32_BYTES (100 MB):
    positions 0-1 first for K <= 7, 0-2 for K >= 8 (session 18, benchmarks/NOTES_rejection.md "v24"). With the rule
    against one launch, same process, each plan twice, means, H100 / H200, every row exact
    (results/rejection_sweep_{H100_80GB_HBM3,H200}_s18_confirm.csv): (32, 7, 100000) 78.2 -> 52.8 / 61.6 -> 46.0 us,
    (16, 8, 151936) 70.1 -> 54.0 / 53.1 -> 47.0, (32, 5, 128256) 74.4 -> 63.0 / 56.0 -> 50.2, (32, 8, 80000) 70.8 ->
    55.7 / 53.7 -> 46.7, (32, 4, 128256) 63.5 -> 56.2 / 49.2 -> 46.2; 16 shapes of 107-292 MB, the smallest changes
    (32, 4, 151936) -2% / +1% and (16, 5, 151936) -9% / -1%. At V <= 65536, where the fp32 statistics run their own
    plan, only K = 6-7 (positions 0-1 first; ..._s18_small.csv, against one launch): (32, 6, 65536) 49.0 -> 40.7 /
    43.4 -> 36.8, (40, 7, 65536) 66.1 -> 48.7 / 52.4 -> 46.9; below about 70 MB it lost ((40, 6, 32000) 67 MB,
    H200 25.1 -> 30.1), and the H200 lost at K = 8 ((32, 8, 65536) 41.7 -> 45.9 with 0-2 first; ..._s18_rule.csv)
    and K = 5 ((48, 5, 65536) 40.5 -> 48.4). Not for 16-bit logits below 200 MB (H200 bf16 (32, 8, 151936) 58.1 ->
    73.7 with 0-1 first, 75.9 with 0-2 first; ..._s18_rule_bf16.csv).
    """
    if _INTERPRET:
        return (2, 4) if num_positions >= 3 else ()  # CPU tests: every staged path runs
    logit_bytes = _logit_bytes(batch, num_positions, vocab, element_size)
    if element_size == 4 and batch < LIVE_SKIP_FP32_BATCH and logit_bytes >= STAGES_FP32_BYTES:
        if vocab > FP32_SMALL_VOCAB and num_positions >= 5:
            return (2,) if num_positions <= 8 else (3,)
        if num_positions in (7, 8):  # V <= FP32_SMALL_VOCAB: K = 6-7 only
            return (2,)
    if num_positions < 7 or logit_bytes < STAGES_BYTES:
        return ()
    if element_size == 4 and num_positions == 7:
        return (2,)
    return (3,)


def _fp32_small_vocab(element_size: int, vocab: int) -> bool:
    """fp32 logits with V <= FP32_SMALL_VOCAB: the latency-bound shapes several launch rules single out."""
    return element_size == 4 and vocab <= FP32_SMALL_VOCAB


def _skip_bonus(setting: bool | None, element_size: int, vocab: int, num_drafts: int, greedy_rows: bool,
                batch: int) -> bool:
    """Whether the statistics launches leave out the bonus position (``tune['skip_bonus']``, None = automatic).
    Greedy rows need its arg-max, so a batch that may hold one never skips. Automatic: skip, except fp32 logits with
    V <= FP32_SMALL_VOCAB and K >= 8 at B = 1 (H200 and H100: (1, 8, 32000) 10.3 -> 9.5 us and 10.5 -> 9.8 us without
    the skip) or B >= 16 (equal at (16, 8, 32000) on the H100, B >= 32 not measured). With half the statistics
    programs (_stats_programs) skipping won at B = 4 and 8 on the H100 ((4, 8, 32000) 14.2 -> 13.4 us, (8, 8, 32000)
    17.3 -> 16.7; results/rejection_sweep_H100_80GB_HBM3_s8_k5to8b_fp32.csv)."""
    if greedy_rows or num_drafts < 1:
        return False
    if setting is None:
        return not (_fp32_small_vocab(element_size, vocab) and num_drafts >= 8 and (batch == 1 or batch >= 16))
    return bool(setting)


def _stats_programs(setting: int | None, element_size: int, vocab: int, num_drafts: int, batch: int) -> int:
    """Statistics grid target in programs per SM (``tune['stats_programs']``, None = automatic): 4, except 2 for
    fp32 logits with V <= FP32_SMALL_VOCAB, K >= 5 and B <= 8. There every race program combines (K + 1) x S
    partials and the statistics are a few short programs: halving S cost the statistics little and the call gained
    13% at (8, 8, 32000) (H100, results/rejection_sweep_H100_80GB_HBM3_s8_waves_fp32.csv: 19.6 -> 17.0 us), and
    with the skipped bonus statistics 4-19% at K = 5-7 ((8, 6, 32000) 19.0 -> 15.4 us, (4, 5, 32000) 13.2 -> 12.1;
    results/rejection_sweep_H100_80GB_HBM3_s8_k5to8b_fp32.csv), while (32, 8, 32000) lost 7% with it, bf16
    (8, 8, 32000) 8%, and B = 16 was unchanged."""
    if setting is None:
        return 2 if (_fp32_small_vocab(element_size, vocab) and num_drafts >= 5 and batch <= 8) else 4
    if int(setting) < 1:
        raise ValueError(f"tune['stats_programs'] must be None or >= 1 (programs per SM), got {setting}")
    return int(setting)


def _l2_keep(setting: int | None, element_size: int, vocab: int, num_drafts: int, batch: int) -> int:
    """Positions whose statistics loads are marked ``evict_last`` in L2 (``tune['l2_keep']``, None = automatic; 0 = no
    eviction hints). With n > 0 the statistics rows of positions >= n and the race kernel's level-1 loads are
    ``evict_first``, so the rows of positions < n (the likeliest stop rows, which the race kernel reads again after a
    rejection) stay in L2.

    Automatic: 1 for fp32 logits with V <= FP32_SMALL_VOCAB, K >= 4, B >= 32 and the kept rows (target and draft at
    position 0) <= 32 MiB, else 0. H100 same process (results/rejection_sweep_H100_80GB_HBM3_s10_c_fp32.csv):
    (32, 4, 32000) 22.4 -> 21.4 us, (64, 4, 32000) 36.4 -> 34.7, (32, 8, 32000) 33.6 -> 32.6, (128, 4, 32000) 59.0
    -> 57.8, (32, 4, 65536) 37.1 -> 35.9; (128, 8, 32000) equal; outside the rule it lost: (128, 8, 65536) +3% (67 MB
    kept) and B = 1 +1-2% (same file), K = 1 +3-6% (..._s10_{a,b}_fp32.csv), and bf16 moved both ways
    ((128, 4, 32000) -9%, (32, 4, 32000) +9%; ..._s10_c_bf16.csv)."""
    if setting is None:
        kept_bytes = 2 * batch * vocab * element_size
        return int(_fp32_small_vocab(element_size, vocab) and num_drafts >= 4 and batch >= 32
                   and kept_bytes <= 32 << 20)
    if isinstance(setting, bool) or int(setting) < 0:
        raise ValueError(f"tune['l2_keep'] must be None or an int >= 0 (positions), got {setting!r}")
    return int(setting)


def _fast_math(key: str, setting: bool | None) -> bool:
    """Whether an inline-PTX setting (``tune['ftz']``, ``tune['fast_log']``, and the exact ``tune['unpack']``) may be
    used: None or True on the GPU, never in the interpreter (it has no PTX). The rules built on it (``_fold_scale``,
    ``_unpack``) decide what None means."""
    if setting is not None and not isinstance(setting, bool):
        raise ValueError(f"tune[{key!r}] must be None, True or False, got {setting!r}")
    return setting is not False and not _INTERPRET


def _fold_scale(setting: bool | None, element_size: int, batch: int) -> bool:
    """Whether the statistics loop folds the logit scale into its exponent (``tune['fold_scale']``, see
    :func:`_stats_tile`; only with ``ftz``). None (automatic): on the GPU for 16-bit logits with B <= 4
    (FOLD_MAX_BATCH; the measurements are there)."""
    if not _fast_math("fold_scale", setting):
        return False
    return setting is True or (element_size == 2 and batch <= FOLD_MAX_BATCH)


# Measured in one process, each setting twice, interleaved, every row exact, bf16, folded against not, with this code
# (results/rejection_sweep_{H100_80GB_HBM3,H200}_s19_fold3.csv; means, us, H100 / H200): faster at every B <= 4 shape
# on the H100 and at all but one on the H200, e.g. (1, 8, 128256) 12.7 -> 11.3 / 12.7 -> 11.1, (1, 4, 151936)
# 10.7 -> 10.0 / 10.5 -> 9.9, (2, 4, 151936) 12.8 -> 11.7 / 12.6 -> 11.6, (4, 4, 32000) 9.6 -> 9.1 / 9.6 -> 9.1; the
# exception (4, 8, 128256) 17.3 -> 17.4 on the H200 (18.5 -> 18.3 on the H100). At B = 8 within -1% / +2% ((8, 8,
# 151936) 26.7 -> 26.4 / 23.4 -> 23.7), at B = 16 slower ((16, 8, 32000) 17.3 -> 18.6 / 15.9 -> 17.4). Two earlier
# versions of the fold (exponent ``t (s log2 e) - m s log2 e``, written as a product and a subtract, then as one
# tl.fma; ..._s19_fold{,_b}.csv, ..._H200_s19_fold_b1.csv, ..._s19_fma.csv) measured the same pattern, but were not
# exact at T = 1e-5 (see _stats_tile); fp32 logits gained nothing consistent with them (H100: (4, 8, 128256) -6%,
# (8, 8, 151936) +3%) and are not folded.
FOLD_MAX_BATCH = 4


def _unpack(setting: bool | None, target_dtype: torch.dtype, draft_dtype: torch.dtype, vocab: int) -> bool:
    """Whether bf16 statistics tiles are converted by :func:`_bf16_to_f32` (``tune['unpack']``; never in the
    interpreter; other dtypes are unaffected either way). None (automatic): when either logit tensor is bf16 and
    ``V % 16 == 0``: every measured vocabulary was (32000, 128256, 151936); with other V the rows are not provably
    16-byte aligned, the tiles load as 16-bit scalars and the unpack would first have to repack them (more
    instructions in offline SASS; not timed)."""
    if not _fast_math("unpack", setting) or torch.bfloat16 not in (target_dtype, draft_dtype):
        return False
    return setting is True or vocab % 16 == 0


def _race_plan(element_size: int, batch: int, cfg: dict, num_warps: int | None, interpret: bool,
               vocab: int = 1 << 20) -> tuple[int, int, int]:
    """``(race_tiles, race_warps, race_programs)`` of the race kernel from the tune settings (None = automatic)."""
    one_warp = (element_size == 4 and batch >= FP32_ONE_WARP_RACE_BATCH and not interpret
                and cfg["race_tiles"] is None and cfg["race_warps"] is None and num_warps is None)
    # small fp32 vocabularies below B = 128: two tiles per one-warp program, 8 programs per SM (see FP32_SMALL_VOCAB)
    two_tiles = one_warp and _fp32_small_vocab(element_size, vocab) and batch < 128
    race_tiles = (2 if two_tiles else 1) if one_warp else int(cfg["race_tiles"] or (2 if batch <= 2 else 4))
    if race_tiles < 1 or race_tiles & (race_tiles - 1):
        raise ValueError(f"tune['race_tiles'] must be a power of two >= 1, got {race_tiles}")
    race_programs = cfg["race_programs"]
    if race_programs is None:
        race_programs = (8 if two_tiles else 16) if one_warp else 4
        low, high = BF16_FEW_RACE_BATCH
        if element_size <= 2 and low <= batch <= high and vocab <= FP32_SMALL_VOCAB:
            race_programs = 1
    if int(race_programs) < 1:
        raise ValueError(f"tune['race_programs'] must be None or >= 1 (programs per SM), got {race_programs}")
    race_warps = 1 if one_warp else (num_warps or cfg["race_warps"] or race_tiles)  # bf16: one warp per tile
    return race_tiles, int(race_warps), int(race_programs)


def rejection_sample_triton(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    temperature: float,
    greedy_mask: torch.Tensor | None = None,
    num_draft_tokens: torch.Tensor | None = None,
    compute_scores: bool = False,
    *,
    strategy: str = "auto",
    block_v: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    tune: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Fused rejection sampling from logits; same contract and results as ``rejection_sample_reference``.

    Args:
        target_logits: [B, K+1, V] fp32/bf16/fp16 verifier logits (K draft positions + bonus).
        draft_logits: [B, K, V] logits the drafts were sampled from.
        draft_tokens: [B, K] int64 draft ids, ``-1`` ends a row.
        seeds, offsets: [B] int64 keys of the counter-based random stream.
        temperature: T >= 0 (0 = greedy for every row).
        greedy_mask: optional [B] bool, rows decoded greedily although T > 0.
        num_draft_tokens: optional [B] int64 per-row draft counts (<= K).
        compute_scores: also return [B, K] fp32 ``log p(draft)`` (-inf where no draft) and
            ``alpha = sum_x min(p, q)`` (at T = 1 for greedy rows); forces the "split" strategy and one more
            read of the logits.
        strategy: "auto" (``"seq"`` for B >= SEQ_MIN_BATCH without scores, else ``"split"``), "split" or "seq".
        block_v, num_splits, num_warps: tuning overrides (vocabulary tile, maximum vocabulary chunks per row,
            warps per program); results do not depend on them.
        tune: overrides of :data:`TUNE_DEFAULT` (launch plan of "split"; results do not depend on it).

    Returns:
        tokens [B, K+1] int64, num_accepted [B] int64, draft_logprob, alpha ([B, K] fp32 or None). A row whose
        race has no finite candidate (NaN / all -inf logits) gets ``-1`` at its stop position, never an id >= V.
    """
    if strategy not in ("auto", "split", "seq"):
        raise ValueError(f"strategy must be 'auto', 'split' or 'seq', got {strategy!r}")
    if block_v is not None and (block_v < 8 or block_v & (block_v - 1)):
        raise ValueError(f"block_v must be a power of two >= 8, got {block_v}")
    batch, num_positions, vocab = target_logits.shape
    num_drafts = num_positions - 1
    device = target_logits.device
    target = target_logits.contiguous()
    draft = draft_logits.contiguous()
    tokens_in = draft_tokens.to(torch.int64).contiguous()
    seeds = seeds.to(torch.int64).contiguous()
    offsets = offsets.to(torch.int64).contiguous()
    all_greedy = temperature == 0
    inv_t = 1.0 / temperature if temperature > 0 else 1.0
    has_mask = greedy_mask is not None and not all_greedy
    mask_arg = greedy_mask.contiguous() if has_mask else seeds
    has_counts = num_draft_tokens is not None
    counts_arg = num_draft_tokens.to(torch.int64).contiguous() if has_counts else seeds
    kp2 = triton.next_power_of_2(num_drafts)
    jp2 = triton.next_power_of_2(num_drafts + 1)

    tokens = torch.empty((batch, num_positions), dtype=torch.int64, device=device)
    num_accepted = torch.empty((batch,), dtype=torch.int64, device=device)
    if vocab >= 2**24:
        raise ValueError(f"vocabulary size {vocab} >= 2**24 is not supported by the Triton rejection sampler")
    if batch == 0:
        empty = torch.empty((0, num_drafts), dtype=torch.float32, device=device)
        return tokens, num_accepted, (empty if compute_scores else None), (empty if compute_scores else None)
    sms = sm_count(device)
    if strategy == "auto":
        strategy = "seq" if (batch >= SEQ_MIN_BATCH and not compute_scores) else "split"
    flags = dict(HAS_COUNTS=has_counts, HAS_MASK=has_mask, ALL_GREEDY=all_greedy)

    if strategy == "seq":
        block = block_v or (min(1024, triton.next_power_of_2(vocab)) if _INTERPRET else 4096)
        _seq_kernel[(batch,)](
            target, draft, tokens_in, counts_arg, mask_arg, seeds, offsets, tokens, num_accepted,
            inv_t, vocab, num_drafts, KP2=kp2, JP2=jp2, BLOCK=block, MASS_EPS=RESIDUAL_MASS_EPS,
            TILES=1, RACE_TILE=RACE_TILE, TILE_BASE=TILE_INDEX_BASE, num_warps=num_warps or 8, **flags,
        )
        return tokens, num_accepted, None, None

    cfg = dict(TUNE_DEFAULT)
    if tune:
        unknown = set(tune) - set(cfg)
        if unknown:
            raise ValueError(f"unknown tune keys {sorted(unknown)}")
        cfg.update(tune)
    pairs = batch * num_positions
    # Without greedy rows the bonus position needs no statistics (its race uses the raw logits, its accept test does
    # not exist): the statistics launches cover positions 0 .. K-1 only (skip_bonus); the tiles and splits stay those
    # of all K+1 positions.
    skip_bonus = _skip_bonus(cfg["skip_bonus"], target.element_size(), vocab, num_drafts, has_mask or all_greedy,
                             batch)
    stat_positions = num_positions - 1 if skip_bonus else num_positions
    fp32_small = _fp32_small_vocab(target.element_size(), vocab)
    if block_v is not None:
        block = block_v
    elif _INTERPRET:
        block = min(1024, max(8, triton.next_power_of_2(vocab)))  # the stats tile is [BLOCK // 8, 8]
    elif cfg["stats_block"] is not None:
        block = cfg["stats_block"]
    elif fp32_small:
        block = 2048  # 8 KB tiles, prefetched (latency-bound shapes: fewer, wider loads per program)
    else:
        block = 4096 if pairs * triton.cdiv(vocab, 4096) >= 4 * sms else 1024
    prefetch = cfg["stats_prefetch"]
    live_skip = _live_skip(cfg["live_skip"], compute_scores, has_mask or all_greedy, batch, num_positions, vocab,
                           target.element_size())
    if live_skip and cfg["stats_programs"] is None:
        stats_programs = LIVE_SKIP_STATS_PROGRAMS[0 if target.element_size() == 4 else 1]
    else:
        stats_programs = _stats_programs(cfg["stats_programs"], target.element_size(), vocab, num_drafts, batch)
    auto_warps = 8 if block >= 4096 else 4
    if prefetch is None:
        auto_plan = not _INTERPRET and block_v is None and cfg["stats_block"] is None
        prefetch = auto_plan and (fp32_small or (block == 4096 and batch >= 16))
        if prefetch and not fp32_small and pairs >= stats_programs * sms:
            auto_warps = 16
    warps = num_warps or cfg["stats_warps"] or auto_warps
    race_tiles, race_warps, race_programs = _race_plan(target.element_size(), batch, cfg, num_warps, _INTERPRET,
                                                       vocab)
    max_splits = num_splits if num_splits is not None else (2 if _INTERPRET else _MAX_SPLITS)
    max_splits = min(max_splits, _MAX_SPLITS)
    chunk, splits = _split_plan(vocab, block, pairs, stats_programs * sms, max_splits)
    chunk2, splits2 = _split_plan(vocab, race_tiles * RACE_TILE, batch, race_programs * sms, max_splits)
    fuse = bool(cfg["fuse"])
    if _INTERPRET:
        pdl = 0
    elif cfg["pdl"] is None:
        pdl = 2 if (batch <= 8 and major_capability(device) >= 9) else 0  # PDL needs sm_90+
    else:
        pdl = int(cfg["pdl"])
    ftz = _fast_math("ftz", cfg["ftz"])
    fold = _fold_scale(cfg["fold_scale"], target.element_size(), batch) and ftz
    unpack = _unpack(cfg["unpack"], target.dtype, draft.dtype, vocab)
    fast_log = _fast_math("fast_log", cfg["fast_log"])
    l2_keep = _l2_keep(cfg["l2_keep"], target.element_size(), vocab, num_drafts, batch)
    keep_evict, rest_evict = ("evict_last", "evict_first") if l2_keep else ("", "")
    stats = torch.empty((pairs, splits, 4), dtype=torch.float32, device=device)
    argmax = torch.empty((pairs, splits), dtype=torch.int32, device=device)
    race = torch.empty((batch, splits2, 6), dtype=torch.float32, device=device)
    info = stats if fuse else torch.empty((batch, 4), dtype=torch.int32, device=device)
    counter = torch.empty((batch,), dtype=torch.int32, device=device) if fuse else argmax
    if compute_scores:
        draft_logprob = torch.empty((batch, num_drafts), dtype=torch.float32, device=device)
        alpha = torch.empty((batch, num_drafts), dtype=torch.float32, device=device)
        alpha_part = torch.empty((batch, num_drafts, splits2), dtype=torch.float32, device=device)
    else:
        draft_logprob = alpha = alpha_part = stats  # unused placeholders
    if live_skip:
        stages = [(0, stat_positions)]
        pair_counter = torch.zeros((pairs + batch,), dtype=torch.int32, device=device)
    else:
        stages = _stage_plan(num_positions, batch, compute_scores, cfg["stages"], vocab, target.element_size())
        stages = [(lo, min(count, stat_positions - lo)) for lo, count in stages if lo < stat_positions]
        pair_counter = counter  # unused placeholder
    for index, (pos_lo, pos_count) in enumerate(stages):
        last = index == len(stages) - 1
        grid = (splits, batch * pos_count) if live_skip else (batch * pos_count, splits)
        _stats_kernel[grid](
            target, draft, tokens_in, counts_arg, mask_arg, stats, argmax, counter, seeds, offsets, inv_t, vocab,
            num_drafts, chunk, splits, pos_lo, pos_count, COMPUTE_SCORES=compute_scores, KP2=kp2, BLOCK=block,
            ZERO_COUNTERS=fuse and index == 0, PDL_TRIGGER=pdl >= 2 and last, PREFETCH=bool(prefetch),
            STAGED=index > 0, JP2=jp2, SP2=_sp2(splits, cfg["tight_sp2"]), FTZ=ftz, num_warps=warps,
            keep_positions=l2_keep, KEEP_EVICT=keep_evict, REST_EVICT=rest_evict, pair_counter_ptr=pair_counter,
            batch=batch, LIVE_SKIP=live_skip, FOLD=fold, UNPACK=unpack, **flags,
        )
    if cfg["stats_only"]:
        return tokens, num_accepted, None, None
    launch = dict(launch_pdl=True) if pdl >= 1 else {}
    _race_kernel[(batch, splits2)](
        target, draft, tokens_in, counts_arg, mask_arg, seeds, offsets, stats, argmax, race, info, draft_logprob,
        alpha_part, counter, tokens, num_accepted, alpha, inv_t, vocab, num_drafts, splits, chunk2, splits2,
        stat_positions,
        COMPUTE_SCORES=compute_scores, KP2=kp2, JP2=jp2, SP2=_sp2(splits, cfg["tight_sp2"]), TILES=race_tiles,
        RACE_TILE=RACE_TILE, TILE_BASE=TILE_INDEX_BASE, SINGLE=chunk2 == race_tiles * RACE_TILE, FUSE=fuse,
        SP2B=_sp2(splits2, cfg["tight_sp2"]), MASS_EPS=RESIDUAL_MASS_EPS,
        PDL_WAIT=pdl >= 1, FTZ=ftz, RACE_EVICT=rest_evict, num_warps=race_warps,
        FAST_LOG=fast_log, **launch, **flags,
    )
    if not fuse:
        _finalize_kernel[(batch,)](
            target, tokens_in, seeds, offsets, race, info, tokens, num_accepted, alpha_part, alpha, inv_t, vocab,
            num_drafts, splits2, MASS_EPS=RESIDUAL_MASS_EPS, COMPUTE_SCORES=compute_scores, JP2=jp2,
            SP2=_sp2(splits2, cfg["tight_sp2"]), RACE_TILE=RACE_TILE, num_warps=4,
        )
    if not compute_scores:
        return tokens, num_accepted, None, None
    return tokens, num_accepted, draft_logprob, alpha
