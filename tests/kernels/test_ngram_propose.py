"""The fused n-gram proposal equals its reference, :func:`~specdec.kernels.ngram_propose_reference.ngram_propose`,
exactly (integer arithmetic): token tables of small vocabularies (so suffixes recur), rows of length 1 up to the
table width, every suffix range ``min_ngram .. max_ngram`` up to 4, widths that are not tile multiples and strided
tables."""

import pytest
import torch

from specdec.kernels.ngram_propose import ngram_propose_triton
from specdec.kernels.ngram_propose_reference import ngram_propose

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("max_ngram,min_ngram", [(1, 1), (2, 1), (3, 1), (3, 2), (4, 4)])
@pytest.mark.parametrize("vocab", [2, 5])
def test_the_fused_proposal_equals_the_reference(max_ngram, min_ngram, vocab):
    generator = torch.Generator().manual_seed(100 * max_ngram + 10 * min_ngram + vocab)
    batch, width = 24, 150
    tokens = torch.randint(0, vocab, (batch, width), generator=generator)
    lengths = torch.randint(1, width + 1, (batch,), generator=generator)
    lengths[:4] = torch.tensor([1, 2, 3, width])
    tokens, lengths = tokens.to(DEVICE), lengths.to(DEVICE)
    expected = ngram_propose(tokens, lengths, max_ngram, min_ngram)
    got = ngram_propose_triton(tokens, lengths, max_ngram, min_ngram)
    assert got.dtype == torch.int64 and torch.equal(got, expected)
    last = tokens.gather(1, (lengths - 1)[:, None])[:, 0]
    assert bool((expected != last).any()), "some rows must propose a matched follower, not the fallback"


def test_a_strided_table_is_read_in_place_and_rows_stay_apart():
    generator = torch.Generator().manual_seed(7)
    wide = torch.randint(0, 3, (6, 2, 70), generator=generator).to(DEVICE)
    tokens = wide[:, 0]  # [6, 70], row stride 140
    lengths = torch.tensor([70, 1, 35, 69, 2, 50], device=DEVICE)
    assert torch.equal(ngram_propose_triton(tokens, lengths, 3, 1), ngram_propose(tokens, lengths, 3, 1))
    copy = tokens.clone()
    copy[1:] = 9  # the other rows change: row 0's proposal does not
    assert int(ngram_propose_triton(copy, lengths, 3, 1)[0]) == int(ngram_propose(tokens, lengths, 3, 1)[0])


def test_the_static_slot_proposes_the_same_with_the_kernel():
    """An NgramSlot fed a prompt and then single tokens proposes the same with the kernel as with the reference."""
    from specdec.decoding.ngram import NgramSlot, ngram_drafter

    generator = torch.Generator().manual_seed(11)
    batch, capacity, vocab = 3, 40, 4
    key_ok = torch.ones((batch, capacity), dtype=torch.bool, device=DEVICE)
    key_ok[1, :5] = False  # a left-padded row
    positions = (key_ok.cumsum(dim=1) - 1).clamp(min=0)
    slots = [NgramSlot(ngram_drafter(3, 1), batch, capacity, vocab, key_ok, positions, use_kernels=use)
             for use in (True, False)]
    prompt = torch.randint(0, vocab, (batch, 20), generator=generator).to(DEVICE)
    prompt_slots = torch.arange(20, device=DEVICE).expand(batch, 20)
    logits = [slot.forward(prompt, prompt_slots, 2) for slot in slots]
    assert torch.equal(logits[0], logits[1])
    for step in range(20, 30):
        ids = torch.randint(0, vocab, (batch, 1), generator=generator).to(DEVICE)
        at = torch.full((batch, 1), step, device=DEVICE)
        logits = [slot.forward(ids, at, 1) for slot in slots]
        assert torch.equal(logits[0], logits[1]), step


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_engine_backend_chooses_the_proposal(backend):
    """The static engine's ``backend`` decides the n-gram drafter's proposal as it decides its other kernels."""
    from specdec.decoding.ngram import ngram_drafter
    from specdec.decoding.static import StaticEngine
    from specdec.kernels.exponential_race import exponential_race_triton
    from specdec.kernels.rejection_sampling_reference import exponential_race

    from models import tiny_llama

    verifier = tiny_llama(vocab_size=64, hidden_size=32, num_layers=1, seed=0).to(DEVICE)
    engine = StaticEngine(verifier, ngram_drafter(3, 1), 2, 64, 64, 2, 1, DEVICE, backend, False)
    expected = ngram_propose_triton if backend == "triton" else ngram_propose
    assert engine.drafter.propose is expected
    assert engine.race is (exponential_race_triton if backend == "triton" else exponential_race)
