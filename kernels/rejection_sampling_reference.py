"""Torch reference of speculative rejection sampling: the ground truth the Triton kernel is tested against.

Conventions shared with the kernel (``kernels/rejection_sampling.py``):

* ``p = softmax(target_logits / T)``, ``q = softmax(draft_logits / T)``, in float32.
* Row ``b`` has ``n_b`` real drafts: ``num_draft_tokens[b]`` capped at the first ``-1`` in ``draft_tokens[b]``.
  Draft ``j < n_b`` is accepted iff ``log u + log q(x) <= log p(x)`` with ``u = uniform(seed_b, offset_b + j,
  ACCEPT_INDEX)`` and ``q(x) > 0`` (a draft the drafter could not have produced is always rejected).
* At the first rejected position the recovered token is drawn from ``max(0, p - q)`` by an exponential race:
  ``argmax_x log(max(0, p(x) - q(x))) - log(-log u_x)`` with ``u_x = uniform(seed_b, offset_b + j, x)``, ties to the
  lowest id, **if** the residual mass ``sum_x max(0, p(x) - q(x))`` (``= TV(p, q)``, the probability that this
  position is rejected) exceeds :data:`RESIDUAL_MASS_EPS`; otherwise (``p == q`` up to rounding) the race runs on
  ``p``. See :data:`RESIDUAL_MASS_EPS` for why a threshold, and what it costs.
* When all ``n_b`` drafts are accepted the bonus token at position ``n_b`` is drawn from ``p`` by the same race on
  ``target_logits / T`` (the normaliser does not change the argmax).
* Greedy rows (``temperature == 0`` or ``greedy_mask[b]``) use no random numbers: draft ``j`` is accepted iff it
  equals ``argmax target_logits[b, j]`` (ties to the lowest id), and the next token is that argmax.
"""

from __future__ import annotations

import torch

from .rng import ACCEPT_INDEX, stream_keys, uniform_from_keys

RESIDUAL_MASS_EPS = 1e-6
"""Residual mass (fp32) at or below which a rejected position's recovered token is drawn from ``p`` instead of the
residual ``max(0, p - q)``.

Why: when ``q == p`` up to rounding the residual is rounding noise whose support depends on the order of the float
operations (the torch reference's fp32 residual can be exactly 0 while the Triton kernel's is ~1e-7-scale noise),
so a rule "fall back to ``p`` only when the residual is exactly 0" makes the two backends disagree. Comparing the
*mass* against a threshold far above fp32 noise (a few 1e-8 to a few 1e-7 on ~1e5-token vocabularies) and far
below any real rejection probability makes the decision robust.

Losslessness cost: the emitted distribution is ``min(p, q) + m * r`` with ``m`` the residual mass and ``r`` the
normalised residual; replacing ``r`` by ``p`` moves it by ``m * TV(r, p) <= m``. So the output deviates from ``p``
by at most ``RESIDUAL_MASS_EPS = 1e-6`` in total variation, and only at positions whose rejection probability was
itself ``<= 1e-6``; everywhere else the sampler is exactly lossless.
"""


def effective_draft_counts(draft_tokens: torch.Tensor, num_draft_tokens: torch.Tensor | None) -> torch.Tensor:
    """[B] int64: per-row number of real drafts (``num_draft_tokens`` capped at the first ``-1``)."""
    batch, num_drafts = draft_tokens.shape
    is_pad = draft_tokens < 0
    first_pad = torch.where(
        is_pad.any(dim=1), is_pad.to(torch.int64).argmax(dim=1), torch.full_like(draft_tokens[:, 0], num_drafts)
    )
    if num_draft_tokens is None:
        return first_pad
    return torch.minimum(first_pad, num_draft_tokens.to(torch.int64).clamp(0, num_drafts))


def exponential_race(scores: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """argmax_x scores[b, x] - log(-log u(seed_b, position_b, x)), ties to the lowest id.

    scores: [B, V] float32 log-weights (``-inf`` = weight 0); seeds, positions: [B] int64. Returns [B] int64.
    Equivalent to sampling x with probability proportional to exp(scores[b, x]).

    NaN race scores never win (as in the kernel, whose comparisons ignore NaN); the result is ``argmax`` over the
    others. They occur where the uniform is exactly 1.0 (``(2**24 - 1 + 0.5) * 2**-24`` rounds to 1.0 in fp32,
    probability 2**-24 per draw, ~1% of races at V ~ 1e5): the exponential noise is then 0, the race score
    ``scores - log(0)`` is ``+inf`` (that id wins, lowest id on ties) where the weight is positive, and
    ``-inf + inf = NaN`` where it is 0. ``torch.argmax`` treats NaN as the maximum, so without this rule the
    reference emitted an id of zero weight (residual or probability 0) and disagreed with the kernel (GPU
    benchmark row 123 of (B, K, V) = (128, 8, 128256)).
    """
    vocab = scores.shape[-1]
    key_a, key_b = stream_keys(seeds[:, None], positions[:, None])
    ids = torch.arange(vocab, device=scores.device, dtype=torch.int64)[None, :]
    exp_noise = -torch.log(uniform_from_keys(key_a, key_b, ids))
    race = scores - torch.log(exp_noise)
    return torch.argmax(torch.where(torch.isnan(race), float("-inf"), race), dim=-1)


def _residual_mass(target: torch.Tensor, draft: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """[B] float32 ``sum_x max(0, p(x) - q(x))`` (= TV(p, q)) of scaled logits ``target``, ``draft`` [B, V].

    Computed as ``sum_x p(x) * max(0, -expm1(z(x)))`` with ``z = log q - log p = (draft - target) - delta`` and
    ``delta = L_d - L_t = (m_d - m_t) + log(S_d / S_t)`` (maxima ``m``, ``S = sum exp(x - m)``): no rounded
    log-sum-exp ``L`` enters, whose fp32 rounding (up to ~1e-6 relative for ``|L|`` ~ 10-40) would scale all of p
    against all of q and give a ~1e-6 mass where ``q == p`` up to rounding. The kernel uses the same formula.
    """
    m_t = target.max(dim=-1, keepdim=True).values
    m_d = draft.max(dim=-1, keepdim=True).values
    s_t = torch.exp(target - m_t).sum(dim=-1, keepdim=True)
    s_d = torch.exp(draft - m_d).sum(dim=-1, keepdim=True)
    z = (draft - target) - ((m_d - m_t) + torch.log(s_d / s_t))
    terms = torch.where(z < 0, p * -torch.expm1(z.clamp(max=0.0)), torch.zeros_like(z))
    return terms.sum(dim=-1)


def rejection_sample_reference(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    temperature: float,
    greedy_mask: torch.Tensor | None = None,
    num_draft_tokens: torch.Tensor | None = None,
    compute_scores: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Reference rejection sampler. Inputs are assumed validated (see ``specdec.rejection_sample``).

    Lossless except that a rejected position whose residual mass ``sum_x max(0, p - q)`` is ``<=``
    :data:`RESIDUAL_MASS_EPS` (1e-6) draws its token from ``p``: a deviation of at most 1e-6 in total variation,
    only where a rejection had probability ``<= 1e-6``.

    Args:
        target_logits: [B, K+1, V] float (fp32/bf16/fp16) verifier logits at the K draft positions and the bonus one.
        draft_logits: [B, K, V] float, the logits the drafts were sampled from.
        draft_tokens: [B, K] int64, ``-1`` marks the end of a row's drafts.
        seeds: [B] int64 per-row seeds; offsets: [B] int64 position offsets of the random stream.
        temperature: float >= 0; 0 means greedy for every row.
        greedy_mask: optional [B] bool, rows to decode greedily although ``temperature > 0``.
        num_draft_tokens: optional [B] int64 per-row draft counts (<= K).
        compute_scores: also return per-position ``log p(draft)`` and ``alpha = sum_x min(p, q)``.

    Returns:
        tokens [B, K+1] int64 (accepted drafts, then the recovered/bonus token, then -1),
        num_accepted [B] int64, and when ``compute_scores`` the [B, K] float32 tensors ``draft_logprob`` (``-inf``
        where there is no draft) and ``alpha`` (at temperature 1 for greedy rows and ``temperature == 0``).
    """
    batch, num_positions, vocab = target_logits.shape
    num_drafts = num_positions - 1
    device = target_logits.device
    counts = effective_draft_counts(draft_tokens, num_draft_tokens)
    positions = torch.arange(num_positions, device=device, dtype=torch.int64)
    if greedy_mask is None:
        greedy_mask = torch.zeros(batch, dtype=torch.bool, device=device)
    greedy = greedy_mask.to(torch.bool) | (temperature == 0)
    inv_temperature = 1.0 / temperature if temperature > 0 else 1.0

    target = target_logits.float() * inv_temperature
    draft = draft_logits.float() * inv_temperature
    target_logprob = torch.log_softmax(target, dim=-1)
    draft_logprob_all = torch.log_softmax(draft, dim=-1)
    target_argmax = torch.argmax(target_logits.float(), dim=-1)  # [B, K+1]

    is_real = positions[None, :num_drafts] < counts[:, None]  # [B, K]
    safe_drafts = draft_tokens.clamp(min=0)[..., None]
    lp_draft = target_logprob[:, :num_drafts].gather(-1, safe_drafts).squeeze(-1)
    lq_draft = draft_logprob_all.gather(-1, safe_drafts).squeeze(-1)
    key_a, key_b = stream_keys(seeds[:, None], offsets[:, None] + positions[None, :num_drafts])
    log_u = torch.log(uniform_from_keys(key_a, key_b, torch.full_like(key_a, ACCEPT_INDEX)))
    sampled_accept = (lq_draft > float("-inf")) & (log_u + lq_draft <= lp_draft)
    greedy_accept = draft_tokens == target_argmax[:, :num_drafts]
    accept = is_real & torch.where(greedy[:, None], greedy_accept, sampled_accept)
    num_accepted = torch.cumprod(accept.to(torch.int64), dim=1).sum(dim=1)

    rows = torch.arange(batch, device=device)
    stop = num_accepted  # position of the recovered or bonus token
    rejected = stop < counts
    p_stop = target_logprob[rows, stop].exp()
    q_stop = draft_logprob_all[rows, stop.clamp(max=num_drafts - 1)].exp()
    residual_scores = torch.log(torch.clamp(p_stop - q_stop, min=0.0))
    residual_mass = _residual_mass(target[rows, stop], draft[rows, stop.clamp(max=num_drafts - 1)], p_stop)
    use_residual = rejected & (residual_mass > RESIDUAL_MASS_EPS)
    race_scores = torch.where(use_residual[:, None], residual_scores, target[rows, stop])
    sampled_token = exponential_race(race_scores, seeds, offsets + stop)
    next_token = torch.where(greedy, target_argmax[rows, stop], sampled_token)

    tokens = torch.full((batch, num_positions), -1, dtype=torch.int64, device=device)
    keep = positions[None, :num_drafts] < num_accepted[:, None]
    tokens[:, :num_drafts] = torch.where(keep, draft_tokens, tokens[:, :num_drafts])
    tokens[rows, stop] = next_token

    if not compute_scores:
        return tokens, num_accepted, None, None
    # Scores: at temperature 1 where the row is greedy.
    score_target = torch.where(greedy[:, None, None], target_logits[:, :num_drafts].float(), target[:, :num_drafts])
    score_draft = torch.where(greedy[:, None, None], draft_logits.float(), draft)
    score_lp = torch.log_softmax(score_target, dim=-1)
    score_lq = torch.log_softmax(score_draft, dim=-1)
    draft_logprob = score_lp.gather(-1, safe_drafts).squeeze(-1).masked_fill(~is_real, float("-inf"))
    alpha = torch.minimum(score_lp, score_lq).exp().sum(dim=-1)
    return tokens, num_accepted, draft_logprob, alpha
