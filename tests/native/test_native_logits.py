"""The native runner computes the Hugging Face model's logits: tiny random Llama, Mistral, Qwen2 and Qwen3 models
through the static path's model contract, the prompt pass then steps of T = 1, 2 and K + 1 tokens on ragged
left-padded rows (a hole in one prompt's mask), rows advancing by different amounts so that rejected drafts stay
behind in the cache. The HF side is the model's own forward on the slot cache (``_ModelSlot``).

float32: equal to float32 rounding, with the kernels (Triton's interpreter on the CPU) and with their references.
bfloat16: about as close to the float32 result as HF's own bfloat16 forward is (at most twice as far)."""

import copy

import pytest
import torch

from specdec.decoding.native import NativeModelSlot
from specdec.decoding.static import _ModelSlot
from specdec.kernels._device import INTERPRETER

from models import left_padded_prompts, tiny_llama, tiny_mistral, tiny_qwen2, tiny_qwen3

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FACTORIES = {"llama": tiny_llama, "mistral": lambda **kw: tiny_mistral(None, **kw), "qwen2": tiny_qwen2,
             "qwen3": tiny_qwen3}
CAPACITY = 32
K = 3


def _engine_state(attention_mask):
    """The static engine's key_ok [B, S] and slot_positions [B, S] for these prompts (as its prefill fills them)."""
    batch, prompt_len = attention_mask.shape
    key_ok = torch.ones((batch, CAPACITY), dtype=torch.bool, device=DEVICE)
    key_ok[:, :prompt_len] = attention_mask.bool()
    real = attention_mask.sum(1, keepdim=True)
    positions = torch.arange(CAPACITY, device=DEVICE) - prompt_len + real
    positions[:, :prompt_len] = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return key_ok, positions


def _run(slot, input_ids):
    """Prompt pass, then T = 1, the drafter's [prev, pending] (T = 2, keep 1), K + 1 and T = 1 again."""
    batch, prompt_len = input_ids.shape
    generator = torch.Generator().manual_seed(5)
    outputs = [slot.forward(input_ids, torch.arange(prompt_len, device=DEVICE).expand(batch, -1), 1, eager=True)]
    n = torch.full((batch,), prompt_len, device=DEVICE)
    for steps, keep, start, advance in ((1, 1, 0, [1, 1, 1]), (2, 1, -1, [1, 1, 1]), (K + 1, K + 1, 0, [1, 4, 2]),
                                        (1, 1, 0, [1, 1, 1])):
        ids = torch.randint(0, slot.vocab, (batch, steps), generator=generator).to(DEVICE)
        slots = n[:, None] + start + torch.arange(steps, device=DEVICE)
        outputs.append(slot.forward(ids, slots, keep))
        n = n + torch.tensor(advance, device=DEVICE)
    return [out.float() for out in outputs]


def _prompts(vocab):
    input_ids, attention_mask = left_padded_prompts([7, 3, 5], vocab, seed=1)
    attention_mask[2, 4] = 0  # a hole inside a prompt
    return input_ids.to(DEVICE), attention_mask.to(DEVICE)


def _pair(model, use_kernels):
    input_ids, attention_mask = _prompts(model.config.vocab_size)
    key_ok, positions = _engine_state(attention_mask)
    args = (model, 3, CAPACITY, model.config.vocab_size, key_ok, positions)
    return _ModelSlot(*args), NativeModelSlot(*args, use_kernels=use_kernels), input_ids


@pytest.mark.parametrize("family", list(FACTORIES))
@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "references"])
def test_float32_logits_equal_hf(family, use_kernels):
    model = FACTORIES[family](hidden_size=32, init_std=0.3, seed=3).to(DEVICE)
    hf, native, input_ids = _pair(model, use_kernels)
    for index, (got, want) in enumerate(zip(_run(native, input_ids), _run(hf, input_ids), strict=True)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=2e-5 * want.abs().max().item(), rtol=0, msg=f"call {index}")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bfloat16_logits_are_as_close_to_float32_as_hf(family, use_kernels=True):
    model = FACTORIES[family](hidden_size=32, init_std=0.3, seed=4).to(DEVICE)
    exact_model = copy.deepcopy(model)  # (the slots hold their model weakly)
    exact_hf, _, input_ids = _pair(exact_model, use_kernels=False)
    exact = _run(exact_hf, input_ids)  # float32 HF on the same weights: the truth
    model = model.to(torch.bfloat16)
    hf, native, input_ids = _pair(model, use_kernels)
    # NOTE: Triton's interpreter converts float32 to bfloat16 toward zero (compiled kernels round to nearest), which
    # about doubles the kernels' rounding error on the CPU.
    factor = 3.0 if use_kernels and INTERPRETER else 2.0
    for index, (got, want, truth) in enumerate(zip(_run(native, input_ids), _run(hf, input_ids), exact,
                                                   strict=True)):
        scale = truth.abs().max().item()
        native_error = (got - truth).abs().max().item() / scale
        hf_error = (want - truth).abs().max().item() / scale
        assert native_error <= factor * hf_error + 4e-3, (index, native_error, hf_error)
