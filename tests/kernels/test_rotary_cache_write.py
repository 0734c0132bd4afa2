"""The rotary/cache-write kernel equals its reference (HF's ``apply_rotary_pos_emb`` and Qwen3's per-head norms, in
the model's dtype) under every plan: rotated queries returned, rotated keys and values written at each token's slot
and nothing else in the cache touched; GQA head counts, head tiles that cross the query/key boundary."""

import pytest
import torch

from specdec.kernels.rotary_cache_write import RotaryCacheWritePlan, rotary_cache_write_triton
from specdec.kernels.rotary_cache_write_reference import rotary_cache_write_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (atol relative to the largest output, rtol): in bf16 with per-head norms a normalised value can round one step
# apart (the float32 statistics are summed in another order), which the rotation carries to the output
TOL = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (2e-2, 1.6e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 8), (3, 1, 12), (2, 2, 16)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_cache_write_equals_reference(dtype, heads, kv_heads, head_dim, qk_norm):
    generator = torch.Generator().manual_seed(heads * 100 + head_dim)
    batch, steps, capacity, table = 2, 3, 12, 20
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)  # noqa: E731
    qkv = rand(batch * steps, (heads + 2 * kv_heads) * head_dim)
    angles = torch.rand(table, head_dim // 2, generator=generator) * 6
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype).to(DEVICE)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype).to(DEVICE)
    positions = torch.randint(0, table, (batch, steps), generator=generator).to(DEVICE)
    slots = torch.stack([torch.randperm(capacity, generator=generator)[:steps] for _ in range(batch)]).to(DEVICE)
    norms = (rand(head_dim), rand(head_dim)) if qk_norm else (None, None)
    atol, rtol = TOL[dtype]
    atol *= max(1.0, qkv.abs().max().item() * (2 if qk_norm else 1))
    expected_cache = (rand(batch, kv_heads, capacity, head_dim), rand(batch, kv_heads, capacity, head_dim))
    expected_q = rotary_cache_write_reference(qkv, positions, slots, cos, sin, *expected_cache, heads, *norms, 1e-6)
    plans = [RotaryCacheWritePlan(block_h=1, num_warps=1), RotaryCacheWritePlan(block_h=2, num_warps=1),
             RotaryCacheWritePlan(block_h=8, num_warps=2), None]
    for plan in plans:
        generator.manual_seed(7)
        cache = (rand(batch, kv_heads, capacity, head_dim), rand(batch, kv_heads, capacity, head_dim))
        generator.manual_seed(7)
        untouched = (rand(batch, kv_heads, capacity, head_dim), rand(batch, kv_heads, capacity, head_dim))
        q = rotary_cache_write_triton(qkv, positions, slots, cos, sin, *cache, heads, *norms, 1e-6, plan=plan)
        torch.testing.assert_close(q, expected_q, atol=atol, rtol=rtol)
        written = torch.zeros(batch, capacity, dtype=torch.bool, device=DEVICE)
        written[torch.arange(batch, device=DEVICE)[:, None], slots] = True
        for got, want, before in zip(cache, expected_cache, untouched, strict=True):
            torch.testing.assert_close(got.transpose(1, 2)[written], want.transpose(1, 2)[written], atol=atol,
                                       rtol=rtol)
            assert torch.equal(got.transpose(1, 2)[~written], before.transpose(1, 2)[~written])


def test_bad_shapes_are_named():
    cache = torch.zeros(1, 2, 8, 8)
    with pytest.raises(ValueError, match=r"qkv must be \[B T, \(H \+ 2 H_kv\) D\]"):
        rotary_cache_write_triton(torch.zeros(1, 60), torch.zeros(1, 1, dtype=torch.int64),
                                  torch.zeros(1, 1, dtype=torch.int64), torch.zeros(4, 8), torch.zeros(4, 8), cache,
                                  cache.clone(), 4)
