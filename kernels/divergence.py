"""Fused Triton kernel: drafter-verifier divergences per token, per-task sums, and the cross-entropy gradient.

One program handles one row (token) at a time (a grid-stride loop over rows), never writing a [N, V] intermediate:

* Pass 1 streams both logit rows over vocabulary tiles of ``BLOCK`` columns with an online log-sum-exp in base 2
  (``x = v log2(e) / T``, ``y = d log2(e) / T``): running maxima ``mx, my``, normalisers
  ``sx = sum 2^(x - mx)``, ``sy = sum 2^(y - my)``, and two weighted sums rescaled with ``sx``:
  ``r = sum w (x - mx)`` and ``e = sum w (x - y)`` with ``w = 2^(x - mx)``. Then, in nats,
  ``H(p) = ln2 (log2 sx - r / sx)``, ``KL = ln2 (e / sx - (mx + log2 sx) + (my + log2 sy))`` (clamped at 0) and
  ``H(p, q) = H(p) + KL``. Entries with ``x = -inf`` contribute nothing; an entry with ``x > -inf`` and ``y = -inf``
  makes H(p, q) and KL ``+inf``. The loss path (``pass1=2``, the default) needs only the cross-entropy and
  accumulates ``t = sum w (y - my)`` instead: ``H(p, q) = ln2 (log2 sy - t / sx)``. With ``pass1=2`` such
  ``y = -inf`` entries are not counted apart: they make ``e`` +inf (or ``t`` -inf), and a sum turned NaN by an
  underflowed weight times an infinite difference is read as +inf.
* Pass 2 (only for TV / alpha, or for the gradient) re-reads the row in *reverse* tile order, so that the tiles
  read last by pass 1 are still in L2, with the normalisers known: ``p = 2^(x - Lp)``, ``q = 2^(y - Lq)``,
  accumulating ``sum |p - q|`` and ``sum min(p, q)``, or writing ``grad = w_n s (q - p)`` in the drafter's dtype
  (``s = 1 / T`` times the reduction factor), computed in float32 from float32 ``p`` and ``q``.

Per-task sums are accumulated with float64 atomics (sums, in any order: not bitwise deterministic) and int64
counts. A per-row status word flags bad input: bit 0 the verifier row, bit 1 the drafter row (NaN, +inf, or all
``-inf``, detected as a normaliser that is not a positive number).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ._device import device_name, launching_on, major_capability, sm_count
from .divergence_cluster import cluster_eligible, launch_cluster_forward, launch_cluster_loss

LOG2E = 1.4426950408889634


@triton.jit
def _max_pair(a0, a1, b0, b1):
    return tl.maximum(a0, b0), tl.maximum(a1, b1)


@triton.jit
def _sum_three(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _sum_four(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _tile_sums_v1(x, y, mx, my, sx, sy, r, e, n_bad):
    """Version 1's pass-1 update for one tile of scaled logits ``x``, ``y`` ([BLOCK] float32, base 2): running
    maxima, normalisers ``sx``, ``sy``, ``r = sum w (x - mx)``, ``e = sum w (x - y)`` (entries with ``x = -inf``
    or ``y = -inf`` left out) and ``n_bad`` = entries with ``p > 0`` where ``q = 0``, each reduced separately."""
    NEG_INF: tl.constexpr = float("-inf")
    mx_new = tl.maximum(mx, tl.max(x, 0))
    my_new = tl.maximum(my, tl.max(y, 0))
    mx_ref = tl.where(mx_new == NEG_INF, 0.0, mx_new)
    my_ref = tl.where(my_new == NEG_INF, 0.0, my_new)
    cx = tl.exp2(mx - mx_ref)
    cy = tl.exp2(my - my_ref)
    shift_x = tl.where(mx == NEG_INF, 0.0, mx - mx_ref)
    dx = x - mx_ref
    wx = tl.exp2(dx)
    wy = tl.exp2(y - my_ref)
    fx = x > NEG_INF
    fy = y > NEG_INF
    r = cx * (r + shift_x * sx) + tl.sum(tl.where(fx, wx * dx, 0.0), 0)
    e = cx * e + tl.sum(tl.where(fx & fy, wx * (x - y), 0.0), 0)
    n_bad += tl.sum((fx & (y == NEG_INF)).to(tl.int32), 0)
    sx = cx * sx + tl.sum(wx, 0)
    sy = cy * sy + tl.sum(wy, 0)
    return mx_new, my_new, sx, sy, r, e, n_bad


@triton.jit
def _divergence_kernel(
    v_ptr, d_ptr, stride_v, stride_d,
    mask_ptr, task_ptr, weight_ptr,
    ce_ptr, kl_ptr, tv_ptr, alpha_ptr, status_ptr,
    grad_ptr, stride_g,
    task_ce_ptr, task_kl_ptr, task_tv_ptr, task_alpha_ptr, task_count_ptr,
    n_rows, vocab, num_programs, scale2, grad_scale, count_ptr,
    HAS_MASK: tl.constexpr, HAS_TASKS: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
    COMPUTE_TV: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr, EVICT_LAST: tl.constexpr,
    PASS1: tl.constexpr = 0, STAGES1: tl.constexpr = 1, STAGES2: tl.constexpr = 1,
    HAS_COUNT: tl.constexpr = False,
):
    LN2: tl.constexpr = 0.6931471805599453
    NEG_INF: tl.constexpr = float("-inf")
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    n_tiles = tl.cdiv(vocab, BLOCK)
    for row in range(pid, n_rows, num_programs):
        row64 = tl.cast(row, tl.int64)
        v_row = v_ptr + row64 * stride_v
        d_row = d_ptr + row64 * stride_d
        keep = True
        if HAS_MASK:
            keep = tl.load(mask_ptr + row64) != 0
        if keep:
            # ---- pass 1: online log-sum-exp of both rows, entropy and KL pieces ----
            if PASS1 == 2:
                # Version 1's tile sums, each tile's maxima and sums in one multi-operand reduction apiece (fewer
                # shared-memory round trips and barriers); the loss path accumulates only what H(p, q) needs.
                mx = NEG_INF
                my = NEG_INF
                sx = 0.0
                sy = 0.0
                r = 0.0  # CE only: sum w (y - my); else sum w (x - mx)
                e = 0.0
                for start in tl.range(0, vocab, BLOCK, num_stages=STAGES1):
                    cols = start + offs
                    inb = cols < vocab
                    x = tl.load(v_row + cols, mask=inb, other=NEG_INF).to(tl.float32) * scale2
                    y = tl.load(d_row + cols, mask=inb, other=NEG_INF).to(tl.float32) * scale2
                    tile_mx, tile_my = tl.reduce((x, y), 0, _max_pair)
                    mx_new = tl.maximum(mx, tile_mx)
                    my_new = tl.maximum(my, tile_my)
                    mx_ref = tl.where(mx_new == NEG_INF, 0.0, mx_new)
                    my_ref = tl.where(my_new == NEG_INF, 0.0, my_new)
                    cx = tl.exp2(mx - mx_ref)
                    cy = tl.exp2(my - my_ref)
                    dx = x - mx_ref
                    dy = y - my_ref
                    wx = tl.exp2(dx)
                    wy = tl.exp2(dy)
                    fx = x > NEG_INF
                    # p > 0 where q = 0 (x finite, y = -inf) is not counted separately: it makes the KL sum +inf
                    # (x - y = +inf), or the cross-entropy sum -inf (y - my = -inf), or NaN where its weight
                    # underflowed to 0 (mapped to +inf after the loop)
                    if COMPUTE_TV:
                        shift = tl.where(mx == NEG_INF, 0.0, mx - mx_ref)
                        t_wx, t_wy, t_a, t_e = tl.reduce(
                            (wx, wy, tl.where(fx, wx * dx, 0.0), tl.where(fx, wx * (x - y), 0.0)), 0, _sum_four)
                        e = cx * e + t_e
                    else:
                        shift = tl.where(my == NEG_INF, 0.0, my - my_ref)
                        t_wx, t_wy, t_a = tl.reduce((wx, wy, tl.where(fx, wx * dy, 0.0)), 0, _sum_three)
                    r = cx * (r + shift * sx) + t_a
                    sx = cx * sx + t_wx
                    sy = cy * sy + t_wy
                    mx = mx_new
                    my = my_new
                support_sum = e if COMPUTE_TV else r
                n_bad = tl.where((support_sum != support_sum) & (sx == sx) & (sy == sy), 1, 0)
            else:
                mx = NEG_INF
                my = NEG_INF
                sx = 0.0
                sy = 0.0
                r = 0.0
                e = 0.0
                n_bad = 0
                for start in range(0, vocab, BLOCK):
                    cols = start + offs
                    inb = cols < vocab
                    if EVICT_LAST:
                        x = tl.load(v_row + cols, mask=inb, other=NEG_INF, eviction_policy="evict_last")
                        y = tl.load(d_row + cols, mask=inb, other=NEG_INF, eviction_policy="evict_last")
                    else:
                        x = tl.load(v_row + cols, mask=inb, other=NEG_INF)
                        y = tl.load(d_row + cols, mask=inb, other=NEG_INF)
                    mx, my, sx, sy, r, e, n_bad = _tile_sums_v1(x.to(tl.float32) * scale2, y.to(tl.float32) * scale2,
                                                                mx, my, sx, sy, r, e, n_bad)
            status = tl.where(sx > 0.0, 0, 1) + tl.where(sy > 0.0, 0, 2)
            mx = tl.where(mx == NEG_INF, 0.0, mx)
            my = tl.where(my == NEG_INF, 0.0, my)
            log2_sx = tl.log2(sx)
            log2_sy = tl.log2(sy)
            lp = mx + log2_sx
            lq = my + log2_sy
            if PASS1 == 2 and not COMPUTE_TV:
                # H(p, q) = ln2 (lq - sum p y) = ln2 (log2 sy - sum w (y - my) / sx)
                kl = 0.0
                ce = LN2 * (log2_sy - r / sx)
                ce = tl.where(n_bad > 0, float("inf"), ce)
            else:
                entropy = LN2 * (log2_sx - r / sx)
                kl = LN2 * tl.maximum(e / sx - lp + lq, 0.0)
                kl = tl.where(n_bad > 0, float("inf"), kl)
                ce = entropy + kl
            tl.store(ce_ptr + row64, ce)
            tl.store(status_ptr + row64, status)
            if COMPUTE_TV:
                tl.store(kl_ptr + row64, kl)
                # ---- pass 2: TV and alpha with the normalisers known (reverse order: L2-warm tiles first) ----
                acc_abs = tl.zeros([BLOCK], dtype=tl.float32)
                acc_min = tl.zeros([BLOCK], dtype=tl.float32)
                for i in tl.range(0, n_tiles, num_stages=STAGES2):
                    cols = (n_tiles - 1 - i) * BLOCK + offs
                    inb = cols < vocab
                    x = tl.load(v_row + cols, mask=inb, other=NEG_INF, eviction_policy="evict_first")
                    y = tl.load(d_row + cols, mask=inb, other=NEG_INF, eviction_policy="evict_first")
                    px = tl.exp2(x.to(tl.float32) * scale2 - lp)
                    qy = tl.exp2(y.to(tl.float32) * scale2 - lq)
                    acc_abs += tl.abs(px - qy)
                    acc_min += tl.minimum(px, qy)
                tv = tl.minimum(tl.maximum(0.5 * tl.sum(acc_abs, 0), 0.0), 1.0)
                # summed, not 1 - TV: keeps relative precision when p and q barely overlap
                alpha = tl.minimum(tl.maximum(tl.sum(acc_min, 0), 0.0), 1.0)
                tl.store(tv_ptr + row64, tv)
                tl.store(alpha_ptr + row64, alpha)
                if HAS_TASKS:
                    task = tl.load(task_ptr + row64).to(tl.int64)
                    if task >= 0:
                        tl.atomic_add(task_ce_ptr + task, ce.to(tl.float64))
                        tl.atomic_add(task_kl_ptr + task, kl.to(tl.float64))
                        tl.atomic_add(task_tv_ptr + task, tv.to(tl.float64))
                        tl.atomic_add(task_alpha_ptr + task, alpha.to(tl.float64))
                        tl.atomic_add(task_count_ptr + task, 1)
            if WRITE_GRAD:
                # ---- pass 2': gradient of w_n H(p_n, q_n) w.r.t. the drafter logits, (q - p) / T ----
                w = grad_scale
                if HAS_COUNT:  # "mean" over a mask: 1 / max(count, 1), counted on the device (no host sync)
                    w = w / tl.maximum(tl.load(count_ptr), 1.0)
                if HAS_WEIGHTS:
                    w = w * tl.load(weight_ptr + row64).to(tl.float32)
                g_row = grad_ptr + row64 * stride_g
                for i in tl.range(0, n_tiles, num_stages=STAGES2):
                    cols = (n_tiles - 1 - i) * BLOCK + offs
                    inb = cols < vocab
                    x = tl.load(v_row + cols, mask=inb, other=NEG_INF, eviction_policy="evict_first")
                    y = tl.load(d_row + cols, mask=inb, other=NEG_INF, eviction_policy="evict_first")
                    x = x.to(tl.float32) * scale2
                    y = y.to(tl.float32) * scale2
                    g = (tl.exp2(y - lq) - tl.exp2(x - lp)) * w
                    tl.store(g_row + cols, g.to(grad_ptr.dtype.element_ty), mask=inb)
        else:
            tl.store(ce_ptr + row64, 0.0)
            tl.store(status_ptr + row64, 0)
            if COMPUTE_TV:
                tl.store(kl_ptr + row64, 0.0)
                tl.store(tv_ptr + row64, 0.0)
                tl.store(alpha_ptr + row64, 0.0)
            if WRITE_GRAD:
                g_row = grad_ptr + row64 * stride_g
                for start in range(0, vocab, BLOCK):
                    cols = start + offs
                    tl.store(g_row + cols, tl.zeros([BLOCK], dtype=grad_ptr.dtype.element_ty), mask=cols < vocab)


@triton.jit
def _divergence_chunked_kernel(
    v_ptr, d_ptr, stride_v, stride_d,
    mask_ptr, task_ptr, weight_ptr,
    ce_ptr, kl_ptr, tv_ptr, alpha_ptr, status_ptr,
    grad_ptr, stride_g,
    task_ce_ptr, task_kl_ptr, task_tv_ptr, task_alpha_ptr, task_count_ptr,
    stats_ptr, part_ptr, count_ptr,
    n_rows, vocab, n_groups, n_chunks, chunk_cols, scale2, grad_scale, max_spin,
    HAS_MASK: tl.constexpr, HAS_TASKS: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
    COMPUTE_TV: tl.constexpr, WRITE_GRAD: tl.constexpr, PHASE: tl.constexpr, BLOCK: tl.constexpr,
    G_POW2: tl.constexpr,
):
    """Each row is split into ``n_chunks`` column chunks, one program per (row group, chunk).

    PHASE 0: one launch; after pass 1 a program publishes its chunk statistics, bumps the row's counter and spins
    until the row's other chunks have arrived (all programs must be co-resident: the host sizes the grid), then runs
    pass 2 on its own chunk, still in L2. PHASE 1 / PHASE 2: the same work split over two launches (no spinning;
    the interpreter and the fallback use it). TV/alpha partials are summed, in chunk order, by the last program of
    the row to finish pass 2 (a second round on the same counter).
    """
    LN2: tl.constexpr = 0.6931471805599453
    NEG_INF: tl.constexpr = float("-inf")
    pid = tl.program_id(0)
    group = pid // n_chunks
    chunk = pid % n_chunks
    c_start = chunk * chunk_cols
    c_end = tl.minimum(c_start + chunk_cols, vocab)
    n_ct = tl.cdiv(c_end - c_start, BLOCK)
    offs = tl.arange(0, BLOCK)
    goffs = tl.arange(0, G_POW2)
    gmask = goffs < n_chunks
    for row in range(group, n_rows, n_groups):
        row64 = tl.cast(row, tl.int64)
        v_row = v_ptr + row64 * stride_v
        d_row = d_ptr + row64 * stride_d
        slot64 = row64 * n_chunks + chunk
        keep = True
        if HAS_MASK:
            keep = tl.load(mask_ptr + row64) != 0
        if keep:
            if PHASE != 2:
                # ---- pass 1 on this chunk: online log-sum-exp and the entropy / KL pieces ----
                mx = NEG_INF
                my = NEG_INF
                sx = 0.0
                sy = 0.0
                r = 0.0
                e = 0.0
                n_bad = 0
                for start in range(c_start, c_end, BLOCK):
                    cols = start + offs
                    inb = cols < c_end
                    x = tl.load(v_row + cols, mask=inb, other=NEG_INF)
                    y = tl.load(d_row + cols, mask=inb, other=NEG_INF)
                    mx, my, sx, sy, r, e, n_bad = _tile_sums_v1(x.to(tl.float32) * scale2, y.to(tl.float32) * scale2,
                                                                mx, my, sx, sy, r, e, n_bad)
                st = stats_ptr + slot64 * 8
                tl.store(st + 0, mx)
                tl.store(st + 1, sx)
                tl.store(st + 2, my)
                tl.store(st + 3, sy)
                tl.store(st + 4, r)
                tl.store(st + 5, e)
                tl.store(st + 6, n_bad.to(tl.float32))
                tl.debug_barrier()
                tl.atomic_add(count_ptr + row64, 1, sem="release", scope="gpu")
            if PHASE != 1:
                timed_out = False
                if PHASE == 0:
                    # wait for the row's other chunks; count_ptr[n_rows] is a sticky abort flag: once one program
                    # has given up (programs not co-resident), every later wait gives up at once
                    arrived = tl.atomic_add(count_ptr + row64, 0, sem="acquire", scope="gpu")
                    aborted = 0
                    spins = 0
                    while (arrived < n_chunks) & (spins < max_spin) & (aborted == 0):
                        arrived = tl.atomic_add(count_ptr + row64, 0, sem="acquire", scope="gpu")
                        aborted = tl.atomic_add(count_ptr + n_rows, 0, sem="relaxed", scope="gpu")
                        spins += 1
                    timed_out = arrived < n_chunks
                    if timed_out:
                        tl.atomic_xchg(count_ptr + n_rows, 1, sem="relaxed", scope="gpu")
                # ---- combine the row's chunk statistics (every program of the row does the same sums) ----
                sb = stats_ptr + (row64 * n_chunks + goffs) * 8
                mx_c = tl.load(sb + 0, mask=gmask, other=NEG_INF, volatile=True)
                sx_c = tl.load(sb + 1, mask=gmask, other=0.0, volatile=True)
                my_c = tl.load(sb + 2, mask=gmask, other=NEG_INF, volatile=True)
                sy_c = tl.load(sb + 3, mask=gmask, other=0.0, volatile=True)
                r_c = tl.load(sb + 4, mask=gmask, other=0.0, volatile=True)
                e_c = tl.load(sb + 5, mask=gmask, other=0.0, volatile=True)
                nb_c = tl.load(sb + 6, mask=gmask, other=0.0, volatile=True)
                mx = tl.max(mx_c, 0)
                my = tl.max(my_c, 0)
                mx = tl.where(mx == NEG_INF, 0.0, mx)
                my = tl.where(my == NEG_INF, 0.0, my)
                # chunks with nothing (sum 0: all -inf) drop out; NaN sums (NaN / +inf logits) propagate
                live_x = sx_c != 0.0
                live_y = sy_c != 0.0
                f_x = tl.where(live_x, tl.exp2(mx_c - mx), 0.0)
                f_y = tl.where(live_y, tl.exp2(my_c - my), 0.0)
                sx = tl.sum(tl.where(live_x, f_x * sx_c, 0.0), 0)
                sy = tl.sum(tl.where(live_y, f_y * sy_c, 0.0), 0)
                r = tl.sum(tl.where(live_x, f_x * (r_c + (mx_c - mx) * sx_c), 0.0), 0)
                e = tl.sum(tl.where(live_x, f_x * e_c, 0.0), 0)
                n_bad = tl.sum(nb_c, 0)
                status = tl.where(sx > 0.0, 0, 1) + tl.where(sy > 0.0, 0, 2)
                log2_sx = tl.log2(sx)
                log2_sy = tl.log2(sy)
                lp = mx + log2_sx
                lq = my + log2_sy
                entropy = LN2 * (log2_sx - r / sx)
                kl = LN2 * tl.maximum(e / sx - lp + lq, 0.0)
                kl = tl.where(n_bad > 0.0, float("inf"), kl)
                ce = entropy + kl
                if PHASE == 0:
                    # a spin that gave up (programs not co-resident): poison the row rather than hang
                    status = tl.where(timed_out, 7, status)
                    ce = tl.where(timed_out, float("nan"), ce)
                if COMPUTE_TV:
                    # ---- pass 2 on this chunk (reverse tile order: the tiles read last are the warmest) ----
                    acc_abs = tl.zeros([BLOCK], dtype=tl.float32)
                    acc_min = tl.zeros([BLOCK], dtype=tl.float32)
                    for i in range(0, n_ct):
                        cols = c_start + (n_ct - 1 - i) * BLOCK + offs
                        inb = cols < c_end
                        x = tl.load(v_row + cols, mask=inb, other=NEG_INF, eviction_policy="evict_first")
                        y = tl.load(d_row + cols, mask=inb, other=NEG_INF, eviction_policy="evict_first")
                        x = x.to(tl.float32) * scale2
                        y = y.to(tl.float32) * scale2
                        px = tl.exp2(x - lp)
                        qy = tl.exp2(y - lq)
                        acc_abs += tl.abs(px - qy)
                        acc_min += tl.minimum(px, qy)
                    pt = part_ptr + slot64 * 2
                    tl.store(pt + 0, tl.sum(acc_abs, 0))
                    tl.store(pt + 1, tl.sum(acc_min, 0))
                    tl.debug_barrier()
                    done = tl.atomic_add(count_ptr + row64, 1, sem="acq_rel", scope="gpu")
                    if done == 2 * n_chunks - 1:
                        # last program of the row: sum the partials in chunk order and write the row
                        pb = part_ptr + (row64 * n_chunks + goffs) * 2
                        abs_c = tl.load(pb + 0, mask=gmask, other=0.0, volatile=True)
                        min_c = tl.load(pb + 1, mask=gmask, other=0.0, volatile=True)
                        tv = tl.minimum(tl.maximum(0.5 * tl.sum(abs_c, 0), 0.0), 1.0)
                        alpha = tl.minimum(tl.maximum(tl.sum(min_c, 0), 0.0), 1.0)
                        tl.store(ce_ptr + row64, ce)
                        tl.store(status_ptr + row64, status)
                        tl.store(kl_ptr + row64, kl)
                        tl.store(tv_ptr + row64, tv)
                        tl.store(alpha_ptr + row64, alpha)
                        if HAS_TASKS:
                            task = tl.load(task_ptr + row64).to(tl.int64)
                            if task >= 0:
                                tl.atomic_add(task_ce_ptr + task, ce.to(tl.float64))
                                tl.atomic_add(task_kl_ptr + task, kl.to(tl.float64))
                                tl.atomic_add(task_tv_ptr + task, tv.to(tl.float64))
                                tl.atomic_add(task_alpha_ptr + task, alpha.to(tl.float64))
                                tl.atomic_add(task_count_ptr + task, 1)
                else:
                    if chunk == 0:
                        tl.store(ce_ptr + row64, ce)
                        tl.store(status_ptr + row64, status)
                if WRITE_GRAD:
                    # ---- pass 2': gradient (q - p) w / T of this chunk ----
                    w = grad_scale
                    if HAS_WEIGHTS:
                        w = w * tl.load(weight_ptr + row64).to(tl.float32)
                    g_row = grad_ptr + row64 * stride_g
                    for i in range(0, n_ct):
                        cols = c_start + (n_ct - 1 - i) * BLOCK + offs
                        inb = cols < c_end
                        x = tl.load(v_row + cols, mask=inb, other=NEG_INF, eviction_policy="evict_first")
                        y = tl.load(d_row + cols, mask=inb, other=NEG_INF, eviction_policy="evict_first")
                        x = x.to(tl.float32) * scale2
                        y = y.to(tl.float32) * scale2
                        g = (tl.exp2(y - lq) - tl.exp2(x - lp)) * w
                        tl.store(g_row + cols, g.to(grad_ptr.dtype.element_ty), mask=inb,
                                 eviction_policy="evict_first")
        else:
            if PHASE != 1:
                if chunk == 0:
                    tl.store(ce_ptr + row64, 0.0)
                    tl.store(status_ptr + row64, 0)
                    if COMPUTE_TV:
                        tl.store(kl_ptr + row64, 0.0)
                        tl.store(tv_ptr + row64, 0.0)
                        tl.store(alpha_ptr + row64, 0.0)
                if WRITE_GRAD:
                    g_row = grad_ptr + row64 * stride_g
                    for start in range(c_start, c_end, BLOCK):
                        cols = start + offs
                        tl.store(g_row + cols, tl.zeros([BLOCK], dtype=grad_ptr.dtype.element_ty), mask=cols < c_end)


# Launch configuration (NOTES_divergence.md); the benchmark overrides it through `set_config` to sweep tile sizes,
# chunk sizes and grid shapes.
_DEFAULT_CONFIG: dict[str, int] = {"block": 0, "num_warps": 0, "programs_per_sm": 0, "programs": 0,
                                   "evict_last": 0, "interpret_block": 256, "pass1": 2, "stages1": 1, "stages2": 0,
                                   "split": 0, "chunk_tiles": 8, "spin": 1, "chunk_programs_per_sm": 0,
                                   "interpret_chunk_tiles": 2, "cluster": 1, "cluster_forward": 1,
                                   "cluster_min_vocab": 32000}
_CONFIG: dict[str, int] = dict(_DEFAULT_CONFIG)
MAX_SPIN = 1 << 20  # polls of a row counter (about a microsecond each) before a program gives up and poisons the row


def set_config(**overrides: int | None) -> dict[str, int]:
    """Override the launch configuration; returns the previous one (pass it back to restore; no argument = reset).

    Keys: ``block`` (vocabulary tile) and ``num_warps`` (0 = chosen by the card, rows per multiprocessor, the
    vocabulary and the pass, see ``_auto_tile``; 2048 / 4 for ``split=1``), ``interpret_block`` (tile under
    ``TRITON_INTERPRET=1``),
    ``split`` (0: one program per row, the default (fastest measured); 1: rows split into column chunks, one program
    per (row, chunk): the experimental version 2 of NOTES_divergence.md),
    ``chunk_tiles`` (tiles per chunk; ``interpret_chunk_tiles`` under the interpreter), ``spin`` (chunked path on
    CUDA: 1 = one launch whose programs wait for the row's other chunks (a co-resident persistent grid), 0 = two
    launches), ``chunk_programs_per_sm`` (cap on co-resident programs per multiprocessor for ``spin``; 0 = as many as
    fit), ``programs`` (a fixed number of rows in flight: programs for ``split=0``, row groups for ``split=1``;
    0 = off), ``programs_per_sm`` (``split=0`` only: grid of that many programs per multiprocessor), ``evict_last``
    (``split=0`` only: pass-1 loads ask L2 to keep the row), ``pass1`` (``split=0`` only: 0 = sums reduced per
    tile (version 1); 2 = one multi-operand reduction per tile, accumulating only the cross-entropy on the loss path,
    the default), ``stages1`` / ``stages2`` (``split=0`` only: ``tl.range`` software-pipelining stages of pass 1
    (``pass1=2``) / of pass 2; 0 = by device), ``cluster`` (Hopper: 1 = the cluster kernels of
    ``kernels/divergence_cluster.py`` where they apply, 0 = always the row kernel), ``cluster_forward`` (1 = the
    forward too, 0 = the loss only) and ``cluster_min_vocab`` (the smallest vocabulary they are used for: 32000, the
    smallest measured; NOTES_divergence.md, "Session 13").
    """
    previous = dict(_CONFIG)
    if not overrides:
        _CONFIG.clear()
        _CONFIG.update(_DEFAULT_CONFIG)
    for key, value in overrides.items():
        if key not in _DEFAULT_CONFIG:
            raise ValueError(f"unknown launch setting {key!r}; known: {sorted(_DEFAULT_CONFIG)}")
        if value is not None:
            _CONFIG[key] = int(value)
    return previous


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# Loss path (gradient, no TV) on the H200 at vocabularies up to this size: 2048 columns / 4 warps, no pipelining
# (same-process probe, 16384 x 32000: 1.17 vs 1.24 ms for the small-program setting; at V = 151936 equal or worse).
SMALL_VOCAB_LOSS = 65536


def _auto_tile(n_rows: int, device: torch.device, vocab: int = 0, write_grad: bool = False) -> tuple[int, int, int]:
    """``(block, num_warps, pass-2 pipelining stages)`` of the one-program-per-row kernel, from same-process sweeps
    (NOTES_divergence.md, version 5). On the H200 small programs (one warp, 512 columns, pass 2 pipelined over 3
    stages) win when there are >= 16 rows per multiprocessor, 1024 columns / 2 warps from 4 rows per SM, except for
    the loss path at vocabularies <= SMALL_VOCAB_LOSS; on the H100 (and, untested, anything else) 2048 columns / 4
    warps without pipelining did best."""
    if "H200" not in device_name(device):
        return 2048, 4, 1
    if write_grad and vocab <= SMALL_VOCAB_LOSS:
        return 2048, 4, 1
    rows_per_sm = n_rows / sm_count(device)
    if rows_per_sm >= 16:
        return 512, 1, 3
    if rows_per_sm >= 4:
        return 1024, 2, 3
    return 2048, 4, 3


def _launch_params(n_rows: int, vocab: int, device: torch.device,
                   write_grad: bool = False) -> tuple[int, int, int, int]:
    """``(block, num_warps, programs, stages2)`` from the configuration (0 entries: chosen by ``_auto_tile``)."""
    block, num_warps, stages2 = _CONFIG["block"], _CONFIG["num_warps"], _CONFIG["stages2"]
    auto_block, auto_warps, auto_stages = ((2048, 4, 1) if _CONFIG["split"]
                                           else _auto_tile(n_rows, device, vocab, write_grad))
    block = block if block > 0 else auto_block
    num_warps = num_warps if num_warps > 0 else auto_warps
    stages2 = stages2 if stages2 > 0 else auto_stages
    block = min(triton.next_power_of_2(vocab), block)
    if _interpreting():
        block = min(triton.next_power_of_2(vocab), _CONFIG["interpret_block"])  # small tiles: multi-tile paths run
    num_warps = max(1, min(num_warps, block // 256))
    programs = n_rows
    if _CONFIG["programs"] > 0:
        programs = min(n_rows, _CONFIG["programs"])
    elif _CONFIG["programs_per_sm"] > 0 and device.type == "cuda":
        programs = min(n_rows, sm_count(device) * _CONFIG["programs_per_sm"])
    return block, num_warps, max(programs, 1), stages2


def chunk_layout(vocab: int, block: int, chunk_tiles: int) -> tuple[int, int]:
    """``(n_chunks, chunk_cols)``: about ``chunk_tiles`` tiles of ``block`` columns per chunk, balanced."""
    n_tiles = triton.cdiv(vocab, block)
    n_chunks = triton.cdiv(n_tiles, max(1, chunk_tiles))
    tiles = triton.cdiv(n_tiles, n_chunks)
    return triton.cdiv(n_tiles, tiles), tiles * block


# (device index, num_warps, COMPUTE_TV, WRITE_GRAD, BLOCK) -> co-resident programs per multiprocessor, read off the
# compiled kernel after its first launch (registers, shared memory); before that a bound that holds for any kernel.
_RESIDENT: dict[tuple, int] = {}


def _resident_per_sm(key: tuple, num_warps: int) -> int:
    if key in _RESIDENT:
        return _RESIDENT[key]
    return max(1, 8 // num_warps)  # <= 255 registers a thread: at least 8 warps of any kernel fit on an SM


def _record_residency(key: tuple, kernel, num_warps: int, device: torch.device) -> None:
    try:
        n_regs = int(kernel.n_regs)
        shared = int(kernel.metadata.shared)
    except Exception:  # noqa: BLE001 - an older/newer runtime without these fields keeps the safe bound
        return
    if n_regs <= 0:
        return
    props = torch.cuda.get_device_properties(device)
    regs_sm = int(getattr(props, "regs_per_multiprocessor", 65536) or 65536)
    threads_sm = int(getattr(props, "max_threads_per_multi_processor", 2048) or 2048)
    smem_sm = int(getattr(props, "shared_memory_per_multiprocessor", 233472) or 233472)
    per_warp = -(-n_regs * 32 // 256) * 256  # registers are allocated per warp in units of 256
    by_regs = ((regs_sm // 4) // per_warp) // max(1, num_warps // 4) if num_warps >= 4 else regs_sm // (
        per_warp * num_warps)
    by_threads = threads_sm // (32 * num_warps)
    by_smem = smem_sm // (shared + 1024)
    _RESIDENT[key] = max(1, min(by_regs, by_threads, by_smem, 32))


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def launch_divergence(
    verifier_logits: torch.Tensor,
    drafter_logits: torch.Tensor,
    temperature: float,
    *,
    mask: torch.Tensor | None = None,
    task_ids: torch.Tensor | None = None,
    num_tasks: int | None = None,
    compute_tv: bool = True,
    grad_out: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    grad_scale: float = 1.0,
    grad_count: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Run the kernel once. Returns ``(ce, kl, tv, alpha, status, per_task)`` ([N] float32 / int32 tensors; kl, tv,
    alpha are None when ``compute_tv`` is False; per_task a tuple of 4 float64 sums and an int64 count, or None).

    ``grad_out`` ([N, V], may be ``drafter_logits`` itself for an in-place gradient) receives
    ``weights[n] * grad_scale * (q - p) / T`` in its own dtype. Launches on the inputs' device.
    """
    with launching_on(verifier_logits.device):
        return _launch_divergence(verifier_logits, drafter_logits, temperature, mask, task_ids, num_tasks,
                                  compute_tv, grad_out, weights, grad_scale, grad_count)


def _launch_divergence(verifier_logits, drafter_logits, temperature, mask, task_ids, num_tasks, compute_tv,
                       grad_out, weights, grad_scale, grad_count) -> tuple[torch.Tensor, ...]:
    """``launch_divergence`` with its device current."""
    verifier_logits = _row_major(verifier_logits)
    drafter_logits = _row_major(drafter_logits)
    # the kernel indexes [N] side inputs with unit stride
    mask, task_ids, weights = (t.contiguous() if t is not None else None for t in (mask, task_ids, weights))
    n_rows, vocab = verifier_logits.shape
    device = verifier_logits.device
    cluster_loss = grad_out is not None and not compute_tv
    cluster_forward = grad_out is None and compute_tv and _CONFIG["cluster_forward"]
    if ((cluster_loss or cluster_forward) and _CONFIG["cluster"] and not _CONFIG["split"]
            and cluster_eligible(verifier_logits, drafter_logits, grad_out, major_capability(device),
                                 _CONFIG["cluster_min_vocab"])):
        if cluster_loss:
            out = launch_cluster_loss(verifier_logits, drafter_logits, temperature, grad_out, mask=mask,
                                      weights=weights, grad_scale=grad_scale, grad_count=grad_count)
            if out is not None:
                ce, status = out
                return ce, None, None, None, status, None
        else:
            out = launch_cluster_forward(verifier_logits, drafter_logits, temperature, mask=mask, task_ids=task_ids,
                                         num_tasks=num_tasks)
            if out is not None:
                return out
    f32 = dict(dtype=torch.float32, device=device)
    ce = torch.empty(n_rows, **f32)
    kl = torch.empty(n_rows, **f32) if compute_tv else None
    tv = torch.empty(n_rows, **f32) if compute_tv else None
    alpha = torch.empty(n_rows, **f32) if compute_tv else None
    status = torch.empty(n_rows, dtype=torch.int32, device=device)
    has_tasks = task_ids is not None and compute_tv
    if has_tasks:
        sums = [torch.zeros(num_tasks, dtype=torch.float64, device=device) for _ in range(4)]
        count = torch.zeros(num_tasks, dtype=torch.int64, device=device)
    dummy = ce
    write_grad = grad_out is not None
    block, num_warps, programs, stages2 = _launch_params(n_rows, vocab, device, write_grad)
    common = (
        verifier_logits, drafter_logits, verifier_logits.stride(0), drafter_logits.stride(0),
        mask if mask is not None else dummy, task_ids if has_tasks else dummy,
        weights if weights is not None else dummy,
        ce, kl if compute_tv else dummy, tv if compute_tv else dummy, alpha if compute_tv else dummy, status,
        grad_out if write_grad else dummy, grad_out.stride(0) if write_grad else 0,
        *(sums if has_tasks else [dummy] * 4), count if has_tasks else dummy,
    )
    flags = dict(HAS_MASK=mask is not None, HAS_TASKS=has_tasks, HAS_WEIGHTS=weights is not None,
                 COMPUTE_TV=compute_tv, WRITE_GRAD=write_grad)
    chunk_tiles = _CONFIG["interpret_chunk_tiles"] if _interpreting() else _CONFIG["chunk_tiles"]
    n_chunks, chunk_cols = chunk_layout(vocab, block, chunk_tiles)
    if not _CONFIG["split"]:
        _divergence_kernel[(programs,)](
            *common, n_rows, vocab, programs, LOG2E / temperature, grad_scale / temperature,
            grad_count if grad_count is not None else dummy,
            **flags, BLOCK=block, EVICT_LAST=bool(_CONFIG["evict_last"]), PASS1=_CONFIG["pass1"],
            STAGES1=max(1, _CONFIG["stages1"]), STAGES2=stages2,
            HAS_COUNT=grad_count is not None, num_warps=num_warps,
        )
    else:
        if grad_count is not None:  # the experimental chunked kernel takes the scale on the host
            grad_scale = grad_scale / max(float(grad_count.item()), 1.0)
        stats = torch.empty(n_rows * n_chunks * 8, dtype=torch.float32, device=device)
        part = torch.empty(n_rows * n_chunks * 2, dtype=torch.float32, device=device) if compute_tv else stats
        counter = torch.zeros(n_rows + 1, dtype=torch.int32, device=device)  # + the abort flag
        groups = programs  # rows in flight: every row unless `programs` caps it
        spin = bool(_CONFIG["spin"]) and device.type == "cuda" and not _interpreting()
        key = (device.index, num_warps, compute_tv, write_grad, block)
        if spin:
            per_sm = _resident_per_sm(key, num_warps)
            if _CONFIG["chunk_programs_per_sm"] > 0:
                per_sm = min(per_sm, _CONFIG["chunk_programs_per_sm"])
            resident = sm_count(device) * per_sm
            groups = min(groups, resident // n_chunks)
            spin = groups >= 1
            groups = max(groups, 1)
        tail = (stats, part, counter, n_rows, vocab, groups, n_chunks, chunk_cols, LOG2E / temperature,
                grad_scale / temperature, MAX_SPIN)
        meta = dict(**flags, BLOCK=block, G_POW2=triton.next_power_of_2(n_chunks), num_warps=num_warps)
        grid = (groups * n_chunks,)
        if spin:
            kernel = _divergence_chunked_kernel[grid](*common, *tail, PHASE=0, **meta)
            if key not in _RESIDENT and kernel is not None:
                _record_residency(key, kernel, num_warps, device)
        else:
            _divergence_chunked_kernel[grid](*common, *tail, PHASE=1, **meta)
            _divergence_chunked_kernel[grid](*common, *tail, PHASE=2, **meta)
    per_task = (*sums, count) if has_tasks else None
    return ce, kl, tv, alpha, status, per_task


def divergence_triton(
    verifier_logits: torch.Tensor,
    drafter_logits: torch.Tensor,
    temperature: float,
    *,
    mask: torch.Tensor | None = None,
    task_ids: torch.Tensor | None = None,
    num_tasks: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """[N] float32 H(p,q), KL, TV, alpha, [N] int32 status and optional per-task sums (see module doc).

    Args: verifier_logits, drafter_logits [N, V] fp32/bf16/fp16 (T > 0 applied to both); mask [N] bool
    (True = counted); task_ids [N] int in [-1, num_tasks).
    """
    mask_u8 = mask.to(torch.uint8) if mask is not None else None
    ce, kl, tv, alpha, status, per_task = launch_divergence(
        verifier_logits, drafter_logits, temperature, mask=mask_u8, task_ids=task_ids, num_tasks=num_tasks)
    return ce, kl, tv, alpha, status, per_task


def _weighted_total(ce: torch.Tensor, weights: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
    if weights is None and mask is None:
        return ce.sum()
    w = torch.ones_like(ce) if weights is None else weights.to(torch.float32)
    if mask is not None:
        w = torch.where(mask, w, torch.zeros_like(w))
    return torch.where(w != 0, w * ce, torch.zeros_like(ce)).sum()


def loss_scale(reduction: str, n_rows: int, mask: torch.Tensor | None) -> tuple[float, torch.Tensor | None]:
    """``(scale, count)`` of a loss reduction: "sum" -> (1, None); an unmasked "mean" -> (1 / N, None); a masked
    "mean" -> (1, the [1] float32 number of counted tokens), kept on the device (the kernel divides by it)."""
    if reduction != "mean":
        return 1.0, None
    if mask is None:
        return 1.0 / max(n_rows, 1), None
    return 1.0, mask.sum(dtype=torch.float32).reshape(1)


def reduced_loss(ce: torch.Tensor, weights: torch.Tensor | None, mask: torch.Tensor | None, scale: float,
                 count: torch.Tensor | None) -> torch.Tensor:
    """0-dim ``scale * sum_n w_n ce_n`` over the counted rows, divided by ``max(count, 1)`` when given."""
    total = _weighted_total(ce, weights, mask) * scale
    return total if count is None else total / count.clamp_min(1.0).reshape(())


@triton.jit
def _rescale_gradient_kernel(grad_ptr, upstream_ptr, numel, num_programs, BLOCK: tl.constexpr):
    """grad *= upstream in place; every program returns at once when upstream is exactly 1."""
    factor = tl.load(upstream_ptr).to(tl.float32)
    if factor != 1.0:
        offs = tl.arange(0, BLOCK).to(tl.int64)
        for start in range(tl.program_id(0) * BLOCK, numel, num_programs * BLOCK):
            idx = start + offs
            inb = idx < numel
            g = tl.load(grad_ptr + idx, mask=inb).to(tl.float32)
            tl.store(grad_ptr + idx, (g * factor).to(grad_ptr.dtype.element_ty), mask=inb)


def rescale_gradient(grad: torch.Tensor, upstream: torch.Tensor) -> None:
    """Scale ``grad`` (dense) in place by ``upstream`` (a 1-element tensor on its device) without a host sync: the
    usual ``loss.backward()`` (upstream 1) costs one launch whose programs return at once, instead of a
    ``torch.equal`` round trip."""
    numel = grad.numel()
    block = 4096 if not _interpreting() else 256
    programs = max(1, min(triton.cdiv(numel, block), 4 * sm_count(grad.device)))
    _rescale_gradient_kernel[(programs,)](grad, upstream, numel, programs, BLOCK=block, num_warps=4)


SECOND_BACKWARD = ("the Triton path of {name} computes the gradient in the forward pass and hands that buffer out, "
                   "scaled in place, on the first backward; a second backward through the same graph "
                   "(retain_graph=True) is not supported: compute the loss again, or use backend='torch'")


def check_first_backward(ctx, name: str) -> None:
    """RuntimeError on a second backward through the same graph (the stored gradient was already handed out)."""
    if getattr(ctx, "backward_done", False):
        raise RuntimeError(SECOND_BACKWARD.format(name=name))
    ctx.backward_done = True


class DivergenceLossFunction(torch.autograd.Function):
    """``sum_n w_n H(p_n, q_n)`` (or its mean) with the drafter-logit gradient computed in the forward pass.

    No host sync unless ``check_inputs``: a masked mean's token count stays on the device and the backward scales
    the stored gradient in place by the incoming one on the device (nothing to do for the usual
    ``loss.backward()``). Hence one backward per graph: a second one (``retain_graph=True``) raises RuntimeError,
    and double backward (``create_graph=True``) is not supported."""

    @staticmethod
    def forward(ctx, drafter_logits: torch.Tensor, verifier_logits: torch.Tensor, weights: torch.Tensor | None,
                mask: torch.Tensor | None, temperature: float, reduction: str,
                check_inputs: bool = False) -> torch.Tensor:
        scale, count = loss_scale(reduction, drafter_logits.shape[0], mask)
        needs_grad = ctx.needs_input_grad[0]
        # fp16: the gradient is kept in fp32 until the backward has scaled it by the incoming gradient (a GradScaler's
        # loss scale); stored in fp16 first, its small entries (w (q - p) / (T N)) would underflow before the scaling
        # that exists to save them. bf16 has fp32's exponent range and keeps its own dtype.
        grad_dtype = torch.float32 if drafter_logits.dtype == torch.float16 else drafter_logits.dtype
        grad = torch.empty(drafter_logits.shape, dtype=grad_dtype, device=drafter_logits.device) if needs_grad else None
        ctx.input_dtype = drafter_logits.dtype
        mask_u8 = mask.to(torch.uint8) if mask is not None else None
        w32 = weights.to(torch.float32).contiguous() if weights is not None else None
        ce, _, _, _, status, _ = launch_divergence(verifier_logits, drafter_logits, temperature, mask=mask_u8,
                                                   compute_tv=False, grad_out=grad, weights=w32, grad_scale=scale,
                                                   grad_count=count)
        if check_inputs:
            raise_on_bad_status(status)
        ctx.save_for_backward(grad)
        return reduced_loss(ce, weights, mask, scale, count)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        check_first_backward(ctx, "divergence_loss")
        (grad,) = ctx.saved_tensors
        if grad is None:
            return None, None, None, None, None, None, None
        rescale_gradient(grad, grad_output)
        return grad.to(ctx.input_dtype), None, None, None, None, None, None


def divergence_loss_triton(drafter_logits: torch.Tensor, verifier_logits: torch.Tensor,
                           weights: torch.Tensor | None, mask: torch.Tensor | None, temperature: float,
                           reduction: str, check_inputs: bool = False) -> torch.Tensor:
    """Triton path of :func:`specdec.divergence_loss` (0-dim float32, differentiable w.r.t. ``drafter_logits``)."""
    return DivergenceLossFunction.apply(drafter_logits, verifier_logits.detach(), weights, mask, temperature,
                                        reduction, check_inputs)


def raise_on_bad_status(status: torch.Tensor) -> None:
    """ValueError naming the input whose counted rows the kernel flagged (``status`` [N] int32: bit 0 verifier,
    bit 1 drafter: NaN, +inf or every entry -inf). One device sync."""
    verifier_bad, drafter_bad = torch.stack([(status & 1).any(), (status & 2).any()]).tolist()
    for name, bad in (("verifier_logits", verifier_bad), ("drafter_logits", drafter_bad)):
        if bad:
            raise ValueError(f"{name} contains NaN or +inf, or a row with every entry -inf: p or q would be undefined")


__all__ = ["DivergenceLossFunction", "chunk_layout", "divergence_loss_triton", "divergence_triton",
           "check_first_backward", "launch_divergence", "loss_scale", "raise_on_bad_status", "reduced_loss",
           "rescale_gradient", "set_config", "LOG2E"]
