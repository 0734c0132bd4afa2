"""The RMS-norm kernel equals its reference (HF's ``LlamaRMSNorm`` and ``Qwen3RMSNorm`` cast order) under every
plan, on rows that are not chunk multiples, strided 3-D inputs (the last tokens of every row) and 16-bit dtypes."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from specdec.kernels.rms_norm import RmsNormPlan, rms_norm_plan, rms_norm_triton
from specdec.kernels.rms_norm_reference import rms_norm_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (0.0, 1.6e-2)}  # (atol, rtol): bf16 one rounding step


@pytest.mark.parametrize("module", [LlamaRMSNorm, Qwen3RMSNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_hf_rms_norm(module, dtype):
    generator = torch.Generator().manual_seed(0)
    norm = module(37, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(37, generator=generator))
    x = torch.randn(4, 5, 37, generator=generator).to(dtype)
    assert torch.equal(rms_norm_reference(x, norm.weight.detach(), 1e-5), norm(x).detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("features", [7, 16, 45])
@pytest.mark.parametrize("plan", [RmsNormPlan(block=8, num_warps=1), RmsNormPlan(block=64, num_warps=2), None],
                         ids=["multi-chunk", "one-chunk", "default"])
def test_rms_norm_equals_reference(dtype, features, plan):
    generator = torch.Generator().manual_seed(features)
    hidden = (torch.randn(3, 4, features, generator=generator) * 3).to(dtype).to(DEVICE)
    weight = torch.randn(features, generator=generator).to(dtype).to(DEVICE)
    atol, rtol = TOL[dtype]
    for x in (hidden, hidden[:, -2:], hidden[:, -1], hidden[0, 0]):  # strided rows: the last tokens of every row
        out = rms_norm_triton(x, weight, 1e-6, plan=plan)
        assert out.shape == x.shape and out.is_contiguous()
        torch.testing.assert_close(out, rms_norm_reference(x, weight, 1e-6), atol=atol, rtol=rtol)


def test_plan_and_errors():
    plan = rms_norm_plan(2048, DEVICE)
    assert plan.block & (plan.block - 1) == 0 and plan.num_warps >= 1
    with pytest.raises(ValueError, match="share a dtype"):
        rms_norm_triton(torch.randn(2, 8), torch.randn(8, dtype=torch.float64), 1e-6)
    with pytest.raises(ValueError, match=r"x \[..., N\]"):
        rms_norm_triton(torch.randn(2, 8), torch.randn(9), 1e-6)
