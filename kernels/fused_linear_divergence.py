"""Fused LM head + drafter cross-entropy against the verifier, never storing the [N, V] drafter logits whole.

Tokens are processed in chunks of ``C`` rows. Per chunk: ``logits_c = h_c W^T`` ([C, V], the hidden dtype), then the
divergence kernel (:mod:`specdec.kernels.divergence`) computes ``H(p_n, q_n)`` and overwrites ``logits_c`` in place
with ``dL/dlogits = w_n s (q - p) / T``; then ``grad_h_c = dlogits_c W`` and ``grad_W += dlogits_c^T h_c`` with a
float32 accumulator (a float32-output matrix product where the device has one, else float32 operands). Peak extra
memory is one [C, V] chunk, the [V, H] float32 weight-gradient accumulator and the [N, H] hidden gradient.

The gradients are computed in the forward pass and scaled in place by the incoming gradient in the backward pass,
on the device (no host sync unless ``check_inputs``): one backward per graph (a second raises RuntimeError).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .divergence import (
    DivergencePlan,
    check_first_backward,
    launch_divergence,
    loss_scale,
    raise_on_bad_status,
    reduced_loss,
    rescale_gradient,
)

DEFAULT_CHUNK_ELEMENTS = 1 << 27  # logits per chunk: 256 MiB in bf16


def _accumulate_weight_grad(grad_weight: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor) -> None:
    """``grad_weight (fp32, [V, H]) += grad_logits^T [V, C] @ hidden [C, H]`` with float32 accumulation."""
    if grad_logits.dtype == torch.float32:
        grad_weight.addmm_(grad_logits.t(), hidden)
        return
    if grad_logits.is_cuda:
        try:
            torch.addmm(grad_weight, grad_logits.t(), hidden, out_dtype=torch.float32, out=grad_weight)
            return
        except (TypeError, RuntimeError, NotImplementedError):
            pass
    grad_weight.addmm_(grad_logits.t().float(), hidden.float())


class FusedLinearDivergenceFunction(torch.autograd.Function):
    """``sum_n w_n H(p_n, softmax(h_n W^T / T))`` (or its mean); gradients for ``h`` and ``W``."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, verifier_logits: torch.Tensor,
                weights: torch.Tensor | None, mask: torch.Tensor | None, temperature: float, reduction: str,
                chunk_size: int | None, check_inputs: bool = False,
                plan: DivergencePlan | None = None) -> torch.Tensor:
        n_rows, _ = hidden.shape
        vocab = weight.shape[0]
        scale, count = loss_scale(reduction, n_rows, mask)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_grad = need_h or need_w
        chunk = chunk_size or max(1, DEFAULT_CHUNK_ELEMENTS // vocab)
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        verifier_logits = verifier_logits.contiguous()
        ce = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
        status = torch.zeros(n_rows, dtype=torch.int32, device=hidden.device)
        for start in range(0, n_rows, chunk):
            end = min(start + chunk, n_rows)
            h_c = hidden[start:end]
            logits_c = h_c @ weight.t()
            ce[start:end], _, _, _, status[start:end], _ = launch_divergence(
                verifier_logits[start:end], logits_c, temperature,
                mask=mask[start:end] if mask is not None else None, compute_tv=False,
                grad_out=logits_c if need_grad else None,
                weights=weights[start:end] if weights is not None else None, grad_scale=scale, grad_count=count,
                plan=plan)
            if need_h:
                torch.mm(logits_c, weight, out=grad_hidden[start:end])
            if need_w:
                _accumulate_weight_grad(grad_weight, logits_c, h_c)
            del logits_c
        if check_inputs:
            raise_on_bad_status(status)  # bit 1: the drafter logits h W^T (NaN / inf in h or W)
        if grad_weight is not None and weight.dtype != torch.float32:
            grad_weight = grad_weight.to(weight.dtype)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return reduced_loss(ce, weights, mask, scale, count)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        check_first_backward(ctx, "fused_linear_divergence_loss")
        grad_hidden, grad_weight = ctx.saved_tensors
        for grad in (grad_hidden, grad_weight):
            if grad is not None:
                rescale_gradient(grad, grad_output)  # in place on the device, no sync
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def fused_linear_divergence_loss_triton(hidden: torch.Tensor, weight: torch.Tensor, verifier_logits: torch.Tensor,
                                        weights: torch.Tensor | None, mask: torch.Tensor | None, temperature: float,
                                        reduction: str, chunk_size: int | None = None,
                                        check_inputs: bool = False,
                                        plan: DivergencePlan | None = None) -> torch.Tensor:
    """Triton path of :func:`specdec.fused_linear_divergence_loss` (0-dim float32); ``plan``: the divergence
    kernel's plan for every chunk (default :func:`~specdec.kernels.divergence.divergence_plan` per chunk)."""
    return FusedLinearDivergenceFunction.apply(hidden, weight, verifier_logits.detach(), weights, mask, temperature,
                                               reduction, chunk_size, check_inputs, plan)
