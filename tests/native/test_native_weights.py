"""The native runner's weight table and its reasons to refuse a model: every HF parameter is consumed exactly once
(biases, per-head norms and tied or untied heads included), unfused tensors are the HF tensors themselves, fused
copies follow in-place updates (version counters) and are shared with a layer-skip drafter, and a model the runner
cannot run gets a one-line reason."""

import pytest
import torch

import specdec
from specdec.decoding.native import NativeConfig, NativeModel, NativeModelSlot, native_problem
from specdec.decoding.native.weights import load_weights

from models import left_padded_prompts, tiny_llama, tiny_mistral, tiny_qwen2, tiny_qwen3

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MODELS = {
    "llama": lambda: tiny_llama(seed=1),
    "llama-biases-tied": lambda: tiny_llama(seed=1, attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    "mistral": lambda: tiny_mistral(None),
    "qwen2": lambda: tiny_qwen2(seed=2),
    "qwen3-tied": lambda: tiny_qwen3(seed=3, tie_word_embeddings=True),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_every_parameter_is_consumed_exactly_once(name):
    model = MODELS[name]()
    assert native_problem(model) is None
    weights = load_weights(model, NativeConfig.from_hf(model))
    names = [n for n, _ in model.named_parameters()]
    assert sorted(weights.consumed) == sorted(names) and len(set(weights.consumed)) == len(weights.consumed)
    params = dict(model.named_parameters())
    layer = weights.layers[1]
    assert layer["o_proj.weight"] is not None and layer["o_proj.weight"].data_ptr() == params[
        "model.layers.1.self_attn.o_proj.weight"].data_ptr()  # not a copy
    assert weights.head.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    q = params["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(layer["qkv_proj.weight"][: q.shape[0]], q)
    assert (layer["qkv_proj.bias"] is not None) == (name in ("llama-biases-tied", "qwen2"))
    assert (layer["q_norm"] is not None) == name.startswith("qwen3")


def test_an_unknown_parameter_is_named():
    model = tiny_llama(seed=4)
    model.model.layers[0].self_attn.q_proj.register_parameter("lora_A", torch.nn.Parameter(torch.zeros(2, 32)))
    reason = native_problem(model)
    assert "model.layers.0.self_attn.q_proj.lora_A" in reason and "weight table" in reason
    with pytest.raises(ValueError, match="lora_A has no place"):
        load_weights(model, NativeConfig.from_hf(model))


@pytest.mark.parametrize("build,expected", [
    (lambda: tiny_mistral(8), "sliding-window"),
    (lambda: tiny_llama(hidden_act="gelu"), "activation 'gelu'"),
    (lambda: tiny_llama(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope type 'dynamic'"),
    (lambda: tiny_llama().to(torch.float64), "dtypes"),
])
def test_refused_models_get_a_one_line_reason(build, expected):
    reason = native_problem(build())
    assert reason is not None and expected in reason and "\n" not in reason


def test_quantised_weights_are_refused_and_a_dequantised_gguf_model_is_not():
    from transformers.utils.quantization_config import BitsAndBytesConfig, GgufConfig

    model = tiny_llama(seed=5)
    model.config.quantization_config = BitsAndBytesConfig(load_in_8bit=True)
    assert native_problem(model) == "quantised weights have no native decode runner"
    model.config.quantization_config = {"quant_method": "awq", "bits": 4}
    assert native_problem(model) == "quantised weights have no native decode runner"
    model.config.quantization_config = GgufConfig()  # what from_pretrained(gguf_file=...) leaves: float weights
    assert native_problem(model) is None


def test_a_model_type_without_a_runner_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=2))
    assert "model type 'gpt2'" in native_problem(model)


def test_fused_copies_follow_in_place_updates_and_are_shared_with_a_layer_skip_drafter():
    verifier = tiny_qwen2(hidden_size=32, num_layers=3, seed=5, init_std=0.3).to(DEVICE)
    drafter = specdec.layer_skip_drafter(verifier, 2)
    ids, mask = left_padded_prompts([5, 3], 96, seed=6)
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    key_ok = torch.ones(2, 16, dtype=torch.bool, device=DEVICE)
    key_ok[:, :5] = mask.bool()
    positions = torch.arange(16, device=DEVICE).expand(2, -1).contiguous()
    slot = NativeModelSlot(verifier, 2, 16, 96, key_ok, positions, use_kernels=False)
    drafter_model = NativeModel(drafter, 2, 16, use_kernels=False)
    for index in range(2):
        assert drafter_model.weights.layers[index]["qkv_proj.weight"] is slot.native.weights.layers[index][
            "qkv_proj.weight"]
        assert drafter_model.weights.layers[index]["gate_up_proj.weight"] is slot.native.weights.layers[index][
            "gate_up_proj.weight"]
    slots = torch.arange(5, device=DEVICE).expand(2, -1)
    before = slot.forward(ids, slots, 1, eager=True)
    fused = slot.native.weights.layers[1]["qkv_proj.weight"]
    address = fused.data_ptr()
    with torch.no_grad():
        verifier.model.layers[1].self_attn.k_proj.bias.add_(0.5)  # an optimiser-style in-place update
        verifier.model.layers[1].mlp.up_proj.weight.mul_(1.5)
    assert slot.native.refresh() == 2  # the fused qkv bias and gate_up weight; the qkv weight is untouched
    assert slot.native.refresh() == 0
    assert fused.data_ptr() == address  # in place: captured graphs keep reading it
    after = slot.forward(ids, slots, 1, eager=True)
    expected = verifier(input_ids=ids, attention_mask=mask).logits[:, -1:]
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, expected, atol=1e-4, rtol=1e-4)
