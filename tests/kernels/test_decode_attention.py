"""The decode-attention kernel equals its reference under every plan (one split, several splits and their merge,
key tiles smaller than the row), and the reference equals HF's eager attention under the static path's slot mask:
ragged rows, prompt padding and holes (``key_ok``), T = 1, 2, K + 1 queries per row, GQA groups, stale slots past
the last query never read."""

import pytest
import torch
from transformers.models.llama.modeling_llama import eager_attention_forward

from specdec.decoding.slot_cache import slot_attention_mask
from specdec.kernels.decode_attention import DecodeAttentionPlan, decode_attention_plan, decode_attention_triton
from specdec.kernels.decode_attention_reference import decode_attention_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: (2e-6, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _case(batch, steps, heads, kv_heads, head_dim, capacity, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)  # noqa: E731
    q = rand(batch * steps, heads, head_dim)
    k_cache, v_cache = rand(batch, kv_heads, capacity, head_dim), rand(batch, kv_heads, capacity, head_dim)
    key_ok = torch.rand(batch, capacity, generator=generator) > 0.25  # padding and holes
    starts = torch.randint(0, capacity - steps - 4, (batch,), generator=generator)
    slots = starts[:, None] + torch.arange(steps)
    return q, k_cache, v_cache, key_ok.to(DEVICE), slots.to(DEVICE)


def test_reference_is_hf_eager_attention_under_the_slot_mask():
    q, k_cache, v_cache, key_ok, slots = _case(3, 4, 6, 2, 8, 29, torch.float32, 0)

    class Module:
        num_key_value_groups, training = 3, False

    mask = slot_attention_mask(key_ok, slots, torch.float32, additive=True)
    queries = q.reshape(3, 4, 6, 8).transpose(1, 2)
    expected, _ = eager_attention_forward(Module(), queries, k_cache, v_cache, mask, scaling=0.4)
    torch.testing.assert_close(decode_attention_reference(q, k_cache, v_cache, key_ok, slots, 0.4),
                               expected.reshape(12, 6, 8), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("steps", [1, 2, 5])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 8), (6, 2, 12), (2, 2, 16)])
def test_decode_attention_equals_reference_under_every_plan(dtype, steps, heads, kv_heads, head_dim):
    q, k_cache, v_cache, key_ok, slots = _case(3, steps, heads, kv_heads, head_dim, 45, dtype, steps * heads)
    expected = decode_attention_reference(q, k_cache, v_cache, key_ok, slots, head_dim ** -0.5)
    # stale slots past every row's last query hold NaN: a kernel that read them would return NaN
    stale = torch.arange(45, device=DEVICE) > slots[:, -1:]
    k_cache.transpose(1, 2)[stale] = float("nan")
    v_cache.transpose(1, 2)[stale] = float("nan")
    atol, rtol = TOL[dtype]
    plans = [DecodeAttentionPlan(block_s=16, splits=1, num_warps=1), DecodeAttentionPlan(block_s=16, splits=3,
             num_warps=1), DecodeAttentionPlan(block_s=32, splits=2, num_warps=2), None]
    for plan in plans:
        out = decode_attention_triton(q, k_cache, v_cache, key_ok, slots, head_dim ** -0.5, plan=plan)
        torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


def test_plan_rules_and_errors():
    plan = decode_attention_plan(1, 8, 4096, 64, DEVICE)
    assert 1 <= plan.splits <= 64 and plan.block_s >= 16
    q, k_cache, v_cache, key_ok, slots = _case(2, 1, 4, 2, 8, 20, torch.float32, 1)
    with pytest.raises(ValueError, match=r"key_ok must be \[B, S\]"):
        decode_attention_triton(q, k_cache, v_cache, key_ok[:, :5], slots, 1.0)
    with pytest.raises(ValueError, match="multiple of H_kv"):
        decode_attention_triton(q[:, :3], k_cache, v_cache, key_ok, slots, 1.0)
