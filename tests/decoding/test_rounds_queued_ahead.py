"""Rounds queued ahead of the host: with one K and no stop strings or streaming, the static path queues each round
before it reads the last one's flags, and the round queued after the last one must change nothing. Against rounds
read one at a time (the loop a stop string that never matches takes), the tokens, every counter and the rounds
counted are the same, for ragged rows that end at eos and at the budget, greedy and sampled, K = 0 and K > 0."""

import pytest
import torch

import specdec

from models import byte_level_tokenizer, left_padded_prompts, perturbed_copy, tiny_llama

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
NEVER = "\u2603\u2603\u2603\u2603"  # a stop string these models do not write: it only selects the loop


@pytest.fixture(scope="module")
def setting():
    tokenizer = byte_level_tokenizer()
    verifier = tiny_llama(vocab_size=len(tokenizer), hidden_size=64, num_layers=2, seed=0, init_std=0.3)
    drafter = perturbed_copy(verifier, noise=0.05, seed=1).to(DEVICE)
    verifier = verifier.to(DEVICE)
    input_ids, attention_mask = left_padded_prompts([5, 9, 2, 7], len(tokenizer), seed=4)
    input_ids, attention_mask = input_ids.to(DEVICE), attention_mask.to(DEVICE)
    greedy = verifier.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=12,
                               eos_token_id=[], pad_token_id=0)[:, input_ids.shape[1]:]
    # row 1 ends early when greedy; a 25th of the vocabulary as eos ends sampled rows at varied lengths
    eos = [int(greedy[1, 3]), *range(100, 100 + len(tokenizer) // 25)]
    return tokenizer, verifier, drafter, input_ids, attention_mask, eos


STATS = ("drafted", "accepted", "generated", "verifier_calls", "drafter_calls", "accepted_per_position",
         "attempted_per_position")


@pytest.mark.parametrize("num_draft_tokens", [0, 3])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_rounds_queued_ahead_emit_what_rounds_read_one_at_a_time_emit(setting, num_draft_tokens, temperature):
    tokenizer, verifier, drafter, input_ids, attention_mask, eos = setting
    options = dict(max_new_tokens=12, num_draft_tokens=num_draft_tokens, temperature=temperature, seed=7,
                   eos_token_id=eos, pad_token_id=0, static=True)
    ahead = specdec.generate(verifier, drafter, input_ids, attention_mask, **options)
    one_by_one = specdec.generate(verifier, drafter, input_ids, attention_mask, stop_strings=[NEVER],
                                  tokenizer=tokenizer, **options)
    assert ahead.stats.path == one_by_one.stats.path == "static"
    assert torch.equal(ahead.sequences, one_by_one.sequences)
    for name in STATS:
        assert torch.equal(getattr(ahead.stats, name), getattr(one_by_one.stats, name)), name
    assert ahead.stats.draft_lengths == one_by_one.stats.draft_lengths == [num_draft_tokens] * len(
        ahead.stats.draft_lengths)
    generated = ahead.stats.generated.tolist()
    assert min(generated) < 12 == max(generated), f"rows must end at eos and at the budget: {generated}"
    # every round but the last one left a row unfinished: the count is the longest row's
    assert len(ahead.stats.draft_lengths) == int(ahead.stats.verifier_calls.max()) - 1
