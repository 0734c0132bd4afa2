"""Torch reference of the drafter-verifier divergences: the ground truth the Triton kernel is tested against.

With ``p = softmax(verifier_logits / T)`` and ``q = softmax(drafter_logits / T)`` (the same temperature on both), per
row (token) ``n``:

* cross-entropy ``H(p, q) = -sum_x p(x) log q(x)``
* ``KL(p || q) = sum_x p(x) (log p(x) - log q(x))``
* total variation ``TV(p, q) = 1/2 sum_x |p(x) - q(x)|``
* acceptance ``alpha = sum_x min(p(x), q(x))`` (``= 1 - TV``; both are computed directly, not one from the other)

Conventions (shared with ``kernels/divergence.py``):

* An entry where the verifier logit is ``-inf`` (``p(x) = 0``) contributes ``0 * log 0 = 0`` to H and KL, whatever
  the drafter's logit; entries ``-inf`` on both sides (the same top-k/top-p filter applied to both) contribute
  nothing at all.
* An entry with ``p(x) > 0`` and ``q(x) = 0`` (finite verifier logit, ``-inf`` drafter logit) makes H and KL
  ``+inf``, never NaN. The support is read off the logits (``-inf`` or not), not off ``exp`` underflow.
* Rows where ``p == q`` give ``KL = TV = 0`` and ``alpha = 1`` up to rounding.
* ``temperature == 0`` is greedy: ``p`` and ``q`` are one-hot at the argmax (ties to the lowest id), so
  ``H = KL = 0`` and ``TV = 0``, ``alpha = 1`` where the argmaxes agree, else ``H = KL = +inf``, ``TV = 1``,
  ``alpha = 0``.
* Rows with ``mask[n] == False`` are not computed: their four values are 0 and they are left out of the per-task sums.
  Tokens with ``task_ids[n] == -1`` are computed but left out of the per-task sums.
* Per-task sums are float64 sums of the per-token values (cast to float32 first when ``round_to_float32``, the way
  the kernel accumulates them).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def _row_divergences(verifier: torch.Tensor, drafter: torch.Tensor, temperature: float,
                     compute_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """H, KL, TV, alpha for a [n, V] block of rows, in ``compute_dtype``."""
    a = verifier.to(compute_dtype)
    b = drafter.to(compute_dtype)
    if temperature == 0.0:
        same = a.argmax(dim=-1) == b.argmax(dim=-1)  # torch.argmax returns the first maximal index
        inf = torch.full_like(same, float("inf"), dtype=compute_dtype)
        zero = torch.zeros_like(inf)
        ce = torch.where(same, zero, inf)
        return ce, ce.clone(), torch.where(same, zero, zero + 1), torch.where(same, zero + 1, zero)
    log_p = torch.log_softmax(a / temperature, dim=-1)
    log_q = torch.log_softmax(b / temperature, dim=-1)
    p, q = log_p.exp(), log_q.exp()
    in_p = log_p > NEG_INF
    in_both = in_p & (log_q > NEG_INF)
    p_outside_q = (in_p & ~in_both).any(dim=-1)  # p > 0 where q == 0: H = KL = +inf
    zero = torch.zeros((), dtype=compute_dtype, device=a.device)
    inf = torch.full((), float("inf"), dtype=compute_dtype, device=a.device)
    ce = -torch.where(in_both, p * log_q, zero).sum(dim=-1)
    kl = torch.where(in_both, p * (log_p - log_q), zero).sum(dim=-1).clamp_min(0)
    ce = torch.where(p_outside_q, inf, ce)
    kl = torch.where(p_outside_q, inf, kl)
    tv = 0.5 * (p - q).abs().sum(dim=-1)
    alpha = torch.minimum(p, q).sum(dim=-1)
    return ce, kl, tv, alpha


def divergence_reference(
    verifier_logits: torch.Tensor,
    drafter_logits: torch.Tensor,
    temperature: float = 1.0,
    *,
    mask: torch.Tensor | None = None,
    task_ids: torch.Tensor | None = None,
    num_tasks: int | None = None,
    compute_dtype: torch.dtype = torch.float64,
    round_to_float32: bool = True,
    chunk_elements: int = 1 << 24,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """Per-token H(p,q), KL(p||q), TV(p,q), alpha, and optional per-task sums (float64 by default).

    Args:
        verifier_logits: [N, V] float logits of the verifier (p), before temperature.
        drafter_logits: [N, V] float logits of the drafter (q), exactly as it sampled from them, before temperature.
        temperature: T >= 0 applied to both; 0 is greedy (one-hot argmax distributions).
        mask: optional [N] bool, True = token counted; False rows get zeros and no per-task contribution.
        task_ids: optional [N] int64 task of each token in [0, num_tasks), or -1 = no task.
        num_tasks: number of tasks (required with ``task_ids``).
        compute_dtype: float64 (exact ground truth) or float32.
        round_to_float32: per-task sums add the per-token values rounded to float32, as the kernel does.
        chunk_elements: rows are processed in blocks of about this many elements to bound memory.

    Returns:
        ``(cross_entropy, kl, tv, alpha, per_task)``: four [N] tensors in ``compute_dtype`` and ``per_task`` = None or
        ``(ce_sum, kl_sum, tv_sum, alpha_sum, count)`` with [num_tasks] float64 sums and an int64 count.
    """
    num_rows, vocab = verifier_logits.shape
    device = verifier_logits.device
    outs = [torch.zeros(num_rows, dtype=compute_dtype, device=device) for _ in range(4)]
    keep = torch.ones(num_rows, dtype=torch.bool, device=device) if mask is None else mask.to(torch.bool)
    rows = keep.nonzero().flatten()
    step = max(1, chunk_elements // max(vocab, 1))
    for start in range(0, rows.numel(), step):
        idx = rows[start:start + step]
        for out, value in zip(outs, _row_divergences(verifier_logits[idx], drafter_logits[idx], temperature,
                                                     compute_dtype), strict=True):
            out[idx] = value
    ce, kl, tv, alpha = outs
    per_task = None
    if task_ids is not None:
        if num_tasks is None:
            raise ValueError("num_tasks is required with task_ids")
        counted = keep & (task_ids >= 0)
        tasks = task_ids[counted].to(torch.int64)
        sums = []
        for value in outs:
            v = value[counted]
            if round_to_float32:
                v = v.to(torch.float32)
            sums.append(torch.zeros(num_tasks, dtype=torch.float64, device=device).index_add_(
                0, tasks, v.to(torch.float64)))
        count = torch.zeros(num_tasks, dtype=torch.int64, device=device).index_add_(
            0, tasks, torch.ones_like(tasks))
        per_task = (*sums, count)
    return ce, kl, tv, alpha, per_task


def cross_entropy_rows(verifier_logits: torch.Tensor, drafter_logits: torch.Tensor, temperature: float,
                       compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Differentiable [N] ``H(p_n, q_n)`` for the training loss; the verifier side is detached.

    Uses plain autograd: ``d H / d drafter_logits = (q - p) / T``. Entries with ``p = 0`` (a ``-inf`` verifier logit)
    contribute nothing (no NaN from ``0 * -inf``); ``p > 0`` (a finite verifier logit, even where ``p`` underflows in
    ``compute_dtype``) where ``q = 0`` (a ``-inf`` drafter logit) gives ``+inf`` with the finite gradient
    ``(q - p) / T``; a NaN ``p`` (unchecked NaN logits) gives NaN.
    """
    p = torch.softmax(verifier_logits.detach().to(compute_dtype) / temperature, dim=-1)
    log_q = torch.log_softmax(drafter_logits.to(compute_dtype) / temperature, dim=-1)
    ce = -torch.where(p != 0, p * log_q, torch.zeros((), dtype=compute_dtype, device=p.device)).sum(dim=-1)
    # The support is read off the logits: a finite verifier logit whose p underflows to 0 still has p > 0, so a -inf
    # drafter logit there makes H(p, q) infinite (as in the kernels and `divergence`); added as a constant, so the
    # gradient stays the finite (q - p) / T
    unsupported = ((verifier_logits.detach() > float("-inf")) & (drafter_logits.detach() == float("-inf"))).any(-1)
    return ce + torch.where(unsupported, float("inf"), 0.0).to(ce.dtype)
