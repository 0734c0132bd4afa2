"""``specdec.generate`` on the native runner: greedy output equals the verifier's own ``generate`` token for token for
every family (ragged left-padded batches, a layer-skip drafter sharing the verifier's weights), with the kernels
(Triton's interpreter on the CPU) and with their references; a seed gives the same samples as on the HF runner; the
runner is reported, asked-for-but-refused models say why, and bad runner arguments are named."""

import pytest
import torch

import specdec
from specdec.decoding import static as static_path

from models import left_padded_prompts, perturbed_copy, tiny_llama, tiny_mistral, tiny_qwen2, tiny_qwen3

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VOCAB = 96
FACTORIES = {"llama": tiny_llama, "mistral": lambda **kw: tiny_mistral(None, **kw), "qwen2": tiny_qwen2,
             "qwen3": tiny_qwen3}


def _prompts(lengths, seed):
    input_ids, attention_mask = left_padded_prompts(lengths, VOCAB, seed=seed)
    return input_ids.to(DEVICE), attention_mask.to(DEVICE)


def _reference(model, input_ids, attention_mask, max_new_tokens):
    return model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=max_new_tokens,
                          eos_token_id=[], pad_token_id=0)


@pytest.mark.parametrize("family", list(FACTORIES))
def test_greedy_equals_the_verifier_on_the_native_runner(family):
    verifier = FACTORIES[family](hidden_size=32, num_layers=3, seed=11, init_std=0.3).to(DEVICE)
    drafter = specdec.layer_skip_drafter(verifier, 2)
    input_ids, attention_mask = _prompts([6, 3, 9], seed=12)
    expected = _reference(verifier, input_ids, attention_mask, 12)
    for num_draft_tokens in (0, 3):
        out = specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=12,
                               num_draft_tokens=num_draft_tokens, pad_token_id=0, runner="native")
        assert out.stats.path == "static" and out.stats.runner == "native", out.stats.fallback_reason
        assert out.stats.fallback_reason is None
        assert torch.equal(out.sequences, expected), num_draft_tokens


def test_greedy_equals_the_verifier_with_the_kernels():
    # backend="triton": the runner's decode steps run the Triton kernels (the interpreter on the CPU); Qwen3 has
    # every optional part but biases (per-head norms), which the kernel tests cover
    verifier = tiny_qwen3(hidden_size=32, num_layers=2, seed=13, init_std=0.3).to(DEVICE)
    drafter = specdec.layer_skip_drafter(verifier, 1)
    input_ids, attention_mask = _prompts([5, 2], seed=15)
    expected = _reference(verifier, input_ids, attention_mask, 5)
    out = specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=5, num_draft_tokens=2,
                           pad_token_id=0, runner="native", backend="triton")
    assert out.stats.runner == "native"
    assert torch.equal(out.sequences, expected)


def test_a_seed_samples_the_same_tokens_on_both_runners():
    verifier = tiny_llama(vocab_size=VOCAB, hidden_size=32, seed=16, init_std=0.3).to(DEVICE)
    drafter = perturbed_copy(verifier.cpu(), noise=0.1, seed=17).to(DEVICE)
    verifier = verifier.to(DEVICE)
    input_ids, attention_mask = _prompts([4, 7], seed=18)
    runs = {runner: specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=10,
                                     num_draft_tokens=3, temperature=0.9, top_k=20, top_p=0.95, seed=19,
                                     static=True, runner=runner) for runner in ("native", "hf")}
    assert runs["native"].stats.runner == "native" and runs["hf"].stats.runner == "hf"
    assert torch.equal(runs["native"].sequences, runs["hf"].sequences)
    assert torch.equal(runs["native"].stats.accepted, runs["hf"].stats.accepted)


def test_the_runner_is_reported_and_a_refused_model_says_why():
    verifier = tiny_llama(vocab_size=VOCAB, hidden_size=32, seed=20, init_std=0.3).to(DEVICE)
    drafter = tiny_llama(vocab_size=VOCAB, hidden_size=32, seed=21, init_std=0.3, hidden_act="gelu").to(DEVICE)
    input_ids, attention_mask = _prompts([5, 3], seed=22)
    expected = _reference(verifier, input_ids, attention_mask, 5)
    asked = specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=5, num_draft_tokens=2,
                             pad_token_id=0, runner="native")
    assert asked.stats.path == "static" and asked.stats.runner == "hf"
    assert asked.stats.fallback_reason == "native runner not used: drafter: activation 'gelu' has no native " \
                                         "decode runner (SiLU only)"
    assert torch.equal(asked.sequences, expected)
    auto = specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=5, num_draft_tokens=2,
                            pad_token_id=0, static=True, runner="auto")
    assert auto.stats.runner == "hf" and auto.stats.fallback_reason is None  # "auto" falls back silently
    engines = list(static_path._ENGINES[verifier].values())
    kinds = {type(engine.verifier).__name__ for engine in engines}
    assert kinds == {"NativeModelSlot"}, "the verifier runs native next to an HF drafter"
    plain = specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=5, num_draft_tokens=0,
                             pad_token_id=0, runner="native")
    assert plain.stats.runner == "native", "plain decoding runs no drafter"
    hf = specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=5, num_draft_tokens=0,
                          pad_token_id=0, static=True, runner="hf")
    assert hf.stats.runner == "hf" and torch.equal(hf.sequences, plain.sequences)
    kinds = {type(engine.verifier).__name__ for engine in static_path._ENGINES[verifier].values()}
    assert "_ModelSlot" in kinds, "the runner is part of the engine key"


def test_bad_runner_arguments_are_named():
    verifier = tiny_llama(vocab_size=VOCAB, hidden_size=32, seed=23)
    input_ids, attention_mask = left_padded_prompts([3], VOCAB, seed=24)
    with pytest.raises(ValueError, match="runner must be 'auto', 'native' or 'hf'"):
        specdec.generate(verifier, verifier, input_ids, attention_mask, max_new_tokens=2, runner="fast")
    with pytest.raises(ValueError, match="runner='native' runs on the static path"):
        specdec.generate(verifier, verifier, input_ids, attention_mask, max_new_tokens=2, runner="native",
                         static=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs and their memory pool)")
@pytest.mark.parametrize("runner", ["native", "hf"])
def test_graphs_released_in_any_order_leave_the_engine_able_to_capture(runner):
    # each captured step is dropped before the next capture in the engine's shared pool (as LRU eviction and the
    # benchmarks' step timing do); decoding afterwards still equals HF greedy
    verifier = tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=3, seed=25, init_std=0.3).to(DEVICE)
    drafter = specdec.layer_skip_drafter(verifier, 1)
    engine = static_path.get_engine(verifier, drafter, 2, 64, VOCAB, 1, 1, DEVICE, "auto", True, runner=runner)
    ids = torch.zeros((2, 1), dtype=torch.int64, device=DEVICE)
    slots = torch.full((2, 1), 30, dtype=torch.int64, device=DEVICE)
    for _ in range(3):
        for model_slot in engine.model_slots():
            replay = engine._capture(lambda model_slot=model_slot: model_slot.forward(ids, slots, 1))
            replay()
            del replay
    input_ids, attention_mask = _prompts([5, 8], seed=26)
    expected = _reference(verifier, input_ids, attention_mask, 9)
    for temperature in (0.7, 0.8, 0.9, 0.0):  # more sampling settings than the engine keeps captured rounds for
        out = specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=9, num_draft_tokens=2,
                               pad_token_id=0, runner=runner, temperature=temperature, seed=27)
        assert out.stats.runner == runner
    assert torch.equal(out.sequences, expected)
