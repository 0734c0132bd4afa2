"""The GEMV kernel equals its reference (``F.linear`` with HF's norm before and epilogues after, in HF's cast order)
under every plan: both inner products (broadcast, ``tl.dot``), tails in N and K, 1 to MAX_ROWS rows, biases, the RMS
norm prologue, the residual and SiLU-mul epilogues; past the row limit the plan hands the call to torch."""

import pytest
import torch

from specdec.kernels.gemv import MAX_ROWS, GemvPlan, gemv_plan, gemv_triton, shared_memory_bytes
from specdec.kernels.gemv_reference import gemv_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (atol relative to the largest output, rtol): in bf16 a rounding step of the gate, the up projection or the
# normalised input can move an output by several of its own rounding steps
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (5e-2, 1.6e-2)}


def _plans(rows):
    dot = [GemvPlan(False, max(16, 1 << (rows - 1).bit_length()), 16, 16, True, 1, 1),
           GemvPlan(False, max(16, 1 << (rows - 1).bit_length()), 32, 32, True, 2, 2)]
    if rows > 2:
        return dot
    block_m = 1 << (rows - 1).bit_length()
    return [GemvPlan(False, block_m, 4, 16, False, 1, 1), GemvPlan(False, block_m, 2, 64, False, 2, 1), *dot]


def _case(rows, weight_rows, reduction, dtype, generator):
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)  # noqa: E731
    return rand(rows, reduction), rand(weight_rows, reduction) / reduction ** 0.5, rand(weight_rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 17])
@pytest.mark.parametrize("epilogue", ["none", "residual", "silu_mul"])
def test_gemv_equals_reference_under_every_plan(dtype, rows, epilogue):
    generator = torch.Generator().manual_seed(rows * 7 + len(epilogue))
    x, weight, bias = _case(rows, 38, 45, dtype, generator)  # N_w = 38 (19 SiLU-mul features), K = 45: tails
    features = 19 if epilogue == "silu_mul" else 38
    residual = torch.randn(rows, features, generator=generator).to(dtype).to(DEVICE)
    norm = (1 + 0.3 * torch.randn(45, generator=generator)).to(dtype).to(DEVICE)
    atol, rtol = TOL[dtype]
    variants = ((None, None), (bias, None), (bias, norm), (None, norm))  # (bias, norm prologue), rotated over plans
    for index, plan in enumerate([*_plans(rows), None]):
        b, n = variants[index % len(variants)]
        kwargs = dict(bias=b, epilogue=epilogue, residual=residual if epilogue == "residual" else None,
                      norm_weight=n, eps=1e-6)
        out = gemv_triton(x, weight, plan=plan, **kwargs)
        assert out.shape == (rows, features) and out.dtype == dtype
        expected = gemv_reference(x, weight, **kwargs)
        scale = max(1.0, expected.abs().max().item())
        torch.testing.assert_close(out, expected, atol=atol * scale, rtol=rtol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the automatic plan's tiles and shared-memory limit are a "
                    "CUDA device's (the interpreter plan is tested above)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [36, MAX_ROWS])
def test_the_automatic_plan_fits_the_device_at_many_rows(dtype, rows):
    # a verification step of B (K + 1) rows: 4 x 9 = 36 rows take 64-row tiles
    generator = torch.Generator().manual_seed(rows)
    x, weight, bias = _case(rows, 1024, 512, dtype, generator)
    plan = gemv_plan(rows, 512, 512, dtype, DEVICE)
    assert plan.dot and shared_memory_bytes(plan.block_m, plan.block_n, plan.block_k, plan.num_stages, dtype) \
        <= torch.cuda.get_device_properties(DEVICE).shared_memory_per_block_optin
    atol, rtol = TOL[dtype]
    expected = gemv_reference(x, weight, bias, "silu_mul")
    torch.testing.assert_close(gemv_triton(x, weight, bias, "silu_mul"), expected,
                               atol=atol * max(1.0, expected.abs().max().item()), rtol=rtol)


def test_strided_rows_and_the_row_limit():
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 4, 40, generator=generator).to(DEVICE)
    weight = torch.randn(24, 40, generator=generator).to(DEVICE)
    rows = hidden[:, -1]  # [3, 40] with row stride 160: the last token of every row
    torch.testing.assert_close(gemv_triton(rows, weight), gemv_reference(rows, weight), atol=2e-5, rtol=2e-5)
    assert gemv_plan(MAX_ROWS + 1, 24, 40, torch.float32, DEVICE).matmul
    assert not gemv_plan(MAX_ROWS, 24, 40, torch.float32, DEVICE).matmul
    many = torch.randn(MAX_ROWS + 3, 40, generator=generator).to(DEVICE)
    torch.testing.assert_close(gemv_triton(many, weight, epilogue="silu_mul"),
                               gemv_reference(many, weight, epilogue="silu_mul"))


def test_bad_arguments_are_named():
    x, weight = torch.randn(2, 8), torch.randn(6, 8)
    with pytest.raises(ValueError, match="epilogue must be one of"):
        gemv_triton(x, weight, epilogue="gelu")
    with pytest.raises(ValueError, match=r"residual \[M, N\]"):
        gemv_triton(x, weight, epilogue="residual")
    with pytest.raises(ValueError, match=r"bias must be \[N_w\]"):
        gemv_triton(x, weight, bias=torch.randn(5))
    with pytest.raises(ValueError, match=r"norm_weight must be \[K\]"):
        gemv_triton(x, weight, norm_weight=torch.randn(7))
    with pytest.raises(ValueError, match="holds fewer than"):
        gemv_triton(torch.randn(5, 8), weight, plan=GemvPlan(False, 4, 4, 16, False, 1, 1))
