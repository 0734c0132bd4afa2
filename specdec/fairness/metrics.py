"""Closed-form speculative-decoding quantities.

With per-position acceptance probability alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q) and K drafts per round:

* expected tokens per verifier call  E[N] = (1 - alpha^(K+1)) / (1 - alpha)   (K + 1 at alpha = 1)
* predicted speed-up with cost ratio c = t_drafter / t_verifier   S = E[N] / (K c + 1): the cost model counts a round
  as K drafter steps and one verifier step and leaves out everything else a round costs (sampling, bookkeeping, the
  verifier's longer call), so a measured wall-clock speed-up (:func:`specdec.fairness.measure_wall_clock_speedup`)
  can be well below it, as it is for small models on a CPU
* P(n accepted drafts) for position-wise acceptance a_1..a_K:
  (prod_{i<=n} a_i)(1 - a_{n+1}) for n < K, and prod_i a_i for n = K.
"""

from __future__ import annotations

import math

import torch

from specdec._validation import check_logit_rows, check_number, check_temperature, check_tensor

TensorOrFloat = torch.Tensor | float


def _check_num_draft_tokens(num_draft_tokens: int) -> int:
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be an integer K >= 1, got {num_draft_tokens!r}")
    return num_draft_tokens


def _check_alpha(alpha: TensorOrFloat, name: str = "alpha") -> TensorOrFloat:
    if isinstance(alpha, torch.Tensor):
        if not alpha.dtype.is_floating_point:
            raise TypeError(f"{name} must be a float tensor or a float, got {alpha.dtype}")
        if alpha.numel() == 0:
            return alpha
        low, high = torch.stack(torch.aminmax(alpha)).tolist()  # one device sync; NaN propagates into both
        has_nan = low != low
    elif isinstance(alpha, (int, float)) and not isinstance(alpha, bool):
        low = high = float(alpha)
        has_nan = alpha != alpha
    else:
        raise TypeError(f"{name} must be a float tensor or a float, got {type(alpha).__name__}")
    if has_nan or not (0.0 <= low <= high <= 1.0):
        raise ValueError(f"{name} must lie in [0, 1], got values in [{low}, {high}]{' and NaN' if has_nan else ''}")
    return alpha


def expected_tokens_per_call(alpha: TensorOrFloat, num_draft_tokens: int) -> TensorOrFloat:
    """E[N] = (1 - alpha^(K+1)) / (1 - alpha) = sum_{i=0..K} alpha^i, tokens emitted per verifier call.

    alpha: float or tensor in [0, 1] (any shape). Returns the same type/shape. Computed as the finite geometric sum,
    which is exact at alpha = 1 (K + 1) and free of 0/0.
    """
    num_draft_tokens = _check_num_draft_tokens(num_draft_tokens)
    _check_alpha(alpha)
    total = alpha * 0 + 1.0
    power = alpha * 0 + 1.0
    for _ in range(num_draft_tokens):
        power = power * alpha
        total = total + power
    return total


def speedup(alpha: TensorOrFloat, num_draft_tokens: int, cost_ratio: float) -> TensorOrFloat:
    """S(alpha) = (1 - alpha^(K+1)) / ((1 - alpha)(K c + 1)): the speed-up over plain decoding that the cost model
    predicts (a round costs K drafter steps and one verifier step; nothing else).

    cost_ratio: c = t_drafter / t_verifier >= 0 (time of one drafter decoding step over one verifier step;
    :func:`specdec.fairness.measure_decode_costs` measures it); TypeError for a non-number, ValueError for a negative
    or non-finite one.
    """
    cost_ratio = check_number(cost_ratio, "cost_ratio", 0.0)
    return expected_tokens_per_call(alpha, num_draft_tokens) / (num_draft_tokens * cost_ratio + 1.0)


def accepted_count_distribution(position_alpha: torch.Tensor) -> torch.Tensor:
    """Law of the number of accepted drafts when draft j is accepted with probability a_j independently.

    position_alpha: [..., K] acceptance probabilities. Returns [..., K+1] probabilities of n = 0..K.
    """
    if not isinstance(position_alpha, torch.Tensor):
        raise TypeError(f"position_alpha must be a float tensor [..., K], got {type(position_alpha).__name__}")
    if position_alpha.dim() < 1 or position_alpha.shape[-1] < 1:
        raise ValueError("position_alpha must have shape [..., K] with K >= 1")
    _check_alpha(position_alpha, "position_alpha")
    ones = torch.ones_like(position_alpha[..., :1])
    survive = torch.cumprod(torch.cat([ones, position_alpha], dim=-1), dim=-1)  # P(n >= j), j = 0..K
    reject_next = torch.cat([1 - position_alpha, ones], dim=-1)
    return survive * reject_next


def acceptance_from_logits(target_logits: torch.Tensor, draft_logits: torch.Tensor,
                           temperature: float = 1.0) -> torch.Tensor:
    """alpha = sum_x min(p(x), q(x)) per position, from [..., V] logits at the same temperature T > 0.

    target_logits, draft_logits: [..., V] float tensors (fp32 / fp16 / bf16 / fp64), finite or ``-inf`` (masked out),
    each row with at least one finite entry. Returns [...] fp32 in [0, 1] (the float32 sum can land a few ulps above
    1 when p = q; it is clamped, so the result can be passed to :func:`speedup`).
    """
    check_tensor(target_logits, "target_logits", float_dtype=True, shape_doc="[..., V]")
    check_tensor(draft_logits, "draft_logits", float_dtype=True, shape_doc="[..., V]")
    if target_logits.shape != draft_logits.shape or target_logits.dim() < 1:
        raise ValueError(f"target_logits {tuple(target_logits.shape)} and draft_logits "
                         f"{tuple(draft_logits.shape)} must have the same shape [..., V]")
    temperature = check_temperature(temperature, allow_zero=False)
    check_logit_rows(target_logits, "target_logits")
    check_logit_rows(draft_logits, "draft_logits")
    log_p = torch.log_softmax(target_logits.float() / temperature, dim=-1)
    log_q = torch.log_softmax(draft_logits.float() / temperature, dim=-1)
    return torch.minimum(log_p, log_q).exp().sum(dim=-1).clamp_(0.0, 1.0)


def speedup_lower_bounds(tv: float, kl: float, num_draft_tokens: int, cost_ratio: float) -> tuple[float, float]:
    """The speed-up lower bounds S_T >= S(1 - TV_T) >= S(max(0, 1 - sqrt(D_T / 2))) (Jensen, then Pinsker).

    tv: TV_T in [0, 1]; kl: D_T >= 0 (``inf`` allowed: the Pinsker bound is then S(0)). Returns the two bounds."""
    for name, value, high in (("tv", tv, 1.0), ("kl", kl, float("inf"))):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a float, got {type(value).__name__}")
        if not 0.0 <= value <= high:  # (False for NaN)
            raise ValueError(f"{name} must lie in [0, {high:g}], got {value}")
    from_tv = float(speedup(min(max(1.0 - tv, 0.0), 1.0), num_draft_tokens, cost_ratio))
    from_kl = float(speedup(min(max(1.0 - math.sqrt(max(kl, 0.0) / 2.0), 0.0), 1.0), num_draft_tokens, cost_ratio))
    return from_tv, from_kl
