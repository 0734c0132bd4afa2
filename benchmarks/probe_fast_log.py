"""The race noise's fast logarithm for the largest uniforms (GPU): -log u through lg2.approx against float64.

    python benchmarks/probe_fast_log.py   # session 21, H200: results/fast_log_near_one_H200_s21.txt
"""
import torch
import triton
import triton.language as tl

from specdec.kernels.rejection_sampling import _log


@triton.jit
def _noise_kernel(u_ptr, out_ptr, inner_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    u = tl.load(u_ptr + i, mask=i < n, other=0.5)
    inner = -_log(u, True)
    tl.store(inner_ptr + i, inner, mask=i < n)
    tl.store(out_ptr + i, _log(inner, True), mask=i < n)


top_ids = torch.arange(2**23 - 4096, 2**23, dtype=torch.float64)
u = ((top_ids + 0.5) * 2.0**-23).float().cuda()
out = torch.empty_like(u)
inner = torch.empty_like(u)
_noise_kernel[(1,)](u, out, inner, u.numel(), BLOCK=4096)
exact_inner = -torch.log(u.double())
print("largest uniforms:", u.numel(), "fast -log u <= 0:", int((inner <= 0).sum()),
      "non-finite noise:", int((~torch.isfinite(out)).sum()))
rel = ((inner.double() - exact_inner) / exact_inner).abs()
print("max rel err of -log u over the top 4096 uniforms:", float(rel.max()), "at u =", float(u[rel.argmax()]))
print("top 5 u:", u[-5:].tolist(), "fast -log u:", inner[-5:].tolist(), "exact:", exact_inner[-5:].tolist())
