"""Drafter-verifier divergences per token and per task, and the drafter's training loss.

``p = softmax(verifier_logits / T)`` and ``q = softmax(drafter_logits / T)``. Per token:
``H(p, q) = -sum_x p log q`` (the drafter's cross-entropy against the verifier), ``KL(p || q) = H(p, q) - H(p)``,
``TV(p, q) = 1/2 sum_x |p - q|`` and the acceptance probability ``alpha = sum_x min(p, q) = 1 - TV``.
Conventions (``-inf`` logits, ``p > 0`` where ``q = 0``, ``T = 0``) are those of
:mod:`specdec.kernels.divergence_reference`.

``backend="auto"`` runs the fused Triton kernels (:mod:`specdec.kernels.divergence`) on CUDA tensors and the torch
reference elsewhere; ``"triton"`` forces the kernels (on the CPU only under ``TRITON_INTERPRET=1``), ``"torch"`` the
reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec._validation import check_logit_rows, check_same_device, check_temperature, check_tensor, use_triton
from specdec.kernels.divergence_reference import cross_entropy_rows, divergence_reference

__all__ = [
    "DivergenceOutput",
    "PerTaskDivergence",
    "divergence",
    "divergence_loss",
    "fused_linear_divergence_loss",
]

REDUCTIONS = ("sum", "mean")


@dataclass
class PerTaskDivergence:
    """Per-task sums of the per-token divergences (tokens with ``task_ids == -1`` or ``mask == False`` left out).

    Attributes:
        cross_entropy_sum, kl_sum, tv_sum, alpha_sum: [num_tasks] float64 sums of the per-token float32 values.
        count: [num_tasks] int64 number of tokens of each task.

    Sums over several batches add up with ``+``; the means (``K_T``, ``D_T``, ``TV_T``, ``alpha_T`` of DESIGN.md) are
    NaN for a task without tokens.
    """

    cross_entropy_sum: torch.Tensor
    kl_sum: torch.Tensor
    tv_sum: torch.Tensor
    alpha_sum: torch.Tensor
    count: torch.Tensor

    def _mean(self, total: torch.Tensor) -> torch.Tensor:
        return total / self.count.to(total.dtype)  # 0 / 0 = NaN for empty tasks

    cross_entropy_mean = property(lambda self: self._mean(self.cross_entropy_sum),
                                  doc="[num_tasks] float64 ``K_T = E_{s~T} H(p, q)``.")
    kl_mean = property(lambda self: self._mean(self.kl_sum), doc="[num_tasks] float64 ``D_T = E_{s~T} KL(p || q)``.")
    tv_mean = property(lambda self: self._mean(self.tv_sum), doc="[num_tasks] float64 ``TV_T = E_{s~T} TV(p, q)``.")
    alpha_mean = property(lambda self: self._mean(self.alpha_sum),
                          doc="[num_tasks] float64 ``alpha_T = E_{s~T} alpha``.")

    def mean(self) -> dict[str, torch.Tensor]:
        """The four per-task means as a dict keyed ``cross_entropy``, ``kl``, ``tv``, ``alpha``."""
        return {"cross_entropy": self.cross_entropy_mean, "kl": self.kl_mean, "tv": self.tv_mean,
                "alpha": self.alpha_mean}

    def __add__(self, other: PerTaskDivergence) -> PerTaskDivergence:
        if not isinstance(other, PerTaskDivergence):
            return NotImplemented
        if other.count.shape != self.count.shape:
            raise ValueError(f"cannot add per-task sums over {self.count.numel()} and {other.count.numel()} tasks")
        return PerTaskDivergence(self.cross_entropy_sum + other.cross_entropy_sum, self.kl_sum + other.kl_sum,
                                 self.tv_sum + other.tv_sum, self.alpha_sum + other.alpha_sum,
                                 self.count + other.count)


@dataclass
class DivergenceOutput:
    """Result of :func:`divergence`.

    Attributes:
        cross_entropy: [N] float32 ``H(p, q)`` (nats); ``+inf`` where p puts mass on a token q excludes.
        kl: [N] float32 ``KL(p || q) >= 0``; the verifier's entropy is ``cross_entropy - kl``.
        tv: [N] float32 ``TV(p, q)`` in [0, 1].
        alpha: [N] float32 acceptance probability ``sum_x min(p, q)`` in [0, 1].
        per_task: :class:`PerTaskDivergence` when ``task_ids`` was given, else None.

    Tokens with ``mask == False`` get 0 in all four.
    """

    cross_entropy: torch.Tensor
    kl: torch.Tensor
    tv: torch.Tensor
    alpha: torch.Tensor
    per_task: PerTaskDivergence | None = None


def _check_logit_pair(first: torch.Tensor, second: torch.Tensor, first_name: str, second_name: str) -> tuple[int, int]:
    check_tensor(first, first_name, 2, float_dtype=True, shape_doc="[N, V]")
    check_tensor(second, second_name, 2, float_dtype=True, shape_doc="[N, V]")
    if first.shape[1] < 1:
        raise ValueError(f"{first_name} must have a vocabulary dimension V >= 1, got shape {tuple(first.shape)}")
    if tuple(second.shape) != tuple(first.shape):
        raise ValueError(f"{second_name} must have the shape of {first_name} [N, V] = {tuple(first.shape)}, "
                         f"got {tuple(second.shape)}")
    return first.shape[0], first.shape[1]


def _check_mask(mask: torch.Tensor | None, num_rows: int) -> None:
    if mask is None:
        return
    check_tensor(mask, "mask", 1, shape_doc="[N]")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor of shape [N] (True = token counted), got {mask.dtype}")
    if mask.shape[0] != num_rows:
        raise ValueError(f"mask must have shape [N] = [{num_rows}], got {tuple(mask.shape)}")


def _check_weights(weights: torch.Tensor | None, num_rows: int, check_values: bool = True) -> None:
    """Shape and dtype of ``weights``; with ``check_values`` also finiteness (one device sync)."""
    if weights is None:
        return
    check_tensor(weights, "weights", 1, float_dtype=True, shape_doc="[N]")
    if weights.shape[0] != num_rows:
        raise ValueError(f"weights must have shape [N] = [{num_rows}], got {tuple(weights.shape)}")
    if check_values and not torch.isfinite(weights).all():
        raise ValueError("weights must be finite (no NaN or inf)")


def _check_loss_order(drafter_requires_grad: bool, verifier_logits: torch.Tensor, function: str,
                      drafter_name: str) -> None:
    """ValueError when ``verifier_logits`` requires grad and the drafter's input does not: the arguments of
    ``function`` were most likely given in :func:`divergence`'s order (verifier first), which would otherwise fail
    only at ``backward()``."""
    if verifier_logits.requires_grad and not drafter_requires_grad:
        raise ValueError(f"{function}: verifier_logits requires grad and {drafter_name} does not, so the arguments "
                         f"look swapped: {function} takes the drafter's first ({function}({drafter_name}, "
                         "verifier_logits, ...)), divergence() the verifier's; pass them by keyword to be sure")


def _check_reduction(reduction: str) -> str:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return reduction


def divergence(
    verifier_logits: torch.Tensor,
    drafter_logits: torch.Tensor,
    temperature: float = 1.0,
    task_ids: torch.Tensor | None = None,
    num_tasks: int | None = None,
    backend: str = "auto",
    *,
    mask: torch.Tensor | None = None,
    check_inputs: bool = True,
) -> DivergenceOutput:
    """Per-token H(p, q), KL(p || q), TV(p, q) and alpha, with optional per-task sums, without [N, V] intermediates.

    Args:
        verifier_logits: [N, V] fp32/bf16/fp16 logits of the verifier p, before temperature.
        drafter_logits: [N, V] logits of the drafter q exactly as it sampled from them (after any top-k/top-p filter,
            which leaves ``-inf``), before temperature.
        temperature: T >= 0 applied to both; ``0`` is greedy (one-hot argmax, ties to the lowest id).
        task_ids: optional [N] integer task of each token in ``[0, num_tasks)``; ``-1`` = token in no task.
        num_tasks: number of tasks (default ``max(task_ids) + 1``, which costs a device sync).
        backend: "auto" (Triton on CUDA, torch otherwise), "triton" or "torch".
        mask: optional [N] bool, True = token counted; False tokens are skipped (values 0, not in per-task sums).
        check_inputs: raise ValueError on NaN or +inf logits or an all ``-inf`` row (the Triton path detects these
            in the kernel itself and pays one small device sync).

    Returns:
        :class:`DivergenceOutput` with four [N] float32 tensors and ``per_task`` (float64 sums, int64 counts).
        On Hopper GPUs with bf16/fp16 logits (V >= 32000, a multiple of 16) the Triton path splits each row over a
        thread-block cluster and reads the logits once (``kernels/divergence_cluster.py``); elsewhere one program
        per row reads them twice.
    """
    num_rows, _ = _check_logit_pair(verifier_logits, drafter_logits, "verifier_logits", "drafter_logits")
    temperature = check_temperature(temperature)
    _check_mask(mask, num_rows)
    if task_ids is not None:
        check_tensor(task_ids, "task_ids", 1, integer_dtype=True, shape_doc="[N]")
        if task_ids.shape[0] != num_rows:
            raise ValueError(f"task_ids must have shape [N] = [{num_rows}], got {tuple(task_ids.shape)}")
    device = check_same_device(verifier_logits=verifier_logits, drafter_logits=drafter_logits, task_ids=task_ids,
                               mask=mask)
    if num_tasks is not None and (isinstance(num_tasks, bool) or not isinstance(num_tasks, int)):
        raise TypeError(f"num_tasks must be an int, got {type(num_tasks).__name__}")
    if task_ids is not None:
        lowest = int(task_ids.min()) if num_rows else 0
        highest = int(task_ids.max()) if num_rows else -1
        if num_tasks is None:
            num_tasks = max(highest + 1, 1)
        if num_tasks < 1:
            raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
        if lowest < -1 or highest >= num_tasks:
            raise ValueError(f"task_ids must lie in [0, num_tasks={num_tasks}) or be -1, got values in "
                             f"[{lowest}, {highest}]")
    elif num_tasks is not None:
        raise ValueError("num_tasks was given without task_ids")
    triton_path = use_triton(backend, device) and temperature > 0 and num_rows > 0

    if triton_path:
        from specdec.kernels.divergence import launch_divergence, raise_on_bad_status

        ce, kl, tv, alpha, status, sums = launch_divergence(
            verifier_logits, drafter_logits, temperature, mask=mask, task_ids=task_ids, num_tasks=num_tasks)
        if check_inputs:
            raise_on_bad_status(status)
    else:
        if check_inputs:
            for name, logits in (("verifier_logits", verifier_logits), ("drafter_logits", drafter_logits)):
                check_logit_rows(logits, name, mask)
        ce, kl, tv, alpha, sums = divergence_reference(
            verifier_logits, drafter_logits, temperature, mask=mask, task_ids=task_ids, num_tasks=num_tasks,
            compute_dtype=torch.float64 if verifier_logits.device.type == "cpu" else torch.float32)
        ce, kl, tv, alpha = (t.to(torch.float32) for t in (ce, kl, tv, alpha))
    per_task = PerTaskDivergence(*sums) if sums is not None else None
    return DivergenceOutput(ce, kl, tv, alpha, per_task)


def _reduce_weighted(ce: torch.Tensor, weights: torch.Tensor | None, mask: torch.Tensor | None,
                     reduction: str) -> torch.Tensor:
    """``sum_n w_n H_n`` over counted tokens (weight 0 contributes 0 even where H is inf); mean divides by count."""
    w = torch.ones_like(ce) if weights is None else weights.to(ce.dtype)
    if mask is not None:
        w = torch.where(mask, w, torch.zeros_like(w))
    total = torch.where(w != 0, w * ce, torch.zeros_like(ce)).sum()
    if reduction == "mean":
        count = ce.shape[0] if mask is None else mask.sum()
        total = total / max(count, 1) if isinstance(count, int) else total / count.clamp_min(1)
    return total


def _loss_dtype(logits: torch.Tensor) -> torch.dtype:
    """The torch path computes in float32, or float64 for float64 inputs (so it can serve as ground truth)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def divergence_loss(
    drafter_logits: torch.Tensor,
    verifier_logits: torch.Tensor,
    weights: torch.Tensor | None = None,
    temperature: float = 1.0,
    reduction: str = "sum",
    backend: str = "auto",
    *,
    mask: torch.Tensor | None = None,
    check_inputs: bool = True,
) -> torch.Tensor:
    """Weighted drafter cross-entropy ``L = sum_n w_n H(p_n, q_n)``; gradient only to ``drafter_logits``.

    The drafter's logits come first (the trained argument first, as in ``torch.nn.functional.cross_entropy``), the
    reverse of :func:`divergence`; keywords avoid the question. A call in :func:`divergence`'s order, with
    ``verifier_logits`` requiring grad and ``drafter_logits`` not, raises ValueError at once (it could not train).

    ``dL / d drafter_logits[n] = w_n (q_n - p_n) / T`` (times ``1 / count`` for ``"mean"``); the verifier is treated
    as a constant (detached). Since ``H = H(p) + KL(p || q)`` and H(p) is constant, this is also the KL gradient.

    Args:
        drafter_logits: [N, V] fp32/bf16/fp16 (or fp64) drafter logits (requires_grad for training).
        verifier_logits: [N, V] verifier logits, same dtype family, no gradient.
        weights: optional [N] float per-token weights ``w_n`` (e.g. s-CDF task weights), constants; default 1.
        temperature: T > 0 applied to both.
        reduction: "sum" = ``sum_n w_n H_n``; "mean" = that sum divided by the number of counted tokens.
        backend: "auto", "triton" or "torch" (plain autograd through the reference).
        mask: optional [N] bool, True = token counted (False = weight 0, zero gradient).
        check_inputs: raise ValueError when a counted row holds NaN or +inf or is all ``-inf`` (p or q undefined),
            or ``weights`` is not finite; costs a device sync (on the Triton path the kernel flags such rows, no extra
            pass over [N, V]). Pass False inside training loops: the Triton path then never syncs with the host (a
            masked mean's count and the backward's scaling stay on the device), and such rows give a NaN loss
            instead of an error.

    Returns:
        0-dim loss: float32, or float64 for float64 logits on the torch path. On the Triton path the gradient is
        computed during the forward pass (one extra write of [N, V] in the drafter's dtype, no [N, V] float32
        intermediates; for fp16 logits in float32, so that a loss scaler's factor reaches the small entries before
        they are rounded to fp16) and scaled in place by the incoming gradient on the device, so one backward per
        graph: a
        second backward through the same graph (``retain_graph=True``) raises RuntimeError. On Hopper GPUs with
        bf16/fp16 logits (V >= 32000, a multiple of 16) the kernel splits each row over a thread-block cluster and
        reads the logits once (``kernels/divergence_cluster.py``); elsewhere one program per row reads them twice.
    """
    num_rows, _ = _check_logit_pair(drafter_logits, verifier_logits, "drafter_logits", "verifier_logits")
    _check_loss_order(drafter_logits.requires_grad, verifier_logits, "divergence_loss", "drafter_logits")
    temperature = check_temperature(temperature, allow_zero=False)
    reduction = _check_reduction(reduction)
    _check_weights(weights, num_rows, check_values=check_inputs)
    _check_mask(mask, num_rows)
    device = check_same_device(drafter_logits=drafter_logits, verifier_logits=verifier_logits, weights=weights,
                               mask=mask)
    if use_triton(backend, device) and num_rows > 0:
        from specdec.kernels.divergence import divergence_loss_triton

        return divergence_loss_triton(drafter_logits, verifier_logits, weights, mask, temperature, reduction,
                                      check_inputs)
    if check_inputs:
        check_logit_rows(verifier_logits, "verifier_logits", mask)
        check_logit_rows(drafter_logits, "drafter_logits", mask)
    ce = cross_entropy_rows(verifier_logits, drafter_logits, temperature, _loss_dtype(drafter_logits))
    return _reduce_weighted(ce, weights, mask, reduction)


def fused_linear_divergence_loss(
    drafter_hidden: torch.Tensor, lm_head_weight: torch.Tensor, verifier_logits: torch.Tensor,
    weights: torch.Tensor | None = None, temperature: float = 1.0, reduction: str = "sum", backend: str = "auto", *,
    mask: torch.Tensor | None = None, chunk_size: int | None = None, check_inputs: bool = True,
) -> torch.Tensor:
    """:func:`divergence_loss` of ``drafter_logits = drafter_hidden @ lm_head_weight.T`` without storing them whole.

    ``verifier_logits`` requiring grad while neither drafter input does raises ValueError (arguments swapped).

    Args:
        drafter_hidden: [N, H] drafter hidden states (fp32/bf16/fp16).
        lm_head_weight: [V, H] drafter LM-head weight, same dtype.
        verifier_logits: [N, V] verifier logits (no gradient).
        weights, temperature, reduction, backend, mask: as in :func:`divergence_loss`.
        chunk_size: tokens per chunk on the Triton path (default: about 2**27 logits per chunk).
        check_inputs: raise ValueError when a counted row of ``verifier_logits`` or of the drafter logits holds NaN
            or +inf or is all ``-inf``, or ``weights`` is not finite (one device sync; the Triton path reads the
            kernel's flags, no extra pass). False: no host sync.

    Returns:
        0-dim loss (float32; float64 for float64 inputs on the torch path) with gradients for ``drafter_hidden``
        and ``lm_head_weight``. The Triton path computes logits chunk by chunk, runs the divergence kernel in place
        on each chunk and accumulates the weight gradient in float32 (one backward per graph, as for
        :func:`divergence_loss`); the torch path is plain autograd (materialises [N, V]). With fp16 inputs the
        Triton path rounds the per-chunk logit gradients to fp16 before a loss scaler's factor is applied, so its
        smallest entries underflow (bf16 and fp32 do not); train in bf16 or use ``backend="torch"`` there.
    """
    check_tensor(drafter_hidden, "drafter_hidden", 2, float_dtype=True, shape_doc="[N, H]")
    check_tensor(lm_head_weight, "lm_head_weight", 2, float_dtype=True, shape_doc="[V, H]")
    check_tensor(verifier_logits, "verifier_logits", 2, float_dtype=True, shape_doc="[N, V]")
    _check_loss_order(drafter_hidden.requires_grad or lm_head_weight.requires_grad, verifier_logits,
                      "fused_linear_divergence_loss", "drafter_hidden")
    num_rows, hidden = drafter_hidden.shape
    vocab = lm_head_weight.shape[0]
    if lm_head_weight.shape[1] != hidden:
        raise ValueError(f"lm_head_weight must have shape [V, H] with H = {hidden} (drafter_hidden's last "
                         f"dimension), got {tuple(lm_head_weight.shape)}")
    if lm_head_weight.dtype != drafter_hidden.dtype:
        raise TypeError(f"lm_head_weight must have drafter_hidden's dtype {drafter_hidden.dtype}, "
                        f"got {lm_head_weight.dtype}")
    if vocab < 1:
        raise ValueError("lm_head_weight must have V >= 1 rows")
    if tuple(verifier_logits.shape) != (num_rows, vocab):
        raise ValueError(f"verifier_logits must have shape [N, V] = {(num_rows, vocab)}, "
                         f"got {tuple(verifier_logits.shape)}")
    temperature = check_temperature(temperature, allow_zero=False)
    reduction = _check_reduction(reduction)
    _check_weights(weights, num_rows, check_values=check_inputs)
    _check_mask(mask, num_rows)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    device = check_same_device(drafter_hidden=drafter_hidden, lm_head_weight=lm_head_weight,
                               verifier_logits=verifier_logits, weights=weights, mask=mask)
    if use_triton(backend, device) and num_rows > 0:
        from specdec.kernels.fused_linear_divergence import fused_linear_divergence_loss_triton

        return fused_linear_divergence_loss_triton(drafter_hidden, lm_head_weight, verifier_logits, weights, mask,
                                                   temperature, reduction, chunk_size, check_inputs)
    logits = drafter_hidden @ lm_head_weight.t()
    if check_inputs:
        check_logit_rows(verifier_logits, "verifier_logits", mask)
        check_logit_rows(logits.detach(), "drafter_logits", mask)
    ce = cross_entropy_rows(verifier_logits, logits, temperature, _loss_dtype(logits))
    return _reduce_weighted(ce, weights, mask, reduction)
