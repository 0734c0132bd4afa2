"""Reference divergences (float64 ground truth), the torch backend of the public API, and argument checks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as nnf

import specdec.fairness.divergences as sd
from specdec.kernels.divergence_reference import cross_entropy_rows, divergence_reference

NEG_INF = float("-inf")
NAN = float("nan")
INF = float("inf")


def _logits(n: int, v: int, seed: int, scale: float = 2.0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, v, generator=g, dtype=torch.float64) * scale).to(dtype)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_reference_matches_textbook_formulas(temperature: float) -> None:
    v, d = _logits(9, 31, 0), _logits(9, 31, 1)
    ce, kl, tv, alpha, _ = divergence_reference(v, d, temperature)
    p = torch.softmax(v / temperature, -1)
    q = torch.softmax(d / temperature, -1)
    torch.testing.assert_close(ce, nnf.cross_entropy(d / temperature, p, reduction="none"), rtol=1e-12, atol=1e-12)
    log_p, log_q = torch.log_softmax(v / temperature, -1), torch.log_softmax(d / temperature, -1)
    torch.testing.assert_close(kl, nnf.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1), rtol=1e-12,
                               atol=1e-12)
    torch.testing.assert_close(tv, 0.5 * (p - q).abs().sum(-1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(alpha, 1 - tv, rtol=1e-12, atol=1e-12)
    entropy = -(p * log_p).sum(-1)
    torch.testing.assert_close(kl, ce - entropy, rtol=1e-10, atol=1e-12)
    assert bool((tv <= torch.sqrt(kl / 2) + 1e-12).all()), "Pinsker's inequality"


def test_reference_is_shift_invariant_and_zero_on_equal_rows() -> None:
    v = _logits(6, 40, 2)
    shift = torch.arange(6, dtype=torch.float64)[:, None] * 3.0
    ce_a, kl_a, tv_a, alpha_a, _ = divergence_reference(v + shift, v - shift, 0.9)
    ce_b, *_ = divergence_reference(v, v, 0.9)
    torch.testing.assert_close(kl_a, torch.zeros(6, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(tv_a, torch.zeros(6, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(alpha_a, torch.ones(6, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(ce_a, ce_b, rtol=1e-12, atol=1e-12)  # H(p, p) = H(p)


def test_masked_entries_on_both_sides_equal_the_reduced_vocabulary() -> None:
    v, d = _logits(5, 30, 3), _logits(5, 30, 4)
    dropped = torch.tensor([0, 7, 8, 29])
    v_masked, d_masked = v.clone(), d.clone()
    v_masked[:, dropped] = NEG_INF
    d_masked[:, dropped] = NEG_INF
    keep = torch.ones(30, dtype=torch.bool)
    keep[dropped] = False
    full = divergence_reference(v_masked, d_masked, 1.3)[:4]
    reduced = divergence_reference(v[:, keep], d[:, keep], 1.3)[:4]
    for a, b in zip(full, reduced, strict=True):
        assert not torch.isnan(a).any()
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_support_mismatch_gives_inf_never_nan() -> None:
    v, d = _logits(4, 12, 5), _logits(4, 12, 6)
    d[0, 3] = NEG_INF  # p > 0 where q = 0: H = KL = +inf
    v[1, 5] = NEG_INF  # q > 0 where p = 0: finite
    ce, kl, tv, alpha, _ = divergence_reference(v, d, 1.0)
    assert math.isinf(ce[0]) and ce[0] > 0 and math.isinf(kl[0]) and kl[0] > 0
    assert torch.isfinite(ce[1:]).all() and torch.isfinite(kl[1:]).all()
    assert torch.isfinite(tv).all() and torch.isfinite(alpha).all()
    # disjoint supports: alpha = 0, TV = 1
    v_disjoint = torch.tensor([[0.0, 1.0, NEG_INF, NEG_INF]], dtype=torch.float64)
    d_disjoint = torch.tensor([[NEG_INF, NEG_INF, 0.5, 0.0]], dtype=torch.float64)
    ce2, kl2, tv2, alpha2, _ = divergence_reference(v_disjoint, d_disjoint, 1.0)
    assert math.isinf(ce2[0]) and math.isinf(kl2[0]) and float(tv2[0]) == 1.0 and float(alpha2[0]) == 0.0


def test_greedy_temperature_zero() -> None:
    v = torch.tensor([[0.0, 2.0, 2.0], [1.0, 0.0, 0.0], [3.0, 1.0, 0.0]])
    d = torch.tensor([[0.0, 2.0, 1.0], [0.0, 1.0, 0.0], [5.0, 1.0, 0.0]])
    out = sd.divergence(v, d, 0.0)
    assert out.cross_entropy.tolist() == [0.0, math.inf, 0.0]
    assert out.kl.tolist() == [0.0, math.inf, 0.0]
    assert out.tv.tolist() == [0.0, 1.0, 0.0] and out.alpha.tolist() == [1.0, 0.0, 1.0]


def test_per_task_sums_are_group_by_and_mask_skips_tokens() -> None:
    n, num_tasks = 40, 5
    v, d = _logits(n, 17, 7), _logits(n, 17, 8)
    g = torch.Generator().manual_seed(9)
    task_ids = torch.randint(-1, num_tasks - 1, (n,), generator=g)  # task 4 stays empty, -1 = no task
    mask = torch.rand(n, generator=g) > 0.25
    out = sd.divergence(v.float(), d.float(), 1.1, task_ids=task_ids, num_tasks=num_tasks, mask=mask, backend="torch")
    assert out.cross_entropy.dtype == torch.float32 and out.cross_entropy.shape == (n,)
    for name in ("cross_entropy", "kl", "tv", "alpha"):
        assert bool((getattr(out, name)[~mask] == 0).all())
    counted = mask & (task_ids >= 0)
    pt = out.per_task
    for task in range(num_tasks):
        sel = counted & (task_ids == task)
        assert int(pt.count[task]) == int(sel.sum())
        for name in ("cross_entropy", "kl", "tv", "alpha"):
            expected = getattr(out, name)[sel].double().sum()
            torch.testing.assert_close(getattr(pt, f"{name}_sum")[task], expected, rtol=1e-12, atol=1e-12)
    means = pt.mean()
    assert math.isnan(means["cross_entropy"][4]) and pt.count[4] == 0
    torch.testing.assert_close(pt.alpha_mean[:4], pt.alpha_sum[:4] / pt.count[:4].double())
    both = pt + pt
    torch.testing.assert_close(both.kl_sum, 2 * pt.kl_sum)
    assert torch.equal(both.count, 2 * pt.count)


def test_public_torch_backend_matches_float64_reference() -> None:
    v, d = _logits(12, 50, 10, dtype=torch.float32), _logits(12, 50, 11, dtype=torch.float32)
    out = sd.divergence(v, d, 0.8, backend="auto")
    ref = divergence_reference(v.double(), d.double(), 0.8)
    for got, want in zip((out.cross_entropy, out.kl, out.tv, out.alpha), ref[:4], strict=True):
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-6)
    assert out.per_task is None


def test_reference_chunking_does_not_change_values() -> None:
    v, d = _logits(23, 19, 12), _logits(23, 19, 13)
    whole = divergence_reference(v, d, 1.0)[:4]
    chunked = divergence_reference(v, d, 1.0, chunk_elements=40)[:4]
    for a, b in zip(whole, chunked, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_loss_gradient_is_weighted_q_minus_p_over_t(reduction: str) -> None:
    n, v, temperature = 11, 26, 0.7
    verifier, drafter = _logits(n, v, 14), _logits(n, v, 15).requires_grad_()
    weights = torch.rand(n, generator=torch.Generator().manual_seed(16), dtype=torch.float64)
    mask = torch.ones(n, dtype=torch.bool)
    mask[[2, 5]] = False
    loss = sd.divergence_loss(drafter, verifier, weights, temperature, reduction, "torch", mask=mask)
    loss.backward()
    w = torch.where(mask, weights, 0.0)
    ce = divergence_reference(verifier, drafter.detach(), temperature)[0]
    count = int(mask.sum()) if reduction == "mean" else 1
    torch.testing.assert_close(loss.double(), (w * ce).sum() / count, rtol=1e-5, atol=1e-6)
    p = torch.softmax(verifier / temperature, -1)
    q = torch.softmax(drafter.detach() / temperature, -1)
    expected = w[:, None] * (q - p) / temperature / count
    torch.testing.assert_close(drafter.grad, expected, rtol=1e-5, atol=1e-7)


def test_cross_entropy_rows_has_no_nan_gradient_on_masked_entries() -> None:
    v, d = _logits(3, 8, 17), _logits(3, 8, 18)
    v[:, :3] = NEG_INF
    d[:, :3] = NEG_INF
    d = d.requires_grad_()
    cross_entropy_rows(v, d, 1.0, torch.float64).sum().backward()
    assert torch.isfinite(d.grad).all() and bool((d.grad[:, :3] == 0).all())


def test_loss_support_is_read_off_the_logits_not_off_an_underflowed_softmax() -> None:
    # row 1: one verifier logit 300 above the rest, so p of the others underflows to 0 in float32, and a -inf drafter
    # logit at one of them: p > 0 where q = 0, so H(p, q) = +inf (as divergence() says), with a finite gradient
    v = torch.zeros(2, 12)
    v[1, 0] = 300.0
    d = torch.randn(2, 12, generator=torch.Generator().manual_seed(5))
    d[1, 10] = NEG_INF
    d.requires_grad_()
    ce = cross_entropy_rows(v, d, 1.0)
    assert math.isfinite(float(ce[0].detach())) and float(ce[1].detach()) == math.inf
    assert float(sd.divergence(v, d.detach(), backend="torch").cross_entropy[1]) == math.inf
    assert float(sd.divergence_loss(d, v, reduction="sum", backend="torch").detach()) == math.inf
    ce[1].backward()
    assert torch.isfinite(d.grad).all()


def test_fused_linear_torch_path_matches_unfused() -> None:
    g = torch.Generator().manual_seed(19)
    hidden = torch.randn(9, 6, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(21, 6, generator=g, dtype=torch.float64, requires_grad=True)
    verifier = _logits(9, 21, 20)
    loss = sd.fused_linear_divergence_loss(hidden, weight, verifier, temperature=1.2, reduction="mean")
    logits = hidden @ weight.t()
    expected = sd.divergence_loss(logits, verifier, temperature=1.2, reduction="mean")
    torch.testing.assert_close(loss, expected)


# ---------------------------------------------------------------------------------------------- argument checks
GOOD_V = torch.zeros(4, 7)
GOOD_D = torch.ones(4, 7)


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"verifier_logits": [[0.0]]}, TypeError, "verifier_logits"),
        ({"drafter_logits": torch.zeros(4, 7, dtype=torch.int64)}, TypeError, "drafter_logits"),
        ({"verifier_logits": torch.zeros(4, 7, 1)}, ValueError, "verifier_logits"),
        ({"drafter_logits": torch.zeros(4, 8)}, ValueError, "drafter_logits"),
        ({"verifier_logits": torch.zeros(4, 0), "drafter_logits": torch.zeros(4, 0)}, ValueError, "V >= 1"),
        ({"temperature": -0.5}, ValueError, "temperature"),
        ({"temperature": "1"}, TypeError, "temperature"),
        ({"task_ids": torch.zeros(3, dtype=torch.int64)}, ValueError, "task_ids"),
        ({"task_ids": torch.zeros(4)}, TypeError, "task_ids"),
        ({"task_ids": torch.tensor([0, 1, 2, 3]), "num_tasks": 3}, ValueError, "task_ids"),
        ({"task_ids": torch.tensor([0, -2, 0, 0]), "num_tasks": 3}, ValueError, "task_ids"),
        ({"num_tasks": 3}, ValueError, "num_tasks"),
        ({"task_ids": torch.tensor([0, 0, 0, 0]), "num_tasks": 0}, ValueError, "num_tasks"),
        ({"task_ids": torch.tensor([0, 0, 0, 0]), "num_tasks": 2.0}, TypeError, "num_tasks"),
        ({"mask": torch.ones(4)}, TypeError, "mask"),
        ({"mask": torch.ones(5, dtype=torch.bool)}, ValueError, "mask"),
        ({"backend": "cuda"}, ValueError, "backend"),
        ({"verifier_logits": torch.full((4, 7), float("nan"))}, ValueError, "verifier_logits"),
        ({"drafter_logits": torch.full((4, 7), float("inf"))}, ValueError, "drafter_logits"),
        ({"drafter_logits": torch.full((4, 7), NEG_INF)}, ValueError, "drafter_logits"),
        ({"verifier_logits": torch.zeros(4, 7, device="meta")}, ValueError, "device"),
        ({"temperature": 1e-40}, ValueError, "temperature"),
    ],
)
def test_divergence_rejects_bad_arguments(kwargs: dict, error: type, needle: str) -> None:
    args = {"verifier_logits": GOOD_V, "drafter_logits": GOOD_D} | kwargs
    with pytest.raises(error, match=needle):
        sd.divergence(**args)


def test_masked_bad_rows_are_not_checked() -> None:
    d = GOOD_D.clone()
    d[1] = float("nan")
    mask = torch.tensor([True, False, True, True])
    out = sd.divergence(GOOD_V, d, mask=mask)
    assert torch.isfinite(out.cross_entropy).all()
    loss = sd.divergence_loss(d, GOOD_V, mask=mask)
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match="drafter_logits contains NaN"):
        sd.divergence_loss(d, GOOD_V)


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"temperature": 0.0}, ValueError, "temperature"),
        ({"reduction": "none"}, ValueError, "reduction"),
        ({"weights": torch.ones(3)}, ValueError, "weights"),
        ({"weights": torch.tensor([1.0, float("nan"), 1.0, 1.0])}, ValueError, "weights"),
        ({"weights": torch.ones(4, dtype=torch.int64)}, TypeError, "weights"),
        ({"mask": torch.ones(4, dtype=torch.int64)}, TypeError, "mask"),
        ({"verifier_logits": torch.zeros(5, 7)}, ValueError, "verifier_logits"),
        ({"drafter_logits": "x"}, TypeError, "drafter_logits"),
        ({"backend": "jax"}, ValueError, "backend"),
        ({"temperature": 1e-40}, ValueError, "temperature"),
        ({"verifier_logits": GOOD_V.clone().index_put_((torch.tensor(1), torch.tensor(3)), torch.tensor(NAN))},
         ValueError, "verifier_logits contains NaN"),
        ({"verifier_logits": GOOD_V.clone().index_put_((torch.tensor(2), torch.tensor(0)), torch.tensor(INF))},
         ValueError, "verifier_logits contains \\+inf"),
        ({"drafter_logits": GOOD_D.clone().index_fill_(0, torch.tensor(0), NEG_INF)}, ValueError,
         "drafter_logits has a row with every entry -inf"),
    ],
)
def test_divergence_loss_rejects_bad_arguments(kwargs: dict, error: type, needle: str) -> None:
    args = {"drafter_logits": GOOD_D, "verifier_logits": GOOD_V} | kwargs
    with pytest.raises(error, match=needle):
        sd.divergence_loss(**args)


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"drafter_hidden": torch.zeros(4)}, ValueError, "drafter_hidden"),
        ({"lm_head_weight": torch.zeros(7, 5)}, ValueError, "lm_head_weight"),
        ({"lm_head_weight": torch.zeros(7, 3, dtype=torch.float64)}, TypeError, "lm_head_weight"),
        ({"verifier_logits": torch.zeros(4, 8)}, ValueError, "verifier_logits"),
        ({"chunk_size": 0}, ValueError, "chunk_size"),
        ({"temperature": -1.0}, ValueError, "temperature"),
        ({"reduction": "max"}, ValueError, "reduction"),
    ],
)
def test_fused_linear_rejects_bad_arguments(kwargs: dict, error: type, needle: str) -> None:
    args = {"drafter_hidden": torch.zeros(4, 3), "lm_head_weight": torch.zeros(7, 3), "verifier_logits": GOOD_V}
    with pytest.raises(error, match=needle):
        sd.fused_linear_divergence_loss(**(args | kwargs))


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        sd.divergence(GOOD_V, GOOD_D, backend="triton")


def test_divergence_loss_without_checks_propagates_nan_instead_of_raising() -> None:
    """check_inputs=False skips every value check (the Triton path then never syncs with the host): non-finite
    weights or logits give a NaN loss, as in torch.nn.functional.cross_entropy, instead of a ValueError."""
    weights = torch.tensor([1.0, NAN, 1.0, 1.0])
    assert torch.isnan(sd.divergence_loss(GOOD_D, GOOD_V, weights, check_inputs=False))
    bad_v = GOOD_V.clone()
    bad_v[1, 3] = NAN
    assert torch.isnan(sd.divergence_loss(GOOD_D, bad_v, check_inputs=False))
    with pytest.raises(ValueError, match="weights"):
        sd.divergence_loss(GOOD_D, GOOD_V, weights)
