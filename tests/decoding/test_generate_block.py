"""`specdec.generate(..., verification="block")` is lossless end to end on both paths (static slot caches, eager
dynamic caches): sampled rounds that keep several drafts reproduce the verifier's joint law of consecutive tokens, and
greedy decoding is the verifier's own (the arg-max rule under both schemes). On the GPU the Triton sampler runs."""

import pytest
import torch

import specdec

from models import left_padded_prompts, perturbed_copy, tiny_llama
from stats import assert_follows

VOCAB = 96
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PROMPT = [5, 17, 33, 8]


@pytest.fixture(scope="module")
def pair():
    verifier = tiny_llama(vocab_size=VOCAB, hidden_size=64, num_layers=2, seed=10, init_std=0.3)
    drafter = perturbed_copy(verifier, noise=0.2, seed=11).to(DEVICE)
    return verifier.to(DEVICE), drafter


def _exact_law_of_second_and_third_tokens(verifier, temperature, top_k, top_p):
    """[V, V] float64 law of (x2, x3) after ``PROMPT``: sum over x1 of p(x1) p(x2 | x1) p(x3 | x1, x2)."""
    prompt = torch.tensor(PROMPT, device=DEVICE)

    def law(prefixes):
        logits = verifier(prefixes).logits[:, -1]
        return torch.softmax(specdec.filter_logits(logits / temperature, top_k, top_p).double(), -1)

    ids = torch.arange(VOCAB, device=DEVICE)
    with torch.no_grad():
        p1 = law(prompt[None])[0]  # [V]
        p2 = law(torch.cat([prompt.expand(VOCAB, -1), ids[:, None]], 1))  # [V x1, V x2]
        pairs = torch.cartesian_prod(ids, ids)  # (x1, x2), x1-major
        p3 = law(torch.cat([prompt.expand(VOCAB * VOCAB, -1), pairs], 1)).view(VOCAB, VOCAB, VOCAB)
    return torch.einsum("a,ab,abc->bc", p1, p2, p3).cpu()


@pytest.mark.parametrize("temperature,top_k,top_p,static", [(1.0, 0, 1.0, False), (0.7, 12, 0.9, True)],
                         ids=["T1-eager", "T0.7-topk-topp-static"])
def test_block_rounds_reproduce_the_verifiers_joint_law_of_consecutive_tokens(pair, temperature, top_k, top_p,
                                                                              static):
    # x1 comes from the prompt pass; the first round verifies 2 drafts as a block and emits x2 and x3 when it keeps
    # at least one draft (else x3 comes from the next round): (x2, x3) must follow the verifier's joint law
    verifier, drafter = pair
    rows = 8000
    out = specdec.generate(verifier, drafter, torch.tensor(PROMPT, device=DEVICE).expand(rows, -1).clone(),
                           max_new_tokens=3, num_draft_tokens=2, temperature=temperature, top_k=top_k, top_p=top_p,
                           seed=321, static=static, verification="block")
    assert out.stats.path == ("static" if static else "eager")
    tokens = out.sequences[:, len(PROMPT) + 1:].cpu()
    law = _exact_law_of_second_and_third_tokens(verifier, temperature, top_k, top_p)
    assert_follows(torch.bincount(tokens[:, 0] * VOCAB + tokens[:, 1], minlength=VOCAB * VOCAB), law.flatten(),
                   what="joint law of (x2, x3)")
    assert 0.05 < out.stats.total_acceptance_rate < 0.95, "the drafter must be neither useless nor perfect here"


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_verification_reaches_the_sampler_and_greedy_is_the_verifiers(pair, static):
    verifier, drafter = pair
    input_ids, attention_mask = left_padded_prompts([5, 9, 2, 7] * 4, VOCAB, seed=3)
    input_ids, attention_mask = input_ids.to(DEVICE), attention_mask.to(DEVICE)
    runs = {scheme: specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=10,
                                     num_draft_tokens=4, temperature=1.0, seed=9, static=static, verification=scheme)
            for scheme in ("token", "block")}
    assert not torch.equal(runs["token"].sequences, runs["block"].sequences)  # same seeds, other decisions
    expected = verifier.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=10,
                                 eos_token_id=[], pad_token_id=0)
    greedy = specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=10, num_draft_tokens=4,
                              pad_token_id=0, static=static, verification="block")
    assert torch.equal(greedy.sequences, expected)
    with pytest.raises(ValueError, match="verification must be one of"):
        specdec.generate(verifier, drafter, input_ids, attention_mask, verification="tokens")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs, Triton sampler)")
@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_gpu_block_rounds_with_the_triton_sampler_follow_the_verifier(pair, static):
    verifier, drafter = pair
    rows = 100_000
    out = specdec.generate(verifier, drafter, torch.tensor(PROMPT, device=DEVICE).expand(rows, -1).clone(),
                           max_new_tokens=3, num_draft_tokens=2, temperature=1.0, seed=5, backend="triton",
                           static=static, verification="block")
    assert out.stats.path == ("static" if static else "eager")
    tokens = out.sequences[:, len(PROMPT) + 1:].cpu()
    law = _exact_law_of_second_and_third_tokens(verifier, 1.0, 0, 1.0)
    assert_follows(torch.bincount(tokens[:, 0] * VOCAB + tokens[:, 1], minlength=VOCAB * VOCAB), law.flatten(),
                   what="joint law of (x2, x3) on the GPU")
