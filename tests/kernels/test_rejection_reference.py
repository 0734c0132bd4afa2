"""Rejection sampling is lossless: statistical and exact properties of `specdec.rejection_sample` (torch path).

Each case draws many independent rows (distinct seeds) from one (p, q) pair; chi-square thresholds sit about 10
standard deviations above the statistic's mean, after merging bins expecting fewer than 5 observations.
"""

import pytest
import torch

import specdec
from specdec.fairness.metrics import accepted_count_distribution

from stats import assert_follows

BACKEND = "torch"
ROWS = 20000


def _random_case(vocab: int, num_drafts: int, seed: int, scale: float = 1.5):
    generator = torch.Generator().manual_seed(seed)
    target = torch.randn(num_drafts + 1, vocab, generator=generator) * scale
    draft = torch.randn(num_drafts, vocab, generator=generator) * scale
    return target, draft


def _sample_drafts(draft_logits: torch.Tensor, rows: int, temperature: float, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    probs = torch.softmax(draft_logits / temperature, dim=-1)
    return torch.stack([torch.multinomial(p, rows, replacement=True, generator=generator) for p in probs], dim=1)


def _run(target, draft, drafts, temperature, seed_base=0, **kwargs):
    rows = drafts.shape[0]
    return specdec.rejection_sample(
        target.expand(rows, -1, -1), draft.expand(rows, -1, -1), drafts, temperature=temperature,
        seeds=torch.arange(rows, dtype=torch.int64) + seed_base * 1_000_003, backend=BACKEND, **kwargs,
    )


def _assert_positions_follow_p(tokens: torch.Tensor, target: torch.Tensor, temperature: float, what: str):
    vocab = target.shape[-1]
    p = torch.softmax(target.double() / temperature, dim=-1)
    for j in range(tokens.shape[1]):
        reached = tokens[:, j] >= 0
        if int(reached.sum()) < 200:
            continue
        counts = torch.bincount(tokens[reached, j], minlength=vocab)
        assert_follows(counts, p[j], what=f"{what} position {j}")


@pytest.mark.parametrize("support", [None, [5, 250, 300, 700, 999]], ids=["dense", "four_race_tiles"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_emitted_tokens_follow_p_and_accept_counts_match_closed_form(temperature, support):
    # "four_race_tiles": p and q live on 5 ids of V = 1000, in 4 race tiles of 256 ids (two in tile 0, one in the
    # ragged last tile), so level 1 of the race decides every recovered and bonus token
    num_drafts = 3
    if support is None:
        vocab, rows = 6, ROWS
        target, draft = _random_case(vocab, num_drafts, seed=1)
    else:
        vocab, rows = 1000, ROWS // 4
        dense_target, dense_draft = _random_case(len(support), num_drafts, seed=1)
        target = torch.full((num_drafts + 1, vocab), float("-inf"))
        draft = torch.full((num_drafts, vocab), float("-inf"))
        target[:, support], draft[:, support] = dense_target, dense_draft
    drafts = _sample_drafts(draft, rows, temperature, seed=2)
    out = _run(target, draft, drafts, temperature)
    tokens, accepted = out.tokens, out.num_accepted
    # Structure: accepted drafts, then exactly one new token, then -1.
    positions = torch.arange(num_drafts + 1)
    assert bool(((tokens >= 0) == (positions[None] <= accepted[:, None])).all())
    kept = positions[None, :num_drafts] < accepted[:, None]
    assert torch.equal(tokens[:, :num_drafts][kept], drafts[kept])
    _assert_positions_follow_p(tokens, target, temperature, "sampled")
    alpha = specdec.fairness.metrics.acceptance_from_logits(target[:num_drafts], draft, temperature).double()
    expected = accepted_count_distribution(alpha)
    assert_follows(torch.bincount(accepted, minlength=num_drafts + 1), expected, what="accepted counts")


def test_identical_distributions_always_accept_and_bonus_follows_p():
    vocab, num_drafts = 5, 4
    target, _ = _random_case(vocab, num_drafts, seed=3)
    draft = target[:num_drafts].clone()
    drafts = _sample_drafts(draft, ROWS, 1.0, seed=4)
    out = _run(target, draft, drafts, 1.0)
    assert bool((out.num_accepted == num_drafts).all())
    assert torch.equal(out.tokens[:, :num_drafts], drafts)
    counts = torch.bincount(out.tokens[:, num_drafts], minlength=vocab)
    assert_follows(counts, torch.softmax(target[num_drafts].double(), -1), what="bonus")


def test_disjoint_supports_always_reject_and_output_follows_p():
    vocab, num_drafts = 8, 2
    target, draft = _random_case(vocab, num_drafts, seed=5)
    target[:, :4] = float("-inf")  # p lives on {4..7}
    draft[:, 4:] = float("-inf")  # q lives on {0..3}
    drafts = _sample_drafts(draft, ROWS, 1.0, seed=6)
    out = _run(target, draft, drafts, 1.0)
    assert bool((out.num_accepted == 0).all())
    counts = torch.bincount(out.tokens[:, 0], minlength=vocab)
    assert_follows(counts, torch.softmax(target[0].double(), -1), what="recovered token")


def test_one_hot_p_always_yields_its_argmax():
    vocab, num_drafts, rows = 7, 3, 2000
    target = torch.full((num_drafts + 1, vocab), float("-inf"))
    hot = torch.tensor([3, 0, 6, 2])
    target[torch.arange(num_drafts + 1), hot] = 0.0
    _, draft = _random_case(vocab, num_drafts, seed=7)
    drafts = _sample_drafts(draft, rows, 1.0, seed=8)
    out = _run(target, draft, drafts, 1.0)
    for row in range(rows):
        n = int(out.num_accepted[row])
        assert torch.equal(drafts[row, :n], hot[:n])
        assert int(out.tokens[row, n]) == int(hot[n])
        if n < num_drafts:
            assert int(drafts[row, n]) != int(hot[n])


def test_greedy_accepts_iff_argmax_with_ties_to_lowest_id():
    target = torch.tensor([[[0.0, 2.0, 1.0, 2.0], [5.0, 1.0, 5.0, 0.0], [0.0, 0.0, 0.0, 1.0]]])
    draft = torch.randn(1, 2, 4)
    cases = {(1, 0): (2, [1, 0, 3]), (1, 2): (1, [1, 0, -1]), (3, 0): (0, [1, -1, -1])}
    for drafts, (accepted, tokens) in cases.items():
        out = specdec.rejection_sample(target, draft, torch.tensor([drafts]), temperature=0.0, backend=BACKEND)
        assert int(out.num_accepted[0]) == accepted
        assert out.tokens[0].tolist() == tokens


def test_greedy_mask_rows_ignore_randomness_and_sampled_rows_share_the_batch():
    vocab, num_drafts, rows = 6, 3, 64
    target, draft = _random_case(vocab, num_drafts, seed=9)
    drafts = _sample_drafts(draft, rows, 1.0, seed=10)
    greedy_mask = torch.arange(rows) % 2 == 0
    out = _run(target, draft, drafts, 1.0, greedy_mask=greedy_mask)
    greedy_out = _run(target, draft, drafts, 0.0)
    sampled_out = _run(target, draft, drafts, 1.0)
    assert torch.equal(out.tokens[greedy_mask], greedy_out.tokens[greedy_mask])
    assert torch.equal(out.tokens[~greedy_mask], sampled_out.tokens[~greedy_mask])


def test_minus_one_drafts_and_per_row_counts_end_the_drafts():
    vocab, num_drafts, rows = 6, 4, 4000
    target, draft = _random_case(vocab, num_drafts, seed=11)
    drafts = _sample_drafts(draft, rows, 1.0, seed=12)
    drafts[:, 2:] = -1
    out = _run(target, draft, drafts, 1.0)
    assert int(out.num_accepted.max()) <= 2
    counted = _run(target, draft, _sample_drafts(draft, rows, 1.0, seed=12), 1.0,
                   num_draft_tokens=torch.full((rows,), 2))
    assert torch.equal(out.tokens, counted.tokens)
    # Position 2 is reached whenever both real drafts are accepted and is then drawn from p_2 (no draft there).
    reached = out.num_accepted == 2
    counts = torch.bincount(out.tokens[reached, 2], minlength=vocab)
    assert_follows(counts, torch.softmax(target[2].double(), -1), what="token after the last real draft")


def test_draft_with_zero_drafter_probability_is_rejected():
    vocab, num_drafts, rows = 5, 2, 500
    target, draft = _random_case(vocab, num_drafts, seed=13)
    draft[0, 1] = float("-inf")
    drafts = torch.ones(rows, num_drafts, dtype=torch.int64)  # id 1 has q = 0 at position 0
    out = _run(target, draft, drafts, 1.0)
    assert bool((out.num_accepted == 0).all())


def test_results_do_not_depend_on_batch_composition_and_are_reproducible():
    vocab, num_drafts, rows = 9, 3, 32
    target, draft = _random_case(vocab, num_drafts, seed=14)
    drafts = _sample_drafts(draft, rows, 1.0, seed=15)
    seeds = torch.arange(rows, dtype=torch.int64) * 7919
    full = specdec.rejection_sample(target.expand(rows, -1, -1), draft.expand(rows, -1, -1), drafts,
                                    seeds=seeds, backend=BACKEND)
    again = specdec.rejection_sample(target.expand(rows, -1, -1), draft.expand(rows, -1, -1), drafts,
                                     seeds=seeds, backend=BACKEND)
    assert torch.equal(full.tokens, again.tokens)
    for row in (0, 17, 31):
        alone = specdec.rejection_sample(target[None], draft[None], drafts[row: row + 1], seeds=seeds[row: row + 1],
                                         backend=BACKEND)
        assert torch.equal(alone.tokens[0], full.tokens[row])


def test_scores_are_draft_logprob_and_acceptance_probability():
    vocab, num_drafts, rows = 11, 3, 4
    target, draft = _random_case(vocab, num_drafts, seed=16)
    drafts = _sample_drafts(draft, rows, 0.5, seed=17)
    out = _run(target, draft, drafts, 0.5, compute_scores=True)
    log_p = torch.log_softmax(target[:num_drafts] / 0.5, -1)
    expected_logprob = log_p[torch.arange(num_drafts)[None, :], drafts]
    torch.testing.assert_close(out.draft_logprob, expected_logprob)
    alpha = specdec.fairness.metrics.acceptance_from_logits(target[:num_drafts], draft, 0.5)
    torch.testing.assert_close(out.alpha, alpha.expand(rows, -1))


def test_residual_mass_is_accurate_and_gates_the_residual_race():
    from specdec.kernels.rejection_sampling_reference import RESIDUAL_MASS_EPS, _residual_mass

    generator = torch.Generator().manual_seed(18)
    target = torch.round((torch.randn(32, 4096, generator=generator) * 2 + 10) * 1024) / 1024
    for draft, bound in ((target + 20.0, 0.0),  # p == q exactly (a logit shift): mass exactly 0
                         (target + 0.5 * torch.randn(32, 4096, generator=generator), 2e-6)):  # far apart
        mass = _residual_mass(target, draft, torch.softmax(target, -1)).double()
        exact = (torch.softmax(target.double(), -1) - torch.softmax(draft.double(), -1)).clamp(min=0).sum(-1)
        assert float((mass - exact).abs().max()) <= bound
    # q(1) = 0 forces a rejection at position 0; the residual is then p(1) alone.
    vocab, rows = 6, 400
    target, _ = _random_case(vocab, 1, seed=19)
    draft = target[:1].clone()
    draft[0, 1] = float("-inf")
    drafts = torch.ones(rows, 1, dtype=torch.int64)
    target[0, 1] = target[0].max() - 40.0  # p(1) ~ 1e-17 <= RESIDUAL_MASS_EPS: race on p, never on the residual
    assert float(torch.softmax(target[0], -1)[1]) < RESIDUAL_MASS_EPS
    out = _run(target, draft, drafts, 1.0)
    assert bool((out.num_accepted == 0).all()) and bool((out.tokens[:, 0] != 1).all())
    target[0, 1] = target[0].max() - 3.0  # p(1) ~ 1e-2: the residual is one-hot on 1
    out = _run(target, draft, drafts, 1.0)
    assert bool((out.tokens[:, 0] == 1).all())


def test_race_never_picks_a_zero_weight_id():
    from specdec.kernels.rejection_sampling_reference import exponential_race

    scores = torch.full((4096, 50), float("-inf"))
    scores[:, 7] = -30.0  # a single id with (tiny) positive weight
    scores[:, 11] = float("nan")  # NaN never wins either
    winners = exponential_race(scores, torch.arange(4096, dtype=torch.int64), torch.zeros(4096, dtype=torch.int64))
    assert bool((winners == 7).all())


@pytest.mark.parametrize("tiles", [3.5, 10.3])
def test_two_level_race_follows_the_weights_across_tiles(tiles):
    # Level 1 picks a tile by its mass, level 2 an id inside it: P(x) = w(x) / sum w. Weights with zeros, a ragged
    # last tile and masses spread over every tile of RACE_TILE ids.
    from specdec.kernels import rejection_sampling_reference as reference

    vocab = int(tiles * reference.RACE_TILE)
    rows = 20000 if tiles < 5 else 10000
    generator = torch.Generator().manual_seed(21)
    size = 40
    support = torch.randperm(vocab, generator=generator)[:size]  # ids spread over every tile
    assert len(set((support // reference.RACE_TILE).tolist())) == -(-vocab // reference.RACE_TILE)
    weights = torch.zeros(vocab)
    weights[support] = torch.rand(size, generator=generator) + 0.05
    probs = weights / weights.sum()
    seeds = torch.arange(rows, dtype=torch.int64) * 7919 + 3
    winners = reference.tiled_exponential_race(weights.expand(rows, -1), torch.log(weights).expand(rows, -1), seeds,
                                               torch.full((rows,), 5, dtype=torch.int64))
    assert_follows(torch.bincount(winners, minlength=vocab), probs, what=f"{tiles} tiles")


def test_target_logits_without_the_bonus_position_are_named_as_the_problem():
    target, draft = torch.zeros(2, 3, 10), torch.zeros(2, 3, 10)
    drafts = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"target_logits must have K\+1 positions .*it has 3, as many as draft_logits"):
        specdec.rejection_sample(target, draft, drafts)
