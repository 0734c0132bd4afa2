"""Probe kernels (session 12, not used by the library): the divergence forward with each row split over the CTAs of
a thread-block cluster (Hopper, sm_90+). Both lost to the shipped one-program-per-row kernel on an H100
(NOTES_divergence.md, "Session 12"); kept as the record of what was measured.

``_cluster_divergence_kernel`` (register-resident, one row per cluster): a row of ``V`` columns is split over the
``C`` CTAs of one cluster (``C`` consecutive programs). Each CTA loads its chunk of both logit rows once into
registers, computes the chunk's pass-1 statistics (maxima, normalisers, the entropy / KL pieces of
``kernels/divergence.py``), publishes them to a small global scratch ``[N, C, 8]`` and waits on the hardware cluster
barrier (``barrier.cluster.arrive.release`` / ``wait.acquire``: the CTAs of a cluster are co-scheduled, so the wait
cannot deadlock). Every CTA then combines the row's ``C`` chunk statistics and runs pass 2 (TV / alpha) on the values
it still holds, so the logits are read from DRAM exactly once.

Triton 3.6 has no cluster API: the kernel is compiled as an ordinary one-CTA program, the barrier is inline PTX, and
the launch asks the driver for clusters of ``C`` CTAs by patching the compiled kernel's launch metadata (Triton's
launcher already passes ``num_ctas`` to ``cuLaunchKernelEx`` as the cluster dimension).

``_cluster_stream_kernel`` (persistent clusters) streams each chunk in tiles instead and re-reads it from L2 for pass 2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.divergence import _max_pair, _sum_four


@triton.jit
def _cluster_barrier():
    """All threads of every CTA of the cluster arrive (release) and wait (acquire): global stores made before it by
    any CTA of the cluster are visible to loads after it in every other CTA of the cluster."""
    tl.inline_asm_elementwise(
        "barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n\tmov.u32 $0, 0;",
        "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _combine_chunks(stats_ptr, row64, goffs, C: tl.constexpr):
    """After the barrier: the row's ``C`` chunk statistics ``(mx, sx, my, sy, r, e)`` of the ``[N, C, 8]`` scratch
    combined into ``(Sx, Sy, R, E, log2 Sx, lp, lq)`` (base-2 log-normalisers ``lp``, ``lq``)."""
    NEG_INF: tl.constexpr = float("-inf")
    sb = stats_ptr + (row64 * C + goffs) * 8
    mx_c = tl.load(sb + 0, cache_modifier=".cg")
    sx_c = tl.load(sb + 1, cache_modifier=".cg")
    my_c = tl.load(sb + 2, cache_modifier=".cg")
    sy_c = tl.load(sb + 3, cache_modifier=".cg")
    r_c = tl.load(sb + 4, cache_modifier=".cg")
    e_c = tl.load(sb + 5, cache_modifier=".cg")
    gx = tl.max(mx_c, 0)
    gy = tl.max(my_c, 0)
    gx = tl.where(gx == NEG_INF, 0.0, gx)
    gy = tl.where(gy == NEG_INF, 0.0, gy)
    live_x = sx_c != 0.0
    live_y = sy_c != 0.0
    f_x = tl.where(live_x, tl.exp2(mx_c - gx), 0.0)
    f_y = tl.where(live_y, tl.exp2(my_c - gy), 0.0)
    sx_t = tl.sum(tl.where(live_x, f_x * sx_c, 0.0), 0)
    sy_t = tl.sum(tl.where(live_y, f_y * sy_c, 0.0), 0)
    r_t = tl.sum(tl.where(live_x, f_x * (r_c + (mx_c - gx) * sx_c), 0.0), 0)
    e_t = tl.sum(tl.where(live_x, f_x * e_c, 0.0), 0)
    log2_sx = tl.log2(sx_t)
    log2_sy = tl.log2(sy_t)
    lp = gx + log2_sx
    lq = gy + log2_sy
    return sx_t, sy_t, r_t, e_t, log2_sx, lp, lq


@triton.jit
def _cluster_divergence_kernel(
    v_ptr, d_ptr, stride_v, stride_d,
    stats_ptr, part_ptr,
    ce_ptr, kl_ptr, status_ptr,
    vocab, chunk_cols, scale2, scale2_again,
    C: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, HOLD_RAW: tl.constexpr,
):
    LN2: tl.constexpr = 0.6931471805599453
    NEG_INF: tl.constexpr = float("-inf")
    pid = tl.program_id(0)
    row = pid // C
    rank = pid % C
    row64 = tl.cast(row, tl.int64)
    c0 = rank * chunk_cols
    c1 = tl.minimum(c0 + chunk_cols, vocab)
    cols_a = c0 + tl.arange(0, BLOCK_A)
    cols_b = c0 + BLOCK_A + tl.arange(0, BLOCK_B)
    in_a = cols_a < c1
    in_b = cols_b < c1
    v_row = v_ptr + row64 * stride_v
    d_row = d_ptr + row64 * stride_d
    xa_raw = tl.load(v_row + cols_a, mask=in_a, other=NEG_INF)
    ya_raw = tl.load(d_row + cols_a, mask=in_a, other=NEG_INF)
    xb_raw = tl.load(v_row + cols_b, mask=in_b, other=NEG_INF)
    yb_raw = tl.load(d_row + cols_b, mask=in_b, other=NEG_INF)
    xa = xa_raw.to(tl.float32) * scale2
    ya = ya_raw.to(tl.float32) * scale2
    xb = xb_raw.to(tl.float32) * scale2
    yb = yb_raw.to(tl.float32) * scale2
    mx = tl.maximum(tl.max(xa, 0), tl.max(xb, 0))
    my = tl.maximum(tl.max(ya, 0), tl.max(yb, 0))
    mx_ref = tl.where(mx == NEG_INF, 0.0, mx)
    my_ref = tl.where(my == NEG_INF, 0.0, my)
    wxa = tl.exp2(xa - mx_ref)
    wxb = tl.exp2(xb - mx_ref)
    wya = tl.exp2(ya - my_ref)
    wyb = tl.exp2(yb - my_ref)
    fxa = xa > NEG_INF
    fxb = xb > NEG_INF
    sx = tl.sum(wxa, 0) + tl.sum(wxb, 0)
    sy = tl.sum(wya, 0) + tl.sum(wyb, 0)
    r = tl.sum(tl.where(fxa, wxa * (xa - mx_ref), 0.0), 0) + tl.sum(tl.where(fxb, wxb * (xb - mx_ref), 0.0), 0)
    e = (tl.sum(tl.where(fxa & (ya > NEG_INF), wxa * (xa - ya), 0.0), 0)
         + tl.sum(tl.where(fxb & (yb > NEG_INF), wxb * (xb - yb), 0.0), 0))
    n_bad = tl.sum((fxa & (ya == NEG_INF)).to(tl.int32), 0) + tl.sum((fxb & (yb == NEG_INF)).to(tl.int32), 0)
    slot64 = row64 * C + rank
    st = stats_ptr + slot64 * 8
    tl.store(st + 0, mx)
    tl.store(st + 1, sx)
    tl.store(st + 2, my)
    tl.store(st + 3, sy)
    tl.store(st + 4, r)
    tl.store(st + 5, e)
    tl.store(st + 6, n_bad.to(tl.float32))
    _cluster_barrier()
    goffs = tl.arange(0, C)
    sx_t, sy_t, r_t, e_t, log2_sx, lp, lq = _combine_chunks(stats_ptr, row64, goffs, C)
    nb_t = tl.sum(tl.load(stats_ptr + (row64 * C + goffs) * 8 + 6, cache_modifier=".cg"), 0)
    status = tl.where(sx_t > 0.0, 0, 1) + tl.where(sy_t > 0.0, 0, 2)
    if HOLD_RAW:
        # recompute from the raw logits (a second scale argument keeps the compiler from reusing the float32
        # values of pass 1, so only the 16-bit loads stay live across the barrier)
        pa = tl.exp2(xa_raw.to(tl.float32) * scale2_again - lp)
        pb = tl.exp2(xb_raw.to(tl.float32) * scale2_again - lp)
        qa = tl.exp2(ya_raw.to(tl.float32) * scale2_again - lq)
        qb = tl.exp2(yb_raw.to(tl.float32) * scale2_again - lq)
    else:
        cx = tl.exp2(mx_ref - lp)
        cy = tl.exp2(my_ref - lq)
        pa = wxa * cx
        pb = wxb * cx
        qa = wya * cy
        qb = wyb * cy
    abs_sum = tl.sum(tl.abs(pa - qa), 0) + tl.sum(tl.abs(pb - qb), 0)
    min_sum = tl.sum(tl.minimum(pa, qa), 0) + tl.sum(tl.minimum(pb, qb), 0)
    pt = part_ptr + slot64 * 2
    tl.store(pt + 0, abs_sum)
    tl.store(pt + 1, min_sum)
    if rank == 0:
        entropy = LN2 * (log2_sx - r_t / sx_t)
        kl = LN2 * tl.maximum(e_t / sx_t - lp + lq, 0.0)
        kl = tl.where(nb_t > 0.0, float("inf"), kl)
        tl.store(ce_ptr + row64, entropy + kl)
        tl.store(kl_ptr + row64, kl)
        tl.store(status_ptr + row64, status)


def cluster_chunking(vocab: int, cluster_size: int) -> tuple[int, int, int]:
    """``(chunk_cols, BLOCK_A, BLOCK_B)``: columns per CTA and the two power-of-two tiles that cover them."""
    chunk_cols = -(-vocab // cluster_size)
    block_a = triton.next_power_of_2(chunk_cols)
    if block_a // 2 >= 16 and chunk_cols <= block_a // 2 + block_a // 8:
        block_a //= 2
        block_b = max(16, triton.next_power_of_2(chunk_cols - block_a))
    else:
        block_b = 16
    return chunk_cols, block_a, block_b


_PATCHED: set[int] = set()


def launch_cluster_forward(verifier_logits: torch.Tensor, drafter_logits: torch.Tensor, temperature: float,
                           cluster_size: int = 16, num_warps: int = 8, hold_raw: bool = False):
    """Probe launcher: [N] float32 ce, kl, tv, alpha and int32 status (no mask, no tasks)."""
    n_rows, vocab = verifier_logits.shape
    device = verifier_logits.device
    chunk_cols, block_a, block_b = cluster_chunking(vocab, cluster_size)
    f32 = dict(dtype=torch.float32, device=device)
    stats = torch.empty(n_rows * cluster_size * 8, **f32)
    part = torch.empty(n_rows * cluster_size, 2, **f32)
    ce = torch.empty(n_rows, **f32)
    kl = torch.empty(n_rows, **f32)
    status = torch.empty(n_rows, dtype=torch.int32, device=device)
    scale2 = 1.4426950408889634 / temperature
    args = (verifier_logits, drafter_logits, verifier_logits.stride(0), drafter_logits.stride(0), stats, part,
            ce, kl, status, vocab, chunk_cols, scale2, scale2)
    meta = dict(C=cluster_size, BLOCK_A=block_a, BLOCK_B=block_b, HOLD_RAW=hold_raw, num_warps=num_warps)
    compiled = _cluster_divergence_kernel.warmup(*args, grid=(n_rows * cluster_size,), **meta)
    if id(compiled) not in _PATCHED:
        nw, _, shared = compiled.packed_metadata
        compiled.packed_metadata = (nw, cluster_size, shared)
        _PATCHED.add(id(compiled))
    _cluster_divergence_kernel[(n_rows,)](*args, **meta)
    sums = part.view(n_rows, cluster_size, 2).sum(dim=1)
    tv = (0.5 * sums[:, 0]).clamp(0.0, 1.0)
    alpha = sums[:, 1].clamp(0.0, 1.0)
    return ce, kl, tv, alpha, status, compiled


@triton.jit
def _cluster_stream_kernel(
    v_ptr, d_ptr, stride_v, stride_d,
    stats_ptr, part_ptr,
    ce_ptr, kl_ptr, status_ptr,
    n_rows, vocab, chunk_cols, n_clusters, scale2,
    C: tl.constexpr, BLOCK: tl.constexpr, EVICT1: tl.constexpr, STAGES: tl.constexpr = 1,
):
    """Persistent clusters: cluster ``pid // C`` walks rows ``cid, cid + n_clusters, ...``; CTA ``pid % C`` streams
    its chunk of each row in tiles (pass 1), publishes the chunk statistics, waits on the cluster barrier, then
    re-reads its chunk in reverse tile order (L2 hits: only ``n_clusters`` rows are in flight) for TV / alpha."""
    LN2: tl.constexpr = 0.6931471805599453
    NEG_INF: tl.constexpr = float("-inf")
    pid = tl.program_id(0)
    cid = pid // C
    rank = pid % C
    c0 = rank * chunk_cols
    c1 = tl.minimum(c0 + chunk_cols, vocab)
    n_ct = tl.cdiv(tl.maximum(c1 - c0, 0), BLOCK)
    offs = tl.arange(0, BLOCK)
    goffs = tl.arange(0, C)
    for row in range(cid, n_rows, n_clusters):
        row64 = tl.cast(row, tl.int64)
        v_row = v_ptr + row64 * stride_v
        d_row = d_ptr + row64 * stride_d
        mx = NEG_INF
        my = NEG_INF
        sx = 0.0
        sy = 0.0
        r = 0.0
        e = 0.0
        for i in tl.range(0, n_ct, num_stages=STAGES):
            cols = c0 + i * BLOCK + offs
            inb = cols < c1
            x = tl.load(v_row + cols, mask=inb, other=NEG_INF, eviction_policy=EVICT1).to(tl.float32) * scale2
            y = tl.load(d_row + cols, mask=inb, other=NEG_INF, eviction_policy=EVICT1).to(tl.float32) * scale2
            tile_mx, tile_my = tl.reduce((x, y), 0, _max_pair)
            mx_new = tl.maximum(mx, tile_mx)
            my_new = tl.maximum(my, tile_my)
            mx_ref = tl.where(mx_new == NEG_INF, 0.0, mx_new)
            my_ref = tl.where(my_new == NEG_INF, 0.0, my_new)
            cx = tl.exp2(mx - mx_ref)
            cy = tl.exp2(my - my_ref)
            dx = x - mx_ref
            wx = tl.exp2(dx)
            wy = tl.exp2(y - my_ref)
            fx = x > NEG_INF
            shift = tl.where(mx == NEG_INF, 0.0, mx - mx_ref)
            t_wx, t_wy, t_a, t_e = tl.reduce(
                (wx, wy, tl.where(fx, wx * dx, 0.0), tl.where(fx, wx * (x - y), 0.0)), 0, _sum_four)
            e = cx * e + t_e
            r = cx * (r + shift * sx) + t_a
            sx = cx * sx + t_wx
            sy = cy * sy + t_wy
            mx = mx_new
            my = my_new
        slot64 = row64 * C + rank
        st = stats_ptr + slot64 * 8
        tl.store(st + 0, mx)
        tl.store(st + 1, sx)
        tl.store(st + 2, my)
        tl.store(st + 3, sy)
        tl.store(st + 4, r)
        tl.store(st + 5, e)
        _cluster_barrier()
        sx_t, sy_t, r_t, e_t, log2_sx, lp, lq = _combine_chunks(stats_ptr, row64, goffs, C)
        acc_abs = tl.zeros([BLOCK], dtype=tl.float32)
        acc_min = tl.zeros([BLOCK], dtype=tl.float32)
        for i in tl.range(0, n_ct, num_stages=STAGES):
            cols = c0 + (n_ct - 1 - i) * BLOCK + offs
            inb = cols < c1
            x = tl.load(v_row + cols, mask=inb, other=NEG_INF, eviction_policy="evict_first")
            y = tl.load(d_row + cols, mask=inb, other=NEG_INF, eviction_policy="evict_first")
            px = tl.exp2(x.to(tl.float32) * scale2 - lp)
            qy = tl.exp2(y.to(tl.float32) * scale2 - lq)
            acc_abs += tl.abs(px - qy)
            acc_min += tl.minimum(px, qy)
        pt = part_ptr + slot64 * 2
        tl.store(pt + 0, tl.sum(acc_abs, 0))
        tl.store(pt + 1, tl.sum(acc_min, 0))
        if rank == 0:
            status = tl.where(sx_t > 0.0, 0, 1) + tl.where(sy_t > 0.0, 0, 2)
            entropy = LN2 * (log2_sx - r_t / sx_t)
            kl = LN2 * tl.maximum(e_t / sx_t - lp + lq, 0.0)
            kl = tl.where(e_t != e_t, float("inf"), kl)
            tl.store(ce_ptr + row64, entropy + kl)
            tl.store(kl_ptr + row64, kl)
            tl.store(status_ptr + row64, status)


def launch_cluster_stream(verifier_logits: torch.Tensor, drafter_logits: torch.Tensor, temperature: float,
                          cluster_size: int = 16, num_warps: int = 4, block: int = 2048, ctas_per_sm: int = 4,
                          evict1: str = "", stages: int = 1):
    """Probe launcher of the persistent streaming variant (no mask, no tasks)."""
    from kernels._device import sm_count

    n_rows, vocab = verifier_logits.shape
    device = verifier_logits.device
    chunk_cols = -(-vocab // cluster_size)
    block = min(block, triton.next_power_of_2(chunk_cols))
    n_clusters = max(1, min(n_rows, sm_count(device) * ctas_per_sm // cluster_size))
    f32 = dict(dtype=torch.float32, device=device)
    stats = torch.empty(n_rows * cluster_size * 8, **f32)
    part = torch.empty(n_rows * cluster_size, 2, **f32)
    ce = torch.empty(n_rows, **f32)
    kl = torch.empty(n_rows, **f32)
    status = torch.empty(n_rows, dtype=torch.int32, device=device)
    args = (verifier_logits, drafter_logits, verifier_logits.stride(0), drafter_logits.stride(0), stats, part,
            ce, kl, status, n_rows, vocab, chunk_cols, n_clusters, 1.4426950408889634 / temperature)
    meta = dict(C=cluster_size, BLOCK=block, EVICT1=evict1, STAGES=stages, num_warps=num_warps)
    compiled = _cluster_stream_kernel.warmup(*args, grid=(n_clusters * cluster_size,), **meta)
    if id(compiled) not in _PATCHED:
        nw, _, shared = compiled.packed_metadata
        compiled.packed_metadata = (nw, cluster_size, shared)
        _PATCHED.add(id(compiled))
    _cluster_stream_kernel[(n_clusters,)](*args, **meta)
    sums = part.view(n_rows, cluster_size, 2).sum(dim=1)
    tv = (0.5 * sums[:, 0]).clamp(0.0, 1.0)
    alpha = sums[:, 1].clamp(0.0, 1.0)
    return ce, kl, tv, alpha, status, compiled
