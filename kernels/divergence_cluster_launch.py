"""Launching the cluster kernels of :mod:`.divergence_cluster` (Hopper): eligibility, compile, patch, launch.

Triton has no cluster launch API for ordinary kernels, but its launcher already passes the kernel's ``num_ctas`` to
``cuLaunchKernelEx`` as the cluster dimension: each kernel is compiled as an ordinary one-CTA program, its launch
metadata is patched to ``num_ctas = C`` and to the shared-memory size of the row-chunk region (``_patch_cluster``),
and the grid is sized with the occupancy API (persistent clusters). Anything unexpected (another Triton, a compile
error, a refused launch) turns the path off for the process, with a warning, and the row kernel runs instead.
"""

from __future__ import annotations

import warnings

import torch
import triton

from ._device import INTERPRETER, major_capability, sm_count
from .divergence_cluster import (
    HAVE_GLUON,
    LANE_COLUMNS,
    NUM_WARPS,
    cluster_layout,
    region_bytes,
)

if HAVE_GLUON:
    from .divergence_cluster import _cluster_forward_kernel, _cluster_loss_kernel

LOG2E = 1.4426950408889634

# "broken": the path is off for the process after a failure; "launches": kernel launches so far (tests check which
# path ran)
_STATE = {"broken": False, "launches": 0}
# (kernel, device, dtypes, flags, layout) -> (compiled kernel patched to launch as clusters, clusters that fit at once)
_COMPILED: dict[tuple, tuple] = {}


def cluster_supported(verifier_dtype: torch.dtype, drafter_dtype: torch.dtype, vocab: int, aligned: bool) -> bool:
    """Whether the kernels can take these inputs: the same 16-bit dtype on both (the shared-memory layout), ``V`` a
    multiple of 16 and rows 16-element aligned (``aligned``: 16-byte ``cp.async``), and a layout that fits shared
    memory."""
    if verifier_dtype != drafter_dtype or verifier_dtype not in (torch.bfloat16, torch.float16):
        return False
    if vocab % 16 or not aligned:
        return False
    return cluster_layout(vocab, 2) is not None  # 2 bytes: bf16 / fp16


def cluster_eligible(verifier_logits: torch.Tensor, drafter_logits: torch.Tensor,
                     grad_out: torch.Tensor | None) -> bool:
    """Whether the cluster kernels can run on these tensors (``grad_out``: the loss's gradient, None for the
    forward): a CUDA device with thread-block clusters (sm_90+), not the interpreter, Gluon importable, the path not
    turned off by an earlier failure, and :func:`cluster_supported`. (Where they are worth it is the plan's rule,
    :func:`specdec.kernels.divergence.divergence_plan`.)"""
    if _STATE["broken"] or not HAVE_GLUON or INTERPRETER:
        return False
    if verifier_logits.device.type != "cuda" or major_capability(verifier_logits.device) < 9:
        return False
    rows = (verifier_logits, drafter_logits) + ((grad_out,) if grad_out is not None else ())
    aligned = all(t.stride(-1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0 for t in rows)
    return cluster_supported(verifier_logits.dtype, drafter_logits.dtype, verifier_logits.shape[1], aligned)


def _patch_cluster(compiled, cluster_size: int, shared: int) -> None:
    """Launch ``compiled`` as clusters of ``cluster_size`` CTAs with ``shared`` bytes of dynamic shared memory:
    Triton's launcher reads ``packed_metadata = (num_warps, num_ctas, shared)`` and passes ``num_ctas`` to
    ``cuLaunchKernelEx`` as the cluster dimension (grid x ``num_ctas`` CTAs)."""
    packed = compiled.packed_metadata
    if not (isinstance(packed, tuple) and len(packed) == 3 and packed[1] in (1, cluster_size)):
        raise RuntimeError(f"unexpected launch metadata {packed!r} (Triton {triton.__version__})")
    compiled.packed_metadata = (packed[0], cluster_size, shared)  # idempotent: Triton's cache may hand it back


def _give_up(what: str, exc: Exception) -> None:
    """Turn the cluster path off for the process, with a warning; the caller falls back to the row kernel."""
    _STATE["broken"] = True
    warnings.warn(f"specdec: the cluster divergence kernel {what} ({type(exc).__name__}: {exc}); using the "
                  "one-program-per-row kernel", RuntimeWarning, stacklevel=4)


def _launch(kernel, key: tuple, arguments, constexprs: dict, c: int, nt: int, n_rows: int,
            device: torch.device) -> bool:
    """Launch ``kernel`` as persistent clusters of ``c`` CTAs (``arguments(n_clusters, region)``: its runtime
    arguments). The first call per ``key`` compiles it, places the row-chunk region after the compiler's own shared
    memory (``region``, 128-byte aligned; ``region_bytes`` long), sizes the grid with the occupancy API
    and patches the launch; later calls launch the compiled kernel directly (no JIT dispatch). False (after a
    warning, for the rest of the process) if it cannot be built or launched as a cluster."""
    if key not in _COMPILED:
        try:
            estimate = max(1, sm_count(device) * 2 // c)
            compiled = kernel.warmup(*arguments(estimate, 0), grid=(estimate * c,), **constexprs,
                                     num_warps=NUM_WARPS)
            region = getattr(compiled, "_specdec_region", None)
            if region is None:  # not yet patched (Triton's cache may hand back a patched kernel for another key)
                region = -(-compiled.metadata.shared // 128) * 128
                compiled.metadata = compiled.metadata._replace(shared=region + region_bytes(c, nt))
                compiled._specdec_region = region
                compiled.module = None  # (re)load below with the new size: it sets the function's shared-memory limit
            compiled._init_handles()  # after the shared-memory size is final: it sets the function's limit
            shared = compiled.metadata.shared
            fit = int(triton.runtime.driver.active.utils.cuOccupancyMaxActiveClusters(compiled.function, shared, c))
            if fit < 1:
                raise RuntimeError(f"no cluster of {c} CTAs fits ({shared} bytes of shared memory)")
            _patch_cluster(compiled, c, shared)
            _COMPILED[key] = (compiled, fit, region)
        except Exception as exc:  # noqa: BLE001 - any failure here falls back to the row kernel
            _give_up("is unavailable", exc)
            return False
    compiled, fit, region = _COMPILED[key]
    n_clusters = min(n_rows, fit)
    try:
        # the launcher takes every parameter in order, constexprs included (it skips them), as the JIT path does
        compiled[(n_clusters, 1, 1)](*arguments(n_clusters, region), *constexprs.values())
    except Exception as exc:  # noqa: BLE001 - a refused launch (cuLaunchKernelEx) falls back to the row kernel
        _give_up("could not be launched", exc)
        return False
    _STATE["launches"] += 1
    return True


def launch_cluster_loss(verifier_logits: torch.Tensor, drafter_logits: torch.Tensor, temperature: float,
                        grad_out: torch.Tensor, *, mask: torch.Tensor | None = None,
                        weights: torch.Tensor | None = None, grad_scale: float = 1.0,
                        grad_count: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(ce, status)`` ([N] float32 H(p, q), [N] int32 status as in :mod:`.divergence`) with ``grad_out``
    ([N, V]) filled with ``weights[n] * grad_scale * (q - p) / T`` (divided by ``max(grad_count, 1)`` when given);
    masked rows (``mask`` [N], nonzero = kept) get 0 everywhere. The side inputs come as
    :func:`.divergence.launch_divergence` prepares them (one compiled kernel per key): contiguous uint8 ``mask``,
    float32 ``weights`` and [1] ``grad_count``. Call only where ``cluster_eligible``; returns None (after a warning,
    for the rest of the process) if the kernel cannot be built or launched as a cluster."""
    n_rows, vocab = verifier_logits.shape
    device = verifier_logits.device
    c, chunk_cols, nt, n_full = cluster_layout(vocab, verifier_logits.element_size())
    ce = torch.empty(n_rows, dtype=torch.float32, device=device)
    status = torch.empty(n_rows, dtype=torch.int32, device=device)
    if n_rows == 0:
        return ce, status
    constexprs = dict(HAS_MASK=mask is not None, HAS_WEIGHTS=weights is not None, HAS_COUNT=grad_count is not None,
                      C=c, NT=nt, N_FULL=n_full, K=LANE_COLUMNS, WARPS=NUM_WARPS)
    key = ("loss", device.index, verifier_logits.dtype, grad_out.dtype, *constexprs.values())

    def arguments(clusters: int, region: int) -> tuple:
        return (verifier_logits, drafter_logits, grad_out, verifier_logits.stride(0), drafter_logits.stride(0),
                grad_out.stride(0), mask if mask is not None else ce, weights if weights is not None else ce,
                grad_count if grad_count is not None else ce, ce, status, n_rows, vocab, chunk_cols,
                clusters, region, LOG2E / temperature, grad_scale / temperature)

    if not _launch(_cluster_loss_kernel, key, arguments, constexprs, c, nt, n_rows, device):
        return None
    return ce, status


def launch_cluster_forward(verifier_logits: torch.Tensor, drafter_logits: torch.Tensor, temperature: float, *,
                           mask: torch.Tensor | None = None, task_ids: torch.Tensor | None = None,
                           num_tasks: int | None = None) -> tuple | None:
    """``(ce, kl, tv, alpha, status, per_task)`` as :func:`.divergence.launch_divergence` returns them
    ([N] float32 / int32; ``per_task`` 4 float64 sums and an int64 count over ``task_ids`` [N] in ``[0, num_tasks)``,
    negative ids left out, or None); masked rows (``mask`` [N], nonzero = kept) get 0. The side inputs come as
    :func:`.divergence.launch_divergence` prepares them: contiguous uint8 ``mask`` and int64 ``task_ids``. Call only
    where ``cluster_eligible``; returns None (after a warning, for the rest of the process) if the kernel cannot be
    built or launched as a cluster."""
    n_rows, vocab = verifier_logits.shape
    device = verifier_logits.device
    c, chunk_cols, nt, n_full = cluster_layout(vocab, verifier_logits.element_size())
    f32 = dict(dtype=torch.float32, device=device)
    ce, kl, tv, alpha = (torch.empty(n_rows, **f32) for _ in range(4))
    status = torch.empty(n_rows, dtype=torch.int32, device=device)
    has_tasks = task_ids is not None
    sums = [torch.zeros(num_tasks, dtype=torch.float64, device=device) for _ in range(4)] if has_tasks else None
    count = torch.zeros(num_tasks, dtype=torch.int64, device=device) if has_tasks else None
    per_task = (*sums, count) if has_tasks else None
    if n_rows == 0:
        return ce, kl, tv, alpha, status, per_task
    constexprs = dict(HAS_MASK=mask is not None, HAS_TASKS=has_tasks, C=c, NT=nt, N_FULL=n_full, K=LANE_COLUMNS,
                      WARPS=NUM_WARPS)
    key = ("forward", device.index, verifier_logits.dtype, *constexprs.values())

    def arguments(clusters: int, region: int) -> tuple:
        return (verifier_logits, drafter_logits, verifier_logits.stride(0), drafter_logits.stride(0),
                mask if mask is not None else ce, task_ids if has_tasks else ce, ce, kl, tv, alpha,
                status, *(sums if has_tasks else [ce] * 4), count if has_tasks else ce, n_rows, vocab, chunk_cols,
                clusters, region, LOG2E / temperature)

    if not _launch(_cluster_forward_kernel, key, arguments, constexprs, c, nt, n_rows, device):
        return None
    return ce, kl, tv, alpha, status, per_task


__all__ = ["cluster_eligible", "cluster_supported", "launch_cluster_forward", "launch_cluster_loss"]
