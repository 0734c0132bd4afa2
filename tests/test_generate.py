"""`specdec.generate` is lossless: greedy equals the verifier's own greedy decoding token for token, and sampling
reproduces the verifier's joint law of the first two tokens."""

import pytest
import torch

import specdec

from models import left_padded_prompts, perturbed_copy, tiny_llama, tiny_mistral
from stats import assert_follows

VOCAB = 96


@pytest.fixture(scope="module")
def verifier():
    return tiny_llama(vocab_size=VOCAB, hidden_size=64, num_layers=2, seed=0, init_std=0.3)


@pytest.fixture(scope="module")
def drafters(verifier):
    return {
        "close": perturbed_copy(verifier, noise=0.05, seed=1),  # ragged partial acceptance
        "unrelated": tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=2, init_std=0.3),
        "identical": verifier,
    }


def _reference(verifier, input_ids, attention_mask, max_new_tokens, eos_token_id=None):
    return verifier.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=eos_token_id, pad_token_id=0)


@pytest.mark.parametrize("num_draft_tokens", [1, 3, 8])
@pytest.mark.parametrize("lengths", [[6], [5, 9, 2, 7]], ids=["batch1", "batch4-ragged"])
@pytest.mark.parametrize("drafter_name", ["close", "unrelated"])
def test_greedy_equals_verifier_greedy(verifier, drafters, num_draft_tokens, lengths, drafter_name):
    input_ids, attention_mask = left_padded_prompts(lengths, VOCAB, seed=len(lengths))
    expected = _reference(verifier, input_ids, attention_mask, 24, eos_token_id=[])
    out = specdec.generate(verifier, drafters[drafter_name], input_ids, attention_mask, max_new_tokens=24,
                           num_draft_tokens=num_draft_tokens, pad_token_id=0)
    assert torch.equal(out.sequences, expected)
    stats = out.stats
    assert bool((stats.generated == 24).all())
    assert bool((stats.accepted <= stats.drafted).all())
    assert bool((stats.generated <= stats.verifier_calls * (num_draft_tokens + 1)).all())
    assert bool((stats.drafter_calls == stats.verifier_calls * num_draft_tokens).all())
    if drafter_name == "close" and len(lengths) > 1:  # the case must exercise ragged acceptance (holes)
        assert int(stats.accepted.sum()) > 0 and len(set(stats.acceptance_rate.tolist())) > 1


def test_sliding_window_models_run_within_their_window_and_are_refused_past_it():
    # the caches keep one slot layout (K + 1 slots a round, masked holes where rows accepted less); a sliding window
    # counts slots, so a call that could outgrow it is refused with a clear error instead of transformers' crop
    # error or a silently shorter context
    input_ids, attention_mask = left_padded_prompts([5, 9, 2, 7], VOCAB, seed=4)
    roomy = tiny_mistral(sliding_window=64, vocab_size=VOCAB, seed=0)
    roomy_drafter = tiny_mistral(sliding_window=64, vocab_size=VOCAB, seed=1)
    expected = _reference(roomy, input_ids, attention_mask, 12, eos_token_id=[])
    out = specdec.generate(roomy, roomy_drafter, input_ids, attention_mask, max_new_tokens=12, num_draft_tokens=3,
                           pad_token_id=0)  # 9 + 12 * 4 = 57 slots at most
    assert torch.equal(out.sequences, expected)
    narrow = tiny_mistral(sliding_window=16, vocab_size=VOCAB, seed=0)
    for verifier, drafter, name in ((narrow, roomy_drafter, "verifier"), (roomy, narrow, "drafter")):
        with pytest.raises(ValueError, match=f"{name} uses sliding-window attention .window 16.*9 \\+ 4 \\* 3 = 21"):
            specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=4, num_draft_tokens=2)


def test_greedy_equals_verifier_greedy_with_sdpa_attention():
    verifier = tiny_llama(vocab_size=VOCAB, hidden_size=64, num_layers=2, seed=0, init_std=0.3)
    drafter = perturbed_copy(verifier, noise=0.05, seed=1)
    for model in (verifier, drafter):
        model.set_attn_implementation("sdpa")
    input_ids, attention_mask = left_padded_prompts([5, 9, 2, 7], VOCAB, seed=4)
    expected = _reference(verifier, input_ids, attention_mask, 24, eos_token_id=[])
    out = specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=24, num_draft_tokens=3,
                           pad_token_id=0)
    assert verifier.config._attn_implementation == "sdpa"
    assert torch.equal(out.sequences, expected)


def test_greedy_rows_stop_at_eos_independently(verifier, drafters):
    input_ids, attention_mask = left_padded_prompts([5, 9, 2, 7], VOCAB, seed=4)
    free_run = _reference(verifier, input_ids, attention_mask, 20, eos_token_id=[])
    eos = int(free_run[1, input_ids.shape[1] + 3])  # row 1 emits it at its 4th step
    expected = _reference(verifier, input_ids, attention_mask, 20, eos_token_id=eos)
    for num_draft_tokens in (1, 3, 8):
        out = specdec.generate(verifier, drafters["close"], input_ids, attention_mask, max_new_tokens=20,
                               num_draft_tokens=num_draft_tokens, eos_token_id=eos, pad_token_id=0)
        width = expected.shape[1]
        assert torch.equal(out.sequences[:, :width], expected)
        assert bool((out.sequences[:, width:] == 0).all())
        assert int(out.stats.generated[1]) <= 4
    assert int(out.stats.generated.max()) == 20, "other rows keep going after row 1 stops"


def test_identical_drafter_accepts_everything(verifier, drafters):
    input_ids, attention_mask = left_padded_prompts([4, 8], VOCAB, seed=5)
    out = specdec.generate(verifier, drafters["identical"], input_ids, attention_mask, max_new_tokens=20,
                           num_draft_tokens=4)
    assert out.stats.total_acceptance_rate == 1.0
    assert out.stats.total_tokens_per_verifier_call == 5.0


def _exact_two_token_law(verifier, prompt, temperature, top_k, top_p):
    with torch.no_grad():
        first = verifier(prompt[None]).logits[0, -1]
        p1 = torch.softmax(specdec.filter_logits(first / temperature, top_k, top_p).double(), -1)
        extended = torch.cat([prompt.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], dim=1)
        second = verifier(extended).logits[:, -1]
        p2 = torch.softmax(specdec.filter_logits(second / temperature, top_k, top_p).double(), -1)
    return p1[:, None] * p2


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 12, 0.9)])
def test_sampling_joint_law_of_first_two_tokens_matches_verifier(temperature, top_k, top_p):
    verifier = tiny_llama(vocab_size=VOCAB, hidden_size=64, num_layers=2, seed=10, init_std=0.3)
    drafter = perturbed_copy(verifier, noise=0.2, seed=11)
    prompt = torch.tensor([5, 17, 33, 8])
    rows = 12000
    out = specdec.generate(verifier, drafter, prompt.expand(rows, -1).clone(), max_new_tokens=2,
                           num_draft_tokens=2, temperature=temperature, top_k=top_k, top_p=top_p, seed=123)
    pairs = out.sequences[:, -2:]
    counts = torch.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB * VOCAB)
    law = _exact_two_token_law(verifier, prompt, temperature, top_k, top_p)
    assert_follows(counts, law.flatten(), what="joint law of (x1, x2)")
    assert 0.05 < out.stats.total_acceptance_rate < 0.95, "the drafter must be neither useless nor perfect here"


def test_seed_makes_sampling_reproducible(verifier, drafters):
    input_ids, attention_mask = left_padded_prompts([4, 8, 3], VOCAB, seed=6)
    runs = [specdec.generate(verifier, drafters["close"], input_ids, attention_mask, max_new_tokens=16,
                             num_draft_tokens=3, temperature=1.0, seed=seed).sequences for seed in (7, 7, 8)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_vocabularies_differing_by_padding_rows_use_the_shared_range(verifier):
    padded_drafter = tiny_llama(vocab_size=VOCAB + 32, hidden_size=32, num_layers=1, seed=3, init_std=0.3)
    input_ids, attention_mask = left_padded_prompts([4, 6], VOCAB, seed=7)
    with pytest.raises(ValueError, match="vocab_size"):
        specdec.generate(verifier, padded_drafter, input_ids, attention_mask, max_new_tokens=4)
    out = specdec.generate(verifier, padded_drafter, input_ids, attention_mask, max_new_tokens=12,
                           vocab_size=VOCAB, pad_token_id=0)
    assert torch.equal(out.sequences, _reference(verifier, input_ids, attention_mask, 12, eos_token_id=[]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton backend on the device)")
def test_on_gpu_with_triton_backend_greedy_and_sampling_are_lossless(verifier, drafters):
    device = torch.device("cuda")
    gpu_verifier = tiny_llama(vocab_size=VOCAB, hidden_size=64, num_layers=2, seed=0, init_std=0.3).to(device)
    gpu_drafter = perturbed_copy(gpu_verifier.cpu(), noise=0.05, seed=1).to(device)
    gpu_verifier.to(device)
    input_ids, attention_mask = left_padded_prompts([5, 9, 2, 7], VOCAB, seed=4)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    expected = _reference(gpu_verifier, input_ids, attention_mask, 24, eos_token_id=[])
    for num_draft_tokens in (1, 3, 8):
        out = specdec.generate(gpu_verifier, gpu_drafter, input_ids, attention_mask, max_new_tokens=24,
                               num_draft_tokens=num_draft_tokens, pad_token_id=0, backend="triton")
        assert torch.equal(out.sequences.cpu(), expected.cpu())
    sampler = tiny_llama(vocab_size=VOCAB, hidden_size=64, num_layers=2, seed=10, init_std=0.3)
    sampler_drafter = perturbed_copy(sampler, noise=0.2, seed=11)
    law = _exact_two_token_law(sampler, torch.tensor([5, 17, 33, 8]), 1.0, 0, 1.0)
    prompt = torch.tensor([5, 17, 33, 8], device=device)
    out = specdec.generate(sampler.to(device), sampler_drafter.to(device), prompt.expand(50000, -1).clone(),
                           max_new_tokens=2, num_draft_tokens=2, temperature=1.0, seed=5, backend="triton")
    pairs = out.sequences[:, -2:].cpu()
    counts = torch.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB * VOCAB)
    assert_follows(counts, law.flatten(), what="joint law of (x1, x2) on the GPU")
