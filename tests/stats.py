"""Goodness-of-fit helpers with fixed, high-power thresholds (about 10 standard deviations)."""

from __future__ import annotations

import math

import torch


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson chi-square of observed ``counts`` against ``probs``; bins expecting < min_expected are merged.

    Returns (statistic, degrees of freedom). Observations in a zero-probability bin make the statistic infinite.
    """
    counts = counts.double().flatten()
    probs = probs.double().flatten()
    total = counts.sum()
    expected = probs * total
    if bool(((probs == 0) & (counts > 0)).any()):
        return math.inf, 1
    order = torch.argsort(expected)
    merged_obs, merged_exp = [], []
    acc_obs = acc_exp = 0.0
    for index in order.tolist():
        acc_obs += float(counts[index])
        acc_exp += float(expected[index])
        if acc_exp >= min_expected:
            merged_obs.append(acc_obs)
            merged_exp.append(acc_exp)
            acc_obs = acc_exp = 0.0
    if acc_exp > 0 and merged_exp:
        merged_obs[-1] += acc_obs
        merged_exp[-1] += acc_exp
    obs, exp = torch.tensor(merged_obs), torch.tensor(merged_exp)
    return float(((obs - exp) ** 2 / exp).sum()), max(len(merged_exp) - 1, 1)


def assert_follows(counts: torch.Tensor, probs: torch.Tensor, sigmas: float = 10.0, what: str = "") -> None:
    """Fail when the chi-square statistic exceeds df + sigmas * sqrt(2 df) (its mean plus `sigmas` std devs)."""
    statistic, dof = chi_square(counts, probs)
    threshold = dof + sigmas * math.sqrt(2 * dof)
    assert statistic <= threshold, f"{what}: chi2={statistic:.1f} > {threshold:.1f} (df={dof})"
