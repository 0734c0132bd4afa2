"""The static path's edges: cache capacity at the slot bucket's boundary, captured rounds that must not outlive what
they captured (attention implementation, drafter objects), masks with zeros inside the prompt, bounded engine
caches; and what a call promises on both paths (K capped by the tokens left, one seed one sample, compile reported).

Every output is compared with the verifier's own Hugging Face ``generate``. On the GPU the static path replays CUDA
graphs (and ``compile=True`` compiles), on the CPU it runs the same rounds without graphs."""

import gc
import warnings

import pytest
import torch

import specdec
from specdec.compat import SpecdecWarning
from specdec.decoding import static as static_path

from models import left_padded_prompts, perturbed_copy, tiny_llama

VOCAB = 96
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def models():
    verifier = tiny_llama(vocab_size=VOCAB, hidden_size=64, num_layers=2, seed=0, init_std=0.3)
    drafter = perturbed_copy(verifier, noise=0.03, seed=1)  # accepted 20-45% of the time by row
    return verifier.to(DEVICE), drafter.to(DEVICE)


@pytest.fixture(scope="module")
def verifier(models):
    return models[0]


@pytest.fixture(scope="module")
def drafter(models):
    return models[1]


def _reference(model, input_ids, attention_mask, max_new_tokens):
    return model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=max_new_tokens,
                          eos_token_id=[], pad_token_id=0)


def _prompts(lengths, seed):
    input_ids, attention_mask = left_padded_prompts(lengths, VOCAB, seed=seed)
    return input_ids.to(DEVICE), attention_mask.to(DEVICE)


@pytest.mark.parametrize("num_draft_tokens", [1, 4, 8, "auto"])
@pytest.mark.parametrize("lengths", [[9, 4, 7], [13, 13]], ids=["L9-ragged", "L13"])
def test_cache_capacity_at_the_slot_bucket_edge(verifier, drafter, num_draft_tokens, lengths):
    # L + n + K + 1 runs across a multiple of the slot bucket; rows accept different numbers of drafts, so they
    # reach their budget in different rounds and the finished ones keep riding along
    input_ids, attention_mask = _prompts(lengths, seed=len(lengths))
    prompt_len = input_ids.shape[1]
    max_drafts = 8 if num_draft_tokens == "auto" else num_draft_tokens
    edge = static_path.SLOT_BUCKET - prompt_len - max_drafts - 1  # n with L + n + K + 1 == SLOT_BUCKET
    rounds_differ = []
    for max_new_tokens in (edge - 1, edge, edge + 1):
        expected = _reference(verifier, input_ids, attention_mask, max_new_tokens)
        out = specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                               num_draft_tokens=num_draft_tokens, pad_token_id=0, static=True)
        assert out.stats.path == "static", out.stats.fallback_reason
        assert torch.equal(out.sequences, expected), max_new_tokens
        rounds_differ.append(len(set(out.stats.verifier_calls.tolist())) > 1)
    if num_draft_tokens != 1:  # (with one draft a round every row tends to need the same number of rounds)
        assert any(rounds_differ), "rows must finish in different rounds"


@pytest.mark.parametrize("num_draft_tokens", [4, "auto"])
def test_gpu_cache_capacity_edge_with_graphs_and_compile(verifier, drafter, num_draft_tokens):
    if DEVICE.type != "cuda":
        pytest.skip("needs a CUDA device: CUDA graphs and torch.compile of the static path")
    input_ids, attention_mask = _prompts([9, 4, 7], seed=3)
    max_drafts = 8 if num_draft_tokens == "auto" else num_draft_tokens
    edge = static_path.SLOT_BUCKET - input_ids.shape[1] - max_drafts - 1
    for compile_models in (False, True):
        for max_new_tokens in (edge - 1, edge, edge + 1):
            expected = _reference(verifier, input_ids, attention_mask, max_new_tokens)
            out = specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                                   num_draft_tokens=num_draft_tokens, pad_token_id=0, compile=compile_models,
                                   runner="hf")  # (compile fuses HF forward calls; native steps are kernels)
            torch.cuda.synchronize()
            assert out.stats.path == "static" and out.stats.compiled == compile_models
            assert torch.equal(out.sequences, expected), (compile_models, max_new_tokens)


def test_switching_the_attention_implementation_between_calls_recaptures():
    verifier = tiny_llama(vocab_size=VOCAB, hidden_size=64, num_layers=2, seed=5, init_std=0.3)
    drafter = perturbed_copy(verifier, noise=0.3, seed=6).to(DEVICE)
    verifier = verifier.to(DEVICE)
    input_ids, attention_mask = _prompts([7, 3, 5], seed=7)
    for implementation in ("sdpa", "eager", "sdpa"):
        for model in (verifier, drafter):
            model.set_attn_implementation(implementation)
        expected = _reference(verifier, input_ids, attention_mask, 12)
        out = specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=12, num_draft_tokens=3,
                               pad_token_id=0, static=True)
        assert out.stats.path == "static"
        assert torch.equal(out.sequences, expected), implementation


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_attention_masks_with_zeros_inside_the_prompt_follow_transformers(verifier, drafter, static):
    # transformers gives position cumsum(mask) - 1 to every token, so a hole shifts the positions after it
    input_ids, attention_mask = _prompts([8, 8, 6, 8], seed=11)
    attention_mask[:, 3] = 0
    attention_mask[1, 5] = 0
    expected = _reference(verifier, input_ids, attention_mask, 10)
    out = specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=10, num_draft_tokens=3,
                           pad_token_id=0, static=static)
    assert torch.equal(out.sequences, expected)


def test_a_rebuilt_drafter_never_meets_a_dead_engine(verifier):
    # CPython reuses the id of a freed object, and a layer-skip drafter has its verifier's parameters: the engine
    # cache must tell the new drafter from the freed one
    input_ids, attention_mask = _prompts([5, 6], seed=13)
    expected = _reference(verifier, input_ids, attention_mask, 6)
    for _ in range(12):
        layer_skip = specdec.layer_skip_drafter(verifier, 1)
        out = specdec.generate(verifier, layer_skip, input_ids, attention_mask, max_new_tokens=6, num_draft_tokens=2,
                               pad_token_id=0, static=True)
        assert out.stats.path == "static" and torch.equal(out.sequences, expected)
        del layer_skip, out
        gc.collect()
    engines = static_path._ENGINES.get(verifier, {})
    assert len(engines) <= static_path.MAX_ENGINES
    assert all(engine.drafter is None or engine.drafter.model() is not None for engine in engines.values())


def test_captured_rounds_are_bounded_per_engine(verifier, drafter):
    input_ids, attention_mask = _prompts([5, 6], seed=17)
    specdec.clear_static_caches()
    for index in range(8):
        specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=4, num_draft_tokens=2,
                         temperature=1.0, top_p=0.5 + 0.05 * index, seed=index, static=True)
    engines = list(static_path._ENGINES.get(verifier, {}).values())
    assert len(engines) == 1
    # two sampling settings' rounds at most (a round of K = 2 each here)
    assert engines[0].num_captured_rounds() <= static_path.MAX_SAMPLINGS


def test_plain_decoding_on_the_static_path_never_calls_the_drafter(verifier, drafter):
    calls = []
    handle = drafter.register_forward_hook(lambda *args: calls.append(1))
    try:
        input_ids, attention_mask = _prompts([5, 6], seed=19)
        specdec.clear_static_caches()
        out = specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=6, num_draft_tokens=0,
                               pad_token_id=0, static=True)
    finally:
        handle.remove()
    assert torch.equal(out.sequences, _reference(verifier, input_ids, attention_mask, 6))
    assert calls == [] and int(out.stats.drafter_calls.sum()) == 0
    engine = next(iter(static_path._ENGINES[verifier].values()))
    assert engine.drafter is None  # no drafter cache either


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_drafts_are_capped_by_the_tokens_left(verifier, drafter, static):
    calls = []
    handle = drafter.register_forward_hook(lambda *args: calls.append(1))
    try:
        input_ids, attention_mask = _prompts([5, 6], seed=23)
        out = specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=5, num_draft_tokens=1000,
                               pad_token_id=0, static=static)
    finally:
        handle.remove()
    assert torch.equal(out.sequences, _reference(verifier, input_ids, attention_mask, 5))
    # the prompt pass emits the first token, so at most 4 drafts a round, at most 4 rounds
    assert out.stats.num_draft_tokens == 4 and set(out.stats.draft_lengths) == {4}
    assert len(calls) <= 4 * 4 + 2


def test_one_seed_gives_the_same_samples_on_both_paths(verifier, drafter):
    input_ids, attention_mask = _prompts([5, 7, 6, 7], seed=29)
    runs = [specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=12, num_draft_tokens=3,
                             temperature=1.0, top_k=40, seed=1234, static=static) for static in (False, True)]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert torch.equal(runs[0].stats.accepted, runs[1].stats.accepted)
    assert torch.equal(runs[0].stats.verifier_calls, runs[1].stats.verifier_calls)


def test_seed_none_follows_torchs_global_generator(verifier, drafter):
    input_ids, attention_mask = _prompts([5, 7], seed=31)
    outputs = []
    for _ in range(2):
        torch.manual_seed(77)
        outputs.append(specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=10,
                                        num_draft_tokens=2, temperature=1.0).sequences)
    assert torch.equal(outputs[0], outputs[1])
    torch.manual_seed(78)
    other = specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=10, num_draft_tokens=2,
                             temperature=1.0).sequences
    assert not torch.equal(outputs[0], other)


def test_compile_on_the_eager_path_warns_and_is_reported(verifier, drafter):
    input_ids, attention_mask = _prompts([5], seed=37)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=3, static=False,
                               compile=True)
    assert out.stats.compiled is False
    assert any(issubclass(w.category, SpecdecWarning) and "compile=True" in str(w.message) for w in caught)


def test_compile_on_the_native_runner_warns_and_is_reported(verifier, drafter):
    input_ids, attention_mask = _prompts([5], seed=38)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=3, static=True,
                               runner="native", compile=True)
    assert out.stats.runner == "native" and out.stats.compiled is False
    assert any(issubclass(w.category, SpecdecWarning) and "runner='hf'" in str(w.message) for w in caught)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_train_mode_models_decode_as_in_eval_mode_and_keep_their_modes(static):
    # with dropout active the output would follow no fixed law; generate runs both models in eval mode
    verifier = tiny_llama(vocab_size=VOCAB, hidden_size=64, num_layers=2, seed=41, init_std=0.3,
                          attention_dropout=0.5)
    drafter = perturbed_copy(verifier, noise=0.03, seed=42)
    verifier, drafter = verifier.to(DEVICE), drafter.to(DEVICE)
    input_ids, attention_mask = _prompts([6, 4], seed=43)
    expected = _reference(verifier.eval(), input_ids, attention_mask, 8)
    verifier.train()
    drafter.train()
    drafter.model.layers[0].eval()  # a mixed state must come back as it was
    out = specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=8, num_draft_tokens=3,
                           pad_token_id=0, static=static)
    assert torch.equal(out.sequences, expected)
    assert verifier.training and drafter.training and not drafter.model.layers[0].training
    assert drafter.model.layers[1].training


def test_the_fused_round_commit_decodes_as_its_reference(verifier, drafter):
    # backend="triton" runs the round-commit kernel (and the sampler) inside the static rounds, in Triton's
    # interpreter on the CPU; greedy must still equal transformers, and sampling must equal the torch backend
    input_ids, attention_mask = _prompts([7, 3, 6], seed=47)
    expected = _reference(verifier, input_ids, attention_mask, 10)
    # (runner="hf": the native runner's kernels in the interpreter are tested in tests/native)
    out = specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=10, num_draft_tokens=3,
                           pad_token_id=0, static=True, backend="triton", runner="hf")
    assert torch.equal(out.sequences, expected)
    runs = [specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=10, num_draft_tokens=3,
                             temperature=1.0, seed=5, static=True, backend=backend, runner="hf")
            for backend in ("triton", "torch")]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    for name in ("accepted", "drafted", "verifier_calls", "drafter_calls", "accepted_per_position"):
        assert torch.equal(getattr(runs[0].stats, name), getattr(runs[1].stats, name)), name


def test_batches_past_the_fused_commits_limit_stay_on_the_static_path(verifier, drafter, monkeypatch):
    monkeypatch.setattr(static_path, "ROUND_COMMIT_MAX_BATCH", 2)  # (the real limit, 1024 rows, is too slow here)
    specdec.clear_static_caches()
    input_ids, attention_mask = _prompts([5, 3, 6], seed=53)
    out = specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=6, num_draft_tokens=2,
                           pad_token_id=0, static=True, backend="triton")
    assert out.stats.path == "static", out.stats.fallback_reason
    assert torch.equal(out.sequences, _reference(verifier, input_ids, attention_mask, 6))
    engine = next(iter(static_path._ENGINES[verifier].values()))
    assert not engine.fused_commit
