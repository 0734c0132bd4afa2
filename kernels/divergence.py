"""Fused Triton divergence kernel: drafter-verifier divergences per token, per-task sums, the cross-entropy gradient.

Terms:
    row ``n``: one token; ``N`` rows of ``V`` vocabulary logits each, verifier ``v`` and drafter ``d``.
    ``x = v log2(e) / T``, ``y = d log2(e) / T``: the scaled logits in base 2; ``p = 2^(x - Lp)``, ``q = 2^(y - Lq)``
    with the base-2 log-normalisers ``Lp = mx + log2 sx``, ``Lq = my + log2 sy``.
    ``mx, my``: running maxima; ``sx = sum 2^(x - mx)``, ``sy = sum 2^(y - my)``: normalisers; ``w = 2^(x - mx)``.
    status word: bit 0 the verifier row, bit 1 the drafter row is bad (NaN, +inf or every entry ``-inf``: a
    normaliser that is not a positive number).
    plan: a :class:`DivergencePlan`, chosen by :func:`divergence_plan`: the cluster kernels or the row kernel's tile.

Formula, per row (nats)::

    H(p)    = ln2 (log2 sx - r / sx),                 r = sum w (x - mx)
    KL(p|q) = ln2 max(0, e / sx - Lp + Lq),           e = sum w (x - y)
    H(p, q) = H(p) + KL        (loss path: ln2 (log2 sy - t / sx), t = sum w (y - my))
    TV      = 1/2 sum |p - q|,  alpha = sum min(p, q)                         (summed, not 1 - TV)
    grad    = w_n s (q - p)     (s = 1 / T times the reduction factor; the drafter's dtype)

The one-program-per-row kernel (:func:`_divergence_kernel`) handles a row at a time in a grid-stride loop, never
writing a [N, V] intermediate. Pass 1 streams both rows over tiles of ``BLOCK`` columns with an online
log-sum-exp; each tile's maxima and sums are one multi-operand reduction apiece. Pass 2 (TV and alpha, or the
gradient) re-reads the row in *reverse* tile order, so the tiles pass 1 read last are still in L2. Entries with
``x = -inf`` contribute nothing; ``x`` finite where ``y = -inf`` makes H(p, q) and KL ``+inf``: such entries make
``e`` +inf (``t`` -inf), and a sum turned NaN by an underflowed weight times an infinite difference reads as +inf.
On Hopper the forward and the loss run as thread-block-cluster kernels instead (:mod:`.divergence_cluster`), which
read each logit from DRAM once.

Per-task sums are float64 atomics (sums in any order: not bitwise deterministic) and int64 counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ._device import INTERPRETER, DeviceFacts, device_facts, launching_on, sm_count
from .divergence_cluster_launch import LOG2E, cluster_eligible, launch_cluster_forward, launch_cluster_loss

__all__ = ["LOG2E", "DivergenceLossFunction", "DivergencePlan", "check_first_backward", "divergence_loss_triton",
           "divergence_plan", "launch_divergence", "loss_scale", "raise_on_bad_status",
           "reduced_loss", "rescale_gradient"]

CLUSTER_MIN_VOCAB = 32000  # the smallest vocabulary the cluster kernels were measured at
SMALL_VOCAB_LOSS = 65536  # H200 loss path up to this V: the 2048-column tile without pipelining


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
def _add_to_task(task_ptr, row64, task_ce_ptr, task_kl_ptr, task_tv_ptr, task_alpha_ptr, task_count_ptr,
                 ce, kl, tv, alpha):
    """Add row ``row64``'s four values to the float64 sums of its task and count it (``task < 0``: no task)."""
    task = tl.load(task_ptr + row64).to(tl.int64)
    if task >= 0:
        tl.atomic_add(task_ce_ptr + task, ce.to(tl.float64))
        tl.atomic_add(task_kl_ptr + task, kl.to(tl.float64))
        tl.atomic_add(task_tv_ptr + task, tv.to(tl.float64))
        tl.atomic_add(task_alpha_ptr + task, alpha.to(tl.float64))
        tl.atomic_add(task_count_ptr + task, 1)


@triton.jit
def _divergence_kernel(
    v_ptr, d_ptr, stride_v, stride_d,
    mask_ptr, task_ptr, weight_ptr,
    ce_ptr, kl_ptr, tv_ptr, alpha_ptr, status_ptr,
    grad_ptr, stride_g,
    task_ce_ptr, task_kl_ptr, task_tv_ptr, task_alpha_ptr, task_count_ptr,
    n_rows, vocab, num_programs, scale2, grad_scale, count_ptr,
    HAS_MASK: tl.constexpr, HAS_TASKS: tl.constexpr, HAS_WEIGHTS: tl.constexpr, HAS_COUNT: tl.constexpr,
    COMPUTE_TV: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr, STAGES2: tl.constexpr,
):
    """Rows ``program_id, program_id + num_programs, ...``: ce, status (and kl, tv, alpha with COMPUTE_TV) [N] and,
    with WRITE_GRAD, the row of ``grad`` ([N, V], may alias ``d``). ``scale2 = log2(e) / T``; ``grad_scale`` is
    ``w s`` without the row weight, divided on the device by ``max(count, 1)`` with HAS_COUNT. Masked rows (mask 0)
    get 0 everywhere."""
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
            # ---- pass 1: online log-sum-exp of both rows, with the entropy and KL (or cross-entropy) sums ----
            mx = NEG_INF
            my = NEG_INF
            sx = 0.0
            sy = 0.0
            r = 0.0  # loss path: sum w (y - my); else sum w (x - mx)
            e = 0.0
            for start in tl.range(0, vocab, BLOCK, num_stages=1):  # pass 1 is not software-pipelined
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
                # NOTE: p > 0 where q = 0 is not counted apart: it makes the KL sum +inf, the cross-entropy sum
                # -inf, or NaN where its weight underflowed to 0 (read as +inf after the loop)
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
            status = tl.where(sx > 0.0, 0, 1) + tl.where(sy > 0.0, 0, 2)
            mx = tl.where(mx == NEG_INF, 0.0, mx)
            my = tl.where(my == NEG_INF, 0.0, my)
            log2_sx = tl.log2(sx)
            log2_sy = tl.log2(sy)
            lp = mx + log2_sx
            lq = my + log2_sy
            if not COMPUTE_TV:
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
                alpha = tl.minimum(tl.maximum(tl.sum(acc_min, 0), 0.0), 1.0)  # keeps precision where p, q barely meet
                tl.store(tv_ptr + row64, tv)
                tl.store(alpha_ptr + row64, alpha)
                if HAS_TASKS:
                    _add_to_task(task_ptr, row64, task_ce_ptr, task_kl_ptr, task_tv_ptr, task_alpha_ptr,
                                 task_count_ptr, ce, kl, tv, alpha)
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


# ---------------------------------------------------------------------------------------------------------------
# Launch plan


@dataclass(frozen=True)
class DivergencePlan:
    """How :func:`launch_divergence` runs a call.

    Attributes:
        cluster: the thread-block-cluster kernels of :mod:`.divergence_cluster` (the forward with TV, or the loss),
            where the inputs allow them (the same 16-bit dtype, ``V % 16 == 0``, 16-element aligned rows, a Hopper
            GPU); else, and for other passes, the row kernel.
        block: row kernel: vocabulary columns per tile (a power of two).
        num_warps: row kernel: warps per program (a power of two).
        stages2: row kernel: software-pipelining stages of pass 2 (``tl.range(num_stages=...)``).
        programs: row kernel: programs of the grid-stride loop over rows (at most the rows are launched).
    """

    cluster: bool
    block: int
    num_warps: int
    stages2: int
    programs: int

    def __post_init__(self) -> None:
        if not isinstance(self.cluster, bool):
            raise ValueError(f"DivergencePlan.cluster must be a bool, got {self.cluster!r}")
        for name in ("block", "num_warps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"DivergencePlan.{name} must be a power of two >= 1, got {value!r}")
        for name in ("stages2", "programs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DivergencePlan.{name} must be an int >= 1, got {value!r}")


def divergence_plan(n_rows: int, vocab: int, dtype: torch.dtype, device: torch.device | DeviceFacts, *,
                    loss: bool) -> DivergencePlan:
    """The plan of one call.

    Parameters
    ----------
    n_rows, vocab : int
        ``N`` rows of ``V`` logits.
    dtype : torch.dtype
        The verifier logits' dtype.
    device : torch.device or DeviceFacts
        Where the call runs; :class:`~specdec.kernels._device.DeviceFacts` asks what a given GPU would get.
    loss : bool
        The loss pass (H(p, q) and its gradient, no TV) rather than the forward.

    Returns
    -------
    DivergencePlan
    """
    facts = device_facts(device)
    # clusters read each logit once; measured on Hopper for 16-bit logits from V = 32000
    cluster = (not facts.interpreter and facts.major == 9 and dtype in (torch.bfloat16, torch.float16)
               and vocab >= CLUSTER_MIN_VOCAB)
    if facts.interpreter:
        block, num_warps, stages2 = 256, 1, 1  # small tiles: the multi-tile paths run on small test shapes
    elif "H200" not in facts.name or (loss and vocab <= SMALL_VOCAB_LOSS):
        block, num_warps, stages2 = 2048, 4, 1  # best on the H100 and on the H200's small-vocabulary loss
    elif n_rows >= 16 * facts.sm_count:
        block, num_warps, stages2 = 512, 1, 3  # H200 with many rows per SM: small programs, pass 2 pipelined
    elif n_rows >= 4 * facts.sm_count:
        block, num_warps, stages2 = 1024, 2, 3
    else:
        block, num_warps, stages2 = 2048, 4, 3
    block = min(triton.next_power_of_2(vocab), block)
    num_warps = max(1, min(num_warps, block // 256))
    return DivergencePlan(cluster=cluster, block=block, num_warps=num_warps, stages2=stages2,
                          programs=max(n_rows, 1))


# ---------------------------------------------------------------------------------------------------------------
# Launcher


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _side_inputs(mask: torch.Tensor | None, task_ids: torch.Tensor | None, weights: torch.Tensor | None,
                 grad_count: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The side inputs as every kernel reads them, once per call: [N] with unit stride, the mask as uint8 (nonzero =
    row counted), task ids as int64, weights and the [1] count as float32 (the cluster kernels are compiled once per
    set of flags, so for these dtypes only)."""
    if mask is not None:
        mask = (mask if mask.dtype in (torch.bool, torch.uint8) else mask != 0).to(torch.uint8).contiguous()
    if task_ids is not None:
        task_ids = task_ids.to(torch.int64).contiguous()
    if weights is not None:
        weights = weights.to(torch.float32).contiguous()
    if grad_count is not None:
        grad_count = grad_count.to(torch.float32).reshape(1)
    return mask, task_ids, weights, grad_count


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
    plan: DivergencePlan | None = None,
) -> tuple[torch.Tensor, ...]:
    """Run the divergence kernels once, on the inputs' device.

    Parameters
    ----------
    verifier_logits, drafter_logits : torch.Tensor
        ``[N, V]`` fp32 / bf16 / fp16 logits, unit stride along V; ``T > 0`` is applied to both.
    mask : torch.Tensor, optional
        ``[N]`` bool or uint8, nonzero = row counted; other rows get 0 everywhere.
    task_ids, num_tasks : torch.Tensor, int, optional
        ``[N]`` int task of each row in ``[0, num_tasks)``, ``-1`` = no task (with ``compute_tv`` only).
    compute_tv : bool
        Also KL, TV and alpha (pass 2 over the row); False computes H(p, q) only.
    grad_out : torch.Tensor, optional
        ``[N, V]``, may be ``drafter_logits`` itself: receives ``weights[n] * grad_scale * (q - p) / T`` in its own
        dtype, divided by ``max(grad_count, 1)`` when given (``[1]`` float32 on the device). ``weights``: ``[N]``
        float, optional. The side inputs ``mask``, ``task_ids``, ``weights`` and ``grad_count`` are converted here,
        once, to what every kernel reads: contiguous uint8, int64, float32 and float32.
    plan : DivergencePlan, optional
        Default :func:`divergence_plan` of the call.

    Returns
    -------
    tuple
        ``(ce, kl, tv, alpha, status, per_task)``: [N] float32 (kl, tv, alpha None without ``compute_tv``), [N]
        int32 status, and per_task (4 float64 [num_tasks] sums and an int64 count) or None.
    """
    with launching_on(verifier_logits.device):
        return _launch_divergence(verifier_logits, drafter_logits, temperature, mask, task_ids, num_tasks,
                                  compute_tv, grad_out, weights, grad_scale, grad_count, plan)


def _launch_divergence(verifier_logits, drafter_logits, temperature, mask, task_ids, num_tasks, compute_tv,
                       grad_out, weights, grad_scale, grad_count, plan) -> tuple[torch.Tensor, ...]:
    """``launch_divergence`` with its device current."""
    verifier_logits = _row_major(verifier_logits)
    drafter_logits = _row_major(drafter_logits)
    mask, task_ids, weights, grad_count = _side_inputs(mask, task_ids, weights, grad_count)
    n_rows, vocab = verifier_logits.shape
    device = verifier_logits.device
    write_grad = grad_out is not None
    if plan is None:
        plan = divergence_plan(n_rows, vocab, verifier_logits.dtype, device, loss=write_grad and not compute_tv)
    # the cluster kernels compute the forward with TV, or the loss (H(p, q) and its gradient)
    if plan.cluster and write_grad != compute_tv and cluster_eligible(verifier_logits, drafter_logits, grad_out):
        if write_grad:
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
    programs = max(1, min(n_rows, plan.programs))
    _divergence_kernel[(programs,)](
        verifier_logits, drafter_logits, verifier_logits.stride(0), drafter_logits.stride(0),
        mask if mask is not None else dummy, task_ids if has_tasks else dummy,
        weights if weights is not None else dummy,
        ce, kl if compute_tv else dummy, tv if compute_tv else dummy, alpha if compute_tv else dummy, status,
        grad_out if write_grad else dummy, grad_out.stride(0) if write_grad else 0,
        *(sums if has_tasks else [dummy] * 4), count if has_tasks else dummy,
        n_rows, vocab, programs, LOG2E / temperature, grad_scale / temperature,
        grad_count if grad_count is not None else dummy,
        HAS_MASK=mask is not None, HAS_TASKS=has_tasks, HAS_WEIGHTS=weights is not None,
        HAS_COUNT=grad_count is not None, COMPUTE_TV=compute_tv, WRITE_GRAD=write_grad, BLOCK=plan.block,
        STAGES2=plan.stages2, num_warps=plan.num_warps,
    )
    per_task = (*sums, count) if has_tasks else None
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
    block = 256 if INTERPRETER else 4096
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
                mask: torch.Tensor | None, temperature: float, reduction: str, check_inputs: bool = False,
                plan: DivergencePlan | None = None) -> torch.Tensor:
        scale, count = loss_scale(reduction, drafter_logits.shape[0], mask)
        needs_grad = ctx.needs_input_grad[0]
        # fp16: the gradient is kept in fp32 until the backward has scaled it by the incoming gradient (a GradScaler's
        # loss scale); stored in fp16 first, its small entries (w (q - p) / (T N)) would underflow before the scaling
        # that exists to save them. bf16 has fp32's exponent range and keeps its own dtype.
        grad_dtype = torch.float32 if drafter_logits.dtype == torch.float16 else drafter_logits.dtype
        grad = torch.empty(drafter_logits.shape, dtype=grad_dtype, device=drafter_logits.device) if needs_grad else None
        ctx.input_dtype = drafter_logits.dtype
        ce, _, _, _, status, _ = launch_divergence(verifier_logits, drafter_logits, temperature, mask=mask,
                                                   compute_tv=False, grad_out=grad, weights=weights,
                                                   grad_scale=scale, grad_count=count, plan=plan)
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
            return None, None, None, None, None, None, None, None
        rescale_gradient(grad, grad_output)
        return grad.to(ctx.input_dtype), None, None, None, None, None, None, None


def divergence_loss_triton(drafter_logits: torch.Tensor, verifier_logits: torch.Tensor,
                           weights: torch.Tensor | None, mask: torch.Tensor | None, temperature: float,
                           reduction: str, check_inputs: bool = False,
                           plan: DivergencePlan | None = None) -> torch.Tensor:
    """Triton path of :func:`specdec.divergence_loss` (0-dim float32, differentiable w.r.t. ``drafter_logits``;
    ``plan``: see :func:`launch_divergence`)."""
    return DivergenceLossFunction.apply(drafter_logits, verifier_logits.detach(), weights, mask, temperature,
                                        reduction, check_inputs, plan)


def raise_on_bad_status(status: torch.Tensor) -> None:
    """ValueError naming the input whose counted rows the kernel flagged (``status`` [N] int32: bit 0 verifier,
    bit 1 drafter: NaN, +inf or every entry -inf). One device sync."""
    verifier_bad, drafter_bad = torch.stack([(status & 1).any(), (status & 2).any()]).tolist()
    for name, bad in (("verifier_logits", verifier_bad), ("drafter_logits", drafter_bad)):
        if bad:
            raise ValueError(f"{name} contains NaN or +inf, or a row with every entry -inf: p or q would be undefined")

