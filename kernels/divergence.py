"""Fused Triton kernel: drafter-verifier divergences per token, per-task sums, and the cross-entropy gradient.

One program handles one row (token) at a time (a grid-stride loop over rows), never writing a [N, V] intermediate:

* Pass 1 streams both logit rows over vocabulary tiles of ``BLOCK`` columns with an online log-sum-exp in base 2
  (``x = v log2(e) / T``, ``y = d log2(e) / T``): running maxima ``mx, my``, normalisers
  ``sx = sum 2^(x - mx)``, ``sy = sum 2^(y - my)``, and two weighted sums rescaled with ``sx``:
  ``r = sum w (x - mx)`` and ``e = sum w (x - y)`` with ``w = 2^(x - mx)``. Then, in nats,
  ``H(p) = ln2 (log2 sx - r / sx)``, ``KL = ln2 (e / sx - (mx + log2 sx) + (my + log2 sy))`` (clamped at 0) and
  ``H(p, q) = H(p) + KL``. Entries with ``x = -inf`` contribute nothing; an entry with ``x > -inf`` and ``y = -inf``
  makes H(p, q) and KL ``+inf``.
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

LOG2E = 1.4426950408889634


@triton.jit
def _divergence_kernel(
    v_ptr, d_ptr, stride_v, stride_d,
    mask_ptr, task_ptr, weight_ptr,
    ce_ptr, kl_ptr, tv_ptr, alpha_ptr, status_ptr,
    grad_ptr, stride_g,
    task_ce_ptr, task_kl_ptr, task_tv_ptr, task_alpha_ptr, task_count_ptr,
    n_rows, vocab, num_programs, scale2, grad_scale,
    HAS_MASK: tl.constexpr, HAS_TASKS: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
    COMPUTE_TV: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr, EVICT_LAST: tl.constexpr,
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
                x = x.to(tl.float32) * scale2
                y = y.to(tl.float32) * scale2
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
                mx = mx_new
                my = my_new
            status = tl.where(sx > 0.0, 0, 1) + tl.where(sy > 0.0, 0, 2)
            mx = tl.where(mx == NEG_INF, 0.0, mx)
            my = tl.where(my == NEG_INF, 0.0, my)
            log2_sx = tl.log2(sx)
            log2_sy = tl.log2(sy)
            lp = mx + log2_sx
            lq = my + log2_sy
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
                for i in range(0, n_tiles):
                    cols = (n_tiles - 1 - i) * BLOCK + offs
                    inb = cols < vocab
                    x = tl.load(v_row + cols, mask=inb, other=NEG_INF, eviction_policy="evict_first")
                    y = tl.load(d_row + cols, mask=inb, other=NEG_INF, eviction_policy="evict_first")
                    x = x.to(tl.float32) * scale2
                    y = y.to(tl.float32) * scale2
                    px = tl.exp2(x - lp)
                    qy = tl.exp2(y - lq)
                    acc_abs += tl.abs(px - qy)
                    acc_min += tl.minimum(px, qy)
                tv = tl.minimum(tl.maximum(0.5 * tl.sum(acc_abs, 0), 0.0), 1.0)
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
                if HAS_WEIGHTS:
                    w = w * tl.load(weight_ptr + row64).to(tl.float32)
                g_row = grad_ptr + row64 * stride_g
                for i in range(0, n_tiles):
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


# Launch configuration (default: best of the sweep on H100 and H200, NOTES_divergence.md); the benchmark
# overrides it through `set_config` to sweep tile sizes and grid shapes.
_DEFAULT_CONFIG: dict[str, int] = {"block": 2048, "num_warps": 4, "programs_per_sm": 0, "programs": 0,
                                   "evict_last": 0, "interpret_block": 256}
_CONFIG: dict[str, int] = dict(_DEFAULT_CONFIG)


def set_config(**overrides: int | None) -> dict[str, int]:
    """Override the launch configuration; returns the previous one (pass it back to restore; no argument = reset).

    Keys: ``block`` (vocabulary tile), ``num_warps``, ``programs_per_sm`` (CUDA: grid of that many programs per
    multiprocessor with a grid-stride loop over rows; 0 = one program per row), ``programs`` (a fixed grid size,
    any device; 0 = off), ``evict_last`` (1: pass-1 loads ask L2 to keep the row for pass 2),
    ``interpret_block`` (tile under ``TRITON_INTERPRET=1``).
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


def _launch_params(n_rows: int, vocab: int, device: torch.device) -> tuple[int, int, int]:
    block = min(triton.next_power_of_2(vocab), _CONFIG["block"])
    if os.environ.get("TRITON_INTERPRET") == "1":
        block = min(triton.next_power_of_2(vocab), _CONFIG["interpret_block"])  # small tiles: multi-tile paths run
    num_warps = max(1, min(_CONFIG["num_warps"], block // 256))
    programs = n_rows
    if _CONFIG["programs"] > 0:
        programs = min(n_rows, _CONFIG["programs"])
    elif _CONFIG["programs_per_sm"] > 0 and device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        programs = min(n_rows, sms * _CONFIG["programs_per_sm"])
    return block, num_warps, max(programs, 1)


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
) -> tuple[torch.Tensor, ...]:
    """Run the kernel once. Returns ``(ce, kl, tv, alpha, status, per_task)`` ([N] float32 / int32 tensors; kl, tv,
    alpha are None when ``compute_tv`` is False; per_task a tuple of 4 float64 sums and an int64 count, or None).

    ``grad_out`` ([N, V], may be ``drafter_logits`` itself for an in-place gradient) receives
    ``weights[n] * grad_scale * (q - p) / T`` in its own dtype.
    """
    verifier_logits = _row_major(verifier_logits)
    drafter_logits = _row_major(drafter_logits)
    n_rows, vocab = verifier_logits.shape
    device = verifier_logits.device
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
    block, num_warps, programs = _launch_params(n_rows, vocab, device)
    write_grad = grad_out is not None
    _divergence_kernel[(programs,)](
        verifier_logits, drafter_logits, verifier_logits.stride(0), drafter_logits.stride(0),
        mask if mask is not None else dummy, task_ids if has_tasks else dummy,
        weights if weights is not None else dummy,
        ce, kl if compute_tv else dummy, tv if compute_tv else dummy, alpha if compute_tv else dummy, status,
        grad_out if write_grad else dummy, grad_out.stride(0) if write_grad else 0,
        *(sums if has_tasks else [dummy] * 4), count if has_tasks else dummy,
        n_rows, vocab, programs, LOG2E / temperature, grad_scale / temperature,
        HAS_MASK=mask is not None, HAS_TASKS=has_tasks, HAS_WEIGHTS=weights is not None,
        COMPUTE_TV=compute_tv, WRITE_GRAD=write_grad, BLOCK=block, EVICT_LAST=bool(_CONFIG["evict_last"]),
        num_warps=num_warps,
    )
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
    w = torch.ones_like(ce) if weights is None else weights.to(torch.float32)
    if mask is not None:
        w = torch.where(mask, w, torch.zeros_like(w))
    return torch.where(w != 0, w * ce, torch.zeros_like(ce)).sum()


class DivergenceLossFunction(torch.autograd.Function):
    """``sum_n w_n H(p_n, q_n)`` (or its mean) with the drafter-logit gradient computed in the forward pass."""

    @staticmethod
    def forward(ctx, drafter_logits: torch.Tensor, verifier_logits: torch.Tensor, weights: torch.Tensor | None,
                mask: torch.Tensor | None, temperature: float, reduction: str) -> torch.Tensor:
        n_rows = drafter_logits.shape[0]
        if reduction == "mean":
            count = float(n_rows if mask is None else int(mask.sum()))
            scale = 1.0 / max(count, 1.0)
        else:
            scale = 1.0
        needs_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(drafter_logits, memory_format=torch.contiguous_format) if needs_grad else None
        mask_u8 = mask.to(torch.uint8) if mask is not None else None
        w32 = weights.to(torch.float32).contiguous() if weights is not None else None
        ce = launch_divergence(verifier_logits, drafter_logits, temperature, mask=mask_u8, compute_tv=False,
                               grad_out=grad, weights=w32, grad_scale=scale)[0]
        ctx.save_for_backward(grad)
        return _weighted_total(ce, weights, mask) * scale

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        if grad is None:
            return None, None, None, None, None, None
        if not torch.equal(grad_output, torch.ones_like(grad_output)):
            grad = grad * grad_output.to(grad.dtype)
        return grad, None, None, None, None, None


def divergence_loss_triton(drafter_logits: torch.Tensor, verifier_logits: torch.Tensor,
                           weights: torch.Tensor | None, mask: torch.Tensor | None, temperature: float,
                           reduction: str) -> torch.Tensor:
    """Triton path of :func:`specdec.divergence_loss` (0-dim float32, differentiable w.r.t. ``drafter_logits``)."""
    return DivergenceLossFunction.apply(drafter_logits, verifier_logits.detach(), weights, mask, temperature,
                                        reduction)


__all__ = ["DivergenceLossFunction", "divergence_loss_triton", "divergence_triton", "launch_divergence",
           "set_config", "LOG2E"]
