"""Divergence kernel, version 3: each row is split into column chunks that stay in registers across the row's sync.

Why (``benchmarks/NOTES_divergence.md``): TV / alpha and the gradient need both normalisers ``Lp, Lq`` before their
pass, so a one-program-per-row kernel reads the logits twice from DRAM. Here a persistent grid of co-resident
programs splits every row into ``n_chunks`` chunks of at most ``CHUNK`` columns (one program per (row group,
chunk)); a program loads its whole chunk of both rows as one block, which then stays in registers:

1. pass 1 on the chunk (block maxima, ``sx = sum 2^(x - mx)``, ``sy``, and the rescaled sums ``r``, ``e`` of the
   version-1 kernel), published to ``stats[row, chunk, 0:7]`` as 64-bit words ``(float bits << 32) | (row + 1)``:
   the tag in every word makes each word self-validating, so no fence or counter is needed;
2. wait until the row's ``n_chunks`` records carry the row's tag (one vector load of all of them, repeated), combine
   them into the row's ``Lp, Lq``, H(p, q) and KL (the same sums as version 2);
3. pass 2 from the registers: ``p = w_x 2^(mx - Lp)`` and ``q = w_y 2^(my - Lq)`` (``REUSE``: the pass-1
   exponentials are kept; else they are recomputed from the raw logits), giving the chunk's ``sum |p - q|`` and
   ``sum min(p, q)`` (to a ``[N, n_chunks, 2]`` scratch summed in chunk order by a small second kernel), or the
   gradient ``w_n s (q - p)`` written in the drafter's dtype.

The loop is software-pipelined across rows: the load of the next row's chunk is issued before the wait and pass 2 of
the current row, so DRAM streams while a program waits. DRAM traffic: both inputs read once (+ the gradient written
once): the floor.

Co-residency: every program a program waits for must be running. The host sizes the grid to what fits on the device
(from the compiled kernel's registers and shared memory, after its first launch; before that a bound that holds for
any kernel). If a wait still exceeds ``max_spin`` polls (e.g. another stream's persistent kernel holds the SMs), the
program raises a sticky flag and computes the row's normalisers itself by streaming the whole row (slow, but right):
no hang and no wrong value. Under ``TRITON_INTERPRET=1`` (programs run one after another) the same kernel runs as two
launches: ``PHASE=1`` publishes every row's chunk statistics, ``PHASE=2`` recomputes pass 1, combines and runs pass 2.
"""

from __future__ import annotations

import triton
import triton.language as tl

LN2 = 0.6931471805599453
STATS_WORDS = 8  # mx, sx, my, sy, r, e, n_bad, (unused): one 64-bit word each


@triton.jit
def _pack(value, tag):
    """One 64-bit word: the float32 bits of ``value`` in the high half, ``tag`` (> 0) in the low half."""
    bits = value.to(tl.int32, bitcast=True).to(tl.int64)
    return (bits << 32) | tag.to(tl.int64)


@triton.jit
def _unpack(word):
    return (word >> 32).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _keep_row(mask_ptr, row, n_rows, HAS_MASK: tl.constexpr):
    keep = row < n_rows
    if HAS_MASK:
        keep = keep & (tl.load(mask_ptr + tl.minimum(row, n_rows - 1).to(tl.int64)) != 0)
    return keep


@triton.jit
def _max2(a0, b0, a1, b1):
    return tl.maximum(a0, a1), tl.maximum(b0, b1)


@triton.jit
def _add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _add5(a0, b0, c0, d0, e0, a1, b1, c1, d1, e1):
    return a0 + a1, b0 + b1, c0 + c1, d0 + d1, e0 + e1


@triton.jit
def _chunk_pass1(x_raw, y_raw, scale2, REUSE: tl.constexpr):
    """Statistics of one chunk (one block; -inf outside it). Returns the 7 published numbers and the carried pair.

    The seven block-wide reductions are two multi-operand reductions: each costs a shared-memory round trip and a
    barrier, which is what a program's chain of latencies is made of.
    """
    NEG_INF: tl.constexpr = float("-inf")
    x = x_raw.to(tl.float32) * scale2
    y = y_raw.to(tl.float32) * scale2
    mx, my = tl.reduce((x, y), 0, _max2)
    mx_ref = tl.where(mx == NEG_INF, 0.0, mx)
    my_ref = tl.where(my == NEG_INF, 0.0, my)
    dx = x - mx_ref
    wx = tl.exp2(dx)
    wy = tl.exp2(y - my_ref)
    fx = x > NEG_INF
    fy = y > NEG_INF
    sx, sy, r, e, n_bad = tl.reduce((wx, wy, tl.where(fx, wx * dx, 0.0), tl.where(fx & fy, wx * (x - y), 0.0),
                                     (fx & (y == NEG_INF)).to(tl.float32)), 0, _add5)
    if REUSE:
        return mx, sx, my, sy, r, e, n_bad, wx, wy, mx_ref, my_ref
    else:
        return mx, sx, my, sy, r, e, n_bad, x_raw, y_raw, mx_ref, my_ref


@triton.jit
def _publish(stats_ptr, row, chunk, n_chunks, mx, sx, my, sy, r, e, n_bad):
    tag = row + 1
    base = stats_ptr + (tl.cast(row, tl.int64) * n_chunks + chunk) * 8
    tl.store(base + 0, _pack(mx, tag))
    tl.store(base + 1, _pack(sx, tag))
    tl.store(base + 2, _pack(my, tag))
    tl.store(base + 3, _pack(sy, tag))
    tl.store(base + 4, _pack(r, tag))
    tl.store(base + 5, _pack(e, tag))
    tl.store(base + 6, _pack(n_bad, tag))


@triton.jit
def _row_stats_streamed(v_row, d_row, vocab, scale2, BLOCK: tl.constexpr):
    """The row's combined statistics by streaming the whole row (online log-sum-exp): the no-peer fallback."""
    NEG_INF: tl.constexpr = float("-inf")
    offs = tl.arange(0, BLOCK)
    mx = NEG_INF
    my = NEG_INF
    sx = 0.0
    sy = 0.0
    r = 0.0
    e = 0.0
    n_bad = 0.0
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        x = tl.load(v_row + cols, mask=cols < vocab, other=NEG_INF).to(tl.float32) * scale2
        y = tl.load(d_row + cols, mask=cols < vocab, other=NEG_INF).to(tl.float32) * scale2
        mx_new = tl.maximum(mx, tl.max(x, 0))
        my_new = tl.maximum(my, tl.max(y, 0))
        mx_ref = tl.where(mx_new == NEG_INF, 0.0, mx_new)
        my_ref = tl.where(my_new == NEG_INF, 0.0, my_new)
        cx = tl.exp2(mx - mx_ref)
        cy = tl.exp2(my - my_ref)
        shift_x = tl.where(mx == NEG_INF, 0.0, mx - mx_ref)
        dx = x - mx_ref
        wx = tl.exp2(dx)
        fx = x > NEG_INF
        fy = y > NEG_INF
        r = cx * (r + shift_x * sx) + tl.sum(tl.where(fx, wx * dx, 0.0), 0)
        e = cx * e + tl.sum(tl.where(fx & fy, wx * (x - y), 0.0), 0)
        n_bad += tl.sum((fx & (y == NEG_INF)).to(tl.float32), 0)
        sx = cx * sx + tl.sum(wx, 0)
        sy = cy * sy + tl.sum(tl.exp2(y - my_ref), 0)
        mx = mx_new
        my = my_new
    return tl.where(mx == NEG_INF, 0.0, mx), sx, tl.where(my == NEG_INF, 0.0, my), sy, r, e, n_bad


@triton.jit
def _row_stats(stats_ptr, abort_ptr, v_row, d_row, row, n_chunks, vocab, scale2, max_spin,
               REC: tl.constexpr, SLOW_BLOCK: tl.constexpr):
    """Wait for the row's chunk records and combine them (or stream the row if the wait gives up).

    The records are loaded as one 1-D block of ``REC >= 32 * num_warps`` words, so that no word is held twice: a
    reduction over a replicated layout reads one copy only, and a copy that was not checked could hold a stale
    word. The combine works on the same registers (reshaped), i.e. on words that were all checked.
    """
    NEG_INF: tl.constexpr = float("-inf")
    tag = row + 1
    idx = tl.arange(0, REC)
    live = (idx < n_chunks * 8) & ((idx % 8) < 7)
    ptrs = stats_ptr + tl.cast(row, tl.int64) * n_chunks * 8 + idx
    # one reduction counts the missing words and reads the abort flag (lane 0 only): every thread sees the same
    # two numbers, so the threads of the program never take different branches
    words = tl.load(ptrs, mask=live, other=0, volatile=True)
    both = tl.sum(tl.where(live & (words.to(tl.int32) != tag), 1, 0))
    missing = both
    aborted = 0
    if missing > 0:
        spins = 0
        while (missing > 0) & (spins < max_spin) & (aborted == 0):
            words = tl.load(ptrs, mask=live, other=0, volatile=True)
            flag = tl.load(abort_ptr + idx * 0, mask=idx == 0, other=0, volatile=True)
            both = tl.sum(tl.where(live & (words.to(tl.int32) != tag), 1, 0) + flag * REC)
            missing = both % REC
            aborted = both // REC
            spins += 1
        if missing > 0:
            tl.atomic_xchg(abort_ptr, 1, sem="relaxed")
    if missing > 0:
        mx, sx, my, sy, r, e, n_bad = _row_stats_streamed(v_row, d_row, vocab, scale2, SLOW_BLOCK)
    else:
        vals = tl.reshape(_unpack(words), (REC // 8, 8))
        word = tl.arange(0, 8)[None, :]
        chunk_live = tl.arange(0, REC // 8) < n_chunks
        mx_c = tl.where(chunk_live, tl.sum(tl.where(word == 0, vals, 0.0), 1), NEG_INF)
        sx_c = tl.sum(tl.where(word == 1, vals, 0.0), 1)
        my_c = tl.where(chunk_live, tl.sum(tl.where(word == 2, vals, 0.0), 1), NEG_INF)
        sy_c = tl.sum(tl.where(word == 3, vals, 0.0), 1)
        r_c = tl.sum(tl.where(word == 4, vals, 0.0), 1)
        e_c = tl.sum(tl.where(word == 5, vals, 0.0), 1)
        nb_c = tl.sum(tl.where(word == 6, vals, 0.0), 1)
        mx, my = tl.reduce((mx_c, my_c), 0, _max2)
        mx = tl.where(mx == NEG_INF, 0.0, mx)
        my = tl.where(my == NEG_INF, 0.0, my)
        # chunks with nothing (sum 0: all -inf, or padding) drop out; NaN sums (NaN / +inf logits) propagate
        live_x = sx_c != 0.0
        live_y = sy_c != 0.0
        f_x = tl.where(live_x, tl.exp2(mx_c - mx), 0.0)
        f_y = tl.where(live_y, tl.exp2(my_c - my), 0.0)
        sx, sy, r, e, n_bad = tl.reduce((tl.where(live_x, f_x * sx_c, 0.0), tl.where(live_y, f_y * sy_c, 0.0),
                                         tl.where(live_x, f_x * (r_c + (mx_c - mx) * sx_c), 0.0),
                                         tl.where(live_x, f_x * e_c, 0.0), nb_c), 0, _add5)
    return mx, sx, my, sy, r, e, n_bad


@triton.jit
def _row_pass2(
    v_row, d_row, row, chunk, c_start, cols, own, a, b, mx_own, my_own, keep,
    weight_ptr, ce_ptr, kl_ptr, status_ptr, part_ptr, grad_ptr, stride_g, stats_ptr, abort_ptr,
    n_chunks, vocab, scale2, grad_scale, max_spin,
    HAS_WEIGHTS: tl.constexpr, COMPUTE_TV: tl.constexpr, WRITE_GRAD: tl.constexpr, REUSE: tl.constexpr,
    CARRY: tl.constexpr, REC: tl.constexpr, SLOW_BLOCK: tl.constexpr,
):
    """Combine the row's statistics, then TV/alpha partials or the gradient of this chunk from registers."""
    LN2_: tl.constexpr = 0.6931471805599453
    row64 = tl.cast(row, tl.int64)
    if keep:
        mx, sx, my, sy, r, e, n_bad = _row_stats(stats_ptr, abort_ptr, v_row, d_row, row, n_chunks, vocab, scale2,
                                                 max_spin, REC, SLOW_BLOCK)
        log2_sx = tl.log2(sx)
        log2_sy = tl.log2(sy)
        lp = mx + log2_sx
        lq = my + log2_sy
        if not CARRY:  # the chunk is read again (from L2: this program read it a few microseconds ago)
            p = tl.exp2(tl.load(v_row + cols, mask=own, other=float("-inf"), eviction_policy="evict_first")
                        .to(tl.float32) * scale2 - lp)
            q = tl.exp2(tl.load(d_row + cols, mask=own, other=float("-inf"), eviction_policy="evict_first")
                        .to(tl.float32) * scale2 - lq)
        elif REUSE:
            p = a * tl.exp2(mx_own - lp)
            q = b * tl.exp2(my_own - lq)
        else:
            p = tl.exp2(a.to(tl.float32) * scale2 - lp)
            q = tl.exp2(b.to(tl.float32) * scale2 - lq)
        if chunk == 0:
            entropy = LN2_ * (log2_sx - r / sx)
            kl = LN2_ * tl.maximum(e / sx - lp + lq, 0.0)
            kl = tl.where(n_bad > 0.0, float("inf"), kl)
            tl.store(ce_ptr + row64, entropy + kl)
            tl.store(status_ptr + row64, tl.where(sx > 0.0, 0, 1) + tl.where(sy > 0.0, 0, 2))
            if COMPUTE_TV:
                tl.store(kl_ptr + row64, kl)
        if COMPUTE_TV:
            abs_sum, min_sum = tl.reduce((tl.abs(p - q), tl.minimum(p, q)), 0, _add2)
            pt = part_ptr + (row64 * n_chunks + chunk) * 2
            tl.store(pt + 0, abs_sum)
            tl.store(pt + 1, min_sum)
        if WRITE_GRAD:
            w = grad_scale
            if HAS_WEIGHTS:
                w = w * tl.load(weight_ptr + row64).to(tl.float32)
            g = (q - p) * w
            tl.store(grad_ptr + row64 * stride_g + cols, g.to(grad_ptr.dtype.element_ty), mask=own)
    else:
        if chunk == 0:
            tl.store(ce_ptr + row64, 0.0)
            tl.store(status_ptr + row64, 0)
            if COMPUTE_TV:
                tl.store(kl_ptr + row64, 0.0)
        if COMPUTE_TV:
            pt = part_ptr + (row64 * n_chunks + chunk) * 2
            tl.store(pt + 0, 0.0)
            tl.store(pt + 1, 0.0)
        if WRITE_GRAD:
            zero = tl.zeros(cols.shape, dtype=grad_ptr.dtype.element_ty)
            tl.store(grad_ptr + row64 * stride_g + cols, zero, mask=own)


@triton.jit
def _divergence_resident_kernel(
    v_ptr, d_ptr, stride_v, stride_d, mask_ptr, weight_ptr,
    ce_ptr, kl_ptr, status_ptr, part_ptr, grad_ptr, stride_g, stats_ptr, abort_ptr,
    n_rows, vocab, n_groups, n_chunks, chunk_cols, scale2, grad_scale, max_spin,
    HAS_MASK: tl.constexpr, HAS_WEIGHTS: tl.constexpr, COMPUTE_TV: tl.constexpr, WRITE_GRAD: tl.constexpr,
    PHASE: tl.constexpr, REUSE: tl.constexpr, CARRY: tl.constexpr, PIPE: tl.constexpr, CHUNK: tl.constexpr,
    REC: tl.constexpr, SLOW_BLOCK: tl.constexpr,
):
    """One program per (row group, chunk); rows ``group, group + n_groups, ...``. See the module docstring."""
    NEG_INF: tl.constexpr = float("-inf")
    pid = tl.program_id(0)
    group = pid // n_chunks
    chunk = pid % n_chunks
    c_start = chunk * chunk_cols
    c_end = tl.minimum(c_start + chunk_cols, vocab)
    cols = c_start + tl.arange(0, CHUNK)
    own = cols < c_end
    if (PHASE == 0) and PIPE:
        # prologue: the first row's chunk, its statistics published
        first = group
        keep_first = _keep_row(mask_ptr, first, n_rows, HAS_MASK)
        lim_first = tl.where(keep_first, c_end, c_start)
        first64 = tl.cast(first, tl.int64)
        x_first = tl.load(v_ptr + first64 * stride_v + cols, mask=cols < lim_first, other=NEG_INF)
        y_first = tl.load(d_ptr + first64 * stride_d + cols, mask=cols < lim_first, other=NEG_INF)
        mx, sx, my, sy, r, e, n_bad, a, b, mx_own, my_own = _chunk_pass1(x_first, y_first, scale2, REUSE)
        if keep_first:
            _publish(stats_ptr, first, chunk, n_chunks, mx, sx, my, sy, r, e, n_bad)
        for row in range(group, n_rows, n_groups):
            # the next row's chunk is in flight while this row waits for its peers and runs pass 2
            nxt = row + n_groups
            keep_next = _keep_row(mask_ptr, nxt, n_rows, HAS_MASK)
            lim_next = tl.where(keep_next, c_end, c_start)
            nxt64 = tl.cast(nxt, tl.int64)
            x_next = tl.load(v_ptr + nxt64 * stride_v + cols, mask=cols < lim_next, other=NEG_INF)
            y_next = tl.load(d_ptr + nxt64 * stride_d + cols, mask=cols < lim_next, other=NEG_INF)
            keep = _keep_row(mask_ptr, row, n_rows, HAS_MASK)
            row64 = tl.cast(row, tl.int64)
            _row_pass2(v_ptr + row64 * stride_v, d_ptr + row64 * stride_d, row, chunk, c_start, cols, own,
                       a, b, mx_own, my_own, keep,
                       weight_ptr, ce_ptr, kl_ptr, status_ptr, part_ptr, grad_ptr, stride_g, stats_ptr, abort_ptr,
                       n_chunks, vocab, scale2, grad_scale, max_spin,
                       HAS_WEIGHTS, COMPUTE_TV, WRITE_GRAD, REUSE, CARRY, REC, SLOW_BLOCK)
            mx, sx, my, sy, r, e, n_bad, a, b, mx_own, my_own = _chunk_pass1(x_next, y_next, scale2, REUSE)
            if keep_next:
                _publish(stats_ptr, nxt, chunk, n_chunks, mx, sx, my, sy, r, e, n_bad)
    else:
        for row in range(group, n_rows, n_groups):
            keep = _keep_row(mask_ptr, row, n_rows, HAS_MASK)
            lim = tl.where(keep, c_end, c_start)
            row64 = tl.cast(row, tl.int64)
            x_raw = tl.load(v_ptr + row64 * stride_v + cols, mask=cols < lim, other=NEG_INF)
            y_raw = tl.load(d_ptr + row64 * stride_d + cols, mask=cols < lim, other=NEG_INF)
            mx, sx, my, sy, r, e, n_bad, a, b, mx_own, my_own = _chunk_pass1(x_raw, y_raw, scale2, REUSE)
            if PHASE != 2:
                if keep:
                    _publish(stats_ptr, row, chunk, n_chunks, mx, sx, my, sy, r, e, n_bad)
            if PHASE != 1:
                _row_pass2(v_ptr + row64 * stride_v, d_ptr + row64 * stride_d, row, chunk, c_start, cols, own,
                           a, b, mx_own, my_own, keep,
                           weight_ptr, ce_ptr, kl_ptr, status_ptr, part_ptr, grad_ptr, stride_g, stats_ptr,
                           abort_ptr, n_chunks, vocab, scale2, grad_scale, max_spin,
                           HAS_WEIGHTS, COMPUTE_TV, WRITE_GRAD, REUSE, CARRY, REC, SLOW_BLOCK)


@triton.jit
def _tv_finalize_kernel(
    part_ptr, mask_ptr, task_ptr, ce_ptr, kl_ptr, tv_ptr, alpha_ptr,
    task_ce_ptr, task_kl_ptr, task_tv_ptr, task_alpha_ptr, task_count_ptr,
    n_rows, n_chunks,
    HAS_MASK: tl.constexpr, HAS_TASKS: tl.constexpr, ROWS: tl.constexpr, G_POW2: tl.constexpr,
):
    """TV and alpha per row from the chunk partials (summed in chunk order), and the per-task float64 sums."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    in_rows = rows < n_rows
    rows64 = rows.to(tl.int64)
    goffs = tl.arange(0, G_POW2)
    pmask = in_rows[:, None] & (goffs[None, :] < n_chunks)
    pb = part_ptr + (rows64[:, None] * n_chunks + goffs[None, :]) * 2
    abs_sum = tl.sum(tl.load(pb + 0, mask=pmask, other=0.0), 1)
    min_sum = tl.sum(tl.load(pb + 1, mask=pmask, other=0.0), 1)
    tv = tl.minimum(tl.maximum(0.5 * abs_sum, 0.0), 1.0)
    alpha = tl.minimum(tl.maximum(min_sum, 0.0), 1.0)
    tl.store(tv_ptr + rows64, tv, mask=in_rows)
    tl.store(alpha_ptr + rows64, alpha, mask=in_rows)
    if HAS_TASKS:
        keep = in_rows
        if HAS_MASK:
            keep = keep & (tl.load(mask_ptr + rows64, mask=in_rows, other=0) != 0)
        task = tl.load(task_ptr + rows64, mask=in_rows, other=-1).to(tl.int64)
        keep = keep & (task >= 0)
        task = tl.where(keep, task, 0)
        ce = tl.load(ce_ptr + rows64, mask=keep, other=0.0)
        kl = tl.load(kl_ptr + rows64, mask=keep, other=0.0)
        tl.atomic_add(task_ce_ptr + task, ce.to(tl.float64), mask=keep)
        tl.atomic_add(task_kl_ptr + task, kl.to(tl.float64), mask=keep)
        tl.atomic_add(task_tv_ptr + task, tv.to(tl.float64), mask=keep)
        tl.atomic_add(task_alpha_ptr + task, alpha.to(tl.float64), mask=keep)
        tl.atomic_add(task_count_ptr + task, tl.where(keep, 1, 0).to(tl.int64), mask=keep)


def resident_layout(vocab: int, chunk: int) -> tuple[int, int]:
    """``(n_chunks, chunk_cols)`` for register blocks of ``chunk`` columns: balanced, a multiple of 16 columns."""
    n_chunks = triton.cdiv(vocab, chunk)
    cols = min(chunk, triton.cdiv(triton.cdiv(vocab, n_chunks), 16) * 16)
    return n_chunks, cols


__all__ = ["_divergence_resident_kernel", "_tv_finalize_kernel", "resident_layout"]
