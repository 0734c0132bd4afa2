"""Exact laws of one verification round, enumerated in float64 from the algorithms' statements (Leviathan et al.
token-wise verification; Sun et al., ICLR 2025, block verification), written apart from the code they test."""

from __future__ import annotations

import itertools

import torch


def round_law(p_next, q_next, num_drafts: int, vocab: int, scheme: str) -> dict[tuple, float]:
    """{emitted tokens: probability} of one round. ``p_next(prefix)`` / ``q_next(prefix)``: [V] float64 laws of the
    next token after the drafted ``prefix`` (a tuple). Token-wise: accept draft i with min(1, p/q), stop at the
    first rejection and draw from max(0, p - q). Block: P_0 = 1, P_i = min(1, P_{i-1} p/q), h_i = W_i / (W_i + 1 -
    P_i) with W_i = sum max(0, P_i p_i - q_i) (h_0 = 1, h_K = P_K); the stop is the largest i whose test passes."""
    law: dict[tuple, float] = {}

    def add(tokens, mass, weights):
        for y in range(vocab):
            if float(weights[y]) > 0:
                law[tokens + (y,)] = law.get(tokens + (y,), 0.0) + mass * float(weights[y])

    for xs in itertools.product(range(vocab), repeat=num_drafts):
        q_block = 1.0
        for i in range(num_drafts):
            q_block *= float(q_next(xs[:i])[xs[i]])
        if q_block == 0.0:
            continue
        ratios = [float(p_next(xs[:i])[xs[i]] / q_next(xs[:i])[xs[i]]) for i in range(num_drafts)]
        if scheme == "token":
            kept = 1.0
            for i in range(num_drafts):
                residual = (p_next(xs[:i]) - q_next(xs[:i])).clamp(min=0)
                if float(residual.sum()) > 0:
                    add(xs[:i], q_block * kept * (1 - min(1.0, ratios[i])), residual / residual.sum())
                kept *= min(1.0, ratios[i])
            add(xs, q_block * kept, p_next(xs))
            continue
        weights = [1.0]
        for ratio in ratios:
            weights.append(min(1.0, weights[-1] * ratio))
        h, residuals = [], []
        for i in range(num_drafts):
            w = (weights[i] * p_next(xs[:i]) - q_next(xs[:i])).clamp(min=0)
            mass = float(w.sum())
            h.append(1.0 if i == 0 or mass + 1 - weights[i] == 0 else mass / (mass + 1 - weights[i]))
            residuals.append(w / mass if mass > 0 else w)
        h.append(weights[-1])
        residuals.append(p_next(xs))
        none_above = 1.0
        for i in range(num_drafts, -1, -1):
            add(xs[:i], q_block * none_above * h[i], residuals[i])
            none_above *= 1 - h[i]
    return law


def completed_law(law: dict[tuple, float], p_next, length: int, vocab: int) -> dict[tuple, float]:
    """The law of ``length`` tokens: a round's output, continued by sampling from ``p_next``."""
    full: dict[tuple, float] = {}
    for tokens, mass in law.items():
        for rest in itertools.product(range(vocab), repeat=length - len(tokens)):
            seq = tokens + rest
            for i in range(len(tokens), length):
                mass *= float(p_next(seq[:i])[seq[i]])
            full[seq] = full.get(seq, 0.0) + mass
            mass = law[tokens]
    return full


def bigram(logits: torch.Tensor):
    """``prefix -> softmax(logits[last token])`` (``logits[V]`` for the empty prefix): a context-dependent law."""
    probs = torch.softmax(logits.double(), -1)
    vocab = probs.shape[-1]
    return lambda prefix: probs[prefix[-1] if prefix else vocab]


def positional(logits: torch.Tensor):
    """``prefix -> softmax(logits[len(prefix)])``: one law per position, whatever the drafts before."""
    probs = torch.softmax(logits.double(), -1)
    return lambda prefix: probs[len(prefix)]


def expected_accepted(p: torch.Tensor, q: torch.Tensor, scheme: str) -> float:
    """E[accepted drafts] of one round with per-position laws p [K+1, V], q [K, V] (float64), by enumerating every
    draft block at once: token-wise prod of min(1, p/q) up to each position; block sum_i i h_i prod_{j>i} (1 - h_j)."""
    num_drafts, vocab = q.shape
    paths = torch.cartesian_prod(*[torch.arange(vocab)] * num_drafts).reshape(-1, num_drafts)
    steps = torch.arange(num_drafts)
    q_block = q[steps, paths].prod(dim=1)
    ratio = p[steps, paths] / q[steps, paths]
    if scheme == "token":
        return float((q_block * torch.cumprod(ratio.clamp(max=1), dim=1).sum(dim=1)).sum())
    weights = torch.ones(paths.shape[0], num_drafts + 1, dtype=torch.float64)
    for i in range(num_drafts):
        weights[:, i + 1] = torch.minimum(weights[:, i] * ratio[:, i], torch.ones(()))
    mass = (weights[:, :num_drafts, None] * p[None, :num_drafts] - q[None]).clamp(min=0).sum(dim=-1)
    denominator = mass + 1 - weights[:, :num_drafts]
    h = torch.where(denominator > 0, mass / denominator.clamp(min=1e-300), torch.ones(()))
    h = torch.cat([h, weights[:, num_drafts:]], dim=1)
    h[:, 0] = 1.0
    none_above = torch.flip(torch.cumprod(torch.flip(1 - h, [1]), dim=1), [1])  # prod_{j >= i} (1 - h_j)
    stop_law = h * torch.cat([none_above[:, 1:], torch.ones(paths.shape[0], 1, dtype=torch.float64)], dim=1)
    return float((q_block * (stop_law * torch.arange(num_drafts + 1)).sum(dim=1)).sum())
