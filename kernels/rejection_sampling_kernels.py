"""Triton kernels of the fused rejection sampler: the statistics kernel, the race kernel and their jit helpers.

Terms, formula and launch plan: :mod:`specdec.kernels.rejection_sampling` (the launcher) and
:mod:`specdec.kernels.rejection_sampling_plan`. Shapes used below: ``B`` rows, ``K`` draft positions (``K + 1``
target positions), ``V`` vocabulary ids, ``S`` statistics splits and ``S2`` race splits of the vocabulary per row.

* :func:`_stats_kernel` reduces one vocabulary chunk of one (row, position) to partial (max, sum-exp) of the target
  and draft logits, and the lowest arg-max of the target for greedy rows. ``stats``: [B (K+1), S, 4] fp32
  (m_t, s_t, m_d, s_d); ``argmax``: [B (K+1), S] int32 (``V`` where there is none).
* :func:`_race_kernel` combines the partials of its row, runs the accept tests, finds the stop position and runs the
  two-level race over its vocabulary chunk of the stop row; the last of a row's programs to arrive writes the row's
  outputs (:func:`_finalize_row`).

Positions a kernel never reads are never computed: programs of positions a row does not reach read nothing. All row
offsets are int64; lanes past ``V`` load as ``-inf``; draft ids are clamped to ``[0, V)`` before a gather.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .rejection_sampling_block import _block_log_weights, _block_rows, _block_stop
from .rng import exponential_from_keys_tl, stream_keys_tl, uniform_from_keys_tl
from .rng import log_tl as _log  # race scores: log masses and log noise, whose absolute error is what matters

# ---------------------------------------------------------------------------------------------------------------
# Elementwise helpers


@triton.jit
def _row_setup(draft_tokens_ptr, num_drafts_ptr, greedy_ptr, b, K, inv_t,
               HAS_COUNTS: tl.constexpr, HAS_MASK: tl.constexpr, ALL_GREEDY: tl.constexpr, KP2: tl.constexpr):
    """Row ``b``'s draft count ``n_b`` (its count capped at the first -1), greedy flag (int32) and logit scale (fp32:
    ``1 / T``, or 1 for a greedy row)."""
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
def _exp2_ftz(x):
    """``2**x`` as one ``ex2.approx.ftz.f32`` (results below 2**-126 flush to 0)."""
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _bf16_to_f32(x):
    """bf16 -> fp32, exact, two ids a 32-bit register: the low id shifted up, the high id masked in place."""
    return tl.inline_asm_elementwise("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }", "=r,=r,r", [x],
                                     dtype=tl.float32, is_pure=True, pack=2)


@triton.jit
def _to_f32(x, UNPACK: tl.constexpr):
    """``x`` as fp32; with UNPACK a bf16 ``x`` goes through :func:`_bf16_to_f32` (other dtypes never do, so target
    and draft logits of different dtypes each take their own conversion)."""
    if UNPACK and x.dtype == tl.bfloat16:
        return _bf16_to_f32(x)
    else:
        return x.to(tl.float32)


@triton.jit
def _exp(x, FTZ: tl.constexpr):
    """``exp(x)`` in fp32; FTZ: one ``ex2.approx.ftz`` instead of ``tl.exp``'s subnormal fix-up."""
    if FTZ:
        return _exp2_ftz(x * 1.4426950408889634)
    else:
        return tl.exp(x)


@triton.jit
def _combine_lse(m, s, axis: tl.constexpr):
    """Combine partial (max, sum-exp) along ``axis``: (log-sum-exp, -inf for an empty row; max; sum-exp)."""
    mm = tl.max(m, axis=axis)
    safe = tl.where(mm == float("-inf"), 0.0, mm)
    if axis == 1:
        tot = tl.sum(s * tl.exp(m - safe[:, None]), axis=1)
    else:
        tot = tl.sum(s * tl.exp(m - safe[None, :]), axis=0)
    return mm + tl.log(tot), mm, tot


# ---------------------------------------------------------------------------------------------------------------
# The two-level exponential race


@triton.jit
def _residual_mass_terms(t, d, p, delta, FTZ: tl.constexpr):
    """``max(0, p - q)`` per element as ``p (1 - q/p)`` with ``q/p = exp(z)``, ``z = (d - t) - delta``.

    ``delta = L_d - L_t`` comes as ``(m_d - m_t) + log(S_d / S_t)``: no rounded log-sum-exp enters, so where
    ``q == p`` up to rounding the mass stays ~1e-7 or less (see ``RESIDUAL_MASS_EPS``). ``1 - exp(z)`` is a cubic
    series for ``|z| < 1e-2`` (cancellation). ``z`` NaN (both logits -inf) or ``>= 0`` contributes 0.
    """
    z = (d - t) - delta
    series = -z * (1.0 + z * (0.5 + z * (1.0 / 6.0)))
    one_minus = tl.where(tl.abs(z) < 1e-2, series, 1.0 - _exp(z, FTZ))
    return tl.where(z < 0.0, p * one_minus, 0.0)


@triton.jit
def _tile_race_update(t, d, lt, delta, tile, rk_a, rk_b, best_r, tile_r, best_p, tile_p, mass,
                      TILE_BASE: tl.constexpr, FTZ: tl.constexpr, FAST_LOG: tl.constexpr):
    """Level 1 of the race for ``TILES`` tiles at once (``t``, ``d``: [TILES, RACE_TILE] scaled logits, ``tile``:
    [TILES] tile indices).

    Tile masses of the residual ``W_r = sum max(0, p - q)`` and of p, ``log W_p = log sum exp(t)`` up to the row's
    normaliser (from the tile's own maximum: the bonus position has no normaliser), scores
    ``log W - log E(TILE_BASE + tile)``: one random number per tile. Lane-wise winners by a strict ``>`` (a
    lane sees its tiles in increasing order: the lowest tile wins ties; NaN never wins). ``mass`` accumulates ``W_r``
    per lane; ``lt = -inf`` (no rejection at this row) leaves the residual at 0."""
    m_c = tl.max(t, axis=1)
    safe = tl.where(m_c == float("-inf"), 0.0, m_c)
    e = _exp(t - safe[:, None], FTZ)
    s_e = tl.sum(e, axis=1)
    p = e * tl.where(lt > float("-inf"), tl.exp(safe - lt), 0.0)[:, None]
    w_r = tl.sum(_residual_mass_terms(t, d, p, delta, FTZ), axis=1)
    noise = _log(exponential_from_keys_tl(rk_a, rk_b, tile.to(tl.uint32) | TILE_BASE, FAST_LOG), FAST_LOG)
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
    ``sel``: a race on ``log max(0, p - q)`` (``residual``) or on the scaled target logits (``p`` up to its
    normaliser). Returns the lowest id of the best score, or ``V`` when no selected id has a finite score."""
    noise = _log(exponential_from_keys_tl(rk_a, rk_b, offs, FAST_LOG), FAST_LOG)
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
# Accept tests on combined statistics


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
    """Combine the statistics partials of the positions ``pair`` ([JP2] int64 (row, position) indices; only
    ``rows`` are read): log-sum-exp, max and sum-exp of target and draft, and the greedy arg-max (that of the first
    split holding the row maximum; ``V`` where there is none). CACHE: the loads' cache modifier (``".cg"`` reads L2,
    for partials other programs of the same launch are still writing)."""
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
def _certainly_rejected(target_ptr, draft_ptr, draft_tokens_ptr, seeds_ptr, offsets_ptr, stats_ptr, argmax_ptr,
                        b, g, scale, V, K, S, real, JP2: tl.constexpr, SP2: tl.constexpr, CACHE: tl.constexpr):
    """True when one of the positions ``real`` ([JP2] bool; their statistics complete) of row ``b`` is rejected
    beyond rounding doubt.

    Only the race kernel decides; this only lets the statistics skip work, so it must never claim a rejection that
    the race kernel's own combine of the same statistics (another summation order) could see as an accept. A
    sampled rejection counts with a margin (``log u + log q > log p + margin``) or when ``q(x) = 0`` or
    ``p(x) = 0``; a greedy mismatch ``x != argmax`` is exact."""
    js = tl.arange(0, JP2)
    x, t_x, d_x = _draft_logits(target_ptr, draft_ptr, draft_tokens_ptr, b, js, real, V, K, scale)
    key_a, key_b = stream_keys_tl(tl.load(seeds_ptr + b), tl.load(offsets_ptr + b) + js)
    u = uniform_from_keys_tl(key_a, key_b, tl.full([JP2], 0xFFFFFFFF, tl.uint32))
    lt, _mt, _st, ld, _md, _sd, am = _position_stats(stats_ptr, argmax_ptr, b.to(tl.int64) * (K + 1) + js, real,
                                                     V, S, SP2, CACHE)
    lp = t_x - lt
    lq = d_x - ld
    margin = 1e-3 + 1e-5 * (tl.abs(t_x) + tl.abs(lt) + tl.abs(d_x) + tl.abs(ld))
    # NOTE: NaN compares false, so a NaN logit is never a certain rejection
    rej_s = (d_x == float("-inf")) | (t_x == float("-inf")) | (tl.log(u) + lq > lp + margin)
    rej_g = x != am
    certain = real & tl.where(g != 0, rej_g, rej_s)
    return tl.sum(certain.to(tl.int32), axis=0) > 0


@triton.jit
def _rejected_before(target_ptr, draft_ptr, draft_tokens_ptr, seeds_ptr, offsets_ptr, stats_ptr, argmax_ptr,
                     b, n_b, g, scale, V, K, S, pos_lo, JP2: tl.constexpr, SP2: tl.constexpr):
    """True when row ``b`` certainly stops before position ``pos_lo`` (its positions from ``pos_lo`` on need no
    statistics): a certain rejection among the positions before it (:func:`_certainly_rejected`; their statistics
    are complete), or a row that ends before it (``pos_lo > n_b``)."""
    js = tl.arange(0, JP2)
    stopped = _certainly_rejected(target_ptr, draft_ptr, draft_tokens_ptr, seeds_ptr, offsets_ptr, stats_ptr,
                                  argmax_ptr, b, g, scale, V, K, S, (js < pos_lo) & (js < n_b), JP2, SP2, "")
    return stopped | (pos_lo > n_b)


# ---------------------------------------------------------------------------------------------------------------
# Statistics kernel


@triton.jit
def _stats_loads(t_base, d_base, t_nx, d_nx, offs, lim, V, v_d, scale, BLOCK: tl.constexpr, PREFETCH: tl.constexpr,
                 EVICT: tl.constexpr, FOLD: tl.constexpr, UNPACK: tl.constexpr):
    """The tile at ``offs`` as scaled fp32 (target, draft; FOLD: unscaled, the caller folds the scale into its
    exponent). PREFETCH: ``t_nx`` / ``d_nx`` hold this tile (loaded by the previous call) and the next tile's loads
    are issued here; ids from ``lim`` on load as ``-inf``, so ``lim = 0`` loads nothing. Returns (t, d, t_nx, d_nx)."""
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
    """One [R, 8] tile: lane-wise online (max, sum exp) of target and draft and, for greedy rows, the running arg-max
    (lowest id of the largest target logit).

    FOLD: ``t``, ``d`` and the running maxima are unscaled (:func:`_stats_loop` scales the maxima once at the end)
    and each exponent is ``(t - m) (s log2 e)``: the scale's multiply goes into the exponential's own. ``t - m`` is
    exactly 0 at a lane's maximum, so that maximum contributes exactly 1, which keeps low temperatures exact (a
    fused ``t (s log2 e) - m s log2 e`` is off by up to ``|s t| 2**-24`` there). Greedy rows have ``s = 1``."""
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
    """Lane-wise online log-sum-exp over ``[lo, hi)`` on ``[BLOCK // 8, 8]`` tiles (the axis-1 reductions stay inside
    a thread or a warp: no block-wide barrier per tile) and, for greedy rows, the arg-max. EVICT: the loads' L2
    eviction policy.

    LIVE (live skip): stop once the row's rejection word ``reject_ptr`` says a position before ``j`` is certainly
    rejected (``K + 1 - word < j``; the word only grows). Each tile issues the word's load and the next tile reads
    it, so the check waits on no round trip. A stopped program's partials cover the tiles it read; only positions
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
def _first_tile(t_base, d_base, lo, rows2, V, EVICT: tl.constexpr):
    """The chunk's first target and draft tiles, loaded before the row's draft ids are known (always in bounds of the
    row; never used when the position needs no statistics)."""
    t_nx = tl.load(t_base + lo + rows2, mask=lo + rows2 < V, other=float("-inf"), eviction_policy=EVICT)
    d_nx = tl.load(d_base + lo + rows2, mask=lo + rows2 < V, other=float("-inf"), eviction_policy=EVICT)
    return t_nx, d_nx


@triton.jit
def _stats_kernel(target_ptr, draft_ptr, draft_tokens_ptr, num_drafts_ptr, greedy_ptr, stats_ptr, argmax_ptr,
                  counter_ptr, seeds_ptr, offsets_ptr, inv_t, V, K, chunk, S, pos_lo, pos_count, keep_positions,
                  pair_counter_ptr, batch,
                  HAS_COUNTS: tl.constexpr, HAS_MASK: tl.constexpr, ALL_GREEDY: tl.constexpr,
                  COMPUTE_SCORES: tl.constexpr, KP2: tl.constexpr, JP2: tl.constexpr, SP2: tl.constexpr,
                  BLOCK: tl.constexpr, ZERO_COUNTERS: tl.constexpr, PDL_TRIGGER: tl.constexpr,
                  PREFETCH: tl.constexpr, STAGED: tl.constexpr, LIVE_SKIP: tl.constexpr, FTZ: tl.constexpr,
                  FOLD: tl.constexpr, UNPACK: tl.constexpr, KEEP_EVICT: tl.constexpr, REST_EVICT: tl.constexpr):
    """Partial (max, sum exp) of target and draft over one vocabulary chunk of one (row, position).

    Grid ``(B * pos_count, S)`` over positions ``pos_lo .. pos_lo + pos_count - 1`` of every row (LIVE_SKIP:
    ``(S, B * pos_count)``, position-major). STAGED (a later launch of staged statistics): a row that certainly
    stopped before ``pos_lo`` (:func:`_rejected_before`) reads nothing. ZERO_COUNTERS: program (b, 0, 0) zeroes
    ``counter[b]``, the race kernel's arrival counter of row b. PDL_TRIGGER: let the race kernel, launched with
    programmatic dependent launch, start its prologue now (it waits before reading anything written here).
    ``keep_positions``: positions < it load with ``KEEP_EVICT``, the others with ``REST_EVICT``.

    LIVE_SKIP: ``pair_counter`` ([B (K+1) + B] int32, zeroed) holds an arrival count per (row, position) and a
    rejection word per row. The last program of a position to store its partials tests it
    (:func:`_certainly_rejected`) and on a certain rejection at j raises the row's word to ``K + 1 - j``; programs of
    later positions watch the word while they read (:func:`_stats_loop`) and stop. Which programs stop depends on
    timing, never what the race kernel computes. Never with greedy rows: their arg-max puts block-wide barriers in
    the loop, and the warps of a program may stop at different tiles.
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
    v_d = tl.where(need_d, V, 0)  # NOTE: a scalar-bool & vector-bool mask trips Triton's interpreter
    R: tl.constexpr = BLOCK // 8
    rows2 = tl.arange(0, R)[:, None] * 8 + tl.arange(0, 8)[None, :]
    # eviction policies are constexpr: the branch on `keep` is taken once per program, outside the loop
    keep = j < keep_positions
    t_nx = 0.0
    d_nx = 0.0
    if PREFETCH:
        t_nx = tl.zeros([R, 8], t_base.dtype.element_ty)  # (typed for the branches below)
        d_nx = tl.zeros([R, 8], d_base.dtype.element_ty)
        if KEEP_EVICT == REST_EVICT:
            t_nx, d_nx = _first_tile(t_base, d_base, lo, rows2, V, KEEP_EVICT)
        elif keep:
            t_nx, d_nx = _first_tile(t_base, d_base, lo, rows2, V, KEEP_EVICT)
        else:
            t_nx, d_nx = _first_tile(t_base, d_base, lo, rows2, V, REST_EVICT)
    if STAGED:  # after the first tile's loads are issued: their latency overlaps the check's
        if lo < hi:
            stopped = _rejected_before(target_ptr, draft_ptr, draft_tokens_ptr, seeds_ptr, offsets_ptr, stats_ptr,
                                       argmax_ptr, b, n_b, g, scale, V, K, S, pos_lo, JP2, SP2)
            hi = tl.where(stopped, lo, hi)
            v_d = tl.where(stopped, 0, v_d)
    reject_ptr = pair_counter_ptr + batch * (K + 1) + b  # (LIVE_SKIP) the row's rejection word
    if KEEP_EVICT == REST_EVICT:
        m_t, s_t, m_d, s_d, am_i = _stats_loop(t_base, d_base, t_nx, d_nx, lo, hi, V, v_d, scale, g, rows2, reject_ptr,
                                               j, K, BLOCK, PREFETCH, FTZ, KEEP_EVICT, LIVE_SKIP, FOLD, UNPACK)
    elif keep:
        m_t, s_t, m_d, s_d, am_i = _stats_loop(t_base, d_base, t_nx, d_nx, lo, hi, V, v_d, scale, g, rows2, reject_ptr,
                                               j, K, BLOCK, PREFETCH, FTZ, KEEP_EVICT, LIVE_SKIP, FOLD, UNPACK)
    else:
        m_t, s_t, m_d, s_d, am_i = _stats_loop(t_base, d_base, t_nx, d_nx, lo, hi, V, v_d, scale, g, rows2, reject_ptr,
                                               j, K, BLOCK, PREFETCH, FTZ, REST_EVICT, LIVE_SKIP, FOLD, UNPACK)
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
        tl.debug_barrier()  # every thread's stores above happen before the release below
        arrived = tl.atomic_add(pair_counter_ptr + pair, 1, sem="acq_rel")
        if (arrived == S - 1) & (j < n_b):
            js = tl.arange(0, JP2)
            stopped = _certainly_rejected(target_ptr, draft_ptr, draft_tokens_ptr, seeds_ptr, offsets_ptr,
                                          stats_ptr, argmax_ptr, b, g, scale, V, K, S, js == j, JP2, SP2, ".cg")
            if stopped:
                tl.atomic_max(reject_ptr, K + 1 - j, sem="relaxed")


# ---------------------------------------------------------------------------------------------------------------
# Race kernel


@triton.jit
def _race_row(target_ptr, draft_ptr, race_ptr, b, j, slot, lo, hi, rejected, lt_r, delta_r, scale, rk_a, rk_b,
              V, K, split, S2, R, TILES: tl.constexpr, RACE_TILE: tl.constexpr, TILE_BASE: tl.constexpr,
              SINGLE: tl.constexpr, FTZ: tl.constexpr, FAST_LOG: tl.constexpr, RACE_EVICT: tl.constexpr):
    """Level 1 of both races (residual and p) over ids ``[lo, hi)`` of position ``j`` of row ``b``, then level 2 on
    this program's best tile of the race the row most likely uses (the residual when ``rejected``, else p; the
    finalize redoes it only in the rare residual-mass fallback). ``lt_r``, ``delta_r``: the row's ``L_t - log P`` and
    ``L_d - L_t + log P`` (``P = 1`` token-wise). Stores at ``race[b, split, slot]`` ([B, S2, R, 6]) the best
    residual tile score, its tile, the best p tile score, its tile, the residual mass over the chunk and the level-2
    id (``V`` or the tile count ``NT`` where there is none)."""
    t_base = target_ptr + (b.to(tl.int64) * (K + 1) + j) * V
    d_base = draft_ptr + (b.to(tl.int64) * K + tl.minimum(j, K - 1)) * V
    v_d = tl.where(rejected, V, 0)
    NT = (V + RACE_TILE - 1) // RACE_TILE  # number of tiles; "no tile" is NT
    tiles = tl.arange(0, TILES)
    cols = tl.arange(0, RACE_TILE)
    mass = tl.zeros([TILES], tl.float32)
    best_r = tl.full([TILES], float("-inf"), tl.float32)
    tile_r = tl.zeros([TILES], tl.int32) + NT
    best_p = tl.full([TILES], float("-inf"), tl.float32)
    tile_p = tl.zeros([TILES], tl.int32) + NT
    if SINGLE:
        tile = lo // RACE_TILE + tiles
        offs = tile[:, None] * RACE_TILE + cols[None, :]
        lim = tl.where(lo < hi, V, 0)
        t = tl.load(t_base + offs, mask=offs < lim, other=float("-inf"),
                    eviction_policy=RACE_EVICT).to(tl.float32) * scale
        d = tl.load(d_base + offs, mask=offs < tl.minimum(lim, v_d), other=float("-inf"),
                    eviction_policy=RACE_EVICT).to(tl.float32) * scale
        best_r, tile_r, best_p, tile_p, mass = _tile_race_update(
            t, d, lt_r, delta_r, tile, rk_a, rk_b, best_r, tile_r, best_p, tile_p, mass, TILE_BASE, FTZ, FAST_LOG)
        best_r, win_r = _lanes_winner(best_r, tile_r, NT)
        best_p, win_p = _lanes_winner(best_p, tile_p, NT)
        in_win = tile[:, None] == tl.where(rejected, win_r, win_p)
        local_id = _block_race(t, d, offs, in_win, rejected, lt_r, delta_r, rk_a, rk_b, V, FTZ, FAST_LOG)
    else:  # blocks in a loop, the next block's loads issued before this block's arithmetic
        lim = tl.where(lo < hi, V, 0)
        offs = (lo // RACE_TILE + tiles)[:, None] * RACE_TILE + cols[None, :]
        t_nx = tl.load(t_base + offs, mask=offs < lim, other=float("-inf"), eviction_policy=RACE_EVICT)
        d_nx = tl.load(d_base + offs, mask=offs < tl.minimum(lim, v_d), other=float("-inf"),
                       eviction_policy=RACE_EVICT)
        for start in range(lo, hi, TILES * RACE_TILE):
            tile = start // RACE_TILE + tiles
            t = t_nx.to(tl.float32) * scale
            d = d_nx.to(tl.float32) * scale
            lim = tl.where(start + TILES * RACE_TILE < hi, V, 0)
            nx = tile[:, None] * RACE_TILE + cols[None, :] + TILES * RACE_TILE
            t_nx = tl.load(t_base + nx, mask=nx < lim, other=float("-inf"), eviction_policy=RACE_EVICT)
            d_nx = tl.load(d_base + nx, mask=nx < tl.minimum(lim, v_d), other=float("-inf"),
                           eviction_policy=RACE_EVICT)
            best_r, tile_r, best_p, tile_p, mass = _tile_race_update(
                t, d, lt_r, delta_r, tile, rk_a, rk_b, best_r, tile_r, best_p, tile_p, mass, TILE_BASE, FTZ,
                FAST_LOG)
        best_r, win_r = _lanes_winner(best_r, tile_r, NT)
        best_p, win_p = _lanes_winner(best_p, tile_p, NT)
        local_id = _in_tile_race(t_base, d_base, tl.where(rejected, win_r, win_p), rejected, lt_r, delta_r,
                                 scale, rk_a, rk_b, V, v_d, RACE_TILE, FTZ, FAST_LOG)
    out = ((b.to(tl.int64) * S2 + split) * R + slot) * 6
    tl.store(race_ptr + out, best_r)
    tl.store(race_ptr + out + 1, win_r.to(tl.float32))
    tl.store(race_ptr + out + 2, best_p)
    tl.store(race_ptr + out + 3, win_p.to(tl.float32))
    tl.store(race_ptr + out + 4, tl.sum(mass, axis=0))
    tl.store(race_ptr + out + 5, local_id.to(tl.float32))


@triton.jit
def _race_kernel(target_ptr, draft_ptr, draft_tokens_ptr, num_drafts_ptr, greedy_ptr, seeds_ptr, offsets_ptr,
                 stats_ptr, argmax_ptr, race_ptr, logprob_ptr, alpha_part_ptr, counter_ptr, tokens_ptr,
                 num_accepted_ptr, alpha_ptr, inv_t, V, K, S, chunk, S2, n_stat,
                 HAS_COUNTS: tl.constexpr, HAS_MASK: tl.constexpr, ALL_GREEDY: tl.constexpr,
                 COMPUTE_SCORES: tl.constexpr, KP2: tl.constexpr, JP2: tl.constexpr, SP2: tl.constexpr,
                 SP2B: tl.constexpr, TILES: tl.constexpr, RACE_TILE: tl.constexpr, TILE_BASE: tl.constexpr,
                 SINGLE: tl.constexpr, MASS_EPS: tl.constexpr, PDL_WAIT: tl.constexpr, FTZ: tl.constexpr,
                 FAST_LOG: tl.constexpr, RACE_EVICT: tl.constexpr, BLOCK_VERIFY: tl.constexpr,
                 CERTAIN_EPS: tl.constexpr):
    """Accept tests (vectorised over positions), stop position, race over one chunk of the stop row. Grid (B, S2).

    race: [B, S2, R, 6] fp32 per program and raced row (best residual tile score, its tile, best p tile score, its
    tile, partial residual mass over the chunk, level-2 winner inside this program's best tile; tiles and ids are
    exact in fp32 for V < 2**24): ``R = 1`` token-wise, ``K + 1`` (slot = position) with BLOCK_VERIFY;
    logprob, alpha: [B, K] fp32 and alpha_part [B, K, S2] with COMPUTE_SCORES.
    The chunk is a whole number of ``TILES * RACE_TILE`` ids: level 1 runs over every tile of it, level 2 over this
    program's best tile only (SINGLE: the chunk is one block, still in registers). The last program of a row to
    arrive (``counter[b]``, zeroed by the statistics kernel) writes the row's outputs (:func:`_finalize_row`).
    PDL_WAIT: launched with programmatic dependent launch; everything that does not read the statistics (row setup,
    random keys, draft logits) runs before ``gdc_wait``. Positions ``>= n_stat`` have no statistics (the bonus
    position of a batch without greedy rows).
    BLOCK_VERIFY (sampled rows): each program races its chunk of every row the stop can need (from the statistics
    in registers, :mod:`~specdec.kernels.rejection_sampling_block`); the finalize sums their masses, picks the stop.
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

    lt, mt, st, ld, md, sd, am = _position_stats(stats_ptr, argmax_ptr, pair, js < n_stat, V, S, SP2, "")

    lp = t_x - lt
    lq = d_x - ld
    # NOTE: lt > -inf: a position without statistics stops the row instead of accepting its draft unverified
    acc_s = (lq > float("-inf")) & (lt > float("-inf")) & (tl.log(u) + lq <= lp)
    acc_g = x == am
    acc = real & tl.where(g != 0, acc_g, acc_s)
    stop = tl.min(tl.where(jmask & (js <= n_b) & (~acc), js, JP2), axis=0)
    at_stop = js == stop
    delta = (md - mt) + tl.log(sd / st)  # L_d - L_t per position, accurately
    am_stop = tl.sum(tl.where(at_stop, am, 0), axis=0)
    if COMPUTE_SCORES:
        if split == 0:
            tl.store(logprob_ptr + b.to(tl.int64) * K + js, tl.where(real, lp, float("-inf")), mask=draft_mask)

    # exponential race over this program's chunk of the rows the row can stop at (sampled rows only)
    lo = split * chunk
    hi = tl.where(g == 0, tl.minimum(lo + chunk, V), lo)
    if BLOCK_VERIFY:
        R = K + 1
        log_w, eta = _block_log_weights(lp, lq, lt, t_x, d_x, delta, real, u, js, JP2)
        need = tl.where(g != 0, at_stop, _block_rows(log_w, eta, n_b, js, CERTAIN_EPS))
        for j in range(0, K + 1):
            sel = js == j
            if tl.sum(tl.where(sel & need, 1, 0), axis=0) > 0:
                a_j = tl.sum(tl.where(sel, log_w, 0.0), axis=0)
                _race_row(target_ptr, draft_ptr, race_ptr, b, j, j, lo, hi, j < n_b,
                          tl.sum(tl.where(sel, lt, 0.0), axis=0) - a_j, tl.sum(tl.where(sel, delta, 0.0), axis=0) + a_j,
                          scale, tl.sum(tl.where(sel, key_a, 0), axis=0), tl.sum(tl.where(sel, key_b, 0), axis=0),
                          V, K, split, S2, R, TILES, RACE_TILE, TILE_BASE, SINGLE, FTZ, FAST_LOG, RACE_EVICT)
    else:
        R = 1
        _race_row(target_ptr, draft_ptr, race_ptr, b, stop, 0, lo, hi, stop < n_b,
                  tl.sum(tl.where(at_stop, lt, 0.0), axis=0), tl.sum(tl.where(at_stop, delta, 0.0), axis=0),
                  scale, tl.sum(tl.where(at_stop, key_a, 0), axis=0), tl.sum(tl.where(at_stop, key_b, 0), axis=0),
                  V, K, split, S2, R, TILES, RACE_TILE, TILE_BASE, SINGLE, FTZ, FAST_LOG, RACE_EVICT)
    greedy_next = tl.where(am_stop < V, am_stop, -1)

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

    # the last program to arrive finalises: this program's stores happen before its arrival (barrier + release),
    # and the program that sees S2 - 1 earlier arrivals (acquire) reads every partial of the row from L2
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr + b, 1, sem="acq_rel")
    if arrived == S2 - 1:
        slot = stop * 0
        if BLOCK_VERIFY:
            if g == 0:
                stop = _block_stop(race_ptr, b, K, S2, log_w, eta, need, n_b, js, MASS_EPS, CERTAIN_EPS, SP2B)
            slot = stop
        _finalize_row(target_ptr, draft_tokens_ptr, race_ptr, tokens_ptr, num_accepted_ptr, alpha_part_ptr,
                      alpha_ptr, scale, seed, off, b, stop, slot, greedy_next, g, stop < n_b, V, K, S2, R, MASS_EPS,
                      COMPUTE_SCORES, JP2, SP2B, RACE_TILE)


@triton.jit
def _finalize_row(target_ptr, draft_tokens_ptr, race_ptr, tokens_ptr, num_accepted_ptr, alpha_part_ptr, alpha_ptr,
                  scale, seed, off, b, stop, slot, greedy_next, g, rejected, V, K, S2, R,
                  MASS_EPS: tl.constexpr, COMPUTE_SCORES: tl.constexpr, JP2: tl.constexpr, SP2: tl.constexpr,
                  RACE_TILE: tl.constexpr):
    """Combine the level-1 winners of row ``b``'s race programs at ``race[b, :, slot]`` (ties to the lowest tile)
    and their residual masses, take the level-2 id of the program holding the winning tile, and write tokens,
    num_accepted (``stop``) and alpha.

    The residual race counts only after a rejection whose mass exceeds ``MASS_EPS``; in the fallback (rejected,
    mass <= MASS_EPS) the programs ran level 2 on the residual, so the p race's level 2 runs here."""
    ss = tl.arange(0, SP2)
    smask = ss < S2
    nt = (V + RACE_TILE - 1) // RACE_TILE
    base = ((b.to(tl.int64) * S2 + ss) * R + slot) * 6
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
        rk_a, rk_b = stream_keys_tl(seed, off + stop)
        t_base = target_ptr + (b.to(tl.int64) * (K + 1) + stop) * V
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
