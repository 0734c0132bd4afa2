"""`specdec.generate` is lossless on both of its paths (static slot caches, eager dynamic caches): greedy equals the
verifier's own greedy decoding token for token, and sampling reproduces the verifier's joint law of the first two
tokens. Every test runs on the GPU when there is one (the static path then replays its rounds from CUDA graphs) and
on the CPU otherwise (the static path runs the same rounds without graphs)."""

import warnings

import pytest
import torch

import specdec

from models import left_padded_prompts, perturbed_copy, tiny_llama, tiny_mistral
from stats import assert_follows

VOCAB = 96
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _prompts(lengths, seed):
    input_ids, attention_mask = left_padded_prompts(lengths, VOCAB, seed=seed)
    return input_ids.to(DEVICE), attention_mask.to(DEVICE)


@pytest.fixture(scope="module")
def verifier():
    return tiny_llama(vocab_size=VOCAB, hidden_size=64, num_layers=2, seed=0, init_std=0.3).to(DEVICE)


@pytest.fixture(scope="module")
def drafters(verifier):
    return {
        "close": perturbed_copy(verifier.cpu(), noise=0.05, seed=1).to(DEVICE),  # ragged partial acceptance
        "unrelated": tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=2, init_std=0.3).to(DEVICE),
        "identical": verifier.to(DEVICE),
    }


def _reference(verifier, input_ids, attention_mask, max_new_tokens, eos_token_id=None):
    return verifier.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=eos_token_id, pad_token_id=0)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("num_draft_tokens", [1, 3, 8])
@pytest.mark.parametrize("lengths", [[6], [5, 9, 2, 7]], ids=["batch1", "batch4-ragged"])
@pytest.mark.parametrize("drafter_name", ["close", "unrelated"])
def test_greedy_equals_verifier_greedy(verifier, drafters, num_draft_tokens, lengths, drafter_name, static):
    input_ids, attention_mask = _prompts(lengths, seed=len(lengths))
    expected = _reference(verifier, input_ids, attention_mask, 24, eos_token_id=[])
    out = specdec.generate(verifier, drafters[drafter_name], input_ids, attention_mask, max_new_tokens=24,
                           num_draft_tokens=num_draft_tokens, pad_token_id=0, static=static)
    assert torch.equal(out.sequences, expected)
    stats = out.stats
    assert stats.path == ("static" if static else "eager") and stats.fallback_reason is None
    assert bool((stats.generated == 24).all())
    assert bool((stats.accepted <= stats.drafted).all())
    assert bool((stats.generated <= stats.verifier_calls * (num_draft_tokens + 1)).all())
    assert stats.draft_lengths == [num_draft_tokens] * len(stats.draft_lengths)
    # the first verifier call is the prompt pass; every later one is a round of K drafter calls, on both paths
    assert bool((stats.drafter_calls == (stats.verifier_calls - 1) * num_draft_tokens).all())
    if drafter_name == "close" and len(lengths) > 1:  # the case must exercise ragged acceptance
        assert int(stats.accepted.sum()) > 0 and len(set(stats.acceptance_rate.tolist())) > 1


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("num_draft_tokens", [0, "auto"])
def test_plain_and_automatic_draft_lengths_are_lossless(verifier, drafters, num_draft_tokens, static):
    input_ids, attention_mask = _prompts([5, 9, 2, 7], seed=4)
    expected = _reference(verifier, input_ids, attention_mask, 40, eos_token_id=[])
    for name in ("close", "unrelated", "identical"):
        out = specdec.generate(verifier, drafters[name], input_ids, attention_mask, max_new_tokens=40,
                               num_draft_tokens=num_draft_tokens, pad_token_id=0, static=static)
        assert torch.equal(out.sequences, expected), name
        lengths = out.stats.draft_lengths
        if num_draft_tokens == 0:
            assert set(lengths) == {0} and int(out.stats.drafted.sum()) == 0
            assert bool((out.stats.verifier_calls == 40).all())
        else:  # which K "auto" picks depends on measured times; what it must keep is the output
            assert set(lengths) <= {0, 1, 2, 3, 4, 6, 8}
            if name == "identical" and int(out.stats.drafted.sum()):
                assert out.stats.total_acceptance_rate == 1.0


def test_automatic_draft_length_stops_drafting_for_a_useless_drafter_and_keeps_probing():
    from specdec.decoding.draft_length import DraftLengthController, expected_tokens

    times = {0: 1.0, 1: 1.2, 2: 1.4, 4: 1.8, 8: 2.6}
    controller = DraftLengthController(times, probe_every=16)
    for _ in range(20):
        controller.observe(accepted=9, attempted=10)  # alpha = 0.9
    best = max(times, key=lambda k: expected_tokens(0.9, k) / times[k])
    assert controller.choose() == best == 8
    for _ in range(40):
        controller.observe(accepted=0, attempted=10)
    chosen = [controller.choose() for _ in range(32)]
    assert chosen.count(0) == 30 and chosen[15] == chosen[31] == 1, "plain decoding, one K = 1 probe every 16 rounds"
    assert expected_tokens(0.5, 2) == 1.75 and expected_tokens(0.3, 0) == 1.0


def test_static_path_falls_back_with_a_reason_for_models_it_cannot_run(verifier, drafters):
    input_ids, attention_mask = _prompts([4, 6], seed=7)
    window_model = tiny_mistral(sliding_window=64, vocab_size=VOCAB, seed=0).to(DEVICE)
    window_drafter = tiny_mistral(sliding_window=64, vocab_size=VOCAB, seed=1).to(DEVICE)
    out = specdec.generate(window_model, window_drafter, input_ids, attention_mask, max_new_tokens=6,
                           num_draft_tokens=2, static=True)
    assert out.stats.path == "eager" and "sliding-window" in out.stats.fallback_reason
    assert torch.equal(out.sequences, _reference(window_model, input_ids, attention_mask, 6, eos_token_id=[]))
    default = specdec.generate(verifier, drafters["close"], input_ids, attention_mask, max_new_tokens=4)
    assert default.stats.path == ("static" if DEVICE.type == "cuda" else "eager"), "static by default on CUDA only"
    assert default.stats.fallback_reason is None
    with pytest.raises(ValueError, match="num_draft_tokens must be an integer >= 0 or 'auto'"):
        specdec.generate(verifier, drafters["close"], input_ids, attention_mask, num_draft_tokens="many")
    with pytest.raises(TypeError, match="static must be True, False or None"):
        specdec.generate(verifier, drafters["close"], input_ids, attention_mask, static="yes")


def test_sliding_window_models_run_within_their_window_and_are_refused_past_it():
    # the caches keep one slot layout (K + 1 slots a round, masked holes where rows accepted less); a sliding window
    # counts slots, so a call that could outgrow it is refused with a clear error instead of transformers' crop
    # error or a silently shorter context
    input_ids, attention_mask = _prompts([5, 9, 2, 7], seed=4)
    roomy = tiny_mistral(sliding_window=64, vocab_size=VOCAB, seed=0).to(DEVICE)
    roomy_drafter = tiny_mistral(sliding_window=64, vocab_size=VOCAB, seed=1).to(DEVICE)
    expected = _reference(roomy, input_ids, attention_mask, 12, eos_token_id=[])
    out = specdec.generate(roomy, roomy_drafter, input_ids, attention_mask, max_new_tokens=12, num_draft_tokens=3,
                           pad_token_id=0)  # 9 + 12 * 4 = 57 slots at most
    assert torch.equal(out.sequences, expected)
    narrow = tiny_mistral(sliding_window=16, vocab_size=VOCAB, seed=0).to(DEVICE)
    for verifier, drafter, name in ((narrow, roomy_drafter, "verifier"), (roomy, narrow, "drafter")):
        with pytest.raises(ValueError, match=f"{name} uses sliding-window attention .window 16.*9 \\+ 4 \\* 3 = 21"):
            specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=4, num_draft_tokens=2)


def test_greedy_equals_verifier_greedy_with_sdpa_attention():
    verifier = tiny_llama(vocab_size=VOCAB, hidden_size=64, num_layers=2, seed=0, init_std=0.3)
    drafter = perturbed_copy(verifier, noise=0.05, seed=1).to(DEVICE)
    verifier.to(DEVICE)
    for model in (verifier, drafter):
        model.set_attn_implementation("sdpa")
    input_ids, attention_mask = _prompts([5, 9, 2, 7], seed=4)
    expected = _reference(verifier, input_ids, attention_mask, 24, eos_token_id=[])
    out = specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=24, num_draft_tokens=3,
                           pad_token_id=0)
    assert verifier.config._attn_implementation == "sdpa"
    assert torch.equal(out.sequences, expected)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_greedy_rows_stop_at_eos_independently(verifier, drafters, static):
    input_ids, attention_mask = _prompts([5, 9, 2, 7], seed=4)
    free_run = _reference(verifier, input_ids, attention_mask, 20, eos_token_id=[])
    eos = int(free_run[1, input_ids.shape[1] + 3])  # row 1 emits it at its 4th step
    expected = _reference(verifier, input_ids, attention_mask, 20, eos_token_id=eos)
    for num_draft_tokens in (1, 3, 8):
        out = specdec.generate(verifier, drafters["close"], input_ids, attention_mask, max_new_tokens=20,
                               num_draft_tokens=num_draft_tokens, eos_token_id=eos, pad_token_id=0, static=static)
        width = expected.shape[1]
        assert torch.equal(out.sequences[:, :width], expected)
        assert bool((out.sequences[:, width:] == 0).all())
        assert int(out.stats.generated[1]) <= 4
    assert int(out.stats.generated.max()) == 20, "other rows keep going after row 1 stops"


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_acceptance_counts_stop_at_an_emitted_eos(verifier, drafters, static):
    input_ids, attention_mask = _prompts([5, 9], seed=4)
    free_run = _reference(verifier, input_ids, attention_mask, 12, eos_token_id=[])
    eos = int(free_run[0, input_ids.shape[1] + 3])  # row 0's 4th token, inside the first round of 8 drafts
    out = specdec.generate(verifier, drafters["identical"], input_ids, attention_mask, max_new_tokens=12,
                           num_draft_tokens=8, eos_token_id=eos, pad_token_id=0, static=static)
    stats = out.stats
    first_row_tokens = int(stats.generated[0])
    assert first_row_tokens <= 4
    # every emitted token of row 0 but the first (sampled by the prompt pass) is an accepted draft; the drafts the
    # verifier also accepted after the eos are not counted
    assert int(stats.accepted[0]) == first_row_tokens - 1
    assert int(stats.accepted_per_position[0].sum()) == int(stats.accepted[0])


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_identical_drafter_accepts_everything(verifier, drafters, static):
    input_ids, attention_mask = _prompts([4, 8], seed=5)
    # both paths take the first token from the prompt pass, then 4 rounds of 5: 21 tokens in 5 verifier calls
    out = specdec.generate(verifier, drafters["identical"], input_ids, attention_mask, max_new_tokens=21,
                           num_draft_tokens=4, static=static)
    assert out.stats.total_acceptance_rate == 1.0
    assert bool((out.stats.verifier_calls == 5).all())
    assert out.stats.tokens_per_round.tolist() == [5.0, 5.0]  # E[N] at alpha = 1, K = 4
    assert out.stats.summary()["tokens_per_round"] == 5.0
    # the call splits at its first token: setup and the prompt pass before it, the rounds after it
    assert 0 < out.stats.time_to_first_token_s < out.stats.wall_time_s
    assert out.stats.summary()["time_to_first_token_s"] == out.stats.time_to_first_token_s


def _exact_two_token_law(verifier, prompt, temperature, top_k, top_p):
    with torch.no_grad():
        first = verifier(prompt[None]).logits[0, -1]
        p1 = torch.softmax(specdec.filter_logits(first / temperature, top_k, top_p).double(), -1)
        extended = torch.cat([prompt.expand(VOCAB, -1), torch.arange(VOCAB, device=prompt.device)[:, None]], dim=1)
        second = verifier(extended).logits[:, -1]
        p2 = torch.softmax(specdec.filter_logits(second / temperature, top_k, top_p).double(), -1)
    return (p1[:, None] * p2).cpu()


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 12, 0.9)])
def test_sampling_joint_law_of_first_two_tokens_matches_verifier(temperature, top_k, top_p, static):
    # (the static path samples x1 from the prompt's call and x2 in the first round, by rejection sampling)
    verifier = tiny_llama(vocab_size=VOCAB, hidden_size=64, num_layers=2, seed=10, init_std=0.3)
    drafter = perturbed_copy(verifier, noise=0.2, seed=11).to(DEVICE)
    verifier.to(DEVICE)
    prompt = torch.tensor([5, 17, 33, 8], device=DEVICE)
    rows = 12000
    out = specdec.generate(verifier, drafter, prompt.expand(rows, -1).clone(), max_new_tokens=2,
                           num_draft_tokens=2, temperature=temperature, top_k=top_k, top_p=top_p, seed=123,
                           static=static)
    pairs = out.sequences[:, prompt.shape[0]: prompt.shape[0] + 2].cpu()
    counts = torch.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB * VOCAB)
    law = _exact_two_token_law(verifier, prompt, temperature, top_k, top_p)
    assert_follows(counts, law.flatten(), what="joint law of (x1, x2)")
    assert 0.05 < out.stats.total_acceptance_rate < 0.95, "the drafter must be neither useless nor perfect here"


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_seed_makes_sampling_reproducible(verifier, drafters, static):
    input_ids, attention_mask = _prompts([4, 8, 3], seed=6)
    runs = [specdec.generate(verifier, drafters["close"], input_ids, attention_mask, max_new_tokens=16,
                             num_draft_tokens=3, temperature=1.0, seed=seed, static=static).sequences
            for seed in (7, 7, 8)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_rows_that_can_reach_past_the_models_positions_warn():
    verifier, drafter = tiny_llama(), tiny_llama(seed=1, num_layers=1)
    verifier.config.max_position_embeddings = 24
    input_ids, attention_mask = left_padded_prompts([8, 5], 96)
    with pytest.warns(specdec.SpecdecWarning, match="24 .max_position_embeddings"):  # 8 + 13 + 4 > 24
        specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=13, num_draft_tokens=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", specdec.SpecdecWarning)  # 8 + 12 + 4 = 24 fits
        specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=12, num_draft_tokens=4)


def test_vocabularies_differing_by_padding_rows_use_the_shared_range(verifier):
    padded_drafter = tiny_llama(vocab_size=VOCAB + 32, hidden_size=32, num_layers=1, seed=3, init_std=0.3).to(DEVICE)
    input_ids, attention_mask = _prompts([4, 6], seed=7)
    with pytest.raises(ValueError, match="vocab_size"):
        specdec.generate(verifier, padded_drafter, input_ids, attention_mask, max_new_tokens=4)
    out = specdec.generate(verifier, padded_drafter, input_ids, attention_mask, max_new_tokens=12,
                           vocab_size=VOCAB, pad_token_id=0)
    assert torch.equal(out.sequences, _reference(verifier, input_ids, attention_mask, 12, eos_token_id=[]))


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs, Triton sampler)")


@GPU
@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_gpu_sampling_with_the_triton_sampler_follows_the_verifier(static):
    sampler = tiny_llama(vocab_size=VOCAB, hidden_size=64, num_layers=2, seed=10, init_std=0.3)
    sampler_drafter = perturbed_copy(sampler, noise=0.2, seed=11).to(DEVICE)
    sampler.to(DEVICE)
    prompt = torch.tensor([5, 17, 33, 8], device=DEVICE)
    law = _exact_two_token_law(sampler, prompt, 1.0, 0, 1.0)
    out = specdec.generate(sampler, sampler_drafter, prompt.expand(50000, -1).clone(), max_new_tokens=2,
                           num_draft_tokens=2, temperature=1.0, seed=5, backend="triton", static=static)
    assert out.stats.path == ("static" if static else "eager")
    pairs = out.sequences[:, -2:].cpu()
    counts = torch.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB * VOCAB)
    assert_follows(counts, law.flatten(), what="joint law of (x1, x2) on the GPU")


@GPU
def test_gpu_compiled_static_path_is_lossless(verifier, drafters):
    input_ids, attention_mask = _prompts([5, 9, 2, 7], seed=4)
    expected = _reference(verifier, input_ids, attention_mask, 24, eos_token_id=[])
    for num_draft_tokens in (3, "auto"):
        out = specdec.generate(verifier, drafters["close"], input_ids, attention_mask, max_new_tokens=24,
                               num_draft_tokens=num_draft_tokens, pad_token_id=0, compile=True, runner="hf")
        assert out.stats.path == "static" and out.stats.fallback_reason is None and out.stats.compiled
        assert torch.equal(out.sequences, expected)


@GPU
def test_gpu_rounds_are_captured_once_per_shape_and_reused(verifier, drafters):
    from specdec.decoding.static import _ENGINES, clear_engines

    clear_engines()
    for lengths, max_new_tokens in (([5, 9, 2, 7], 24), ([3, 11, 6, 4], 20)):  # one cache-size bucket
        input_ids, attention_mask = _prompts(lengths, seed=len(lengths) + max_new_tokens)
        expected = _reference(verifier, input_ids, attention_mask, max_new_tokens, eos_token_id=[])
        out = specdec.generate(verifier, drafters["close"], input_ids, attention_mask,
                               max_new_tokens=max_new_tokens, num_draft_tokens=3, pad_token_id=0)
        assert out.stats.path == "static" and torch.equal(out.sequences, expected)
        engines = list(_ENGINES[verifier].values())
        assert len(engines) == 1 and len(engines[0].steps) == 1, "one engine, one captured round shape"
    clear_engines()
