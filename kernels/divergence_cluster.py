"""Cluster kernels (Hopper): the divergence forward and the loss with its gradient, each logit read from DRAM once.

The one-program-per-row kernel (:mod:`.divergence`) reads every row twice: TV / alpha and the gradient need the
row's normalisers, i.e. the whole row, and a 608 KB row pair (V = 151936, bf16) does not stay in L2 while 1000+ rows
are in flight. Here a row is split over the ``C`` CTAs of a thread-block cluster (``C`` consecutive programs; CTA
``rank`` owns columns ``[rank * chunk_cols, (rank + 1) * chunk_cols)``), whose chunks of both rows fit in shared
memory. Each persistent cluster walks rows ``cid, cid + n_clusters, ...``; per row each CTA

1. reduces its chunk tile by tile as the tiles land (``cp.async``, one commit group per tile): per-lane online
   statistics in base 2 (``x = v log2(e) / T``, ``y = d log2(e) / T``): maxima ``mx, my``, normalisers
   ``sx = sum 2^(x - mx)``, ``sy = sum 2^(y - my)``, and ``sum 2^(x - mx) (x - mx)``, ``sum 2^(x - mx) (x - y)``
   (forward) or ``sum 2^(x - mx) (y - my)`` (loss); a chunk with a ``-inf`` verifier logit is redone with selects
   (``_lane_stats``) so that the common case pays none,
2. combines its lanes and pushes the chunk's statistics into every CTA of the cluster (distributed shared memory),
   waits on the hardware cluster barrier (``barrier.cluster.arrive.release`` / ``wait.acquire``), and combines the
   row's ``C`` chunks: ``lp = Mx + log2 Sx``, ``lq = My + log2 Sy``, H(p, q), KL(p || q),
3. makes a second pass over its chunk *in shared memory*: the forward sums ``|p - q|`` and ``min(p, q)`` (pushed to
   CTA 0, which finishes TV and alpha after the next barrier, in a fixed order), the loss writes
   ``grad = w (2^(y - lq) - 2^(x - lp))`` (``w = weight_n * grad_scale / T``, divided by ``max(count, 1)`` for a
   masked mean) in the gradient's dtype; each tile, once read, is refilled with the next row's copy, so the next
   row streams in while this one finishes.

Traffic: both inputs read once (+ the gradient written once): 2 units of [N, V] for the forward (row kernel: 4), 3 for
the loss (row kernel: 5). Every thread copies and reads only its own 16-byte pieces, so the row chunks are reached
through inline PTX (``ld.shared``, ``cp.async``) in a region after the compiler's own shared memory, where the
compiler's analysis would otherwise put a CTA-wide barrier before every copy and read. The kernels are written in
Gluon (Triton's explicit-layout dialect); :mod:`.divergence_cluster_launch` compiles and launches them as clusters.
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the Triton build
    HAVE_GLUON = False

CLUSTER_SIZES = (2, 4, 8)  # 16 CTAs: at most 7-8 active clusters on an H100
LANE_COLUMNS = 8  # K: contiguous columns per lane per tile (16-byte cp.async for 16-bit logits)
NUM_WARPS = 8
SMEM_PER_CTA = 110 * 1024  # one slot (both rows of a chunk) small enough for two CTAs per SM
TILE = 32 * NUM_WARPS * LANE_COLUMNS


if HAVE_GLUON:
    # cp.async.wait_group takes an immediate: one string per count (a chunk has at most 13 tiles, see cluster_layout)
    _WAIT_GROUP_ASM = gl.constexpr(tuple(f"cp.async.wait_group {n};\n\tmov.u32 $0, 0;" for n in range(16)))

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
    def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
        return a0 + b0, a1 + b1, a2 + b2, a3 + b3

    @gluon.jit
    def _add2(a0, a1, b0, b1):
        return a0 + b0, a1 + b1

    @gluon.jit
    def _row_kept(mask_ptr, row, n_rows, HAS_MASK: gl.constexpr):
        keep = row < n_rows
        if HAS_MASK:
            keep = keep & (gl.load(mask_ptr + row, mask=row < n_rows, other=0) != 0)
        return keep

    # The row chunks live in a shared-memory region of this module's own (after the compiler's scratch, at byte
    # ``region`` of the dynamic shared memory; ``_launch`` sizes it) and are reached through inline PTX: the
    # compiler's shared-memory analysis cannot see that every thread copies and reads only its own 16-byte pieces,
    # and would put a CTA-wide barrier before every copy and every read. Piece ``(input, tile, lane)`` (input 0 =
    # verifier, 1 = drafter) holds the lane's ``K = 8`` contiguous columns of that tile at byte
    # ``region + ((input * NT + tile) * R + lane) * 16``.

    @gluon.jit
    def _smem_base():
        """Byte address (shared window) of the dynamic shared memory."""
        return gl.inline_asm_elementwise("mov.u32 $0, global_smem;", "=r", [], dtype=gl.int32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def _copy_piece(smem_addr, src, live):
        """``cp.async`` of 16 bytes per lane from ``src`` to ``smem_addr`` ([R] each); zero-filled, nothing read,
        where not ``live``."""
        gl.inline_asm_elementwise(
            "cp.async.cg.shared.global [$1], [$2], 16, $3;\n\tmov.u32 $0, 0;", "=r,r,l,r",
            [smem_addr, src, gl.where(live, 16, 0)], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _commit():
        gl.inline_asm_elementwise("cp.async.commit_group;\n\tmov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _wait(N: gl.constexpr):
        """``cp.async.wait_group N``: at most ``N`` of this thread's newest commit groups still in flight."""
        gl.inline_asm_elementwise(_WAIT_GROUP_ASM[N], "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _issue_tile(piece, t, v_row, d_row, c0, c1, lanes, keep, NT: gl.constexpr, TILE_: gl.constexpr,
                    R: gl.constexpr, K: gl.constexpr):
        """Tile ``t`` of this CTA's chunk ``[c0, c1)`` of both rows (``v_row``, ``d_row``: row pointers) as one
        commit group, empty copies when not ``keep``; ``piece`` [R]: each lane's byte address of piece (0, 0, lane)."""
        cols = c0 + t * TILE_ + lanes * K
        live = (cols < c1) & keep
        for j in gl.static_range(K // 8):
            _copy_piece(piece + t * (R * K * 2) + 16 * j, v_row + cols + 8 * j, live)
            _copy_piece(piece + (NT + t) * (R * K * 2) + 16 * j, d_row + cols + 8 * j, live)
        _commit()

    @gluon.jit
    def _issue_row(piece, v_row, d_row, c0, c1, lanes, keep, NT: gl.constexpr, TILE_: gl.constexpr,
                   R: gl.constexpr, K: gl.constexpr):
        """All ``NT`` tiles of a row (``NT`` commit groups)."""
        for t in gl.static_range(NT):
            _issue_tile(piece, t, v_row, d_row, c0, c1, lanes, keep, NT, TILE_, R, K)

    @gluon.jit
    def _load_piece(addr2, IS_BF16: gl.constexpr):
        """This lane's 8 16-bit logits of one piece as float32 ([R, K]; ``addr2``: the piece's address, broadcast
        over K): one 16-byte shared-memory load, then one integer op per logit for bf16 (its float32 is the 16 bits
        shifted up) or a ``cvt`` per logit for fp16."""
        if IS_BF16:
            asm: gl.constexpr = (
                "{\n\t.reg .b32 w<4>;\n\tld.shared.v4.b32 {w0, w1, w2, w3}, [$8];\n\t"
                "shl.b32 $0, w0, 16;\n\tand.b32 $1, w0, 0xffff0000;\n\t"
                "shl.b32 $2, w1, 16;\n\tand.b32 $3, w1, 0xffff0000;\n\t"
                "shl.b32 $4, w2, 16;\n\tand.b32 $5, w2, 0xffff0000;\n\t"
                "shl.b32 $6, w3, 16;\n\tand.b32 $7, w3, 0xffff0000;\n\t}")
        else:
            asm: gl.constexpr = (
                "{\n\t.reg .b32 w<4>;\n\t.reg .b16 h<8>;\n\tld.shared.v4.b32 {w0, w1, w2, w3}, [$8];\n\t"
                "mov.b32 {h0, h1}, w0;\n\tmov.b32 {h2, h3}, w1;\n\tmov.b32 {h4, h5}, w2;\n\t"
                "mov.b32 {h6, h7}, w3;\n\tcvt.f32.f16 $0, h0;\n\tcvt.f32.f16 $1, h1;\n\tcvt.f32.f16 $2, h2;\n\t"
                "cvt.f32.f16 $3, h3;\n\tcvt.f32.f16 $4, h4;\n\tcvt.f32.f16 $5, h5;\n\tcvt.f32.f16 $6, h6;\n\t"
                "cvt.f32.f16 $7, h7;\n\t}")
        return gl.inline_asm_elementwise(asm, "=f,=f,=f,=f,=f,=f,=f,=f,r,r,r,r,r,r,r,r", [addr2], dtype=gl.float32,
                                         is_pure=False, pack=8)

    @gluon.jit
    def _raw_tile(piece2, t, c0, c1, offs2, dtype: gl.constexpr, MASKED: gl.constexpr, NT: gl.constexpr,
                  TILE_: gl.constexpr, R: gl.constexpr):
        K: gl.constexpr = TILE_ // R
        """Tile ``t`` of both chunks as unscaled float32 logits ([R, K]); -inf outside the chunk when ``MASKED``.
        ``piece2`` [R, K]: the byte address of the 8-column piece each entry of tile 0 of the verifier lies in."""
        rx = _load_piece(piece2 + t * (R * K * 2), dtype == gl.bfloat16)
        ry = _load_piece(piece2 + (NT + t) * (R * K * 2), dtype == gl.bfloat16)
        if MASKED:
            inb = (c0 + t * TILE_ + offs2) < c1
            rx = gl.where(inb, rx, float("-inf"))
            ry = gl.where(inb, ry, float("-inf"))
        return rx, ry

    @gluon.jit
    def _stats_tile(rx, ry, scale2, mx, my, sx, sy, s3, s4, FORWARD: gl.constexpr, SAFE: gl.constexpr):
        """One [R, K] tile of per-lane online statistics, base 2 (``x = rx * scale2``, ``y = ry * scale2``): maxima
        ``mx, my``, normalisers ``sx = sum 2^(x - mx)``, ``sy = sum 2^(y - my)``, and with ``wx = 2^(x - mx)``
        forward: ``s3 = sum wx (x - mx)``, ``s4 = sum wx (rx - ry)`` (unscaled); loss: ``s3 = sum wx (y - my)``.

        ``SAFE`` leaves out entries with ``x = -inf`` (their products would be 0 * inf = NaN). Without it a lane's
        sums turn NaN wherever ``x = -inf``; the caller then redoes the chunk with ``SAFE`` (``_lane_stats``), so the
        common finite case pays no per-entry select. ``x`` finite where ``y = -inf`` makes the sums infinite (or NaN
        where ``wx`` underflowed), i.e. H(p, q) = KL = +inf."""
        NEG_INF: gl.constexpr = float("-inf")
        mx_new = gl.maximum(mx, gl.max(rx, 1) * scale2)
        my_new = gl.maximum(my, gl.max(ry, 1) * scale2)
        mx_ref = gl.where(mx_new == NEG_INF, 0.0, mx_new)
        my_ref = gl.where(my_new == NEG_INF, 0.0, my_new)
        a = _exp2(mx - mx_ref)
        b = _exp2(my - my_ref)
        ex = rx * scale2 - gl.expand_dims(mx_ref, 1)
        ey = ry * scale2 - gl.expand_dims(my_ref, 1)
        wx = _exp2(ex)
        wy = _exp2(ey)
        if FORWARD:
            shift = gl.where(mx == NEG_INF, 0.0, mx - mx_ref)
            if SAFE:
                fx = rx > NEG_INF
                t3 = gl.sum(gl.where(fx, wx * ex, 0.0), 1)
                t4 = gl.sum(gl.where(fx, wx * (rx - ry), 0.0), 1)
            else:
                t3 = gl.sum(wx * ex, 1)
                t4 = gl.sum(wx * (rx - ry), 1)
            s4 = a * s4 + t4
        else:
            shift = gl.where(my == NEG_INF, 0.0, my - my_ref)
            if SAFE:
                t3 = gl.sum(gl.where(rx > NEG_INF, wx * ey, 0.0), 1)
            else:
                t3 = gl.sum(wx * ey, 1)
        s3 = a * (s3 + shift * sx) + t3
        sx = a * sx + gl.sum(wx, 1)
        sy = b * sy + gl.sum(wy, 1)
        return mx_new, my_new, sx, sy, s3, s4

    @gluon.jit
    def _lane_init(R: gl.constexpr, layout: gl.constexpr):
        """Empty per-lane statistics ([R] each): maxima -inf, sums 0."""
        lane_layout: gl.constexpr = gl.SliceLayout(1, layout)
        mx = gl.full([R], float("-inf"), gl.float32, lane_layout)
        zero = gl.zeros([R], gl.float32, lane_layout)
        return mx, mx, zero, zero, zero, zero

    @gluon.jit
    def _lane_pass(piece2, c0, c1, offs2, scale2, dtype: gl.constexpr, FORWARD: gl.constexpr, NT: gl.constexpr,
                   N_FULL: gl.constexpr, TILE_: gl.constexpr, R: gl.constexpr, layout: gl.constexpr):
        """Per-lane statistics over the chunk in shared memory, unrolled: tile ``t`` waits only for its own copy
        group (the copies of later tiles stay in flight while earlier tiles are reduced); tiles from ``N_FULL`` on
        are masked and safe."""
        mx, my, sx, sy, s3, s4 = _lane_init(R, layout)
        for t in gl.static_range(NT):
            _wait(NT - 1 - t)
            rx, ry = _raw_tile(piece2, t, c0, c1, offs2, dtype, t >= N_FULL, NT, TILE_, R)
            mx, my, sx, sy, s3, s4 = _stats_tile(rx, ry, scale2, mx, my, sx, sy, s3, s4, FORWARD, t >= N_FULL)
        return mx, my, sx, sy, s3, s4

    @gluon.jit
    def _lane_pass_safe(piece2, c0, c1, offs2, scale2, dtype: gl.constexpr, FORWARD: gl.constexpr,
                        NT: gl.constexpr, TILE_: gl.constexpr, R: gl.constexpr, layout: gl.constexpr):
        """``_lane_pass`` with the safe tile everywhere, as a loop (the rare path: its code stays small)."""
        mx, my, sx, sy, s3, s4 = _lane_init(R, layout)
        for t in range(0, NT):
            rx, ry = _raw_tile(piece2, t, c0, c1, offs2, dtype, True, NT, TILE_, R)
            mx, my, sx, sy, s3, s4 = _stats_tile(rx, ry, scale2, mx, my, sx, sy, s3, s4, FORWARD, True)
        return mx, my, sx, sy, s3, s4

    @gluon.jit
    def _lane_stats(piece2, c0, c1, offs2, scale2, dtype: gl.constexpr, FORWARD: gl.constexpr, NT: gl.constexpr,
                    N_FULL: gl.constexpr, TILE_: gl.constexpr, R: gl.constexpr, layout: gl.constexpr):
        """Per-lane statistics of the chunk (``mx, my, sx, sy, s3, s4``, each [R]). The fast pass runs first; a chunk
        where any lane's sums came out NaN (an ``x = -inf`` entry, or a NaN logit) is redone with the safe tile."""
        mx, my, sx, sy, s3, s4 = _lane_pass(piece2, c0, c1, offs2, scale2, dtype, FORWARD, NT, N_FULL, TILE_, R,
                                            layout)
        if FORWARD:
            nan = (s3 != s3) | (s4 != s4)
        else:
            nan = s3 != s3
        if gl.max(nan.to(gl.int32), 0) != 0:
            mx, my, sx, sy, s3, s4 = _lane_pass_safe(piece2, c0, c1, offs2, scale2, dtype, FORWARD, NT, TILE_, R,
                                                     layout)
        return mx, my, sx, sy, s3, s4

    # After the row chunks, the region holds two (by row parity) exchange areas: each CTA pushes its chunk's 6
    # statistics into every CTA's slot ``(parity, rank)`` (``st.shared::cluster``, distributed shared memory) before
    # the cluster barrier, and reads the C slots from its own shared memory after it; the forward's pass-2 sums go
    # to CTA 0 alone, which adds them up after the next barrier. A slot is rewritten two barriers later at the
    # earliest, after every CTA has read it.

    @gluon.jit
    def _push(slot, target, live, a0, a1, a2, a3, a4, a5):
        """Store ``(a0 .. a3)`` at byte ``slot`` and ``(a4, a5)`` at ``slot + 16`` of CTA ``target``'s shared memory
        (all [R]; the lanes where ``live`` is nonzero store)."""
        gl.inline_asm_elementwise(
            "{\n\t.reg .pred p;\n\t.reg .b32 ra;\n\tsetp.ne.s32 p, $3, 0;\n\t"
            "mapa.shared::cluster.u32 ra, $1, $2;\n\t"
            "@p st.shared::cluster.v4.f32 [ra], {$4, $5, $6, $7};\n\t"
            "@p st.shared::cluster.v2.f32 [ra+16], {$8, $9};\n\tmov.u32 $0, 0;\n\t}",
            "=r,r,r,r,f,f,f,f,f,f", [slot, target, live, a0, a1, a2, a3, a4, a5], dtype=gl.int32, is_pure=False,
            pack=1)

    @gluon.jit
    def _push2(slot, target, live, a0, a1):
        """Store ``(a0, a1)`` at byte ``slot`` of CTA ``target``'s shared memory (where ``live`` is nonzero)."""
        gl.inline_asm_elementwise(
            "{\n\t.reg .pred p;\n\t.reg .b32 ra;\n\tsetp.ne.s32 p, $3, 0;\n\t"
            "mapa.shared::cluster.u32 ra, $1, $2;\n\t"
            "@p st.shared::cluster.v2.f32 [ra], {$4, $5};\n\tmov.u32 $0, 0;\n\t}",
            "=r,r,r,r,f,f", [slot, target, live, a0, a1], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _read4(addr):
        """Four float32 at byte ``addr`` of this CTA's shared memory (elementwise over ``addr``)."""
        return gl.inline_asm_elementwise("ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,r", [addr],
                                         dtype=(gl.float32, gl.float32, gl.float32, gl.float32), is_pure=False,
                                         pack=1)

    @gluon.jit
    def _read2(addr):
        """Two float32 at byte ``addr`` of this CTA's shared memory (elementwise over ``addr``)."""
        return gl.inline_asm_elementwise("ld.shared.v2.f32 {$0, $1}, [$2];", "=f,=f,r", [addr],
                                         dtype=(gl.float32, gl.float32), is_pure=False, pack=1)

    @gluon.jit
    def _common_max(mx, my, sx, sy, FTZ: gl.constexpr):
        """Combining parts (lanes or chunks) of online statistics: the maxima ``gmx, gmy`` over the parts, the same
        with ``-inf`` read as 0 (``gx, gy``: the reference point), which parts hold anything (sum != 0: an all
        ``-inf`` part drops out; NaN sums propagate) and each part's rescale factor ``2^(m - g)`` (FTZ: one
        ``ex2.approx.ftz``), 0 for an empty part."""
        NEG_INF: gl.constexpr = float("-inf")
        gmx = gl.max(mx, 0)
        gmy = gl.max(my, 0)
        gx = gl.where(gmx == NEG_INF, 0.0, gmx)
        gy = gl.where(gmy == NEG_INF, 0.0, gmy)
        live_x = sx != 0.0
        live_y = sy != 0.0
        if FTZ:
            f_x = gl.where(live_x, _exp2(mx - gx), 0.0)
            f_y = gl.where(live_y, _exp2(my - gy), 0.0)
        else:
            f_x = gl.where(live_x, gl.exp2(mx - gx), 0.0)
            f_y = gl.where(live_y, gl.exp2(my - gy), 0.0)
        return gmx, gmy, gx, gy, live_x, live_y, f_x, f_y

    @gluon.jit
    def _publish_chunk(slot, lanes, mx, my, sx, sy, s3, s4, C: gl.constexpr, FORWARD: gl.constexpr):
        """Combine the lanes into the chunk's ``(mx, sx, my, sy, s3, s4)`` and push them to every CTA of the
        cluster at byte ``slot`` (this CTA's slot of the current parity). ``s3`` is relative to the x maximum
        (forward) or the y maximum (loss); ``s4`` only rescales."""
        NEG_INF: gl.constexpr = float("-inf")
        gmx, gmy, gmx_ref, gmy_ref, live_x, live_y, f_x, f_y = _common_max(mx, my, sx, sy, True)
        if FORWARD:
            shift = mx - gmx_ref
        else:
            shift = gl.where(my == NEG_INF, 0.0, my - gmy_ref)
        c_sx, c_sy, c_3, c_4 = gl.reduce(
            (gl.where(live_x, f_x * sx, 0.0), gl.where(live_y, f_y * sy, 0.0),
             gl.where(live_x, f_x * (s3 + shift * sx), 0.0), gl.where(live_x, f_x * s4, 0.0)), 0, _add4)
        zero = gl.zeros_like(mx)
        _push(slot + lanes * 0, lanes % C, (lanes < C).to(gl.int32), gmx + zero, c_sx + zero, gmy + zero, c_sy + zero,
              c_3 + zero, c_4 + zero)

    @gluon.jit
    def _combine_row(slots, FORWARD: gl.constexpr):
        """The row's statistics from its ``C`` chunks' (``slots``: [C] byte addresses of this CTA's exchange slots
        of the current parity, read after the cluster barrier): ``(Mx, My, Sx, Sy, S3, S4)`` with ``S3`` relative to
        ``Mx`` (forward) / ``My``."""
        NEG_INF: gl.constexpr = float("-inf")
        mx_c, sx_c, my_c, sy_c = _read4(slots)
        s3_c, s4_c = _read2(slots + 16)
        _, _, gx, gy, live_x, live_y, f_x, f_y = _common_max(mx_c, my_c, sx_c, sy_c, False)
        if FORWARD:
            shift = gl.where(live_x, mx_c - gx, 0.0)
        else:
            shift = gl.where(my_c == NEG_INF, 0.0, my_c - gy)
        sx_t = gl.sum(gl.where(live_x, f_x * sx_c, 0.0), 0)
        sy_t = gl.sum(gl.where(live_y, f_y * sy_c, 0.0), 0)
        s3_t = gl.sum(gl.where(live_x, f_x * (s3_c + shift * sx_c), 0.0), 0)
        s4_t = gl.sum(gl.where(live_x, f_x * s4_c, 0.0), 0)
        return gx, gy, sx_t, sy_t, s3_t, s4_t

    @gluon.jit
    def _finish_forward(row64, ce, kl, part_slots, tv_ptr, alpha_ptr, task_ptr, task_ce_ptr, task_kl_ptr,
                        task_tv_ptr, task_alpha_ptr, task_count_ptr, HAS_TASKS: gl.constexpr):
        """TV and alpha of ``row64`` from its ``C`` chunks' pass-2 sums (``part_slots``: [C] byte addresses in CTA
        0's shared memory; fixed order: deterministic), and the per-task sums."""
        part_abs, part_min = _read2(part_slots)
        tv = gl.minimum(gl.maximum(0.5 * gl.sum(part_abs, 0), 0.0), 1.0)
        alpha = gl.minimum(gl.maximum(gl.sum(part_min, 0), 0.0), 1.0)
        gl.store(tv_ptr + row64, tv)
        gl.store(alpha_ptr + row64, alpha)
        if HAS_TASKS:
            task = gl.load(task_ptr + row64).to(gl.int64)
            if task >= 0:
                gl.atomic_add(task_ce_ptr + task, ce.to(gl.float64), sem="relaxed")
                gl.atomic_add(task_kl_ptr + task, kl.to(gl.float64), sem="relaxed")
                gl.atomic_add(task_tv_ptr + task, tv.to(gl.float64), sem="relaxed")
                gl.atomic_add(task_alpha_ptr + task, alpha.to(gl.float64), sem="relaxed")
                gl.atomic_add(task_count_ptr + task, 1, sem="relaxed")

    @gluon.jit
    def _cta_setup(chunk_cols, vocab, region, C: gl.constexpr, NT: gl.constexpr, K: gl.constexpr,
                   WARPS: gl.constexpr):
        """This CTA's place: cluster ``cid``, ``rank`` in it, its columns ``[c0, c1)``, the lanes ([R]) and their
        columns in a tile (``offs2`` [R, K]), each lane's piece addresses (``piece`` [R], ``piece2`` [R, K]), the
        cluster ranks ``goffs`` [C], and the exchange areas (statistics ``xs``, pass-2 sums ``xp``)."""
        gl.static_assert(K == 8 or K == 16, "a lane's copies are masked by its first column: K = 8 or 16")
        R: gl.constexpr = 32 * WARPS
        layout: gl.constexpr = gl.BlockedLayout([1, K], [32, 1], [WARPS, 1], [1, 0])
        pid = gl.program_id(0)
        cid = pid // C
        rank = pid % C
        c0 = rank * chunk_cols
        c1 = gl.minimum(c0 + chunk_cols, vocab)
        lanes = gl.arange(0, R, layout=gl.SliceLayout(1, layout))
        ks = gl.arange(0, K, layout=gl.SliceLayout(0, layout))
        offs2 = gl.expand_dims(lanes, 1) * K + gl.expand_dims(ks, 0)
        smem = _smem_base() + region
        piece = smem + lanes * (K * 2)
        piece2 = gl.expand_dims(piece, 1) + gl.expand_dims((ks // 8) * 16, 0)  # each 8-column piece's address
        goffs = gl.arange(0, C, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
        xs = smem + 2 * NT * R * K * 2  # exchange slots: statistics [2, C] x 32 bytes, then pass-2 sums [2, C] x 8
        xp = xs + 2 * C * 32
        return cid, rank, c0, c1, lanes, offs2, piece, piece2, goffs, xs, xp

    @gluon.jit
    def _first_row(piece, v_ptr, d_ptr, stride_v, stride_d, mask_ptr, cid, n_rows, c0, c1, lanes,
                   HAS_MASK: gl.constexpr, NT: gl.constexpr, TILE_: gl.constexpr, R: gl.constexpr, K: gl.constexpr):
        """Issue the copies of the cluster's first row ``cid`` and wait until every CTA of the cluster runs (before
        any CTA writes into another's shared memory). Returns whether the row is kept."""
        keep = _row_kept(mask_ptr, cid, n_rows, HAS_MASK)
        _issue_row(piece, v_ptr + cid.to(gl.int64) * stride_v, d_ptr + cid.to(gl.int64) * stride_d, c0, c1, lanes,
                   keep, NT, TILE_, R, K)
        _cluster_barrier()
        return keep

    @gluon.jit
    def _next_row(v_ptr, d_ptr, stride_v, stride_d, mask_ptr, row, n_rows, n_clusters, HAS_MASK: gl.constexpr):
        """The cluster's row after ``row``: whether it is kept, and its verifier and drafter row pointers."""
        nxt64 = (row + n_clusters).to(gl.int64)
        keep_next = _row_kept(mask_ptr, row + n_clusters, n_rows, HAS_MASK)
        return keep_next, v_ptr + nxt64 * stride_v, d_ptr + nxt64 * stride_d

    # n_rows and n_clusters change from call to call; mask / weight / count may be views at any offset: none of them
    # specialises the kernel, so one compiled kernel per (dtypes, flags, layout) serves every call (see _COMPILED)
    @gluon.jit(do_not_specialize=["n_rows", "n_clusters", "region"],
               do_not_specialize_on_alignment=["mask_ptr", "weight_ptr", "count_ptr"])
    def _cluster_loss_kernel(
        v_ptr, d_ptr, g_ptr, stride_v, stride_d, stride_g,
        mask_ptr, weight_ptr, count_ptr, ce_ptr, status_ptr,
        n_rows, vocab, chunk_cols, n_clusters, region, scale2, grad_scale,
        HAS_MASK: gl.constexpr, HAS_WEIGHTS: gl.constexpr, HAS_COUNT: gl.constexpr,
        C: gl.constexpr, NT: gl.constexpr, N_FULL: gl.constexpr, K: gl.constexpr, WARPS: gl.constexpr,
    ):
        LN2: gl.constexpr = 0.6931471805599453
        R: gl.constexpr = 32 * WARPS
        TILE_: gl.constexpr = R * K
        layout: gl.constexpr = gl.BlockedLayout([1, K], [32, 1], [WARPS, 1], [1, 0])
        dtype: gl.constexpr = v_ptr.dtype.element_ty
        cid, rank, c0, c1, lanes, offs2, piece, piece2, goffs, xs, xp = _cta_setup(chunk_cols, vocab, region, C, NT,
                                                                                  K, WARPS)
        phase = rank * 0  # kept rows so far: the parity of the exchange slots
        w_base = grad_scale
        if HAS_COUNT:  # "mean" over a mask: 1 / max(count, 1), counted on the device (no host sync)
            w_base = w_base / gl.maximum(gl.load(count_ptr), 1.0)
        n_mine = gl.cdiv(n_rows - cid, n_clusters)
        keep = _first_row(piece, v_ptr, d_ptr, stride_v, stride_d, mask_ptr, cid, n_rows, c0, c1, lanes, HAS_MASK,
                          NT, TILE_, R, K)
        for it in range(0, n_mine):
            row = cid + it * n_clusters
            row64 = row.to(gl.int64)
            g_row = g_ptr + row64 * stride_g
            keep_next, v_next, d_next = _next_row(v_ptr, d_ptr, stride_v, stride_d, mask_ptr, row, n_rows, n_clusters,
                                                  HAS_MASK)
            if keep:  # the same for every CTA of the cluster (one row), so the barrier below stays matched
                mx, my, sx, sy, tt, s4 = _lane_stats(piece2, c0, c1, offs2, scale2, dtype, False, NT, N_FULL, TILE_, R,
                                                     layout)
                par = phase % 2
                _publish_chunk(xs + (par * C + rank) * 32, lanes, mx, my, sx, sy, tt, s4, C, False)
                _cluster_barrier()
                gx, gy, sx_t, sy_t, t_t, s4_t = _combine_row(xs + (par * C + goffs) * 32, False)
                phase += 1
                log2_sy = gl.log2(sy_t)
                lp = gx + gl.log2(sx_t)
                lq = gy + log2_sy
                w = w_base
                if HAS_WEIGHTS:
                    w = w * gl.load(weight_ptr + row64)
                # pass 2 from shared memory; each tile, once read, is refilled with the next row's copy
                for t in gl.static_range(NT):
                    rx, ry = _raw_tile(piece2, t, c0, c1, offs2, dtype, False, NT, TILE_, R)
                    g = ((_exp2(ry * scale2 - lq) - _exp2(rx * scale2 - lp)) * w).to(g_ptr.dtype.element_ty)
                    cols = c0 + t * TILE_ + offs2
                    if t < N_FULL:
                        gl.store(g_row + cols, g)
                    else:
                        gl.store(g_row + cols, g, mask=cols < c1)
                    _issue_tile(piece, t, v_next, d_next, c0, c1, lanes, keep_next, NT, TILE_, R, K)
                if rank == 0:
                    ce = LN2 * (log2_sy - t_t / sx_t)
                    # a NaN sum over finite normalisers: an underflowed weight times an infinite difference (p > 0
                    # where q = 0): H(p, q) = +inf
                    ce = gl.where((t_t != t_t) & (sx_t == sx_t) & (sy_t == sy_t), float("inf"), ce)
                    gl.store(ce_ptr + row64, ce)
                    gl.store(status_ptr + row64, gl.where(sx_t > 0.0, 0, 1) + gl.where(sy_t > 0.0, 0, 2))
            else:
                _wait(0)  # this row's (empty) copies land before the slot is refilled
                zero = gl.zeros([R, K], g_ptr.dtype.element_ty, layout)
                for t in gl.static_range(NT):
                    cols = c0 + t * TILE_ + offs2
                    gl.store(g_row + cols, zero, mask=cols < c1)
                    _issue_tile(piece, t, v_next, d_next, c0, c1, lanes, keep_next, NT, TILE_, R, K)
                if rank == 0:
                    gl.store(ce_ptr + row64, 0.0)
                    gl.store(status_ptr + row64, 0)
            keep = keep_next
        _wait(0)

    @gluon.jit(do_not_specialize=["n_rows", "n_clusters", "region"],
               do_not_specialize_on_alignment=["mask_ptr", "task_ptr"])
    def _cluster_forward_kernel(
        v_ptr, d_ptr, stride_v, stride_d, mask_ptr, task_ptr,
        ce_ptr, kl_ptr, tv_ptr, alpha_ptr, status_ptr,
        task_ce_ptr, task_kl_ptr, task_tv_ptr, task_alpha_ptr, task_count_ptr,
        n_rows, vocab, chunk_cols, n_clusters, region, scale2,
        HAS_MASK: gl.constexpr, HAS_TASKS: gl.constexpr,
        C: gl.constexpr, NT: gl.constexpr, N_FULL: gl.constexpr, K: gl.constexpr, WARPS: gl.constexpr,
    ):
        LN2: gl.constexpr = 0.6931471805599453
        R: gl.constexpr = 32 * WARPS
        TILE_: gl.constexpr = R * K
        layout: gl.constexpr = gl.BlockedLayout([1, K], [32, 1], [WARPS, 1], [1, 0])
        lane_layout: gl.constexpr = gl.SliceLayout(1, layout)
        dtype: gl.constexpr = v_ptr.dtype.element_ty
        cid, rank, c0, c1, lanes, offs2, piece, piece2, goffs, xs, xp = _cta_setup(chunk_cols, vocab, region, C, NT,
                                                                                  K, WARPS)
        phase = rank * 0  # kept rows so far: the parity of the exchange slots
        n_mine = gl.cdiv(n_rows - cid, n_clusters)
        # TV and alpha of a row need every chunk's pass-2 sums: rank 0 adds them up after the next cluster barrier
        pending = cid * 0 - 1
        pending_ce = scale2 * 0.0
        pending_kl = scale2 * 0.0
        keep = _first_row(piece, v_ptr, d_ptr, stride_v, stride_d, mask_ptr, cid, n_rows, c0, c1, lanes, HAS_MASK,
                          NT, TILE_, R, K)
        for it in range(0, n_mine):
            row = cid + it * n_clusters
            row64 = row.to(gl.int64)
            keep_next, v_next, d_next = _next_row(v_ptr, d_ptr, stride_v, stride_d, mask_ptr, row, n_rows, n_clusters,
                                                  HAS_MASK)
            if keep:
                mx, my, sx, sy, rr, ee = _lane_stats(piece2, c0, c1, offs2, scale2, dtype, True, NT, N_FULL, TILE_, R,
                                                     layout)
                par = phase % 2
                _publish_chunk(xs + (par * C + rank) * 32, lanes, mx, my, sx, sy, rr, ee, C, True)
                _cluster_barrier()
                if rank == 0:
                    if pending >= 0:
                        _finish_forward(pending.to(gl.int64), pending_ce, pending_kl, xp + ((1 - par) * C + goffs) * 8,
                                        tv_ptr, alpha_ptr, task_ptr, task_ce_ptr, task_kl_ptr, task_tv_ptr,
                                        task_alpha_ptr, task_count_ptr, HAS_TASKS)
                gx, gy, sx_t, sy_t, r_t, e_t = _combine_row(xs + (par * C + goffs) * 32, True)
                log2_sx = gl.log2(sx_t)
                log2_sy = gl.log2(sy_t)
                lp = gx + log2_sx
                lq = gy + log2_sy
                acc_abs = gl.zeros([R], gl.float32, lane_layout)
                acc_min = gl.zeros([R], gl.float32, lane_layout)
                for t in gl.static_range(NT):
                    rx, ry = _raw_tile(piece2, t, c0, c1, offs2, dtype, False, NT, TILE_, R)
                    px = _exp2(rx * scale2 - lp)
                    qy = _exp2(ry * scale2 - lq)
                    cols = c0 + t * TILE_ + offs2
                    if t >= N_FULL:  # zero-filled copies outside the chunk
                        px = gl.where(cols < c1, px, 0.0)
                        qy = gl.where(cols < c1, qy, 0.0)
                    acc_abs += gl.sum(gl.abs(px - qy), 1)
                    acc_min += gl.sum(gl.minimum(px, qy), 1)
                    _issue_tile(piece, t, v_next, d_next, c0, c1, lanes, keep_next, NT, TILE_, R, K)
                t_abs, t_min = gl.reduce((acc_abs, acc_min), 0, _add2)
                zero = gl.zeros_like(acc_abs)
                _push2(xp + (par * C + rank) * 8 + lanes * 0, lanes * 0, (lanes == 0).to(gl.int32), t_abs + zero,
                       t_min + zero)
                entropy = LN2 * (log2_sx - r_t / sx_t)
                kl = LN2 * gl.maximum(e_t * scale2 / sx_t - lp + lq, 0.0)
                # a NaN sum over finite normalisers: an underflowed weight times an infinite difference (p > 0
                # where q = 0): KL = +inf
                kl = gl.where((e_t != e_t) & (sx_t == sx_t) & (sy_t == sy_t), float("inf"), kl)
                ce = entropy + kl
                if rank == 0:
                    gl.store(ce_ptr + row64, ce)
                    gl.store(kl_ptr + row64, kl)
                    gl.store(status_ptr + row64, gl.where(sx_t > 0.0, 0, 1) + gl.where(sy_t > 0.0, 0, 2))
                pending = row
                pending_ce = ce
                pending_kl = kl
                phase += 1
            else:
                _wait(0)  # this row's (empty) copies land before the slot is refilled
                _issue_row(piece, v_next, d_next, c0, c1, lanes, keep_next, NT, TILE_, R, K)
                if rank == 0:
                    gl.store(ce_ptr + row64, 0.0)
                    gl.store(kl_ptr + row64, 0.0)
                    gl.store(tv_ptr + row64, 0.0)
                    gl.store(alpha_ptr + row64, 0.0)
                    gl.store(status_ptr + row64, 0)
            keep = keep_next
        _cluster_barrier()  # the last row's pass-2 sums are in
        if rank == 0:
            if pending >= 0:
                _finish_forward(pending.to(gl.int64), pending_ce, pending_kl, xp + ((1 - phase % 2) * C + goffs) * 8,
                                tv_ptr, alpha_ptr, task_ptr, task_ce_ptr, task_kl_ptr, task_tv_ptr, task_alpha_ptr,
                                task_count_ptr, HAS_TASKS)
        _wait(0)


def cluster_layout(vocab: int, elem_bytes: int) -> tuple[int, int, int, int] | None:
    """``(C, chunk_cols, NT, N_FULL)``: the smallest cluster whose chunk of both rows (``NT`` tiles of ``TILE``
    columns, a 16-column aligned ``chunk_cols`` per CTA) fits ``SMEM_PER_CTA``, and ``N_FULL``, the number of leading
    tiles that are whole in every CTA's chunk (the rest are masked); None when no cluster fits."""
    for c in CLUSTER_SIZES:
        chunk_cols = -(-vocab // c)
        chunk_cols = -(-chunk_cols // 16) * 16
        nt = -(-chunk_cols // TILE)
        if 2 * nt * TILE * elem_bytes <= SMEM_PER_CTA:
            n_full = min(max(0, min(chunk_cols, vocab - rank * chunk_cols)) // TILE for rank in range(c))
            return c, chunk_cols, nt, n_full
    return None


def region_bytes(cluster_size: int, nt: int) -> int:
    """Bytes of this module's shared-memory region: the row chunks (``2 * nt * TILE`` 16-bit logits) and the
    exchange slots (``[2, C]`` x 32 bytes of statistics, ``[2, C]`` x 8 bytes of pass-2 sums)."""
    return 2 * nt * TILE * 2 + 2 * cluster_size * (32 + 8)
