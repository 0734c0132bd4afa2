"""The model-free n-gram drafter: its proposal rule on hand-made sequences, padding and holes skipped on both paths,
one-hot drafts through the rejection sampler, and `specdec.generate` with it lossless on both paths (greedy equal to
transformers' greedy decoding, sampling following the verifier's joint law of three tokens), with stats and the
teacher-forced fairness measurements. The verifier of the decoding tests is a tiny Llama that mostly walks short
cycles of tokens (each token's likeliest successor is fixed), so that prompt lookup finds drafts worth accepting."""

from __future__ import annotations

import itertools

import pytest
import torch

import specdec
from specdec.decoding.ngram import (
    NgramRunner,
    NgramSlot,
    ngram_propose,
    one_hot_logits,
    prefix_proposals,
)
from specdec.fairness.teacher_forcing import token_divergences

from models import tiny_llama
from stats import assert_follows

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs, Triton sampler)")
VOCAB = 64


def lookup(tokens: list[int], max_ngram: int, min_ngram: int) -> int:
    """The proposal rule written out plainly: the follower of the most recent earlier occurrence of the last n
    tokens, longest n first; else the last token."""
    length = len(tokens)
    for n in range(max_ngram, min_ngram - 1, -1):
        suffix = tokens[length - n:] if n <= length else None
        for start in range(length - n - 1, -1, -1):
            if suffix is not None and tokens[start: start + n] == suffix:
                return tokens[start + n]
    return tokens[-1]


def cycling_llama(vocab: int = VOCAB, seed: int = 0, sharpness: float = 8.0, context: float = 0.1):
    """A tiny Llama whose likeliest next token after x is ``successor[x]``, a permutation made of cycles of 3-6 ids;
    attention and MLP outputs are scaled by ``context`` (the model still reads its context, a little).
    ``sharpness``: the logit margin of the successor (p(successor) about 0.6-0.95 at 6-8)."""
    model = tiny_llama(vocab_size=vocab, hidden_size=32, num_layers=2, seed=seed, init_std=0.3)
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(vocab, generator=generator).tolist()
    successor = list(range(vocab))
    start = 0
    while start < vocab:
        cycle = order[start: start + int(torch.randint(3, 7, (1,), generator=generator))]
        for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True):
            successor[a] = b
        start += len(cycle)
    with torch.no_grad():
        embedding = torch.randn(vocab, 32, generator=generator)
        model.model.embed_tokens.weight.copy_(embedding)
        head = torch.zeros(vocab, 32)
        head[torch.tensor(successor)] = embedding / embedding.norm(dim=1, keepdim=True) * sharpness / 32**0.5
        model.lm_head.weight.copy_(head)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(context)
            layer.mlp.down_proj.weight.mul_(context)
    return model.to(DEVICE), successor


@pytest.fixture(scope="module")
def verifier():
    return cycling_llama()[0]


def repetitive_prompts(lengths: list[int], seed: int = 0):
    """Left-padded prompts that repeat a short random phrase (so lookups match inside the prompt)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.zeros((len(lengths), width), dtype=torch.int64)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        phrase = torch.randint(3, VOCAB, (int(torch.randint(2, 5, (1,), generator=generator)),), generator=generator)
        input_ids[row, width - length:] = phrase.repeat(length)[:length]
        attention_mask[row, width - length:] = 1
    return input_ids.to(DEVICE), attention_mask.to(DEVICE)


# ---------------------------------------------------------------------------------------------------- the rule
HAND_MADE = [  # (tokens, max_ngram, min_ngram, proposal)
    ([5, 6, 7, 5, 6, 9, 5, 6], 3, 1, 9),  # the most recent [5, 6] is followed by 9 (the first one by 7)
    ([1, 2, 3, 9, 2, 3, 4, 1, 2, 3], 3, 1, 9),  # the 3-gram [1, 2, 3] wins over the more recent 2-gram [2, 3]
    ([1, 2, 3, 9, 2, 3, 4, 1, 2, 3], 2, 1, 4),  # at most 2-grams: the most recent [2, 3]
    ([4, 8, 5, 8], 3, 1, 5),  # only the 1-gram [8] occurs before
    ([4, 8, 5, 8], 3, 2, 8),  # ... which min_ngram = 2 leaves out: the last token
    ([4, 5, 6], 3, 1, 6),  # no match: the last token
    ([7, 7, 7], 3, 1, 7),  # an occurrence may overlap the suffix ([7, 7] at 0, followed by 7)
    ([9], 3, 1, 9),
    ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], 1, 1, 3),  # of the earlier 5s the most recent is followed by 3 (not 9)
]


@pytest.mark.parametrize("tokens,max_ngram,min_ngram,expected", HAND_MADE)
def test_proposal_rule_on_hand_made_sequences(tokens, max_ngram, min_ngram, expected):
    assert lookup(tokens, max_ngram, min_ngram) == expected
    # batched with a row whose tail (past its length) would match if it were read
    width = len(tokens) + 4
    table = torch.tensor([tokens + [tokens[-1], expected + 1, 0, 0], [1] * width])
    lengths = torch.tensor([len(tokens), 1])
    out = ngram_propose(table, lengths, max_ngram, min_ngram)
    assert out.tolist() == [expected, 1]
    ids, mask = torch.tensor([tokens + [0, 0]]), torch.tensor([[1] * len(tokens) + [0, 0]])
    assert int(prefix_proposals(ids, mask, max_ngram, min_ngram)[0, len(tokens) - 1]) == expected


def test_proposals_follow_the_rule_on_random_sequences():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (16,), generator=generator)
    table = torch.randint(0, 4, (16, 40), generator=generator)  # 4 symbols: many matches of every length
    mask = (torch.arange(40)[None] < lengths[:, None]).long()
    for max_ngram, min_ngram in ((3, 1), (4, 2), (1, 1)):
        rows = [table[b, :length].tolist() for b, length in enumerate(lengths.tolist())]
        expected = [lookup(row, max_ngram, min_ngram) for row in rows]
        assert ngram_propose(table, lengths, max_ngram, min_ngram).tolist() == expected
        every_prefix = prefix_proposals(table, mask, max_ngram, min_ngram)
        for b, row in enumerate(rows):
            assert every_prefix[b, : len(row)].tolist() == [lookup(row[: t + 1], max_ngram, min_ngram)
                                                           for t in range(len(row))]


def test_static_slot_skips_prompt_padding_and_masked_slots():
    # row 0: left padding of 6s (read as tokens, [6, 6, 2, 6] would propose 2); row 1: a hole inside the prompt
    # (read as a token, [9, 0, 5, 9] would propose the 0)
    ids = torch.tensor([[6, 6, 2, 6], [9, 0, 5, 9]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 0, 1, 1]], dtype=torch.bool)
    capacity = 8
    key_ok = torch.ones((2, capacity), dtype=torch.bool)
    key_ok[:, :4] = mask
    positions = torch.arange(capacity).expand(2, capacity) - 4 + mask.sum(1, keepdim=True)
    positions[:, :4] = (mask.long().cumsum(1) - 1).clamp(min=0)
    slot = NgramSlot(specdec.ngram_drafter(), 2, capacity, 16, key_ok, positions.contiguous())
    logits = slot.forward(ids, torch.arange(4).expand(2, 4), 1)
    assert logits.shape == (2, 1, 16) and logits.argmax(-1)[:, 0].tolist() == [6, 5]
    assert bool((torch.isinf(logits) | (logits == 0)).all()) and int((logits == 0).sum()) == 2
    # a round's first call rewrites [prev, pending] and proposes after pending; then one draft per call
    assert slot.forward(torch.tensor([[6, 2], [9, 5]]), torch.tensor([[3, 4], [3, 4]]), 1).argmax(-1)[:, 0].tolist() \
        == [6, 9]  # row 0: [2, 6, 2] -> after the earlier 2 came 6; row 1: [9, 5, 9, 5] -> 9
    assert slot.forward(torch.tensor([[6], [9]]), torch.tensor([[5], [5]]), 1).argmax(-1)[:, 0].tolist() == [2, 5]


def test_eager_runner_skips_holes_and_overwrites_rejected_drafts():
    runner = NgramRunner(specdec.ngram_drafter(max_ngram=2), 16)
    seq = torch.tensor([[0, 1, 2, 3, 1, 2, 7, 8, 3, 1]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 0, 1, 1]])
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    out = runner.forward(seq[:, :6], mask[:, :6], positions[:, :6], 1)  # tokens [1, 2, 3, 1, 2]
    assert int(out.argmax(-1)) == lookup([1, 2, 3, 1, 2], 2, 1) == 3
    # slot 6 held a draft (7); the round rejected the one after it (slot 7 became a hole) and put 3 at slot 8
    out = runner.forward(seq[:, 6:9], mask[:, :9], positions[:, 6:9], 1)  # tokens [1, 2, 3, 1, 2, 7, 3]
    assert int(out.argmax(-1)) == lookup([1, 2, 3, 1, 2, 7, 3], 2, 1) == 1
    runner.crop(6)  # the eager path crops, then the next call re-reads the slots from 6 on, slot 6 now a 3
    seq[0, 6], mask[0, 7:] = 3, torch.tensor([0, 0, 1])
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    out = runner.forward(seq[:, 6:10], mask[:, :10], positions[:, 6:10], 2)  # tokens [1, 2, 3, 1, 2, 3, 1]
    assert out.argmax(-1)[0].tolist() == [lookup([1, 2, 3, 1, 2, 3], 2, 1), lookup([1, 2, 3, 1, 2, 3, 1], 2, 1)]
    assert out.argmax(-1)[0].tolist() == [1, 2]


def test_drafter_arguments_are_checked():
    assert specdec.ngram_drafter(4, 2) is specdec.ngram_drafter(max_ngram=4, min_ngram=2)  # engines are reused
    assert repr(specdec.ngram_drafter()) == "ngram_drafter(max_ngram=3, min_ngram=1)"
    with pytest.raises(ValueError, match="min_ngram must be <= max_ngram"):
        specdec.ngram_drafter(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="max_ngram"):
        specdec.ngram_drafter(max_ngram=0)
    verifier = tiny_llama(vocab_size=VOCAB)
    with pytest.raises(TypeError, match="drafter must be .*'ngram', got 'prompt-lookup'"):
        specdec.generate(verifier, "prompt-lookup", torch.tensor([[3, 4]]), max_new_tokens=2)


# ---------------------------------------------------------------------------------------------------- the sampler
def _one_hot_case(vocab: int, seed: int):
    """Target logits [1, 3, V] and two one-hot drafts: x1 the second likeliest token at position 0 (p(x1) about
    0.1-0.3), x2 the likeliest at position 1."""
    generator = torch.Generator().manual_seed(seed)
    target = torch.randn(1, 3, vocab, generator=generator) * 1.5
    drafts = torch.stack([target[0, 0].argsort()[-2], target[0, 1].argmax()])[None]
    return target, drafts, one_hot_logits(drafts, vocab)


def test_one_hot_draft_logits_give_the_exact_rejection_rule():
    """q one-hot at x: x is accepted with probability p(x) and the token after a rejection follows p without x, so
    the first emitted token follows p, and after an accepted x the next one follows p at position 1."""
    vocab, rows = 40, 20000
    target, drafts, draft_logits = _one_hot_case(vocab, seed=3)
    out = specdec.rejection_sample(target.expand(rows, -1, -1), draft_logits.expand(rows, -1, -1),
                                   drafts.expand(rows, -1), 1.0, generator=torch.Generator().manual_seed(4),
                                   backend="torch")
    assert int(out.tokens[:, 0].min()) >= 0 and int(out.tokens.max()) < vocab
    p = torch.softmax(target[0].double(), -1)
    assert_follows(torch.bincount(out.tokens[:, 0], minlength=vocab), p[0], what="first emitted token")
    first_accepted = out.num_accepted >= 1
    assert_follows(torch.bincount(out.tokens[first_accepted, 1], minlength=vocab), p[1],
                   what="token after an accepted first draft")
    share, expected = float(first_accepted.double().mean()), float(p[0, drafts[0, 0]])
    assert abs(share - expected) < 10 * (expected * (1 - expected) / rows) ** 0.5 and 0.05 < expected < 0.5


# NOTE: the interpreter runs the kernel's unselected branches in numpy, which warns on log(0) and -inf - -inf
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_triton_sampler_equals_the_reference_on_one_hot_drafts():
    """The kernel reads the -inf rows of one-hot draft logits as the reference does: token for token equal (the
    interpreter on the CPU), sampled, top-k filtered and greedy, over two race tiles of ids."""
    from specdec.kernels.rejection_sampling import rejection_sample_triton
    from specdec.kernels.rejection_sampling_reference import rejection_sample_reference

    vocab, rows = 300, 16
    target, drafts, draft_logits = _one_hot_case(vocab, seed=5)
    generator = torch.Generator().manual_seed(6)
    seeds = torch.randint(0, 2**62, (rows,), generator=generator).to(DEVICE)
    offsets = torch.randint(0, 2**40, (rows,), generator=generator).to(DEVICE)
    d = draft_logits.expand(rows, -1, -1).contiguous().to(DEVICE)
    x = drafts.expand(rows, -1).contiguous().to(DEVICE)
    for temperature, top_k in ((1.0, 0), (0.7, 40), (0.0, 0)):
        t = target.expand(rows, -1, -1).contiguous().to(DEVICE)
        if top_k:
            t = specdec.filter_logits(t / temperature, top_k) * temperature
        ref = rejection_sample_reference(t, d, x, seeds, offsets, temperature)
        out = rejection_sample_triton(t, d, x, seeds, offsets, temperature)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]), (temperature, top_k)
        if temperature:
            assert 0 < int(ref[1].sum()) < 2 * rows, "some drafts accepted, some rejected"


# ---------------------------------------------------------------------------------------------------- generate
def hf_greedy(verifier, input_ids, attention_mask, max_new_tokens):
    return verifier.generate(input_ids, attention_mask=attention_mask, do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=[], pad_token_id=0)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("num_draft_tokens", [1, 4, "auto"])
def test_greedy_equals_transformers_greedy(verifier, num_draft_tokens, static):
    input_ids, attention_mask = repetitive_prompts([7, 12, 4], seed=1)
    expected = hf_greedy(verifier, input_ids, attention_mask, 32)
    drafter = "ngram" if num_draft_tokens != 1 else specdec.ngram_drafter(max_ngram=2)
    out = specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=32,
                           num_draft_tokens=num_draft_tokens, pad_token_id=0, static=static)
    assert torch.equal(out.sequences, expected)
    stats = out.stats
    assert stats.path == ("static" if static else "eager") and stats.fallback_reason is None
    if num_draft_tokens == "auto":  # K follows measured times; without drafts it probes one every 16 rounds
        assert int(stats.drafted.sum()) > 0 and set(stats.draft_lengths) <= {0, 1, 2, 3, 4, 6, 8}
    else:  # one proposal per draft: K per round after the prompt pass
        assert int(stats.accepted.sum()) > 0 and len(set(stats.acceptance_rate.tolist())) > 1, "ragged acceptance"
        assert bool((stats.drafter_calls == (stats.verifier_calls - 1) * num_draft_tokens).all())
        assert bool((stats.drafted == stats.drafter_calls).all())


def test_both_paths_make_the_same_draws():
    """The drafts are the same function of each row's tokens on both paths (holes and padding skipped), so with one
    seed both paths sample the same sequences."""
    verifier = cycling_llama(seed=1, sharpness=7.0)[0]
    input_ids, attention_mask = repetitive_prompts([5, 9, 3, 6], seed=2)
    runs = [specdec.generate(verifier, "ngram", input_ids, attention_mask, max_new_tokens=24, num_draft_tokens=3,
                             temperature=1.0, seed=11, static=static) for static in (False, True)]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert torch.equal(runs[0].stats.accepted, runs[1].stats.accepted) and int(runs[0].stats.accepted.sum()) > 0


def _exact_three_token_law(verifier, prompt, vocab):
    """P(x1, x2, x3 | prompt) [V, V, V] by enumeration."""
    with torch.no_grad():
        p1 = torch.softmax(verifier(prompt[None]).logits[0, -1].double(), -1)
        ones = torch.arange(vocab, device=prompt.device)
        two = torch.cat([prompt.expand(vocab, -1), ones[:, None]], dim=1)
        p2 = torch.softmax(verifier(two).logits[:, -1].double(), -1)
        pairs = torch.tensor(list(itertools.product(range(vocab), repeat=2)), device=prompt.device)
        three = torch.cat([prompt.expand(vocab * vocab, -1), pairs], dim=1)
        p3 = torch.softmax(verifier(three).logits[:, -1].double(), -1).view(vocab, vocab, vocab)
    return (p1[:, None, None] * p2[:, :, None] * p3).cpu()


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_sampling_follows_the_verifier_joint_law_of_three_tokens(static):
    # x1 comes from the prompt pass, x2 and x3 from rounds of K = 2 drafts (chained proposals)
    vocab = 16
    verifier, successor = cycling_llama(vocab=vocab, seed=3, sharpness=6.0, context=0.3)
    start = 5
    cycle = [start]
    while successor[cycle[-1]] != start:
        cycle.append(successor[cycle[-1]])
    prompt = torch.tensor((cycle * 3)[:7], device=DEVICE)
    rows = 6000
    out = specdec.generate(verifier, "ngram", prompt.expand(rows, -1).clone(), max_new_tokens=3, num_draft_tokens=2,
                           temperature=1.0, seed=5, static=static)
    triples = out.sequences[:, prompt.shape[0]:].cpu()
    counts = torch.bincount((triples[:, 0] * vocab + triples[:, 1]) * vocab + triples[:, 2], minlength=vocab**3)
    assert_follows(counts, _exact_three_token_law(verifier, prompt, vocab).flatten(), what="law of (x1, x2, x3)")
    assert 0.05 < out.stats.total_acceptance_rate < 0.95, "drafts must be accepted and rejected"
    assert float(out.stats.acceptance_per_position[:, 1].nanmean()) > 0, "second drafts must be tested and accepted"


# ---------------------------------------------------------------------------------------------------- fairness
def test_teacher_forced_alpha_is_the_verifier_probability_of_the_proposal(verifier):
    # row 0: the verifier's own greedy continuation of a short prompt (drafts are often its arg-max); row 1: padded
    greedy = hf_greedy(verifier, torch.tensor([[5, 9, 5]], device=DEVICE), None, 9)[0].tolist()
    texts = torch.tensor([greedy, [3, 3, 3, 8, 3] + [0] * 7], device=DEVICE)
    lengths = (12, 5)
    mask = (torch.arange(12, device=DEVICE)[None] < torch.tensor([[12], [5]], device=DEVICE)).long()
    with torch.no_grad():
        logits = verifier(texts, attention_mask=mask).logits.double().cpu()
    for temperature in (1.0, 0.5, 0.0):
        div = token_divergences(verifier, "ngram", texts, mask, temperature=temperature, backend="torch")
        alpha, ref_q = [], []
        for b, length in enumerate(lengths):
            row = texts[b, :length].tolist()
            for t in range(length - 1):
                draft = lookup(row[: t + 1], 3, 1)
                if temperature > 0:
                    alpha.append(float(torch.softmax(logits[b, t] / temperature, -1)[draft]))
                else:
                    alpha.append(float(logits[b, t].argmax() == draft))
                ref_q.append(float(draft == row[t + 1]))
        alpha = torch.tensor(alpha, dtype=torch.float64)
        torch.testing.assert_close(div.alpha.double(), alpha, rtol=1e-5, atol=1e-6)
        if temperature > 0:  # (greedy: TV is taken at temperature 1, alpha is the arg-max test)
            torch.testing.assert_close(div.tv.double(), 1 - alpha, rtol=1e-5, atol=1e-5)
        assert div.ref_q.tolist() == ref_q and sum(ref_q) >= 3
        assert float(alpha.max()) > 0.5 and float(alpha.min()) < 0.5
        assert bool(torch.isinf(div.cross_entropy).all() & torch.isfinite(div.entropy).all())


def test_evaluate_measures_an_ngram_drafter_per_task(verifier):
    tasks = {"repeats": {"prompts": [[5, 9, 5, 9], [4, 4, 4]], "texts": [[5, 9, 5, 9, 5, 9, 5]]},
             "varied": {"prompts": [[7, 3, 11]], "texts": [[7, 3, 11, 20, 31, 2, 9]]}}
    report = specdec.evaluate(verifier, "ngram", tasks, num_draft_tokens=3, temperature=1.0, max_new_tokens=8,
                              batch_size=2, progress=False, wall_clock_repeats=1, backend="torch")
    assert report.summary["cost_ratio_source"] == "measured" and report.summary["cost_ratio"] > 0
    for row in report.tasks:
        assert 0 < row.alpha < 1 and row.tv == pytest.approx(1 - row.alpha, abs=1e-5)
        assert row.speedup_measured is not None and row.alpha_measured is not None
    assert report.summary["U_ce"] == float("inf")


# ---------------------------------------------------------------------------------------------------- GPU
@GPU
def test_gpu_captured_rounds_are_lossless_and_reused(verifier):
    """On CUDA the proposal runs inside each round's CUDA graph: greedy equals transformers for fixed K and "auto";
    a second call with the same drafter (``"ngram"`` is one object) reuses the engine and its captured round."""
    from specdec.decoding.static import _ENGINES, clear_engines

    clear_engines()
    input_ids, attention_mask = repetitive_prompts([7, 12, 4, 9], seed=1)
    expected = hf_greedy(verifier, input_ids, attention_mask, 40)
    captured = []
    for num_draft_tokens in (4, 4, "auto"):
        out = specdec.generate(verifier, "ngram", input_ids, attention_mask, max_new_tokens=40,
                               num_draft_tokens=num_draft_tokens, pad_token_id=0)
        assert out.stats.path == "static" and out.stats.fallback_reason is None
        assert torch.equal(out.sequences, expected) and int(out.stats.accepted.sum()) > 0
        engines = list(_ENGINES[verifier].values())
        captured.append((engines[-1], engines[-1].num_captured_rounds()))
    assert captured[0] == captured[1] == (captured[0][0], 1), "one engine, one captured round, reused"
    clear_engines()


@GPU
@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_gpu_sampling_with_the_triton_sampler_follows_the_verifier(static):
    vocab = 16
    verifier, successor = cycling_llama(vocab=vocab, seed=3, sharpness=6.0, context=0.3)
    cycle = [5]
    while successor[cycle[-1]] != 5:
        cycle.append(successor[cycle[-1]])
    prompt = torch.tensor((cycle * 3)[:7], device=DEVICE)
    out = specdec.generate(verifier, "ngram", prompt.expand(60000, -1).clone(), max_new_tokens=3,
                           num_draft_tokens=2, temperature=1.0, seed=9, backend="triton", static=static)
    assert out.stats.path == ("static" if static else "eager")
    triples = out.sequences[:, prompt.shape[0]:].cpu()
    counts = torch.bincount((triples[:, 0] * vocab + triples[:, 1]) * vocab + triples[:, 2], minlength=vocab**3)
    assert_follows(counts, _exact_three_token_law(verifier, prompt, vocab).flatten(), what="law of (x1, x2, x3)")


@GPU
def test_gpu_cost_ratio_of_the_proposal_step_is_measured_from_a_graph(verifier):
    cost = specdec.measure_decode_costs(verifier, "ngram", batch_size=4, repeats=3)
    assert cost.source == "measured" and cost.value > 0 and cost.drafter_step_s > 0  # (captured and replayed)
