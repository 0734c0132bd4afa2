"""Triton divergence kernels against the float64 torch reference.

On the CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set here before anything launches a
kernel, and by ``conftest.py``); small shapes only. Large vocabularies (V = 151936) run on a GPU only.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import specdec.divergences as sd  # noqa: E402
from specdec.kernels import divergence as kdiv  # noqa: E402
from specdec.kernels.divergence_reference import divergence_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEG_INF = float("-inf")
# The interpreter evaluates masked-out lanes too (-inf - -inf in numpy): its RuntimeWarnings are not results.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="large vocabularies need a CUDA GPU")
# float32 inputs: fp32 arithmetic; bf16/fp16 inputs are exact in fp32 so the same bound holds against a float64
# reference computed on the *rounded* inputs; what differs by dtype is the magnitude of the logits we can use.
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-5, torch.float16: 2e-5}


def _logits(n: int, v: int, seed: int, scale: float = 3.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g) * scale
    x += torch.linspace(0, 4 * scale, v)  # rising maxima across tiles exercise the online rescaling
    return x.to(dtype).to(DEVICE)


def _hard_rows(v: torch.Tensor, d: torch.Tensor) -> None:
    """In place: both-side -inf entries, p > 0 where q = 0, p = q rows, a nearly one-hot row."""
    vocab = v.shape[1]
    v[0, : vocab // 3] = NEG_INF
    d[0, : vocab // 3] = NEG_INF
    d[1, 5] = NEG_INF
    v[2, 7] = NEG_INF
    d[3] = v[3]
    v[4] = d[4] + 11.0  # same distribution, shifted logits
    v[5, 3] = 200.0


def _check(out: sd.DivergenceOutput, ref: tuple, tol: float, mask: torch.Tensor | None = None) -> None:
    for got, want in zip((out.cross_entropy, out.kl, out.tv, out.alpha), ref[:4], strict=True):
        want = want.to(got.device)
        assert got.dtype == torch.float32
        assert not torch.isnan(got).any()
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        fin = torch.isfinite(want)
        torch.testing.assert_close(got[fin].double(), want[fin], rtol=tol, atol=tol)
    if mask is not None:
        assert bool((out.cross_entropy[~mask] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "vocab", "temperature"), [(47, 123, 1.0), (13, 700, 0.7), (7, 1030, 1.9)])
def test_forward_matches_float64_reference(dtype: torch.dtype, n: int, vocab: int, temperature: float) -> None:
    v, d = _logits(n, vocab, 1, dtype=dtype), _logits(n, vocab, 2, dtype=dtype)
    _hard_rows(v, d)
    out = sd.divergence(v, d, temperature, backend="triton")
    ref = divergence_reference(v.double(), d.double(), temperature)
    _check(out, ref, TOL[dtype])
    assert torch.isinf(out.cross_entropy[1]) and torch.isinf(out.kl[1])
    assert float(out.kl[3]) == 0.0 and float(out.tv[3]) == 0.0 and abs(float(out.alpha[3]) - 1.0) < 1e-6
    if dtype == torch.float32:  # the shift by 11 is inexact in bf16/fp16: then only the reference check applies
        assert abs(float(out.kl[4])) < 1e-5 and abs(float(out.tv[4])) < 1e-5 and abs(float(out.alpha[4]) - 1) < 1e-5


def test_per_task_sums_mask_and_grid_stride_loop() -> None:
    n, vocab, num_tasks = 47, 123, 4
    v, d = _logits(n, vocab, 3), _logits(n, vocab, 4)
    _hard_rows(v, d)
    g = torch.Generator().manual_seed(5)
    task_ids = torch.randint(-1, num_tasks, (n,), generator=g).to(DEVICE)
    mask = (torch.rand(n, generator=g) > 0.2).to(DEVICE)
    mask[1] = False  # the +inf row: keep the sums finite
    previous = kdiv.set_config(programs=5)  # 5 programs stride over 47 rows
    try:
        out = sd.divergence(v, d, 1.3, task_ids=task_ids, num_tasks=num_tasks, mask=mask, backend="triton")
    finally:
        kdiv.set_config(**previous)
    ref = divergence_reference(v.double(), d.double(), 1.3, mask=mask, task_ids=task_ids, num_tasks=num_tasks)
    _check(out, ref, 2e-5, mask)
    counted = mask & (task_ids >= 0)
    pt = out.per_task
    assert pt.cross_entropy_sum.dtype == torch.float64 and pt.count.dtype == torch.int64
    for task in range(num_tasks):
        sel = counted & (task_ids == task)
        assert int(pt.count[task]) == int(sel.sum())
        for name in ("cross_entropy", "kl", "tv", "alpha"):
            expected = getattr(out, name)[sel].double().sum()
            torch.testing.assert_close(getattr(pt, f"{name}_sum")[task], expected, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(pt.count, ref[4][4])


def test_backends_agree_through_the_public_api() -> None:
    v, d = _logits(9, 300, 6), _logits(9, 300, 7)
    task_ids = torch.tensor([0, 1, 1, 0, 2, 2, 2, 0, -1], device=DEVICE)
    a = sd.divergence(v, d, 0.9, task_ids=task_ids, backend="triton")
    b = sd.divergence(v, d, 0.9, task_ids=task_ids, backend="torch")
    for name in ("cross_entropy", "kl", "tv", "alpha"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(getattr(a.per_task, f"{name}_sum"), getattr(b.per_task, f"{name}_sum"),
                                   rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(("bad", "needle"), [("nan", "verifier_logits"), ("inf", "drafter_logits"),
                                             ("all_neg_inf", "drafter_logits")])
def test_kernel_flags_bad_rows(bad: str, needle: str) -> None:
    v, d = _logits(6, 50, 8), _logits(6, 50, 9)
    if bad == "nan":
        v[2, 3] = float("nan")
    elif bad == "inf":
        d[4, 1] = float("inf")
    else:
        d[5] = NEG_INF
    with pytest.raises(ValueError, match=needle):
        sd.divergence(v, d, backend="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_loss_gradient_matches_autograd_through_reference(dtype: torch.dtype, reduction: str) -> None:
    n, vocab, temperature = 21, 300, 0.8
    v, d0 = _logits(n, vocab, 10, dtype=dtype), _logits(n, vocab, 11, dtype=dtype)
    v[0, :50] = NEG_INF
    d0[0, :50] = NEG_INF
    weights = torch.rand(n, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    mask = torch.ones(n, dtype=torch.bool, device=DEVICE)
    mask[[3, 4]] = False
    d = d0.clone().requires_grad_()
    loss = sd.divergence_loss(d, v, weights, temperature, reduction, "triton", mask=mask)
    (2.5 * loss).backward()
    d64 = d0.double().requires_grad_()
    ref = sd.divergence_loss(d64, v.double(), weights.double(), temperature, reduction, "torch", mask=mask)
    (2.5 * ref).backward()
    assert loss.dtype == torch.float32 and d.grad.dtype == dtype
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    gtol = 1e-6 if dtype == torch.float32 else 8e-3 * float(d64.grad.abs().max())
    torch.testing.assert_close(d.grad.double(), d64.grad, rtol=0.0 if dtype != torch.float32 else 1e-4, atol=gtol)
    assert bool((d.grad[[3, 4]] == 0).all())


def test_loss_without_grad_and_default_weights() -> None:
    v, d = _logits(7, 130, 13), _logits(7, 130, 14)
    loss = sd.divergence_loss(d, v, backend="triton", reduction="mean")
    ref = divergence_reference(v.double(), d.double(), 1.0)[0].mean()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_gradients_match_autograd(dtype: torch.dtype) -> None:
    n, hidden, vocab = 29, 24, 200
    g = torch.Generator().manual_seed(15)
    h0 = torch.randn(n, hidden, generator=g).to(dtype).to(DEVICE)
    w0 = (torch.randn(vocab, hidden, generator=g) * 0.5).to(dtype).to(DEVICE)
    verifier = _logits(n, vocab, 16, dtype=dtype)
    weights = torch.rand(n, generator=g).to(DEVICE)
    mask = torch.ones(n, dtype=torch.bool, device=DEVICE)
    mask[7] = False
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    loss = sd.fused_linear_divergence_loss(h, w, verifier, weights, 1.2, "mean", "triton", mask=mask, chunk_size=8)
    (3.0 * loss).backward()
    h64, w64 = h0.double().requires_grad_(), w0.double().requires_grad_()
    ref = sd.fused_linear_divergence_loss(h64, w64, verifier.double(), weights.double(), 1.2, "mean", "torch",
                                         mask=mask)
    (3.0 * ref).backward()
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    # bf16: the chunk logits themselves are rounded to bf16 before the kernel, as in eager bf16 training
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(loss.double(), ref, rtol=tol, atol=tol)
    for got, want in ((h.grad, h64.grad), (w.grad, w64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=tol * float(want.abs().max()) + 1e-7)
    assert bool((h.grad[7] == 0).all())


# ------------------------------------------------------------------------------------------------ GPU-only shapes
@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_large_vocabulary_forward(dtype: torch.dtype) -> None:
    n, vocab = 64, 151936
    v, d = _logits(n, vocab, 20, scale=2.0, dtype=dtype), _logits(n, vocab, 21, scale=2.0, dtype=dtype)
    _hard_rows(v, d)
    task_ids = torch.arange(n, device=DEVICE) % 3
    out = sd.divergence(v, d, 0.9, task_ids=task_ids, num_tasks=3)
    ref = divergence_reference(v.double(), d.double(), 0.9, task_ids=task_ids, num_tasks=3)
    _check(out, ref, 1e-4)
    finite = torch.isfinite(ref[4][0])
    torch.testing.assert_close(out.per_task.tv_sum, ref[4][2], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out.per_task.cross_entropy_sum[finite], ref[4][0][finite], rtol=1e-5, atol=1e-3)


@gpu_only
def test_large_vocabulary_persistent_grid_and_loss() -> None:
    n, vocab = 300, 151936
    v, d0 = _logits(n, vocab, 22, dtype=torch.bfloat16), _logits(n, vocab, 23, dtype=torch.bfloat16)
    previous = kdiv.set_config(programs_per_sm=1)
    try:
        out = sd.divergence(v, d0)
        d = d0.clone().requires_grad_()
        sd.divergence_loss(d, v, reduction="mean").backward()
    finally:
        kdiv.set_config(**previous)
    ref = divergence_reference(v.double(), d0.double(), 1.0)
    _check(out, ref, 1e-4)
    p = torch.softmax(v.double(), -1)
    q = torch.softmax(d0.double(), -1)
    torch.testing.assert_close(d.grad.double(), (q - p) / n, rtol=0, atol=1e-2 * float(((q - p) / n).abs().max()))
