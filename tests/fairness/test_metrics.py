"""Closed forms: expected tokens per call, speed-up, accepted-count law, bounds."""

import math

import pytest
import torch

from specdec.fairness import metrics


def test_expected_tokens_matches_geometric_formula_and_limits():
    for alpha in (0.0, 0.3, 0.75, 0.999):
        for k in (1, 4, 8):
            closed = (1 - alpha ** (k + 1)) / (1 - alpha)
            assert math.isclose(metrics.expected_tokens_per_call(alpha, k), closed, rel_tol=1e-12)
    assert metrics.expected_tokens_per_call(1.0, 5) == 6.0
    values = metrics.expected_tokens_per_call(torch.tensor([0.0, 0.5, 1.0]), 2)
    assert torch.allclose(values, torch.tensor([1.0, 1.75, 3.0]))


def test_speedup_is_increasing_in_alpha_and_divides_by_cost():
    alphas = torch.linspace(0, 1, 101, dtype=torch.float64)
    s = metrics.speedup(alphas, 4, 0.1)
    assert bool((s[1:] > s[:-1]).all())
    assert math.isclose(float(s[-1]), 5 / 1.4)
    with pytest.raises(ValueError, match="cost_ratio"):
        metrics.speedup(0.5, 4, -1.0)
    with pytest.raises(ValueError, match="alpha"):
        metrics.speedup(1.5, 4, 0.1)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        metrics.expected_tokens_per_call(0.5, 0)
    with pytest.raises(TypeError, match="cost_ratio"):
        metrics.speedup(0.5, 4, True)
    with pytest.raises(TypeError, match="cost_ratio"):
        metrics.speedup(0.5, 4, "0.1")
    with pytest.raises(ValueError, match="cost_ratio"):
        metrics.speedup(0.5, 4, float("inf"))
    with pytest.raises(ValueError, match="tv must lie"):
        metrics.speedup_lower_bounds(float("nan"), 0.1, 4, 0.1)
    with pytest.raises(ValueError, match="kl must lie"):
        metrics.speedup_lower_bounds(0.2, -0.1, 4, 0.1)


def test_accepted_count_distribution_sums_to_one_and_has_the_right_mean():
    a = torch.tensor([0.9, 0.5, 0.2], dtype=torch.float64)
    law = metrics.accepted_count_distribution(a)
    assert torch.allclose(law, torch.tensor([0.1, 0.9 * 0.5, 0.9 * 0.5 * 0.8, 0.9 * 0.5 * 0.2], dtype=torch.float64))
    same = metrics.accepted_count_distribution(torch.full((4,), 0.6, dtype=torch.float64))
    mean_tokens = float((same * torch.arange(5)).sum()) + 1  # accepted + the recovered/bonus token
    assert math.isclose(mean_tokens, metrics.expected_tokens_per_call(0.6, 4), rel_tol=1e-12)


def test_acceptance_from_logits_is_one_minus_total_variation():
    generator = torch.Generator().manual_seed(0)
    target, draft = torch.randn(2, 5, 30, generator=generator)
    p, q = torch.softmax(target, -1), torch.softmax(draft, -1)
    expected = 1 - 0.5 * (p - q).abs().sum(-1)
    assert torch.allclose(metrics.acceptance_from_logits(target, draft), expected, atol=1e-6)


def test_acceptance_from_logits_of_equal_logits_feeds_the_speedup():
    # p = q: the float32 sum of min(p, q) over 1000 ids lands a few ulps above 1 in some rows unless clamped, and
    # speedup() refuses alpha > 1
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)) * 3
    alpha = metrics.acceptance_from_logits(logits, logits)
    assert float(alpha.max()) <= 1.0 and float(alpha.min()) > 1 - 1e-5
    assert torch.allclose(metrics.speedup(alpha, 4, 0.0), torch.full((64,), 5.0), atol=1e-4)


def test_acceptance_from_logits_refuses_bad_input():
    logits = torch.randn(3, 10)
    with pytest.raises(ValueError, match="temperature"):
        metrics.acceptance_from_logits(logits, logits, temperature=1e-40)
    with pytest.raises(TypeError, match="temperature"):
        metrics.acceptance_from_logits(logits, logits, temperature="1")
    with pytest.raises(TypeError, match="target_logits"):
        metrics.acceptance_from_logits(logits.tolist(), logits)
    nan_row = logits.clone()
    nan_row[0, 3] = float("nan")
    with pytest.raises(ValueError, match="draft_logits contains NaN"):
        metrics.acceptance_from_logits(logits, nan_row)
    with pytest.raises(ValueError, match="same shape"):
        metrics.acceptance_from_logits(logits, logits[:, :5])


def test_bounds_hold_and_are_ordered():
    from_tv, from_kl = metrics.speedup_lower_bounds(tv=0.3, kl=0.4, num_draft_tokens=4, cost_ratio=0.05)
    assert from_tv >= from_kl
    assert math.isclose(from_tv, float(metrics.speedup(0.7, 4, 0.05)))
    assert math.isclose(from_kl, float(metrics.speedup(1 - math.sqrt(0.2), 4, 0.05)))
    assert metrics.speedup_lower_bounds(0.9, 5.0, 4, 0.05)[1] == float(metrics.speedup(0.0, 4, 0.05))


def test_bad_acceptance_probabilities_are_refused():
    with pytest.raises(ValueError, match="position_alpha"):
        metrics.accepted_count_distribution(torch.tensor([1.5, 0.5]))
    with pytest.raises(ValueError, match="position_alpha"):
        metrics.accepted_count_distribution(torch.tensor([float("nan"), 0.5]))
    with pytest.raises(TypeError, match="position_alpha"):
        metrics.accepted_count_distribution([0.5, 0.5])
    with pytest.raises(TypeError, match="alpha"):
        metrics.expected_tokens_per_call("0.5", 4)
    with pytest.raises(ValueError, match="alpha"):
        metrics.expected_tokens_per_call(float("nan"), 4)
    empty = metrics.expected_tokens_per_call(torch.zeros(0), 4)
    assert empty.shape == (0,)
