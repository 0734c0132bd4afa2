"""Cluster loss kernel: H(p, q) per row and its drafter-logit gradient, each logit read from DRAM once (Hopper).

The one-program-per-row loss (``kernels/divergence.py``) must read every row twice: pass 1 needs the whole row
before pass 2 can write ``(q - p)``, and a 608 KB row pair (V = 151936, bf16) does not stay in L2 while 1000+ rows
are in flight. Here a row is split over the ``C`` CTAs of a thread-block cluster (``C`` consecutive programs; CTA
``rank`` owns columns ``[rank * chunk_cols, (rank + 1) * chunk_cols)``). Each persistent cluster walks rows
``cid, cid + n_clusters, ...``; per row each CTA

1. copies its chunk of both logit rows into shared memory (``cp.async``, issued as soon as the previous row is done),
2. computes per-lane online statistics over the chunk (base 2: ``x = v log2(e) / T``, ``y = d log2(e) / T``; maxima
   ``mx, my``, normalisers ``sx = sum 2^(x - mx)``, ``sy = sum 2^(y - my)``, ``t = sum 2^(x - mx) (y - my)``), combines
   the lanes and publishes the chunk's statistics to a ``[N, C, 8]`` float32 scratch,
3. waits on the hardware cluster barrier (inline PTX ``barrier.cluster.arrive.release`` / ``wait.acquire``),
   combines the row's ``C`` chunk statistics into the row's ``Mx, Sx, My, Sy`` and ``t_row`` (relative to ``My``):
   ``lp = Mx + log2 Sx``, ``lq = My + log2 Sy``, ``H(p, q) = ln2 (log2 Sy - t_row / Sx)``,
4. writes ``grad = w (2^(y - lq) - 2^(x - lp))`` (``w = weight_n * grad_scale / T``, divided by ``max(count, 1)``
   for a masked mean) for its chunk from shared memory, in the gradient's dtype.

Traffic: both inputs read once, the gradient written once (3 units of [N, V] instead of the row kernel's 5).
Measured on an H100 (NOTES_divergence.md, "Session 12"): at 1024 x 151936 bf16 the launch takes 435 us against the
row kernel's 653 us, and the whole ``divergence_loss`` forward + backward 0.454 ms against 0.707 ms.

Triton 3.6 (the GPU machine's) has no cluster launch API for ordinary kernels, but its launcher already passes the
kernel's ``num_ctas`` to ``cuLaunchKernelEx`` as the cluster dimension: the kernel is compiled as an ordinary one-CTA
program and its launch metadata is patched to ``num_ctas = C`` (``_patch_cluster``). The kernel is written in Gluon
(Triton's explicit-layout dialect) because it needs shared memory and ``cp.async``. Anything unexpected (another
Triton, a compile error) turns the path off for the process, with a warning, and the row kernel runs instead.
"""

from __future__ import annotations

import os
import warnings

import torch
import triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the Triton build
    HAVE_GLUON = False

LOG2E = 1.4426950408889634
CLUSTER_SIZES = (2, 4, 8)  # 16 is capped at 7-8 active clusters per H100 (NOTES_divergence.md, "Session 12")
LANE_COLUMNS = 8  # K: contiguous columns per lane per tile (16-byte cp.async for 16-bit logits)
NUM_WARPS = 8
SMEM_PER_CTA = 110 * 1024  # one slot (both rows of a chunk) small enough for two CTAs per SM
TILE = 32 * NUM_WARPS * LANE_COLUMNS


if HAVE_GLUON:

    @gluon.jit
    def _exp2(x):
        """2^x as one ``ex2.approx.ftz.f32`` (libdevice's exp2f adds a denormal path; results below 2^-126 are 0)."""
        return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _cluster_barrier():
        """Every thread of every CTA of the cluster arrives (release) and waits (acquire)."""
        gl.inline_asm_elementwise(
            "barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n\tmov.u32 $0, 0;",
            "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _max2(a0, a1, b0, b1):
        return gl.maximum(a0, b0), gl.maximum(a1, b1)

    @gluon.jit
    def _add3(a0, a1, a2, b0, b1, b2):
        return a0 + b0, a1 + b1, a2 + b2

    @gluon.jit
    def _row_kept(mask_ptr, row, n_rows, HAS_MASK: gl.constexpr):
        keep = row < n_rows
        if HAS_MASK:
            keep = keep & (gl.load(mask_ptr + row, mask=row < n_rows, other=0) != 0)
        return keep

    @gluon.jit
    def _issue_row(buf, v_ptr, d_ptr, row, keep, stride_v, stride_d, c0, c1, offs2,
                   NT: gl.constexpr, TILE_: gl.constexpr):
        """``cp.async`` of this CTA's chunk of both rows into ``buf`` (one commit group, empty when not ``keep``)."""
        row64 = row.to(gl.int64)
        v_row = v_ptr + row64 * stride_v
        d_row = d_ptr + row64 * stride_d
        for t in gl.static_range(NT):
            cols = c0 + t * TILE_ + offs2
            inb = gl.max_constancy((cols < c1) & keep, [1, 8])
            async_copy.async_copy_global_to_shared(buf.index(t), v_row + cols, mask=inb, cache_modifier=".cg")
            async_copy.async_copy_global_to_shared(buf.index(NT + t), d_row + cols, mask=inb, cache_modifier=".cg")
        async_copy.commit_group()

    @gluon.jit
    def _load_tile(buf, t, c0, c1, offs2, scale2, MASKED: gl.constexpr, NT: gl.constexpr, TILE_: gl.constexpr,
                   layout: gl.constexpr):
        x = buf.index(t).load(layout).to(gl.float32) * scale2
        y = buf.index(NT + t).load(layout).to(gl.float32) * scale2
        if MASKED:
            inb = (c0 + t * TILE_ + offs2) < c1
            x = gl.where(inb, x, float("-inf"))
            y = gl.where(inb, y, float("-inf"))
        return x, y

    @gluon.jit
    def _ce_tile(x, y, mx, my, sx, sy, tt):
        """One [R, K] tile of per-lane online statistics: running maxima, normalisers and ``tt = sum wx (y - my)``
        (entries with ``x = -inf`` left out; ``x`` finite where ``y = -inf`` makes ``tt`` -inf: H(p, q) = +inf)."""
        NEG_INF: gl.constexpr = float("-inf")
        mx_new = gl.maximum(mx, gl.max(x, 1))
        my_new = gl.maximum(my, gl.max(y, 1))
        mx_ref = gl.where(mx_new == NEG_INF, 0.0, mx_new)
        my_ref = gl.where(my_new == NEG_INF, 0.0, my_new)
        a = _exp2(mx - mx_ref)
        b = _exp2(my - my_ref)
        shift_y = gl.where(my == NEG_INF, 0.0, my - my_ref)
        wx = _exp2(x - gl.expand_dims(mx_ref, 1))
        dy = y - gl.expand_dims(my_ref, 1)
        wy = _exp2(dy)
        tt = a * (tt + shift_y * sx) + gl.sum(gl.where(x > NEG_INF, wx * dy, 0.0), 1)
        sx = a * sx + gl.sum(wx, 1)
        sy = b * sy + gl.sum(wy, 1)
        return mx_new, my_new, sx, sy, tt

    @gluon.jit
    def _publish_chunk(st, mx, my, sx, sy, tt):
        """Combine the lanes into the chunk's ``(mx, sx, my, sy, t)`` and store them at ``st``."""
        NEG_INF: gl.constexpr = float("-inf")
        gmx, gmy = gl.reduce((mx, my), 0, _max2)
        gmx_ref = gl.where(gmx == NEG_INF, 0.0, gmx)
        gmy_ref = gl.where(gmy == NEG_INF, 0.0, gmy)
        live_x = sx != 0.0
        live_y = sy != 0.0
        f_x = gl.where(live_x, _exp2(mx - gmx_ref), 0.0)
        f_y = gl.where(live_y, _exp2(my - gmy_ref), 0.0)
        shift_y = gl.where(my == NEG_INF, 0.0, my - gmy_ref)
        c_sx, c_sy, c_t = gl.reduce(
            (gl.where(live_x, f_x * sx, 0.0), gl.where(live_y, f_y * sy, 0.0),
             gl.where(live_x, f_x * (tt + shift_y * sx), 0.0)), 0, _add3)
        gl.store(st + 0, gmx)
        gl.store(st + 1, c_sx)
        gl.store(st + 2, gmy)
        gl.store(st + 3, c_sy)
        gl.store(st + 4, c_t)

    # n_rows and n_clusters change from call to call; mask / weight / count may be views at any offset: none of them
    # specialises the kernel, so one compiled kernel per (dtypes, flags, layout) serves every call (see _COMPILED)
    @gluon.jit(do_not_specialize=["n_rows", "n_clusters"],
               do_not_specialize_on_alignment=["mask_ptr", "weight_ptr", "count_ptr"])
    def _cluster_loss_kernel(
        v_ptr, d_ptr, g_ptr, stride_v, stride_d, stride_g,
        mask_ptr, weight_ptr, count_ptr, stats_ptr, ce_ptr, status_ptr,
        n_rows, vocab, chunk_cols, n_clusters, scale2, grad_scale,
        HAS_MASK: gl.constexpr, HAS_WEIGHTS: gl.constexpr, HAS_COUNT: gl.constexpr,
        C: gl.constexpr, NT: gl.constexpr, K: gl.constexpr, WARPS: gl.constexpr,
    ):
        LN2: gl.constexpr = 0.6931471805599453
        NEG_INF: gl.constexpr = float("-inf")
        R: gl.constexpr = 32 * WARPS
        TILE_: gl.constexpr = R * K
        layout: gl.constexpr = gl.BlockedLayout([1, K], [32, 1], [WARPS, 1], [1, 0])
        lane_layout: gl.constexpr = gl.SliceLayout(1, layout)
        small: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        smem_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        buf = gl.allocate_shared_memory(v_ptr.dtype.element_ty, [2 * NT, R, K], smem_layout)
        pid = gl.program_id(0)
        cid = pid // C
        rank = pid % C
        c0 = rank * chunk_cols
        c1 = gl.minimum(c0 + chunk_cols, vocab)
        n_full = gl.maximum(c1 - c0, 0) // TILE_
        lanes = gl.arange(0, R, layout=lane_layout)
        ks = gl.arange(0, K, layout=gl.SliceLayout(0, layout))
        offs2 = gl.expand_dims(lanes, 1) * K + gl.expand_dims(ks, 0)
        goffs = gl.arange(0, C, layout=small)
        w_base = grad_scale
        if HAS_COUNT:  # "mean" over a mask: 1 / max(count, 1), counted on the device (no host sync)
            w_base = w_base / gl.maximum(gl.load(count_ptr), 1.0)
        n_mine = gl.cdiv(n_rows - cid, n_clusters)
        keep = _row_kept(mask_ptr, cid, n_rows, HAS_MASK)
        _issue_row(buf, v_ptr, d_ptr, cid, keep, stride_v, stride_d, c0, c1, offs2, NT, TILE_)
        for it in range(0, n_mine):
            row = cid + it * n_clusters
            row64 = row.to(gl.int64)
            g_row = g_ptr + row64 * stride_g
            async_copy.wait_group(0)
            gl.thread_barrier()
            if keep:  # the same for every CTA of the cluster (one row), so the barrier below stays matched
                mx = gl.full([R], NEG_INF, gl.float32, lane_layout)
                my = gl.full([R], NEG_INF, gl.float32, lane_layout)
                sx = gl.zeros([R], gl.float32, lane_layout)
                sy = gl.zeros([R], gl.float32, lane_layout)
                tt = gl.zeros([R], gl.float32, lane_layout)
                for t in range(0, n_full):
                    x, y = _load_tile(buf, t, c0, c1, offs2, scale2, False, NT, TILE_, layout)
                    mx, my, sx, sy, tt = _ce_tile(x, y, mx, my, sx, sy, tt)
                for t in range(n_full, NT):
                    x, y = _load_tile(buf, t, c0, c1, offs2, scale2, True, NT, TILE_, layout)
                    mx, my, sx, sy, tt = _ce_tile(x, y, mx, my, sx, sy, tt)
                _publish_chunk(stats_ptr + (row64 * C + rank) * 8, mx, my, sx, sy, tt)
                _cluster_barrier()
                sb = stats_ptr + (row64 * C + goffs) * 8
                mx_c = gl.load(sb + 0, cache_modifier=".cg")
                sx_c = gl.load(sb + 1, cache_modifier=".cg")
                my_c = gl.load(sb + 2, cache_modifier=".cg")
                sy_c = gl.load(sb + 3, cache_modifier=".cg")
                t_c = gl.load(sb + 4, cache_modifier=".cg")
                gx = gl.max(mx_c, 0)
                gy = gl.max(my_c, 0)
                gx = gl.where(gx == NEG_INF, 0.0, gx)
                gy = gl.where(gy == NEG_INF, 0.0, gy)
                live_x = sx_c != 0.0
                live_y = sy_c != 0.0
                f_x = gl.where(live_x, gl.exp2(mx_c - gx), 0.0)
                f_y = gl.where(live_y, gl.exp2(my_c - gy), 0.0)
                sx_t = gl.sum(gl.where(live_x, f_x * sx_c, 0.0), 0)
                sy_t = gl.sum(gl.where(live_y, f_y * sy_c, 0.0), 0)
                shift_y = gl.where(my_c == NEG_INF, 0.0, my_c - gy)
                t_t = gl.sum(gl.where(live_x, f_x * (t_c + shift_y * sx_c), 0.0), 0)
                log2_sy = gl.log2(sy_t)
                lp = gx + gl.log2(sx_t)
                lq = gy + log2_sy
                w = w_base
                if HAS_WEIGHTS:
                    w = w * gl.load(weight_ptr + row64)
                for t in range(0, NT):
                    x, y = _load_tile(buf, t, c0, c1, offs2, scale2, False, NT, TILE_, layout)
                    g = ((_exp2(y - lq) - _exp2(x - lp)) * w).to(g_ptr.dtype.element_ty)
                    cols = c0 + t * TILE_ + offs2
                    if t < n_full:
                        gl.store(g_row + cols, g)
                    else:
                        gl.store(g_row + cols, g, mask=cols < c1)
                if rank == 0:
                    ce = LN2 * (log2_sy - t_t / sx_t)
                    # a NaN sum over finite normalisers: an underflowed weight times an infinite difference (p > 0
                    # where q = 0): H(p, q) = +inf
                    ce = gl.where((t_t != t_t) & (sx_t == sx_t) & (sy_t == sy_t), float("inf"), ce)
                    gl.store(ce_ptr + row64, ce)
                    gl.store(status_ptr + row64, gl.where(sx_t > 0.0, 0, 1) + gl.where(sy_t > 0.0, 0, 2))
            else:
                zero = gl.zeros([R, K], g_ptr.dtype.element_ty, layout)
                for t in range(0, NT):
                    cols = c0 + t * TILE_ + offs2
                    gl.store(g_row + cols, zero, mask=cols < c1)
                if rank == 0:
                    gl.store(ce_ptr + row64, 0.0)
                    gl.store(status_ptr + row64, 0)
            gl.thread_barrier()  # every thread is done with the slot before it is refilled
            keep = _row_kept(mask_ptr, row + n_clusters, n_rows, HAS_MASK)
            _issue_row(buf, v_ptr, d_ptr, row + n_clusters, keep, stride_v, stride_d, c0, c1, offs2, NT, TILE_)
        async_copy.wait_group(0)


# "broken": the path is off for the process after a failure; "launches": kernel launches so far (tests check which
# path ran)
_STATE = {"broken": False, "launches": 0}
# (device, dtypes, flags, C, NT) -> (compiled kernel patched to launch as clusters, clusters that fit at once)
_COMPILED: dict[tuple, tuple] = {}


def cluster_loss_layout(vocab: int, elem_bytes: int) -> tuple[int, int, int] | None:
    """``(C, chunk_cols, NT)``: the smallest cluster whose chunk of both rows (``NT`` tiles of ``TILE`` columns, a
    16-column aligned ``chunk_cols`` per CTA) fits ``SMEM_PER_CTA``; None when none does."""
    for c in CLUSTER_SIZES:
        chunk_cols = -(-vocab // c)
        chunk_cols = -(-chunk_cols // 16) * 16
        nt = -(-chunk_cols // TILE)
        if 2 * nt * TILE * elem_bytes <= SMEM_PER_CTA:
            return c, chunk_cols, nt
    return None


def cluster_loss_supported(verifier_dtype: torch.dtype, drafter_dtype: torch.dtype, vocab: int, aligned: bool,
                           min_vocab: int) -> bool:
    """The shape and dtype part of the rule: the same 16-bit dtype on both inputs, ``V >= min_vocab``, ``V`` a
    multiple of 16, rows 16-element aligned (``aligned``: 16-byte ``cp.async``), and a layout that fits shared
    memory."""
    if verifier_dtype != drafter_dtype or verifier_dtype not in (torch.bfloat16, torch.float16):
        return False
    if vocab < min_vocab or vocab % 16 or not aligned:
        return False
    return cluster_loss_layout(vocab, 2) is not None  # 2 bytes: bf16 / fp16


def cluster_loss_eligible(verifier_logits: torch.Tensor, drafter_logits: torch.Tensor, grad_out: torch.Tensor,
                          device_major: int, min_vocab: int) -> bool:
    """Whether the cluster loss kernel applies: CUDA on Hopper (sm_90, where it was measured), not the interpreter,
    Gluon importable, the path not turned off by an earlier failure, and ``cluster_loss_supported``."""
    if _STATE["broken"] or not HAVE_GLUON or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if verifier_logits.device.type != "cuda" or device_major != 9:
        return False
    aligned = all(t.stride(-1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0
                  for t in (verifier_logits, drafter_logits, grad_out))
    return cluster_loss_supported(verifier_logits.dtype, drafter_logits.dtype, verifier_logits.shape[1], aligned,
                                  min_vocab)


def _patch_cluster(compiled, cluster_size: int) -> None:
    """Launch ``compiled`` as clusters of ``cluster_size`` CTAs: Triton 3.6's launcher reads ``num_ctas`` from
    ``packed_metadata = (num_warps, num_ctas, shared)`` and passes it to ``cuLaunchKernelEx`` as the cluster
    dimension (grid x ``num_ctas`` CTAs)."""
    packed = compiled.packed_metadata
    if not (isinstance(packed, tuple) and len(packed) == 3 and packed[1] in (1, cluster_size)):
        raise RuntimeError(f"unexpected launch metadata {packed!r} (Triton {triton.__version__})")
    compiled.packed_metadata = (packed[0], cluster_size, packed[2])  # idempotent: Triton's cache may hand it back


def _give_up(what: str, exc: Exception) -> None:
    """Turn the cluster path off for the process, with a warning; the caller falls back to the row kernel."""
    _STATE["broken"] = True
    warnings.warn(f"specdec: the cluster loss kernel {what} ({type(exc).__name__}: {exc}); using the "
                  "one-program-per-row kernel", RuntimeWarning, stacklevel=4)


def launch_cluster_loss(verifier_logits: torch.Tensor, drafter_logits: torch.Tensor, temperature: float,
                        grad_out: torch.Tensor, *, mask: torch.Tensor | None = None,
                        weights: torch.Tensor | None = None, grad_scale: float = 1.0,
                        grad_count: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(ce, status)`` ([N] float32 H(p, q), [N] int32 status as in ``kernels/divergence.py``) with ``grad_out``
    ([N, V]) filled with ``weights[n] * grad_scale * (q - p) / T`` (divided by ``max(grad_count, 1)`` when given);
    masked rows (``mask`` [N] uint8 == 0) get 0 everywhere. Call only where ``cluster_loss_eligible``; returns None
    (after a warning, for the rest of the process) if the kernel cannot be built or launched as a cluster.

    The first call per (device, dtypes, flags, layout) compiles the kernel, sizes the persistent grid with the
    occupancy API and patches the launch; later calls launch the compiled kernel directly (no JIT dispatch)."""
    n_rows, vocab = verifier_logits.shape
    device = verifier_logits.device
    c, chunk_cols, nt = cluster_loss_layout(vocab, verifier_logits.element_size())
    ce = torch.empty(n_rows, dtype=torch.float32, device=device)
    status = torch.empty(n_rows, dtype=torch.int32, device=device)
    if n_rows == 0:
        return ce, status
    stats = torch.empty(n_rows * c * 8, dtype=torch.float32, device=device)
    # one compiled kernel per key: the side inputs always reach it as uint8 / float32 / float32
    if mask is not None:
        mask = (mask if mask.dtype == torch.uint8 else mask != 0).to(torch.uint8).contiguous()
    weights = weights.to(torch.float32).contiguous() if weights is not None else None
    grad_count = grad_count.to(torch.float32).reshape(1) if grad_count is not None else None
    flags = (mask is not None, weights is not None, grad_count is not None)
    constexprs = (*flags, c, nt, LANE_COLUMNS, NUM_WARPS)
    key = (device.index, verifier_logits.dtype, grad_out.dtype, *constexprs)

    def arguments(clusters: int) -> tuple:
        return (verifier_logits, drafter_logits, grad_out, verifier_logits.stride(0), drafter_logits.stride(0),
                grad_out.stride(0), mask if mask is not None else ce, weights if weights is not None else ce,
                grad_count if grad_count is not None else ce, stats, ce, status, n_rows, vocab, chunk_cols,
                clusters, LOG2E / temperature, grad_scale / temperature)

    if key not in _COMPILED:
        try:
            estimate = max(1, torch.cuda.get_device_properties(device).multi_processor_count * 2 // c)
            meta = dict(HAS_MASK=flags[0], HAS_WEIGHTS=flags[1], HAS_COUNT=flags[2], C=c, NT=nt, K=LANE_COLUMNS,
                        WARPS=NUM_WARPS, num_warps=NUM_WARPS)
            compiled = _cluster_loss_kernel.warmup(*arguments(estimate), grid=(estimate * c,), **meta)
            compiled._init_handles()
            fit = int(triton.runtime.driver.active.utils.cuOccupancyMaxActiveClusters(
                compiled.function, compiled.metadata.shared, c))
            if fit < 1:
                raise RuntimeError(f"no cluster of {c} CTAs fits ({compiled.metadata.shared} bytes of shared memory)")
            _patch_cluster(compiled, c)
            _COMPILED[key] = (compiled, fit)
        except Exception as exc:  # noqa: BLE001 - any failure here falls back to the row kernel
            _give_up("is unavailable", exc)
            return None
    compiled, fit = _COMPILED[key]
    n_clusters = min(n_rows, fit)
    try:
        # the launcher takes every parameter in order, constexprs included (it skips them), as the JIT path does
        compiled[(n_clusters, 1, 1)](*arguments(n_clusters), *constexprs)
    except Exception as exc:  # noqa: BLE001 - a refused launch (cuLaunchKernelEx) falls back to the row kernel
        _give_up("could not be launched", exc)
        return None
    _STATE["launches"] += 1
    return ce, status


__all__ = ["HAVE_GLUON", "cluster_loss_eligible", "cluster_loss_layout", "cluster_loss_supported",
           "launch_cluster_loss"]
