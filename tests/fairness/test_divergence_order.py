"""divergence takes the verifier's logits first, divergence_loss the drafter's: a call in the wrong order is refused
when it is made, not at backward()."""

from __future__ import annotations

import pytest
import torch

from specdec.fairness import divergence, divergence_loss, fused_linear_divergence_loss


def logits(seed: int, rows: int = 5, vocab: int = 11) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_divergence_loss_in_divergence_order_is_refused_at_the_call():
    verifier, drafter = logits(0), logits(1).requires_grad_()
    with pytest.raises(ValueError, match=r"divergence_loss: verifier_logits requires grad and drafter_logits does "
                                         r"not, so the arguments look swapped"):
        divergence_loss(verifier, drafter)  # positional, in divergence()'s order
    loss = divergence_loss(verifier_logits=verifier, drafter_logits=drafter)  # keywords in either order
    loss.backward()
    p, q = torch.softmax(verifier, -1), torch.softmax(drafter.detach(), -1)
    torch.testing.assert_close(drafter.grad, q - p)  # dL/dz = q - p, the definition
    expected = (-(p * torch.log_softmax(drafter.detach(), -1)).sum(-1)).sum()
    torch.testing.assert_close(loss.detach(), expected)
    torch.testing.assert_close(divergence(verifier, drafter.detach()).cross_entropy.sum(), expected)


def test_fused_linear_loss_in_the_wrong_order_is_refused_at_the_call():
    hidden, weight = torch.randn(5, 4), torch.randn(11, 4)
    verifier = logits(0).requires_grad_()
    with pytest.raises(ValueError, match="fused_linear_divergence_loss: verifier_logits requires grad"):
        fused_linear_divergence_loss(hidden, weight, verifier)
    weight.requires_grad_()
    fused_linear_divergence_loss(hidden, weight, verifier.detach()).backward()
    assert weight.grad is not None and bool(torch.isfinite(weight.grad).all())
