"""Bad input gets a clear ValueError/TypeError naming the argument."""

import pytest
import torch

import specdec

from models import left_padded_prompts, tiny_llama

VOCAB = 40


@pytest.fixture(scope="module")
def pair():
    return tiny_llama(vocab_size=VOCAB, seed=0), tiny_llama(vocab_size=VOCAB, hidden_size=16, num_layers=1, seed=1)


@pytest.fixture(scope="module")
def prompts():
    return left_padded_prompts([3, 5], VOCAB, seed=0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_draft_tokens": -1}, "num_draft_tokens"),  # 0 is plain decoding
        ({"num_draft_tokens": 2.5}, "num_draft_tokens"),
        ({"num_draft_tokens": "fast"}, "num_draft_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"eos_token_id": VOCAB}, "eos_token_id"),
        ({"temperature": 1e-9}, "temperature"),
        ({"seed": 2**70}, "seed"),
        ({"seed": "x"}, "seed"),
        ({"pad_token_id": VOCAB}, "pad_token_id"),
        ({"pad_token_id": 1.5}, "pad_token_id"),
        ({"backend": "cuda"}, "backend"),
    ],
)
def test_generate_rejects_bad_options(pair, prompts, kwargs, match):
    verifier, drafter = pair
    with pytest.raises(ValueError, match=match):
        specdec.generate(verifier, drafter, *prompts, **kwargs)


def test_generate_rejects_bad_inputs(pair, prompts):
    verifier, drafter = pair
    input_ids, attention_mask = prompts
    with pytest.raises(ValueError, match="vocabularies differ"):
        specdec.generate(verifier, tiny_llama(vocab_size=VOCAB + 7, seed=2), input_ids, attention_mask)
    with pytest.raises(ValueError, match="empty prompt"):
        specdec.generate(verifier, drafter, input_ids, torch.zeros_like(attention_mask))
    with pytest.raises(ValueError, match="input_ids"):
        specdec.generate(verifier, drafter, input_ids[:, :0])
    with pytest.raises(ValueError, match="attention_mask"):
        specdec.generate(verifier, drafter, input_ids, attention_mask[:1])
    with pytest.raises(TypeError, match="input_ids"):
        specdec.generate(verifier, drafter, input_ids.float())
    with pytest.raises(ValueError, match="input_ids"):
        specdec.generate(verifier, drafter, input_ids + VOCAB)
    with pytest.raises(ValueError, match="device"):
        specdec.generate(verifier, drafter, input_ids.to("meta"), attention_mask.to("meta"))
    with pytest.raises(TypeError, match="drafter"):
        specdec.generate(verifier, "not a model", input_ids, attention_mask)


def _sampler_inputs(batch=2, num_drafts=3, vocab=10):
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(batch, num_drafts + 1, vocab, generator=generator),
            torch.randn(batch, num_drafts, vocab, generator=generator),
            torch.randint(0, vocab, (batch, num_drafts), generator=generator))


def test_rejection_sample_rejects_bad_inputs():
    target, draft, drafts = _sampler_inputs()
    cases = [
        ((target[:1], draft, drafts), {}, ValueError, "draft_logits"),
        ((target, draft, drafts[:1]), {}, ValueError, "draft_tokens"),
        ((target, draft[:, :2], drafts), {}, ValueError, "draft_logits"),
        ((target, draft[..., :9], drafts), {}, ValueError, "draft_logits"),
        ((target[:, :1], draft[:, :0], drafts[:, :0]), {}, ValueError, "K\\+1"),
        ((target, draft, drafts.float()), {}, TypeError, "draft_tokens"),
        ((target.long(), draft, drafts), {}, TypeError, "target_logits"),
        ((target, draft, drafts + 10), {}, ValueError, "draft_tokens"),
        ((target, draft, drafts - 5), {}, ValueError, "draft_tokens"),
        ((target, draft, drafts), {"temperature": -1.0}, ValueError, "temperature"),
        ((target, draft, drafts), {"backend": "numpy"}, ValueError, "backend"),
        ((target, draft, drafts), {"seeds": torch.zeros(3, dtype=torch.int64)}, ValueError, "seeds"),
        ((target, draft, drafts), {"num_draft_tokens": torch.tensor([1, 4])}, ValueError, "num_draft_tokens"),
        ((target, draft, drafts), {"greedy_mask": torch.tensor([1, 0])}, TypeError, "greedy_mask"),
        ((target, draft, drafts), {"greedy_mask": torch.tensor([True])}, ValueError, "greedy_mask"),
        ((target, draft, drafts), {"generator": 123}, TypeError, "generator"),
        ((target, draft, drafts), {"seeds": [1, 2]}, TypeError, "seeds"),
        ((target, draft, drafts), {"offsets": [0, 0]}, TypeError, "offsets"),
        ((target, draft, drafts), {"num_draft_tokens": [1, 2]}, TypeError, "num_draft_tokens"),
        ((target, draft, drafts), {"greedy_mask": [True, False]}, TypeError, "greedy_mask"),
        ((target, draft, drafts), {"temperature": 1e-38}, ValueError, "temperature"),
        ((target, draft.to("meta"), drafts), {"check_nan": False}, ValueError, "device"),
        ((torch.zeros(1, 1, 1).expand(2, 4, 2**30), torch.zeros(1, 1, 1).expand(2, 3, 2**30), drafts), {},
         ValueError, "2\\*\\*30"),  # (expanded views: no memory) tile stream indices start at 2**30
    ]
    for args, kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            specdec.rejection_sample(*args, **kwargs)


@pytest.mark.parametrize("which", ["target_logits", "draft_logits"])
def test_rejection_sample_refuses_nan_logits(which):
    target, draft, drafts = _sampler_inputs()
    (target if which == "target_logits" else draft)[1, 0, 3] = float("nan")
    with pytest.raises(ValueError, match=f"{which} contains NaN"):
        specdec.rejection_sample(target, draft, drafts, temperature=1.0)


@pytest.mark.parametrize("which", ["target_logits", "draft_logits"])
def test_rejection_sample_refuses_inf_and_empty_rows(which):
    """+inf anywhere in a used row, or a used row with no finite logit, is refused (the backends would disagree);
    rows past a request's last draft are not used and not checked."""
    target, draft, drafts = _sampler_inputs()
    bad = target if which == "target_logits" else draft
    bad[0, 1, 4] = float("inf")
    with pytest.raises(ValueError, match=f"{which} contains \\+inf"):
        specdec.rejection_sample(target, draft, drafts)
    target, draft, drafts = _sampler_inputs()
    bad = target if which == "target_logits" else draft
    bad[1, 1] = float("-inf")
    with pytest.raises(ValueError, match=f"{which} has a row with every entry -inf"):
        specdec.rejection_sample(target, draft, drafts)
    drafts[1, 1:] = -1  # row 1 now ends after position 0 (target) / has one draft: positions >= 2 / >= 1 unused
    if which == "target_logits":
        with pytest.raises(ValueError, match="every entry -inf"):  # target position 1 is still reachable
            specdec.rejection_sample(target, draft, drafts)
        drafts[1, 0] = -1  # no drafts: only target position 0 is used
    out = specdec.rejection_sample(target, draft, drafts, temperature=1.0, seeds=torch.tensor([1, 2]))
    assert bool((out.tokens >= -1).all()) and bool((out.tokens < target.shape[-1]).all())


def test_generate_refuses_right_padded_prompts(pair, prompts):
    verifier, drafter = pair
    input_ids, attention_mask = prompts
    with pytest.raises(ValueError, match="left-padded"):
        specdec.generate(verifier, drafter, input_ids.flip(1), attention_mask.flip(1), max_new_tokens=2)


def test_generate_accepts_eos_ids_as_a_tensor_or_numpy_integers(pair, prompts):
    import numpy as np

    verifier, drafter = pair
    free = specdec.generate(verifier, drafter, *prompts, max_new_tokens=6)
    width = prompts[0].shape[1]
    eos = int(free.sequences[0, width + 2])  # row 0 emits it at its third step: the eos id must take effect
    a = specdec.generate(verifier, drafter, *prompts, max_new_tokens=6, eos_token_id=eos)
    assert int(a.stats.generated[0]) <= 3 and not torch.equal(a.sequences, free.sequences)
    for same in (torch.tensor(eos), torch.tensor([eos]), np.int64(eos), [np.int32(eos)]):
        b = specdec.generate(verifier, drafter, *prompts, max_new_tokens=6, eos_token_id=same)
        assert torch.equal(a.sequences, b.sequences), same
    c = specdec.generate(verifier, drafter, *prompts, max_new_tokens=np.int64(6), num_draft_tokens=np.int64(4),
                         top_k=np.int64(0), top_p=np.float32(1.0), seed=np.uint64(3), eos_token_id=eos)
    assert torch.equal(a.sequences, c.sequences)
    with pytest.raises(TypeError, match="eos_token_id"):
        specdec.generate(verifier, drafter, *prompts, max_new_tokens=2, eos_token_id=2.0)


def test_backend_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    target, draft, drafts = _sampler_inputs()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        specdec.rejection_sample(target, draft, drafts, backend="triton")


def test_generate_refuses_nan_logits(pair, prompts):
    verifier, _ = pair
    broken = tiny_llama(vocab_size=VOCAB, hidden_size=16, num_layers=1, seed=3)
    with torch.no_grad():
        broken.lm_head.weight[5, 0] = float("nan")
    for temperature in (0.0, 1.0):
        with pytest.raises(ValueError, match="NaN"):
            specdec.generate(verifier, broken, *prompts, max_new_tokens=4, temperature=temperature)


def test_filter_logits_returns_a_new_tensor_even_when_nothing_is_filtered():
    logits = torch.randn(2, 5)
    before = logits.clone()
    out = specdec.filter_logits(logits)
    out[0, 0] = float("-inf")
    assert torch.equal(logits, before)



@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"top_k": -1}, ValueError, "top_k"),
        ({"top_k": 2.5}, ValueError, "top_k"),
        ({"top_p": 0.0}, ValueError, "top_p"),
        ({"top_p": float("nan")}, ValueError, "top_p"),
        ({"top_p": 2.0}, ValueError, "top_p"),
        ({"logits": [1.0, 2.0]}, TypeError, "logits"),
        ({"logits": torch.tensor(1.0)}, ValueError, "logits"),
        ({"logits": torch.ones(3, dtype=torch.int64)}, TypeError, "logits"),
    ],
)
def test_filter_logits_rejects_bad_arguments(kwargs, error, match):
    args = {"logits": torch.randn(2, 5)} | kwargs
    with pytest.raises(error, match=match):
        specdec.filter_logits(**args)
