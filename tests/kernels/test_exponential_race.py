"""The fused exponential race equals its torch reference token for token: rows of random scores with -inf, NaN and
+inf entries, all--inf rows, ties, vocabularies that are not tile multiples, every chunking that covers a row
(one chunk, several, one tile a chunk), batches of 1 to 9; and its draws follow softmax(scores) (chi-square)."""

import pytest
import torch

from specdec.kernels.exponential_race import RacePlan, exponential_race_triton, race_plan
from specdec.kernels.rejection_sampling_reference import exponential_race

from stats import assert_follows

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _scores(batch: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    scores = torch.randn(batch, vocab, generator=generator) * 2
    scores[torch.rand(batch, vocab, generator=generator) < 0.1] = float("-inf")
    scores[torch.rand(batch, vocab, generator=generator) < 0.02] = float("nan")
    return scores


def _plans(vocab: int) -> list[RacePlan]:
    return [RacePlan(chunk=c * b, block=b, num_warps=1) for b in (32, 128) for c in (1, 3, -(-vocab // b))]


@pytest.mark.parametrize("batch,vocab", [(1, 200), (3, 517), (9, 64)])
def test_the_race_equals_the_reference_under_every_plan(batch, vocab):
    generator = torch.Generator().manual_seed(batch * 1000 + vocab)
    scores = _scores(batch, vocab, generator).to(DEVICE)
    scores[0, vocab // 2] = float("inf")  # a +inf score wins outright
    if batch > 1:
        scores[1] = float("-inf")  # no weight at all: id 0, as torch.argmax
    if batch > 2:
        scores[2] = 0.0  # equal scores: the noise decides
    seeds = torch.randint(0, 2**62, (batch,), generator=generator).to(DEVICE)
    positions = torch.randint(0, 2**40, (batch,), generator=generator).to(DEVICE)
    expected = exponential_race(scores, seeds, positions)
    assert int(expected[0]) == vocab // 2
    plans = [None, *_plans(vocab)]
    for plan in plans:
        got = exponential_race_triton(scores, seeds, positions, plan=plan)
        assert got.dtype == torch.int64 and got.shape == (batch,)
        assert torch.equal(got, expected), plan
    if batch > 1:
        assert int(expected[1]) == 0


def test_the_race_reads_rows_of_a_wider_tensor():
    """Rows with a stride (a slice of [B, T, V] logits) are read in place."""
    generator = torch.Generator().manual_seed(3)
    wide = _scores(4, 3 * 150, generator).reshape(4, 3, 150).to(DEVICE)
    seeds, positions = torch.arange(4, device=DEVICE), torch.arange(4, device=DEVICE) * 7
    rows = wide[:, 1]
    assert not rows.is_contiguous()
    assert torch.equal(exponential_race_triton(rows, seeds, positions), exponential_race(rows, seeds, positions))


def test_the_plan_covers_the_vocabulary_in_whole_tiles():
    for batch, vocab in [(1, 128256), (32, 151936), (1, 7), (256, 32000)]:
        plan = race_plan(batch, vocab, DEVICE)
        assert plan.chunk % plan.block == 0 and plan.chunk >= plan.block
        assert -(-vocab // plan.chunk) * plan.chunk >= vocab


@pytest.mark.skipif(DEVICE.type != "cuda", reason="6000 rows are 6000 programs, a minute in Triton's interpreter; "
                    "on the CPU its equality with the reference, whose law test_rejection_reference.py checks, "
                    "carries it")
def test_the_draws_follow_softmax_of_the_scores():
    """One row, 6000 positions of its stream: the ids follow softmax(scores) (chi-square at about 10 sigma)."""
    vocab, draws = 12, 6000
    scores = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5, 1.5, -2.0, 0.2, float("nan"), 1.2, -0.5]])
    law = torch.softmax(torch.nan_to_num(scores, nan=float("-inf")), dim=-1)[0]
    rows = scores.expand(draws, vocab).contiguous().to(DEVICE)
    seeds = torch.full((draws,), 12345, dtype=torch.int64, device=DEVICE)
    positions = torch.arange(draws, device=DEVICE)
    ids = exponential_race_triton(rows, seeds, positions).cpu()
    assert int(ids.max()) < vocab and int(ids.min()) >= 0
    assert not bool(((ids == 4) | (ids == 9)).any()), "ids of weight 0 and NaN scores are never drawn"
    assert_follows(torch.bincount(ids, minlength=vocab), law, what="race draws")
