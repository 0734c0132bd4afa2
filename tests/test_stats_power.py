"""The goodness-of-fit threshold has power: it rejects a plausible wrong law and accepts the right one."""

import pytest
import torch

from stats import assert_follows


def test_chi_square_accepts_true_law_and_rejects_shifted_one():
    generator = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    samples = torch.multinomial(probs, 20000, replacement=True, generator=generator)
    counts = torch.bincount(samples, minlength=4)
    assert_follows(counts, probs, what="true law")
    wrong = torch.tensor([0.37, 0.33, 0.2, 0.1])  # a 3-point shift of mass
    with pytest.raises(AssertionError):
        assert_follows(counts, wrong, what="shifted law")
