"""Triton divergence kernels against the float64 torch reference.

On the CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set here before anything launches a
kernel, and by ``conftest.py``); small shapes only. Large vocabularies (V = 151936) run on a GPU only.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import specdec.fairness.divergences as sd  # noqa: E402
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


def _plan(v: torch.Tensor, loss: bool = False, **changes) -> kdiv.DivergencePlan:
    """The automatic plan of ``v``'s shape, dtype and device, with ``changes``."""
    return replace(kdiv.divergence_plan(v.shape[0], v.shape[1], v.dtype, v.device, loss=loss), **changes)


def _output(launched: tuple) -> sd.DivergenceOutput:
    """``launch_divergence``'s tuple as the public result."""
    ce, kl, tv, alpha, _, sums = launched
    return sd.DivergenceOutput(ce, kl, tv, alpha, sd.PerTaskDivergence(*sums) if sums is not None else None)


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
    out = _output(kdiv.launch_divergence(v, d, 1.3, task_ids=task_ids, num_tasks=num_tasks, mask=mask,
                                         plan=_plan(v, programs=5)))  # 5 programs stride over 47 rows
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


@pytest.mark.parametrize(("n", "vocab", "programs"), [(13, 700, None), (9, 1030, 4)])
def test_forward_and_gradient_hard_rows_grid_stride(n: int, vocab: int, programs: int | None) -> None:
    """Forward and loss gradient against float64 on the hard rows, one program per row and a grid-stride loop
    (4 programs over 9 rows); several tiles a row under the interpreter (tile 256) with a last partial tile."""
    v, d0 = _logits(n, vocab, 31), _logits(n, vocab, 32)
    _hard_rows(v, d0)
    d0[1, 5] = 0.0  # keep every cross-entropy finite for the gradient check
    out = _output(kdiv.launch_divergence(v, d0, 0.8, plan=_plan(v, programs=programs or n)))
    d = d0.clone().requires_grad_()
    loss_plan = _plan(v, loss=True, programs=programs or n)
    kdiv.divergence_loss_triton(d, v, None, None, 0.8, "sum", plan=loss_plan).backward()
    _check(out, divergence_reference(v.double(), d0.double(), 0.8), 2e-5)
    d64 = d0.double().requires_grad_()
    divergence_reference(v.double(), d64, 0.8)[0].sum().backward()
    # (q - p) / T from fp32 exponentials of arguments up to ~50 (log2 units): ~1e-5 of p <= 1 on a GPU
    torch.testing.assert_close(d.grad.double(), d64.grad, rtol=1e-4, atol=1e-5)


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


# ------------------------------------------------------------------------------- small tiles, few programs
def test_mask_with_small_tiles_and_few_programs() -> None:
    n, vocab = 10, 250
    v, d = _logits(n, vocab, 34), _logits(n, vocab, 35)
    mask = torch.tensor([True, False, True, True, False, True, True, True, False, True], device=DEVICE)
    out = _output(kdiv.launch_divergence(v, d, 1.1, mask=mask, plan=_plan(v, block=32, programs=3)))
    ref = divergence_reference(v.double(), d.double(), 1.1, mask=mask)
    _check(out, ref, 2e-5, mask)
    for name in ("kl", "tv", "alpha"):
        assert bool((getattr(out, name)[~mask] == 0).all())


@pytest.mark.parametrize("block", [32, 64])
def test_loss_gradient_with_small_tiles_and_in_place(block: int) -> None:
    n, vocab, temperature = 9, 230, 1.3
    v, d0 = _logits(n, vocab, 36, dtype=torch.bfloat16), _logits(n, vocab, 37, dtype=torch.bfloat16)
    v[0, :100] = NEG_INF
    d0[0, :100] = NEG_INF
    weights = torch.rand(n, generator=torch.Generator().manual_seed(38)).to(DEVICE)
    mask = torch.ones(n, dtype=torch.bool, device=DEVICE)
    mask[5] = False
    plan = _plan(v, loss=True, block=block, programs=4)
    d = d0.clone().requires_grad_()
    loss = kdiv.divergence_loss_triton(d, v, weights, mask, temperature, "sum", plan=plan)
    loss.backward()
    d64 = d0.double().requires_grad_()
    ref = sd.divergence_loss(d64, v.double(), weights.double(), temperature, "sum", "torch", mask=mask)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d.grad.double(), d64.grad, rtol=0, atol=8e-3 * float(d64.grad.abs().max()))
    assert bool((d.grad[5] == 0).all())
    # in place (as the fused-linear path runs it): the gradient overwrites the drafter logits row by row
    inplace = d0.clone()
    ce = kdiv.launch_divergence(v, inplace, temperature, compute_tv=False, grad_out=inplace,
                                weights=weights.float(), grad_scale=1.0, plan=plan)[0]
    torch.testing.assert_close(ce.double(), divergence_reference(v.double(), d0.double(), temperature)[0],
                               rtol=2e-5, atol=2e-5)
    fresh = torch.empty_like(d0)
    kdiv.launch_divergence(v, d0, temperature, compute_tv=False, grad_out=fresh, weights=weights.float(), plan=plan)
    assert torch.equal(inplace, fresh)


def test_divergence_plan_rule_and_fields() -> None:
    from specdec.kernels._device import DeviceFacts

    h100 = DeviceFacts(sm_count=132, major=9, name="NVIDIA H100 80GB HBM3", interpreter=False)
    h200 = replace(h100, name="NVIDIA H200")
    bf16 = torch.bfloat16
    # the cluster kernels: Hopper, 16-bit logits, from V = 32000 (the smallest measured)
    assert kdiv.divergence_plan(4096, 151936, bf16, h100, loss=False).cluster
    assert kdiv.divergence_plan(4096, 32000, torch.float16, h100, loss=True).cluster
    assert not kdiv.divergence_plan(4096, 31999, bf16, h100, loss=True).cluster
    assert not kdiv.divergence_plan(4096, 151936, torch.float32, h100, loss=True).cluster
    assert not kdiv.divergence_plan(4096, 151936, bf16, replace(h100, major=8), loss=True).cluster
    assert not kdiv.divergence_plan(4096, 151936, bf16, replace(h100, interpreter=True), loss=True).cluster
    # the row kernel's tile: 2048 columns / 4 warps (H100; H200 loss up to V = 65536); H200 small programs by rows
    # per SM, pass 2 pipelined over 3 stages
    def tile(n_rows, vocab, facts, loss=False):
        plan = kdiv.divergence_plan(n_rows, vocab, torch.float32, facts, loss=loss)
        return plan.block, plan.num_warps, plan.stages2
    assert tile(16384, 151936, h100) == (2048, 4, 1) and tile(16384, 32000, h200, loss=True) == (2048, 4, 1)
    assert tile(16 * 132, 151936, h200) == (512, 1, 3) and tile(4 * 132, 151936, h200) == (1024, 2, 3)
    assert tile(100, 151936, h200) == (2048, 4, 3)
    assert tile(100, 300, h100) == (512, 2, 1)  # no wider than the row
    assert kdiv.divergence_plan(7, 300, torch.float32, h100, loss=False).programs == 7  # one program per row
    plan = kdiv.divergence_plan(7, 300, torch.float32, h100, loss=False)
    for field, value in (("block", 48), ("num_warps", 0), ("stages2", 0), ("programs", 0), ("cluster", 1)):
        with pytest.raises(ValueError, match=field):
            replace(plan, **{field: value})


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
    # the row kernel with one program per SM (on Hopper the cluster kernels would take these calls; they have
    # tests/test_divergence_cluster.py)
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    out = _output(kdiv.launch_divergence(v, d0, 1.0, plan=_plan(v, cluster=False, programs=sms)))
    d = d0.clone().requires_grad_()
    kdiv.divergence_loss_triton(d, v, None, None, 1.0, "mean",
                                plan=_plan(v, loss=True, cluster=False, programs=sms)).backward()
    ref = divergence_reference(v.double(), d0.double(), 1.0)
    _check(out, ref, 1e-4)
    p = torch.softmax(v.double(), -1)
    q = torch.softmax(d0.double(), -1)
    torch.testing.assert_close(d.grad.double(), (q - p) / n, rtol=0, atol=1e-2 * float(((q - p) / n).abs().max()))


def test_strided_task_ids_mask_and_weights() -> None:
    """Side inputs that are views with a stride (a column of a [N, 2] tensor) give the same sums and loss as their
    contiguous copies: the kernel indexes them with unit stride."""
    n, vocab, num_tasks = 12, 50, 3
    v, d = _logits(n, vocab, 41), _logits(n, vocab, 42)
    g = torch.Generator().manual_seed(43)
    task_pairs = torch.randint(0, num_tasks, (n, 2), generator=g).to(DEVICE)
    mask_pairs = (torch.rand(n, 2, generator=g) > 0.3).to(DEVICE)
    weight_pairs = torch.rand(n, 2, generator=g).to(DEVICE)
    task_ids, mask, weights = task_pairs[:, 0], mask_pairs[:, 0], weight_pairs[:, 0]
    assert task_ids.stride(0) == 2
    got = sd.divergence(v, d, task_ids=task_ids, num_tasks=num_tasks, mask=mask, backend="triton").per_task
    want = sd.divergence(v, d, task_ids=task_ids.contiguous(), num_tasks=num_tasks, mask=mask.contiguous(),
                         backend="triton").per_task
    ref = sd.divergence(v, d, task_ids=task_ids, num_tasks=num_tasks, mask=mask, backend="torch").per_task
    assert torch.equal(got.count, want.count) and torch.equal(got.count, ref.count)
    torch.testing.assert_close(got.cross_entropy_sum, ref.cross_entropy_sum, rtol=1e-5, atol=1e-5)
    loss = sd.divergence_loss(d, v, weights, mask=mask, backend="triton")
    loss_ref = sd.divergence_loss(d.double(), v.double(), weights.double(), mask=mask, backend="torch")
    torch.testing.assert_close(loss.double(), loss_ref, rtol=1e-5, atol=1e-5)


def test_loss_refuses_bad_rows_on_the_triton_path() -> None:
    v, d = _logits(6, 40, 44), _logits(6, 40, 45)
    v[2, 3] = float("nan")
    with pytest.raises(ValueError, match="verifier_logits"):
        sd.divergence_loss(d, v, backend="triton")
    mask = torch.ones(6, dtype=torch.bool, device=DEVICE)
    mask[2] = False
    assert torch.isfinite(sd.divergence_loss(d, v, mask=mask, backend="triton"))  # the bad row is not counted


def test_fused_linear_refuses_bad_rows() -> None:
    g = torch.Generator().manual_seed(46)
    hidden = torch.randn(5, 8, generator=g).to(DEVICE)
    weight = torch.randn(30, 8, generator=g).to(DEVICE)
    v = _logits(5, 30, 47)
    bad_hidden = hidden.clone()
    bad_hidden[3, 0] = float("nan")
    for backend in ("triton", "torch"):
        with pytest.raises(ValueError, match="drafter_logits"):
            sd.fused_linear_divergence_loss(bad_hidden, weight, v, backend=backend, chunk_size=2)
        bad_v = v.clone()
        bad_v[1, 4] = float("inf")
        with pytest.raises(ValueError, match="verifier_logits"):
            sd.fused_linear_divergence_loss(hidden, weight, bad_v, backend=backend, chunk_size=2)
        mask = torch.ones(5, dtype=torch.bool, device=DEVICE)
        mask[3] = False
        assert torch.isfinite(sd.fused_linear_divergence_loss(bad_hidden, weight, v, mask=mask, backend=backend))


def test_one_backward_per_graph_on_the_triton_path() -> None:
    """The stored gradient is scaled in place and handed out by the first backward; a second backward through the
    same graph must refuse (it would change the gradient already handed out), not return something wrong."""
    v, d0 = _logits(9, 300, 48), _logits(9, 300, 49)
    d = d0.clone().requires_grad_()
    loss = sd.divergence_loss(d, v, temperature=0.9, reduction="mean", backend="triton")
    (first,) = torch.autograd.grad(2.5 * loss, d, retain_graph=True)
    kept = first.clone()
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()
    d64 = d0.double().requires_grad_()
    divergence_reference(v.double(), d64, 0.9)[0].mean().backward()
    torch.testing.assert_close(first.double(), 2.5 * d64.grad, rtol=1e-4, atol=1e-6)
    assert torch.equal(first, kept)
    g = torch.Generator().manual_seed(56)
    hidden = torch.randn(5, 8, generator=g).to(DEVICE).requires_grad_()
    weight = torch.randn(30, 8, generator=g).to(DEVICE).requires_grad_()
    fused = sd.fused_linear_divergence_loss(hidden, weight, _logits(5, 30, 57), backend="triton", chunk_size=2)
    fused.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        fused.backward()


def test_mean_over_an_all_false_mask_is_zero() -> None:
    v, d0 = _logits(5, 130, 50), _logits(5, 130, 51)
    d = d0.clone().requires_grad_()
    mask = torch.zeros(5, dtype=torch.bool, device=DEVICE)
    loss = sd.divergence_loss(d, v, reduction="mean", backend="triton", mask=mask)
    loss.backward()
    assert float(loss.detach()) == 0.0 and bool((d.grad == 0).all())


@pytest.mark.parametrize("bad_column", [10, 640])
def test_support_mismatch_with_an_underflowing_weight_is_inf(bad_column: int) -> None:
    """p > 0 where q = 0 at an entry whose weight 2^(x - max) underflows to 0 in float32 (x = 0 against a maximum of
    300 at column 650): cross-entropy and KL are +inf as in float64, never NaN. Under the interpreter's 256-column
    tiles column 10 is two tiles before the maximum (the running sums are rescaled by 0) and column 640 in its tile."""
    v, d = _logits(3, 700, 52), _logits(3, 700, 53)
    v[1] = 0.0
    v[1, 650] = 300.0
    d[1, bad_column] = NEG_INF
    out = sd.divergence(v, d, check_inputs=False, backend="triton")
    ref = divergence_reference(v.double(), d.double(), 1.0)
    assert torch.isinf(ref[0][1]) and torch.isinf(ref[1][1])
    _check(out, ref, 2e-5)
    loss = sd.divergence_loss(d, v, check_inputs=False, backend="triton", mask=torch.arange(3, device=DEVICE) == 1)
    assert torch.isinf(loss) and loss > 0


def test_unchecked_nan_logits_give_a_nan_loss() -> None:
    v, d = _logits(4, 300, 54), _logits(4, 300, 55)
    v[2, 7] = float("nan")
    assert torch.isnan(sd.divergence_loss(d, v, check_inputs=False, backend="triton"))
    assert torch.isnan(sd.divergence_loss(d, v, check_inputs=False, backend="torch"))


@pytest.mark.parametrize("n,vocab", [(6, 300), pytest.param(64, 32000, marks=gpu_only)],
                         ids=["row_kernel", "cluster_kernel_gpu"])
def test_fp16_loss_gradient_survives_a_loss_scale(n: int, vocab: int) -> None:
    # A GradScaler multiplies the loss by 2**16 so that small fp16 gradient entries (here w (q - p) / N, w = 1/4096)
    # survive: the Triton path must apply that factor before rounding to fp16, as autograd does on the torch path.
    v = _logits(n, vocab, 40, scale=1.0, dtype=torch.float16)
    d0 = _logits(n, vocab, 41, scale=1.0, dtype=torch.float16)
    weights = torch.full((n,), 1 / 4096, device=DEVICE)
    d = d0.clone().requires_grad_()
    (sd.divergence_loss(d, v, weights=weights, reduction="mean", backend="triton", check_inputs=False)
     * 65536.0).backward()
    d64 = d0.double().requires_grad_()
    ref = -(torch.softmax(v.double(), -1) * torch.log_softmax(d64, -1)).sum(-1)
    ((ref * weights.double()).sum() / n * 65536.0).backward()
    assert d.grad.dtype == torch.float16
    want = d64.grad
    significant = want.abs() > 1e-3
    assert bool(significant.any()) and not bool((d.grad[significant] == 0).any())
    torch.testing.assert_close(d.grad.double(), want, rtol=0, atol=2e-3 * float(want.abs().max()))
