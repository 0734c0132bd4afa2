"""Torch reference of speculative rejection sampling: the ground truth the Triton kernel is tested against.

Conventions shared with the kernel (``kernels/rejection_sampling.py``):

* ``p = softmax(target_logits / T)``, ``q = softmax(draft_logits / T)``, in float32.
* Row ``b`` has ``n_b`` real drafts: ``num_draft_tokens[b]`` capped at the first ``-1`` in ``draft_tokens[b]``.
  Draft ``j < n_b`` is accepted iff ``log u + log q(x) <= log p(x)`` with ``u = uniform(seed_b, offset_b + j,
  ACCEPT_INDEX)`` and ``q(x) > 0`` (a draft the drafter could not have produced is always rejected).
* At the first rejected position the recovered token is drawn from the residual ``w(x) = max(0, p(x) - q(x))``
  (computed as in :func:`residual_weights`) by a two-level exponential race over vocabulary tiles of
  :data:`RACE_TILE` ids (:func:`tiled_exponential_race`), **if** the residual mass ``sum_x w(x)`` (``= TV(p, q)``,
  the probability that this position is rejected) exceeds :data:`RESIDUAL_MASS_EPS`; otherwise (``p == q`` up to
  rounding) the race runs on ``p``. See :data:`RESIDUAL_MASS_EPS` for why a threshold, and what it costs.
* When all ``n_b`` drafts are accepted the bonus token at position ``n_b`` is drawn from ``p`` by the same race
  (tile masses of ``p``; inside the tile the scaled logits ``target_logits / T``, whose normaliser does not move the
  arg-max).
* Greedy rows (``temperature == 0`` or ``greedy_mask[b]``) use no random numbers: draft ``j`` is accepted iff it
  equals ``argmax target_logits[b, j]`` (ties to the lowest id), and the next token is that argmax.
* ``verification="block"`` (Sun et al., ICLR 2025) decides the sampled rows' drafts jointly: :func:`block_stop`
  picks the stop position ``tau`` from the block weights ``P_i`` (:func:`block_log_weights`) and the residual
  masses ``W_i``, and the token at ``tau`` is drawn from ``max(0, P_tau p_tau - q_tau)`` (``p`` at ``tau = n_b``)
  by the same race; greedy rows keep the arg-max rule. Derivation and proof: ``docs/rejection_sampling.md``.
"""

from __future__ import annotations

import torch

from .rng import ACCEPT_INDEX, exponential_from_keys, stream_keys, uniform_from_keys

VERIFICATIONS = ("token", "block")
"""The verification schemes: token-wise (each draft on its own) and block verification (the drafts jointly)."""

RACE_TILE = 256
"""Vocabulary ids per tile of the two-level race (a fixed part of the sampler's definition, not a launch
parameter: results never depend on how a kernel splits the vocabulary)."""

TILE_INDEX_BASE = 0x40000000
"""Random-stream index of tile ``c``'s uniform is ``TILE_INDEX_BASE + c``: disjoint from the vocabulary ids
(``V < 2**24`` in the kernel; ``specdec.rejection_sample`` refuses ``V >= 2**30``) and from
:data:`~specdec.kernels.rng.ACCEPT_INDEX`, so no uniform is used twice. (Below 2**31 so that compiled int32 index
arithmetic, e.g. torch.compile's Triton code for this reference, cannot overflow.)"""

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


BLOCK_CERTAIN_EPS = 1e-5
"""Block verification treats a position whose log-weight ``a_i = log P_i`` is at least ``-BLOCK_CERTAIN_EPS`` as
certain (``P_i = 1``: the stop is at least ``i`` once the scan reaches it).

Why: the test ``eta_i <= W_i / (W_i + 1 - P_i)`` is 0 / 0 where ``P_i`` is 1 up to rounding and ``W_i`` is rounding
noise (``q == p`` up to rounding, e.g. one model run through two code paths: logits ~1e-6 apart give ``|log P_i|``
of a few 1e-6), so two summation orders of the normalisers could stop at different positions.
Cost: given the drafts before it the scan reaches position ``i`` with probability ``1 - P_i + W_i`` and then fails
with probability ``(1 - P_i) / (1 - P_i + W_i)``, so deciding "stop here" moves ``1 - P_i <= 1e-5`` of probability,
only at positions whose weight lies in ``[exp(-1e-5), 1)``: a deviation of at most 1e-5 in total variation per such
position, and none elsewhere.
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


def exponential_race(scores: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                     ids: torch.Tensor | None = None) -> torch.Tensor:
    """argmax_x scores[b, x] - log E(seed_b, position_b, id_x), ties to the first column (``E``: the Exp(1) race
    noise of :func:`~specdec.kernels.rng.exponential_from_keys`).

    scores: [B, N] float32 log-weights (``-inf`` = weight 0); seeds, positions: [B] int64; ids: optional [B, N]
    int64 random-stream indices of the columns (default ``0..N-1``). Returns the winning column [B] int64.
    Equivalent to sampling a column with probability proportional to exp(scores[b, x]).

    NaN race scores never win (as in the kernel, whose comparisons ignore NaN): ``torch.argmax`` would take NaN as
    the maximum and return a column of zero weight.
    """
    if ids is None:
        ids = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.int64)[None, :]
    key_a, key_b = stream_keys(seeds[:, None], positions[:, None])
    exp_noise = exponential_from_keys(key_a, key_b, ids)
    race = scores - torch.log(exp_noise)
    return torch.argmax(torch.where(torch.isnan(race), float("-inf"), race), dim=-1)


def tiled_exponential_race(weights: torch.Tensor, scores: torch.Tensor, seeds: torch.Tensor,
                           positions: torch.Tensor) -> torch.Tensor:
    """Sample x with probability ``weights[b, x] / sum_x weights[b, x]`` by a two-level exponential race.

    weights: [B, V] float32 >= 0; scores: [B, V] float32, ``log weights`` up to a per-row constant (``-inf`` where
    the weight is 0); seeds, positions: [B] int64. Returns [B] int64 ids.

    Level 1 races the tiles ``c`` of :data:`RACE_TILE` consecutive ids on their masses ``W_c = sum_{x in c} w(x)``:
    ``c* = argmax_c log W_c - log E(seed, position, TILE_INDEX_BASE + c)``. Level 2 races the ids of tile
    ``c*`` on their scores: ``argmax_{x in c*} scores[x] - log E(seed, position, x)``. Ties go to the lowest
    tile and the lowest id. P(x) = (W_c / W) (w(x) / W_c) = w(x) / W: the same law as one race over all ids, but a
    kernel needs per-element random numbers (two hashes and two logarithms) only inside the winning tile; every
    other element costs a sum. An all-zero row returns id 0 (the kernel reports such rows as ``-1``).
    """
    vocab = weights.shape[-1]
    tile_mass = tile_sums(weights)
    num_tiles = tile_mass.shape[-1]
    tile_ids = TILE_INDEX_BASE + torch.arange(num_tiles, device=weights.device, dtype=torch.int64)[None, :]
    tile = exponential_race(torch.log(tile_mass), seeds, positions, tile_ids)
    # (a vocabulary below one tile races its V ids only: the tile's other columns score -inf and never win)
    width = min(RACE_TILE, vocab)
    ids = tile[:, None] * RACE_TILE + torch.arange(width, device=weights.device, dtype=torch.int64)[None, :]
    inside = scores.gather(1, ids.clamp(max=vocab - 1)).masked_fill(ids >= vocab, float("-inf"))
    column = exponential_race(inside, seeds, positions, ids)
    return ids.gather(1, column[:, None]).squeeze(1)


def residual_weights(target: torch.Tensor, draft: torch.Tensor, p: torch.Tensor,
                     log_weight: torch.Tensor | None = None) -> torch.Tensor:
    """[..., V] float32 residual ``max(0, P p(x) - q(x))`` of scaled logits ``target``, ``draft`` [..., V] (``p``
    [..., V] is ``softmax(target)``), the way the kernel computes it. ``log_weight``: optional [...] float32
    ``log P <= 0`` (block verification's weight of the position; default 0, the token-wise residual).

    ``w = P p * (1 - exp(z))`` where ``z = log q - log p - log P = (draft - target) - delta - log P < 0`` (else 0),
    with ``delta = L_d - L_t = (m_d - m_t) + log(S_d / S_t)`` (maxima ``m``, ``S = sum exp(x - m)``) and a cubic
    series for ``|z| < 1e-2``. No rounded log-sum-exp ``L`` enters, whose fp32 rounding (up to ~1e-6 relative for
    ``|L|`` ~ 10-40) would scale all of p against all of q and give a ~1e-6 mass where ``q == p`` up to rounding; an
    exact logit shift gives exactly 0.
    """
    m_t = target.max(dim=-1, keepdim=True).values
    m_d = draft.max(dim=-1, keepdim=True).values
    s_t = torch.exp(target - m_t).sum(dim=-1, keepdim=True)
    s_d = torch.exp(draft - m_d).sum(dim=-1, keepdim=True)
    delta = (m_d - m_t) + torch.log(s_d / s_t)
    if log_weight is not None:
        delta = delta + log_weight[..., None]
        p = p * torch.exp(log_weight)[..., None]
    z = (draft - target) - delta
    series = -z * (1.0 + z * (0.5 + z * (1.0 / 6.0)))
    one_minus = torch.where(z.abs() < 1e-2, series, 1.0 - torch.exp(z))
    return torch.where(z < 0, p * one_minus, torch.zeros_like(z))


def tile_sums(weights: torch.Tensor) -> torch.Tensor:
    """[..., ceil(V / RACE_TILE)] sums of ``weights`` [..., V] over each tile of :data:`RACE_TILE` consecutive
    ids."""
    vocab = weights.shape[-1]
    num_tiles = -(-vocab // RACE_TILE)
    padded = torch.nn.functional.pad(weights, (0, num_tiles * RACE_TILE - vocab))
    return padded.view(*weights.shape[:-1], num_tiles, RACE_TILE).sum(dim=-1)


def _log_ratio(target: torch.Tensor, draft: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[B, K] float32 ``log p(x) - log q(x)`` at ``ids`` [B, K, 1] of scaled logits [B, K, V], as
    ``(t_x - d_x) + ((m_d - m_t) + log(S_d / S_t))`` (see :func:`block_log_weights`)."""
    m_t = target.max(dim=-1).values
    m_d = draft.max(dim=-1).values
    s_t = torch.exp(target - m_t[..., None]).sum(dim=-1)
    s_d = torch.exp(draft - m_d[..., None]).sum(dim=-1)
    return (target.gather(-1, ids) - draft.gather(-1, ids)).squeeze(-1) + ((m_d - m_t) + torch.log(s_d / s_t))


def block_log_weights(log_ratio: torch.Tensor) -> torch.Tensor:
    """[B, K+1] float32 block weights ``a_i = log P_i``: ``a_0 = 0``, ``a_{i+1} = min(0, a_i + log_ratio[:, i])``.

    log_ratio: [B, K] float32 ``log p_i(x_i) - log q_i(x_i)`` of the drafts, ``-inf`` where draft i cannot be kept
    (past the row's drafts, ``q_i(x_i) = 0``, ``p_i(x_i) = 0``), never NaN; computed as
    ``(t_x - d_x) + ((m_d - m_t) + log(S_d / S_t))`` (``= -z`` of :func:`residual_weights`), so that an exact
    logit shift gives exactly 0. ``P_i = min(1, P_{i-1} p/q)`` is the
    running product of the ratios divided by its running maximum; the kernel runs the same recurrence in the same
    order (fp32 add, then min), so the two agree bit for bit on equal ratios.
    """
    batch, num_drafts = log_ratio.shape
    weights = torch.zeros(batch, num_drafts + 1, dtype=torch.float32, device=log_ratio.device)
    run = weights[:, 0]
    for i in range(num_drafts):
        run = torch.minimum(run + log_ratio[:, i], torch.zeros_like(run))
        weights[:, i + 1] = run
    return weights


def block_stop(log_weights: torch.Tensor, accept_uniforms: torch.Tensor, residual_mass: torch.Tensor,
               counts: torch.Tensor) -> torch.Tensor:
    """[B] int64 stop position ``tau`` of block verification (how many drafts a sampled row keeps).

    log_weights: [B, K+1] ``a_i`` of :func:`block_log_weights`; accept_uniforms: [B, K] float32, ``eta_i`` of
    position ``i >= 1`` is ``accept_uniforms[:, i - 1]`` (the token-wise accept uniform of draft ``i - 1``);
    residual_mass: [B, K] float32 ``W_i = sum_x max(0, P_i p_i(x) - q_i(x))``; counts: [B] int64 ``n_b``.

    ``tau = max {i in 1..n_b : success_i}`` (0 when none), with ``success_i``: ``log eta_i <= a_i`` and (``i = n_b``
    or ``a_i >= -BLOCK_CERTAIN_EPS`` or ``eta_i (W_i + 1 - P_i) <= W_i``), i.e. ``eta_i <= h_i = W_i / (W_i + 1 -
    P_i)`` for ``i < n_b`` and ``eta_i <= P_i`` at ``i = n_b``. Masses at or below :data:`RESIDUAL_MASS_EPS` count as
    0, weights within :data:`BLOCK_CERTAIN_EPS` of 1 as 1. The first test is implied by the second (``h_i <= P_i``)
    and lets the kernel read only the rows it can need.
    """
    batch, num_positions = log_weights.shape
    positions = torch.arange(num_positions, device=log_weights.device)
    eta = torch.cat([torch.ones_like(accept_uniforms[:, :1]), accept_uniforms], dim=1)
    mass = torch.cat([residual_mass, torch.zeros_like(residual_mass[:, :1])], dim=1)
    mass = torch.where(mass > RESIDUAL_MASS_EPS, mass, torch.zeros_like(mass))
    inside = (positions[None, :] >= 1) & (positions[None, :] <= counts[:, None])
    candidate = inside & (torch.log(eta) <= log_weights)
    certain = (log_weights >= -BLOCK_CERTAIN_EPS) | (positions[None, :] == counts[:, None])
    success = candidate & (certain | (eta * (mass + (1.0 - torch.exp(log_weights))) <= mass))
    return torch.where(success, positions[None, :], torch.zeros_like(positions[None, :])).amax(dim=1)


def _residual_mass(target: torch.Tensor, draft: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """[B] float32 ``sum_x max(0, p(x) - q(x))`` (= TV(p, q)), summed tile by tile like the race's tile masses."""
    return tile_sums(residual_weights(target, draft, p)).sum(dim=-1)


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
    verification: str = "token",
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
        verification: "token" (each draft accepted with probability ``min(1, p/q)`` until the first rejection) or
            "block" (the drafts of a sampled row decided jointly, :func:`block_stop`; greedy rows unchanged).

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
    accept_u = uniform_from_keys(key_a, key_b, torch.full_like(key_a, ACCEPT_INDEX))
    log_u = torch.log(accept_u)
    sampled_accept = (lq_draft > float("-inf")) & (log_u + lq_draft <= lp_draft)
    greedy_accept = draft_tokens == target_argmax[:, :num_drafts]
    accept = is_real & torch.where(greedy[:, None], greedy_accept, sampled_accept)
    num_accepted = torch.cumprod(accept.to(torch.int64), dim=1).sum(dim=1)

    rows = torch.arange(batch, device=device)
    log_weight = block_mass = None
    if verification == "block":
        keepable = is_real & (lq_draft > float("-inf")) & (lp_draft > float("-inf"))
        log_weights = block_log_weights(torch.where(keepable, _log_ratio(target[:, :num_drafts], draft, safe_drafts),
                                                    float("-inf")))
        weighted = residual_weights(target[:, :num_drafts], draft, target_logprob[:, :num_drafts].exp(),
                                    log_weights[:, :num_drafts])
        masses = tile_sums(weighted).sum(dim=-1)  # [B, K] W_i
        num_accepted = torch.where(greedy, num_accepted, block_stop(log_weights, accept_u, masses, counts))
        log_weight = torch.where(greedy, 0.0, log_weights[rows, num_accepted])
        block_mass = masses[rows, num_accepted.clamp(max=num_drafts - 1)]
    stop = num_accepted  # position of the recovered or bonus token
    rejected = stop < counts
    p_stop = target_logprob[rows, stop].exp()
    target_stop = target[rows, stop]
    residual = residual_weights(target_stop, draft[rows, stop.clamp(max=num_drafts - 1)], p_stop, log_weight)
    # (block: the mass block_stop used, as the kernel does; the same sum up to its order)
    residual_mass = tile_sums(residual).sum(dim=-1) if block_mass is None else block_mass
    use_residual = (rejected & (residual_mass > RESIDUAL_MASS_EPS))[:, None]
    sampled_token = tiled_exponential_race(torch.where(use_residual, residual, p_stop),
                                           torch.where(use_residual, torch.log(residual), target_stop),
                                           seeds, offsets + stop)
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
