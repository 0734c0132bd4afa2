"""The cluster kernels (``kernels/divergence_cluster.py``): the forward (H, KL, TV, alpha, per-task sums) and the loss
(H(p, q) and its drafter gradient) with each row split over a Hopper thread-block cluster. The layout and the
eligibility rule run everywhere; the kernels need an sm_90 GPU. A call is forced onto the cluster kernels or the row
kernel through ``launch_divergence``'s ``plan``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import specdec.fairness.divergences as sd
from specdec.kernels import divergence as kdiv
from specdec.kernels import divergence_cluster as kc
from specdec.kernels import divergence_cluster_launch as kcl
from specdec.kernels.divergence_reference import divergence_reference
from specdec.kernels.fused_linear_divergence import fused_linear_divergence_loss_triton

NEG_INF = float("-inf")
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
hopper_only = pytest.mark.skipif(not HOPPER, reason="the cluster kernels run on Hopper GPUs (sm_90) only")


@pytest.mark.parametrize("elem_bytes", [2, 4])
@pytest.mark.parametrize("vocab", [16, 1024, 32000, 65536, 128256, 151936, 262144])
def test_layout_covers_the_row_and_fits_shared_memory(vocab: int, elem_bytes: int) -> None:
    layout = kc.cluster_layout(vocab, elem_bytes)
    if layout is None:  # nothing fits: even the largest cluster's chunk is too big
        chunk = _cdiv(_cdiv(vocab, max(kc.CLUSTER_SIZES)), 16) * 16
        assert 2 * _cdiv(chunk, kc.TILE) * kc.TILE * elem_bytes > kc.SMEM_PER_CTA
        return
    c, chunk_cols, nt, n_full = layout
    assert c in kc.CLUSTER_SIZES
    assert chunk_cols % 16 == 0 and c * chunk_cols >= vocab and chunk_cols < _cdiv(vocab, c) + 16
    assert nt * kc.TILE >= chunk_cols > (nt - 1) * kc.TILE
    assert 2 * nt * kc.TILE * elem_bytes <= kc.SMEM_PER_CTA
    # tiles before n_full are whole in every CTA's chunk (they are read unmasked); the next one is not in some CTA
    lengths = [max(0, min(chunk_cols, vocab - rank * chunk_cols)) for rank in range(c)]
    assert all(n_full * kc.TILE <= length for length in lengths)
    assert n_full == nt or any((n_full + 1) * kc.TILE > length for length in lengths)
    for smaller in (s for s in kc.CLUSTER_SIZES if s < c):  # the smallest cluster that fits is chosen
        chunk = _cdiv(_cdiv(vocab, smaller), 16) * 16
        assert 2 * _cdiv(chunk, kc.TILE) * kc.TILE * elem_bytes > kc.SMEM_PER_CTA


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_rule_takes_only_aligned_16_bit_shapes_that_fit() -> None:
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert kcl.cluster_supported(bf16, bf16, 151936, True)
    assert kcl.cluster_supported(fp16, fp16, 128256, True)
    assert kcl.cluster_supported(bf16, bf16, 16, True)
    assert not kcl.cluster_supported(fp32, fp32, 151936, True)  # two fp32 rows do not fit two CTAs/SM
    assert not kcl.cluster_supported(bf16, fp16, 151936, True)  # one shared-memory dtype
    assert not kcl.cluster_supported(bf16, bf16, 151944 - 4, True)  # V % 16 != 0
    assert not kcl.cluster_supported(bf16, bf16, 151936, False)  # rows not 16-element aligned
    assert not kcl.cluster_supported(bf16, bf16, 1 << 20, True)  # no cluster's chunk fits


def test_not_eligible_off_the_gpu() -> None:
    v = torch.zeros(2, 65536, dtype=torch.bfloat16)
    assert not kcl.cluster_eligible(v, v, v)
    assert not kcl.cluster_eligible(v, v, None)


def _plan(v: torch.Tensor, cluster: bool, loss: bool = False) -> kdiv.DivergencePlan:
    """The automatic plan of ``v``'s shape with the cluster kernels forced on or off."""
    return replace(kdiv.divergence_plan(v.shape[0], v.shape[1], v.dtype, v.device, loss=loss), cluster=cluster)


def _logits(n: int, v: int, seed: int, dtype: torch.dtype, scale: float = 3.0, rolled: bool = False) -> torch.Tensor:
    """Gaussian logits on a rising trend (maxima that grow across tiles exercise the online rescaling). The trend
    puts most of p in the last chunks of a row; ``rolled`` starts it at a random column in each row, so that over
    many rows every CTA's chunk carries the mass somewhere."""
    g = torch.Generator().manual_seed(seed)
    trend = torch.linspace(0, 4 * scale, v)
    if rolled:
        start = torch.randint(0, v, (n, 1), generator=g, dtype=torch.int32)
        trend = trend[(torch.arange(v, dtype=torch.int32) + start) % v]
    x = torch.randn(n, v, generator=g) * scale + trend
    return x.to(dtype).cuda()


def _clusters(kind: str) -> int:
    """Clusters the launcher uses for ``kind`` ("loss" / "forward"), once a call has compiled it."""
    return max(fit for key, (_, fit, _) in kcl._COMPILED.items() if key[0] == kind)


def _edge_mask(n: int, clusters: int, masked_fraction: float, seed: int) -> torch.Tensor:
    """A row mask (uint8 on the GPU) where every cluster's first row is masked, cluster 0 has no row at all, cluster 1
    loses its last rows after kept ones, and a random ``masked_fraction`` of the others is masked."""
    rows = torch.arange(n)
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(n, generator=g) >= masked_fraction
    keep &= rows >= clusters
    keep &= rows % clusters != 0
    keep &= ~((rows % clusters == 1) & (rows >= n - 3 * clusters))
    return keep.to(torch.uint8).cuda()


def _hard_rows(v: torch.Tensor, d: torch.Tensor) -> None:
    """In place: -inf on both sides of a third of row 0, p = q in row 3, shifted logits in row 4, a near one-hot
    row 5 (finite H(p, q) everywhere)."""
    vocab = v.shape[1]
    v[0, : vocab // 3] = NEG_INF
    d[0, : vocab // 3] = NEG_INF
    d[3] = v[3]
    v[4] = d[4] + 11.0
    v[5, 3] = 200.0


@pytest.fixture
def cluster_on():
    """The cluster path on (a failure turns it off for the process), and on again afterwards."""
    kcl._STATE["broken"] = False
    yield
    kcl._STATE["broken"] = False


@hopper_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [65536, 151936])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_cluster_loss_matches_autograd_through_reference(cluster_on, dtype, vocab: int, reduction: str) -> None:
    n, temperature = 37, 0.8
    v, d0 = _logits(n, vocab, 1, dtype), _logits(n, vocab, 2, dtype)
    _hard_rows(v, d0)
    weights = torch.rand(n, generator=torch.Generator().manual_seed(3)).cuda()
    mask = torch.ones(n, dtype=torch.bool, device="cuda")
    mask[[6, 30]] = False
    launches = kcl._STATE["launches"]
    d = d0.clone().requires_grad_()
    loss = sd.divergence_loss(d, v, weights, temperature, reduction, "triton", mask=mask)
    (2.5 * loss).backward()
    assert kcl._STATE["launches"] == launches + 1, "the cluster kernel did not run"
    d64 = d0.double().requires_grad_()
    ref = sd.divergence_loss(d64, v.double(), weights.double(), temperature, reduction, "torch", mask=mask)
    (2.5 * ref).backward()
    assert loss.dtype == torch.float32 and d.grad.dtype == dtype
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d.grad.double(), d64.grad, rtol=0.0, atol=8e-3 * float(d64.grad.abs().max()))
    assert bool((d.grad[[6, 30]] == 0).all())


@hopper_only
@pytest.mark.parametrize("masked_fraction", [0.0, 0.3])
def test_cluster_matches_the_row_kernel_over_many_rows(cluster_on, masked_fraction: float) -> None:
    """More rows than clusters (every cluster walks several rows, masked rows skipped), in place and not: the
    cluster kernel's H(p, q), status and gradient against the one-program-per-row kernel's."""
    n, vocab = 1000, 131072
    v, d = _logits(n, vocab, 4, torch.bfloat16, rolled=True), _logits(n, vocab, 5, torch.bfloat16, rolled=True)
    _hard_rows(v, d)
    d[7, 11] = NEG_INF  # p > 0 where q = 0: H(p, q) = +inf
    d[8, 12] = float("nan")  # a bad drafter row: status bit 1
    kdiv.launch_divergence(v, d, 0.9, mask=torch.ones(n, dtype=torch.uint8, device="cuda"), compute_tv=False,
                           grad_out=torch.empty_like(d), weights=torch.ones(n, device="cuda"),
                           grad_count=torch.ones(1, device="cuda"))
    mask = _edge_mask(n, _clusters("loss"), masked_fraction, 6)
    mask[[7, 8]] = 1
    weights = torch.rand(n, generator=torch.Generator().manual_seed(6)).cuda()
    count = mask.sum(dtype=torch.float32).reshape(1)
    outs = {}
    for cluster in (0, 1):
        plan = _plan(v, bool(cluster), loss=True)
        launches = kcl._STATE["launches"]
        grad = torch.empty_like(d)
        ce, _, _, _, status, _ = kdiv.launch_divergence(v, d, 0.9, mask=mask, compute_tv=False, grad_out=grad,
                                                        weights=weights, grad_scale=0.5, grad_count=count, plan=plan)
        in_place = d.clone()
        ce2, *_ = kdiv.launch_divergence(v, in_place, 0.9, mask=mask, compute_tv=False, grad_out=in_place,
                                         weights=weights, grad_scale=0.5, grad_count=count, plan=plan)
        assert kcl._STATE["launches"] == launches + 2 * cluster
        torch.testing.assert_close(ce2, ce, rtol=0, atol=0, equal_nan=True)  # row 8 is NaN
        torch.testing.assert_close(in_place, grad, rtol=0, atol=0, equal_nan=True)
        outs[cluster] = (ce, status, grad)
    (ce0, st0, g0), (ce1, st1, g1) = outs[0], outs[1]
    assert torch.equal(st0, st1) and int(st1[8]) == 2 and int(st1[7]) == 0
    assert torch.equal(torch.isinf(ce0), torch.isinf(ce1)) and bool(torch.isinf(ce1[7]))
    fin = torch.isfinite(ce0)
    torch.testing.assert_close(ce1[fin], ce0[fin], rtol=1e-5, atol=1e-5)
    keep = (mask != 0) & fin
    keep[8] = False
    # entry by entry (a stale or wrong-row tile anywhere would show): bf16 outputs of the same fp32 values up to
    # the last bits of lp / lq, so a few entries differ by one bf16 ulp (< 0.8%), near-cancelling ones by ~1e-7 p
    torch.testing.assert_close(g1[keep].float(), g0[keep].float(), rtol=1e-2,
                               atol=1e-4 * float(g0[keep].float().abs().max()))
    off = mask == 0
    assert bool((g1[off] == 0).all()) and bool((ce1[off] == 0).all()) and bool((st1[off] == 0).all())


@hopper_only
def test_fused_linear_loss_through_the_cluster_kernel(cluster_on) -> None:
    """The fused linear loss hands each chunk's bf16 logits to the cluster kernel, which overwrites them in place
    with their gradient: hidden and weight gradients against autograd through the float64 reference."""
    n, hidden, vocab = 70, 64, 65536
    g = torch.Generator().manual_seed(7)
    h0 = torch.randn(n, hidden, generator=g).to(torch.bfloat16).cuda()
    w0 = (torch.randn(vocab, hidden, generator=g) * 0.3).to(torch.bfloat16).cuda()
    verifier = _logits(n, vocab, 8, torch.bfloat16, scale=1.0)
    weights = torch.rand(n, generator=g).cuda()
    mask = torch.ones(n, dtype=torch.bool, device="cuda")
    mask[9] = False
    grads = {}
    for cluster in (1, 0):
        plan = replace(kdiv.divergence_plan(32, vocab, torch.bfloat16, verifier.device, loss=True),
                       cluster=bool(cluster))
        launches = kcl._STATE["launches"]
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = fused_linear_divergence_loss_triton(h, w, verifier, weights, mask, 1.1, "mean", chunk_size=32,
                                                   plan=plan)
        (3.0 * loss).backward()
        assert kcl._STATE["launches"] == launches + 3 * cluster  # chunks of 32, 32 and 6 rows
        grads[cluster] = (loss.detach(), h.grad, w.grad)
    h64, w64 = h0.double().requires_grad_(), w0.double().requires_grad_()
    ref = sd.fused_linear_divergence_loss(h64, w64, verifier.double(), weights.double(), 1.1, "mean", "torch",
                                         mask=mask)
    (3.0 * ref).backward()
    loss, h_grad, w_grad = grads[1]
    # the chunk logits and their gradient are bf16, as in eager bf16 training; the weight gradient sums 70 such rows:
    # both paths measured 2.6% of its largest entry at this shape on an H100, the hidden gradient 0.5%
    torch.testing.assert_close(loss.double(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(h_grad.double(), h64.grad, rtol=0, atol=2e-2 * float(h64.grad.abs().max()))
    torch.testing.assert_close(w_grad.double(), w64.grad, rtol=0, atol=5e-2 * float(w64.grad.abs().max()))
    assert bool((h_grad[9] == 0).all())
    for got, want in zip(grads[1], grads[0], strict=True):  # the row kernel's path: the same bf16 gradients
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=1e-2 * float(want.float().abs().max()))


@hopper_only
@pytest.mark.parametrize("vocab", [16, 1024, 32000])
def test_side_input_dtypes_small_vocabularies_and_bad_verifier_rows(cluster_on, vocab: int) -> None:
    """Masks as bool / int32 / uint8 and weights as float64 / float16 / float32 give the same result (the kernel is
    compiled once per key and always gets uint8 / float32); vocabularies down to 16 columns (V = 16: one CTA of the
    pair has an empty chunk) match the row kernel; a NaN verifier row sets status bit 0."""
    n = 40
    v, d = _logits(n, vocab, 9, torch.bfloat16), _logits(n, vocab, 10, torch.bfloat16)
    v[4, 0] = float("nan")
    g = torch.Generator().manual_seed(11)
    keep = torch.rand(n, generator=g) >= 0.25
    keep[4] = True
    weights = torch.rand(n, generator=g)
    results = []
    for mask, w in ((keep.to(torch.uint8), weights.float()), (keep, weights.double()),
                    (keep.to(torch.int32), weights.half().float()), (keep.to(torch.int32), weights.half())):
        launches = kcl._STATE["launches"]
        grad = torch.empty_like(d)
        ce, _, _, _, status, _ = kdiv.launch_divergence(v, d, 1.3, mask=mask.cuda(), compute_tv=False,
                                                        grad_out=grad, weights=w.cuda(), grad_scale=0.25,
                                                        plan=_plan(v, True, loss=True))
        assert kcl._STATE["launches"] == launches + 1
        results.append((ce, status, grad))
    # a bool mask and float64 weights (rounded to float32 on the way in) against uint8 / float32
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(results[1][2], results[0][2], rtol=0, atol=0, equal_nan=True)
    # float16 weights, passed as float16 or already widened to float32: the same
    torch.testing.assert_close(results[3][2], results[2][2], rtol=0, atol=0, equal_nan=True)
    assert int(results[0][1][4]) == 1 and torch.isnan(results[0][0][4])
    grad_row = torch.empty_like(d)
    ce_row, _, _, _, status_row, _ = kdiv.launch_divergence(v, d, 1.3, mask=keep.to(torch.uint8).cuda(),
                                                            compute_tv=False, grad_out=grad_row,
                                                            weights=weights.cuda(), grad_scale=0.25,
                                                            plan=_plan(v, False, loss=True))
    ce, status, grad = results[0]
    assert torch.equal(status, status_row)
    ok = torch.isfinite(ce_row)
    torch.testing.assert_close(ce[ok], ce_row[ok], rtol=1e-5, atol=1e-5)
    rows = ok & keep.cuda()
    torch.testing.assert_close(grad[rows].float(), grad_row[rows].float(), rtol=0,
                               atol=8e-3 * float(grad_row[rows].float().abs().max()))
    assert bool((grad[~keep.cuda()] == 0).all())


def _forward_check(out: tuple, ref: tuple, tol: float) -> None:
    for got, want in zip(out[:4], ref[:4], strict=True):
        want = want.to(got.device)
        assert got.dtype == torch.float32 and not torch.isnan(got).any()
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        fin = torch.isfinite(want)
        torch.testing.assert_close(got[fin].double(), want[fin], rtol=tol, atol=tol)


@hopper_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("vocab", "temperature"), [(16, 1.0), (1040, 0.7), (32000, 1.3), (151936, 1.0)])
def test_cluster_forward_matches_float64_reference(cluster_on, dtype, vocab: int, temperature: float) -> None:
    """H, KL, TV, alpha and per-task sums against float64 on hard rows: -inf on both sides of a third of a row,
    p > 0 where q = 0 (+inf), x = -inf alone (the kernel's safe pass), p = q, shifted logits, a near one-hot row,
    masked rows; vocabularies from one tile (V = 16: one CTA of the pair has an empty chunk) to 151936."""
    n, num_tasks = 37, 3
    v, d = _logits(n, vocab, 21, dtype), _logits(n, vocab, 22, dtype)
    _hard_rows(v, d)
    d[1, 5] = NEG_INF  # p > 0 where q = 0
    v[2, 7] = NEG_INF  # x = -inf where y is finite
    v[6, 9], d[6, 9] = -300.0, NEG_INF  # p > 0 where q = 0, p below float32: a NaN sum in the kernel, +inf
    g = torch.Generator().manual_seed(23)
    task_ids = torch.randint(-1, num_tasks, (n,), generator=g).cuda()
    mask = torch.rand(n, generator=g) > 0.2
    mask[[0, 1, 2, 3, 4, 5, 6]] = True
    mask = mask.cuda()
    launches = kcl._STATE["launches"]
    out = kdiv.launch_divergence(v, d, temperature, mask=mask, task_ids=task_ids, num_tasks=num_tasks,
                                 plan=_plan(v, True))
    assert kcl._STATE["launches"] == launches + 1, "the cluster kernel did not run"
    ref = divergence_reference(v.double(), d.double(), temperature, mask=mask, task_ids=task_ids,
                               num_tasks=num_tasks)
    _forward_check(out, ref, 2e-5)
    ce, kl, tv, alpha, status, per_task = out
    assert bool(torch.isinf(ce[1])) and bool(torch.isinf(kl[1])) and int(status[1]) == 0
    assert bool(torch.isinf(ce[6])) and bool(torch.isinf(kl[6])) and int(status[6]) == 0
    assert float(kl[3]) == 0.0 and float(tv[3]) == 0.0 and abs(float(alpha[3]) - 1.0) < 1e-6
    off = ~mask
    assert all(bool((t[off] == 0).all()) for t in (ce, kl, tv, alpha, status))
    counted = mask & (task_ids >= 0)
    counted[[1, 6]] = False  # the +inf rows: their tasks' sums are +inf in both
    for task in range(num_tasks):
        sel = counted & (task_ids == task)
        assert int(per_task[4][task]) == int((mask & (task_ids == task)).sum())
        if not bool((mask & (task_ids == task))[[1, 6]].any()):
            for k, values in enumerate((ce, kl, tv, alpha)):
                torch.testing.assert_close(per_task[k][task], values[sel].double().sum(), rtol=1e-9, atol=1e-9)


@hopper_only
@pytest.mark.parametrize("masked_fraction", [0.0, 0.3])
def test_cluster_forward_matches_the_row_kernel_over_many_rows(cluster_on, masked_fraction: float) -> None:
    """More rows than clusters (each cluster walks many rows; TV and alpha of a row are finished at the next row's
    cluster barrier, the last one after the loop), masked rows skipped: against the one-program-per-row kernel."""
    n, vocab, num_tasks = 1000, 131072, 5
    v, d = _logits(n, vocab, 24, torch.bfloat16, rolled=True), _logits(n, vocab, 25, torch.bfloat16, rolled=True)
    _hard_rows(v, d)
    d[8, 12] = float("nan")  # a bad drafter row: status bit 1
    kdiv.launch_divergence(v, d, 0.9, mask=torch.ones(n, dtype=torch.bool, device="cuda"))
    mask = _edge_mask(n, _clusters("forward"), masked_fraction, 26) != 0
    mask[[n - 2, 8]] = True
    g = torch.Generator().manual_seed(26)
    task_ids = torch.randint(-1, num_tasks, (n,), generator=g).cuda()
    task_ids[8] = -1
    outs = {}
    for cluster in (0, 1):
        launches = kcl._STATE["launches"]
        outs[cluster] = kdiv.launch_divergence(v, d, 0.9, mask=mask, task_ids=task_ids, num_tasks=num_tasks,
                                               plan=_plan(v, bool(cluster)))
        assert kcl._STATE["launches"] == launches + cluster
    row, clu = outs[0], outs[1]
    assert torch.equal(row[4], clu[4]) and int(clu[4][8]) == 2
    ok = mask.clone()
    ok[8] = False
    for got, want in zip(clu[:4], row[:4], strict=True):
        assert torch.equal(torch.isinf(got[ok]), torch.isinf(want[ok]))
        torch.testing.assert_close(got[ok], want[ok], rtol=1e-5, atol=1e-5)
        assert bool((got[~mask] == 0).all())
    for k in range(4):
        torch.testing.assert_close(clu[5][k], row[5][k], rtol=1e-6, atol=1e-6)
    assert torch.equal(clu[5][4], row[5][4])
    again = kdiv.launch_divergence(v, d, 0.9, mask=mask, task_ids=task_ids, num_tasks=num_tasks)
    for got, want in zip(again[:5], clu[:5], strict=True):  # deterministic: the same bits again
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@hopper_only
def test_strided_rows_and_in_place_gradient_of_a_view(cluster_on) -> None:
    """Rows 16-element aligned but longer than V (a [N, V] view of a wider buffer, different strides for the two
    inputs and the gradient): the cluster kernels take them and match the row kernel."""
    n, vocab = 300, 32000
    v = _logits(n, vocab + 32, 31, torch.bfloat16, rolled=True)[:, :vocab]
    d = _logits(n, vocab + 16, 32, torch.bfloat16, rolled=True)[:, 16:]
    grad = torch.zeros(n, vocab + 48, dtype=torch.bfloat16, device="cuda")[:, 48:]
    assert v.stride(0) != d.stride(0) != grad.stride(0) and kcl.cluster_eligible(v, d, grad)
    outs = {}
    for cluster in (1, 0):
        launches = kcl._STATE["launches"]
        fwd = kdiv.launch_divergence(v, d, 1.2, plan=_plan(v, bool(cluster)))
        loss = kdiv.launch_divergence(v, d, 1.2, compute_tv=False, grad_out=grad, grad_scale=0.5,
                                      plan=_plan(v, bool(cluster), loss=True))
        assert kcl._STATE["launches"] == launches + 2 * cluster
        outs[cluster] = ([t.clone() for t in fwd[:4]], loss[0].clone(), grad.clone())
    for got, want in zip(outs[1][0] + [outs[1][1]], outs[0][0] + [outs[0][1]], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1][2].float(), outs[0][2].float(), rtol=1e-2,
                               atol=1e-4 * float(outs[0][2].float().abs().max()))


@hopper_only
def test_a_failed_build_falls_back_to_the_row_kernel(cluster_on, monkeypatch) -> None:
    """If the cluster launch cannot be set up, the call warns once, turns the path off for the process and returns
    the row kernel's results."""
    n, vocab = 64, 32000
    v, d = _logits(n, vocab, 33, torch.bfloat16), _logits(n, vocab, 34, torch.bfloat16)
    want = kdiv.launch_divergence(v, d, 1.0, plan=_plan(v, False))
    monkeypatch.setattr(kcl, "_COMPILED", {})

    def refuse(*args, **kwargs):
        raise RuntimeError("refused for the test")

    monkeypatch.setattr(kcl, "_patch_cluster", refuse)
    launches = kcl._STATE["launches"]
    with pytest.warns(RuntimeWarning, match="refused for the test"):
        got = kdiv.launch_divergence(v, d, 1.0)
    assert kcl._STATE["broken"] and kcl._STATE["launches"] == launches
    for a, b in zip(got[:5], want[:5], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not kcl.cluster_eligible(v, d, None)  # off for the rest of the process (the fixture resets it)
