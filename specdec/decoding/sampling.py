"""Public rejection sampler and the logit filters shared by the drafter and the verifier."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec._validation import (
    check_logit_rows,
    check_same_device,
    check_temperature,
    check_tensor,
    check_verification,
    use_triton,
)
from specdec.kernels.rejection_sampling_reference import effective_draft_counts, rejection_sample_reference


@dataclass
class RejectionSampleOutput:
    """Result of :func:`rejection_sample`.

    Attributes:
        tokens: [B, K+1] int64. Accepted drafts, then the recovered (after a rejection) or bonus (after K acceptances)
            token, then ``-1`` padding.
        num_accepted: [B] int64, drafts accepted before the first rejection (0..K).
        draft_logprob: [B, K] float32 ``log p(draft)`` when ``compute_scores``, else None.
        alpha: [B, K] float32 acceptance probability ``sum_x min(p, q)`` per position when ``compute_scores``
            (at temperature 1 for greedy rows and for ``temperature == 0``, where p and q are not sampled from).
    """

    tokens: torch.Tensor
    num_accepted: torch.Tensor
    draft_logprob: torch.Tensor | None = None
    alpha: torch.Tensor | None = None


def _random_seeds(batch: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    gen_device = generator.device if generator is not None else torch.device("cpu")
    seeds = torch.randint(0, 2**62, (batch,), generator=generator, device=gen_device, dtype=torch.int64)
    return seeds.to(device)


def rejection_sample(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    backend: str = "auto",
    *,
    seeds: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
    num_draft_tokens: torch.Tensor | None = None,
    greedy_mask: torch.Tensor | None = None,
    compute_scores: bool = False,
    check_nan: bool = True,
    verification: str = "token",
) -> RejectionSampleOutput:
    """Speculative rejection sampling: the emitted tokens follow the verifier exactly.

    With ``p = softmax(target_logits / T)`` and ``q = softmax(draft_logits / T)``, draft ``x_j`` is accepted with
    probability ``min(1, p_j(x_j) / q_j(x_j))``; at the first rejection a token is drawn from ``max(0, p_j - q_j)``
    (normalised), and if all drafts are accepted a bonus token is drawn from ``p_K``. ``temperature == 0`` is greedy:
    a draft is accepted iff it equals ``argmax p_j`` (ties to the lowest id).

    ``verification="block"`` decides the drafts jointly (Sun et al., "Block Verification Accelerates Speculative
    Decoding", ICLR 2025): with ``P_0 = 1`` and ``P_i = min(1, P_{i-1} p_{i-1}(x_{i-1}) / q_{i-1}(x_{i-1}))`` it keeps
    the first ``tau`` drafts, ``tau`` the largest ``i`` whose test ``eta_i <= W_i / (W_i + 1 - P_i)`` passes
    (``W_i = sum_x max(0, P_i p_i(x) - q_i(x))``; at ``i = n`` the test is ``eta_i <= P_i``), and draws the next
    token from ``max(0, P_tau p_tau - q_tau)`` (``p`` after all drafts). Equally lossless, never fewer accepted
    drafts in expectation, and optimal among schemes that see only these p and q (``docs/rejection_sampling.md``);
    greedy rows keep the arg-max rule.

    Args:
        target_logits: [B, K+1, V] fp32/bf16/fp16 verifier logits at the K draft positions and the bonus position.
        draft_logits: [B, K, V] logits the drafts were sampled from (after any top-k/top-p filtering, before T).
        draft_tokens: [B, K] int64 draft ids in [0, V); ``-1`` ends a row's drafts early.
        temperature: T >= 0 applied to both logits; 0 means greedy.
        generator: torch.Generator for the per-row seeds when ``seeds`` is not given.
        backend: "auto" (Triton on CUDA, torch otherwise), "triton" or "torch".
        seeds: optional [B] int64 per-row seeds of the counter-based random stream (results do not depend on the
            batch a row sits in). offsets: optional [B] int64 position offsets of that stream (default 0).
        num_draft_tokens: optional [B] int64 per-row number of drafts (<= K).
        greedy_mask: optional [B] bool, rows decoded greedily although T > 0.
        compute_scores: also return ``log p(draft)`` and ``alpha`` per position.
        check_nan: raise ValueError on NaN or +inf logits, or on a row with no finite logit (all -inf) at a position
            the request can reach (costs one max-reduction and a device sync).
        verification: "token" (default) or "block".

    Returns:
        :class:`RejectionSampleOutput` with ``tokens`` [B, K+1] and ``num_accepted`` [B].
    """
    check_tensor(target_logits, "target_logits", 3, float_dtype=True, shape_doc="[B, K+1, V]")
    check_tensor(draft_logits, "draft_logits", 3, float_dtype=True, shape_doc="[B, K, V]")
    check_tensor(draft_tokens, "draft_tokens", 2, integer_dtype=True, shape_doc="[B, K]")
    temperature = check_temperature(temperature)
    check_verification(verification)
    batch, num_positions, vocab = target_logits.shape
    num_drafts = num_positions - 1
    if num_drafts < 1:
        raise ValueError(
            f"target_logits must have K+1 >= 2 positions ([B, K+1, V]), got shape {tuple(target_logits.shape)}"
        )
    if not 1 <= vocab < 2**30:
        raise ValueError(f"target_logits must have a vocabulary dimension V in [1, 2**30), got V={vocab}")
    if tuple(draft_logits.shape) == (batch, num_positions, vocab):
        raise ValueError(
            f"target_logits must have K+1 positions ([B, K+1, V]: the K draft positions and the bonus position), but "
            f"it has {num_positions}, as many as draft_logits {tuple(draft_logits.shape)}: add the verifier's logits "
            "after the last draft"
        )
    if tuple(draft_logits.shape) != (batch, num_drafts, vocab):
        raise ValueError(
            f"draft_logits must have shape [B, K, V] = {(batch, num_drafts, vocab)} to match target_logits "
            f"{tuple(target_logits.shape)}, got {tuple(draft_logits.shape)}"
        )
    if tuple(draft_tokens.shape) != (batch, num_drafts):
        raise ValueError(
            f"draft_tokens must have shape [B, K] = {(batch, num_drafts)}, got {tuple(draft_tokens.shape)}"
        )
    for name, value in (("seeds", seeds), ("offsets", offsets), ("num_draft_tokens", num_draft_tokens),
                        ("greedy_mask", greedy_mask)):
        if value is not None:
            check_tensor(value, name, shape_doc="[B]")  # (a tensor before its device is read)
    device = check_same_device(
        target_logits=target_logits, draft_logits=draft_logits, draft_tokens=draft_tokens, seeds=seeds,
        offsets=offsets, num_draft_tokens=num_draft_tokens, greedy_mask=greedy_mask,
    )
    draft_tokens = draft_tokens.to(torch.int64)
    for name, tensor in (("seeds", seeds), ("offsets", offsets), ("num_draft_tokens", num_draft_tokens)):
        if tensor is not None:
            check_tensor(tensor, name, 1, integer_dtype=True, shape_doc="[B]")
            if tensor.shape[0] != batch:
                raise ValueError(f"{name} must have shape [B] = [{batch}], got {tuple(tensor.shape)}")
    # the ranges of draft_tokens and num_draft_tokens, read with one host sync
    ranged = [t for t in (draft_tokens, num_draft_tokens) if t is not None and t.numel()]
    bounds = torch.stack([b.to(torch.int64) for t in ranged for b in torch.aminmax(t)]).tolist() if ranged else []
    if draft_tokens.numel() and (bounds[0] < -1 or bounds[1] >= vocab):
        raise ValueError(f"draft_tokens must lie in [0, V={vocab}) (or -1 for no draft)")
    if num_draft_tokens is not None and num_draft_tokens.numel() and (bounds[-2] < 0 or bounds[-1] > num_drafts):
        raise ValueError(f"num_draft_tokens must lie in [0, K={num_drafts}]")
    if greedy_mask is not None:
        check_tensor(greedy_mask, "greedy_mask", 1, shape_doc="[B]")
        if greedy_mask.dtype != torch.bool:
            raise TypeError(f"greedy_mask must be a bool tensor of shape [B], got {greedy_mask.dtype}")
        if greedy_mask.shape[0] != batch:
            raise ValueError(f"greedy_mask must have shape [B] = [{batch}], got {tuple(greedy_mask.shape)}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if check_nan:
        # rows a request can reach: target positions j <= n_b, draft positions j < n_b (n_b = its number of drafts)
        n_b = effective_draft_counts(draft_tokens, num_draft_tokens)
        positions = torch.arange(num_positions, device=device)
        check_logit_rows(target_logits, "target_logits", positions[None, :] <= n_b[:, None])
        check_logit_rows(draft_logits, "draft_logits", positions[None, :num_drafts] < n_b[:, None])
    if seeds is None:
        seeds = _random_seeds(batch, generator, device)
    if offsets is None:
        offsets = torch.zeros(batch, dtype=torch.int64, device=device)
    return rejection_sample_unchecked(
        target_logits, draft_logits, draft_tokens, temperature, backend, seeds.to(torch.int64),
        offsets.to(torch.int64), num_draft_tokens=num_draft_tokens, greedy_mask=greedy_mask,
        compute_scores=compute_scores, verification=verification,
    )


def rejection_sample_unchecked(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    temperature: float,
    backend: str,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    *,
    num_draft_tokens: torch.Tensor | None = None,
    greedy_mask: torch.Tensor | None = None,
    compute_scores: bool = False,
    verification: str = "token",
) -> RejectionSampleOutput:
    """:func:`rejection_sample` without argument checks (no host sync): for callers such as
    :func:`specdec.generate` that build valid inputs themselves. Same shapes and dtypes; seeds/offsets required."""
    if use_triton(backend, target_logits.device):
        from specdec.kernels.rejection_sampling import rejection_sample_triton

        impl = rejection_sample_triton
    else:
        impl = rejection_sample_reference
    tokens, num_accepted, draft_logprob, alpha = impl(
        target_logits, draft_logits, draft_tokens, seeds, offsets, temperature,
        greedy_mask=greedy_mask, num_draft_tokens=num_draft_tokens, compute_scores=compute_scores,
        verification=verification,
    )
    return RejectionSampleOutput(tokens, num_accepted, draft_logprob, alpha)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Top-k then top-p (nucleus) filtering: removed entries become ``-inf``.

    Args:
        logits: [..., V] float logits, already divided by the temperature.
        top_k: keep the k largest logits (0 = no limit). Ties at the k-th value are all kept.
        top_p: keep the smallest set of largest-probability tokens whose mass reaches ``top_p`` (1.0 = no limit).
    Returns a new float32 tensor of the same shape. The same function is applied to the verifier and the drafter.
    """
    check_tensor(logits, "logits", float_dtype=True, shape_doc="[..., V]")
    if logits.dim() < 1:
        raise ValueError("logits must have shape [..., V] with at least one dimension, got a 0-dim tensor")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = no limit), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = no limit), got {top_p!r}")
    out = filter_logits_unchecked(logits, top_k, top_p)
    return out.clone() if out is logits else out  # (a new tensor, as documented; generate's own calls skip the copy)


def filter_logits_unchecked(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """:func:`filter_logits` without argument checks, for callers that validated ``top_k`` and ``top_p`` once
    (``generate`` filters at every step). May return ``logits`` itself when it is float32 and nothing is filtered."""
    out = logits.float()
    vocab = out.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        remove_sorted = mass_before >= top_p  # the top-1 token is always kept (mass_before = 0 < top_p)
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        out = out.masked_fill(remove, float("-inf"))
    return out
