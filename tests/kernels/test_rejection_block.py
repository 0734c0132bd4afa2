"""Block verification (``verification="block"``, Sun et al., ICLR 2025) in the torch reference.

The exact law of one round is enumerated here in float64 from the paper's statement of the algorithm (every draft
block, the backward scan's stop probabilities ``h_i prod_{j > i} (1 - h_j)``, the residual at the stop), written
apart from the code under test. It is lossless (the round completed by the verifier is the verifier's law), it
reproduces the paper's two-token example, and the reference's samples follow it (chi-square about 10 standard
deviations above the mean, bins expecting fewer than 5 merged). Expected accepted drafts are exact by enumeration.
"""

import itertools

import pytest
import torch

import specdec
from specdec.kernels.rejection_sampling_reference import (
    BLOCK_CERTAIN_EPS,
    block_log_weights,
    block_stop,
    rejection_sample_reference,
)

from exact_laws import bigram, completed_law, expected_accepted, positional, round_law
from stats import assert_follows

ROWS = 12000


def test_paper_example_two_drafts_binary_vocabulary():
    # Sun et al., Section 1: p = (1/3, 2/3), q = (2/3, 1/3) at every position, two drafts: token-wise verification
    # accepts 10/9 drafts a round, block verification 11/9
    p = torch.tensor([[1 / 3, 2 / 3]] * 3, dtype=torch.float64)
    q = torch.tensor([[2 / 3, 1 / 3]] * 2, dtype=torch.float64)
    assert expected_accepted(p, q, "token") == pytest.approx(10 / 9, abs=1e-12)
    assert expected_accepted(p, q, "block") == pytest.approx(11 / 9, abs=1e-12)
    for scheme, expected in (("token", 10 / 9), ("block", 11 / 9)):
        law = round_law(positional(p.log()), positional(q.log()), 2, 2, scheme)
        assert sum((len(tokens) - 1) * mass for tokens, mass in law.items()) == pytest.approx(expected, abs=1e-12)
    # the reference, 20000 rounds: within 5 standard errors of 11/9 (the s.e. is below 0.006; token-wise is 0.11 less)
    rows = 20000
    drafts = torch.multinomial(q[0].float(), rows * 2, replacement=True,
                               generator=torch.Generator().manual_seed(0)).view(rows, 2)
    _, accepted, _, _ = rejection_sample_reference(p.log().float().expand(rows, -1, -1),
                                                   q.log().float().expand(rows, -1, -1), drafts,
                                                   torch.arange(rows), torch.zeros(rows, dtype=torch.int64), 1.0,
                                                   verification="block")
    mean, stderr = accepted.double().mean(), accepted.double().std() / rows ** 0.5
    assert abs(float(mean) - 11 / 9) < 5 * float(stderr)


@pytest.mark.parametrize("vocab,num_drafts,zeros", [(3, 3, False), (4, 2, True), (2, 4, True)])
def test_block_round_completed_by_the_verifier_is_the_verifiers_law(vocab, num_drafts, zeros):
    # context-dependent laws (each next-token law depends on the previous token); "zeros": some ids impossible under
    # p or q in some contexts (top-k-like supports), so drafts p rules out occur
    gen = torch.Generator().manual_seed(vocab * 10 + num_drafts)
    p_logits = torch.randn(vocab + 1, vocab, generator=gen, dtype=torch.float64) * 1.5
    q_logits = torch.randn(vocab + 1, vocab, generator=gen, dtype=torch.float64) * 1.5
    if zeros:
        p_logits[torch.rand(vocab + 1, vocab, generator=gen) < 0.25] = float("-inf")
        q_logits[torch.rand(vocab + 1, vocab, generator=gen) < 0.25] = float("-inf")
        p_logits[:, 0] = q_logits[:, 1] = 0.0  # every context keeps an id under each
    p_next, q_next = bigram(p_logits), bigram(q_logits)
    length = num_drafts + 1
    target = {seq: 1.0 for seq in itertools.product(range(vocab), repeat=length)}
    for seq in target:
        for i in range(length):
            target[seq] *= float(p_next(seq[:i])[seq[i]])
    for scheme in ("token", "block"):
        law = round_law(p_next, q_next, num_drafts, vocab, scheme)
        assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
        completed = completed_law(law, p_next, length, vocab)
        assert max(abs(completed.get(seq, 0.0) - mass) for seq, mass in target.items()) < 1e-12, scheme


# ---------------------------------------------------------------------------------------------------------------
# The reference follows the enumerated law


def _sample_round(p_logits, q_logits, rows, num_drafts, context, seed, temperature=1.0):
    """Drafts sampled from q = softmax(q_logits / temperature) (position by position, or from the previous draft's
    row with ``context``) and the [rows, K+1, V] / [rows, K, V] logits each row's positions see."""
    gen = torch.Generator().manual_seed(seed)
    vocab = q_logits.shape[-1]
    previous = torch.full((rows,), vocab, dtype=torch.int64)
    drafts, targets, draft_rows = [], [], []
    for i in range(num_drafts + 1):
        index = previous if context else torch.full((rows,), i, dtype=torch.int64)
        targets.append(p_logits[index])
        if i == num_drafts:
            break
        draft_rows.append(q_logits[index])
        drafts.append(torch.multinomial(torch.softmax(q_logits[index].double() / temperature, -1), 1,
                                        generator=gen)[:, 0])
        previous = drafts[-1]
    return torch.stack(targets, 1).float(), torch.stack(draft_rows, 1).float(), torch.stack(drafts, 1)


def _filtered(logits, temperature, top_k, top_p):
    """Logits whose ``softmax(. / temperature)`` is the top-k / top-p filtered law at that temperature."""
    return specdec.filter_logits(logits / temperature, top_k, top_p) * temperature


@pytest.mark.parametrize("context", [False, True], ids=["positional", "context"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 4, 0.9)])
def test_reference_block_rounds_follow_the_enumerated_law(temperature, top_k, top_p, context):
    vocab, num_drafts = 5, 3
    gen = torch.Generator().manual_seed(7 + int(context))
    rows_of_logits = vocab + 1 if context else num_drafts + 1  # per previous token, or per position
    p_logits = _filtered(torch.randn(rows_of_logits, vocab, generator=gen) * 1.5, temperature, top_k, top_p)
    q_logits = _filtered(torch.randn(rows_of_logits, vocab, generator=gen) * 1.5, temperature, top_k, top_p)
    law_of = bigram if context else positional
    p_next, q_next = law_of(p_logits.double() / temperature), law_of(q_logits.double() / temperature)
    target, draft, drafts = _sample_round(p_logits, q_logits, ROWS, num_drafts, context, seed=8,
                                          temperature=temperature)
    tokens, accepted, _, _ = rejection_sample_reference(target, draft, drafts, torch.arange(ROWS) * 7919 + 3,
                                                        torch.zeros(ROWS, dtype=torch.int64), temperature,
                                                        verification="block")
    law = round_law(p_next, q_next, num_drafts, vocab, "block")
    outcomes = {tokens: index for index, tokens in enumerate(law)}
    emitted = [tuple(row[row >= 0].tolist()) for row in tokens]
    assert all(len(row) == n + 1 and row[:n] == tuple(d[:n].tolist())
               for row, n, d in zip(emitted, accepted.tolist(), drafts, strict=True))
    counts = torch.bincount(torch.tensor([outcomes[row] for row in emitted]), minlength=len(law))
    assert_follows(counts, torch.tensor(list(law.values())), what="emitted tokens of a round")
    stop_law = torch.zeros(num_drafts + 1, dtype=torch.float64)
    for row, mass in law.items():
        stop_law[len(row) - 1] += mass
    assert_follows(torch.bincount(accepted, minlength=num_drafts + 1), stop_law, what="accepted counts")
    # per position: the token at j, given the row reached j (and, with context, the token before it), follows p
    for j in range(num_drafts + 1):
        reached = tokens[:, j] >= 0
        for before in (range(vocab) if context and j > 0 else [None]):
            rows = reached & (tokens[:, j - 1] == before) if before is not None else reached
            if int(rows.sum()) >= 200:
                prefix = (before,) if before is not None else tuple(range(j))
                assert_follows(torch.bincount(tokens[rows, j], minlength=vocab), p_next(prefix),
                               what=f"position {j} after {before}")


def test_consecutive_tokens_of_a_block_round_follow_the_verifiers_joint_law():
    # positional laws: each round's output continued by sampling from p (as later rounds would) is p_0 x .. x p_K,
    # so every pair of consecutive tokens follows p_j x p_{j+1} (the pair of a round's own tokens, given both were
    # emitted, does not: it leans towards drafts the drafter favours)
    vocab, num_drafts = 4, 3
    gen = torch.Generator().manual_seed(12)
    p_logits = torch.randn(num_drafts + 1, vocab, generator=gen) * 1.5
    q_logits = p_logits + torch.randn(num_drafts + 1, vocab, generator=gen)
    target, draft, drafts = _sample_round(p_logits, q_logits, ROWS, num_drafts, False, seed=13)
    tokens, _, _, _ = rejection_sample_reference(target, draft, drafts, torch.arange(ROWS) + 11,
                                                 torch.zeros(ROWS, dtype=torch.int64), 1.0, verification="block")
    p = torch.softmax(p_logits.double(), -1)
    continuation = torch.multinomial(p, ROWS, replacement=True, generator=gen).T  # [ROWS, K+1]
    completed = torch.where(tokens >= 0, tokens, continuation)
    for j in range(num_drafts):
        pairs = completed[:, j] * vocab + completed[:, j + 1]
        assert_follows(torch.bincount(pairs, minlength=vocab * vocab), (p[j, :, None] * p[j + 1]).flatten(),
                       what=f"tokens {j} and {j + 1}")


# ---------------------------------------------------------------------------------------------------------------
# Never fewer accepted drafts than token-wise verification


def _setting(vocab, num_drafts, spread, seed):
    """Per-position laws: p random, q a perturbation of p by ``spread`` (larger: lower acceptance)."""
    gen = torch.Generator().manual_seed(seed)
    p_logits = torch.randn(num_drafts + 1, vocab, generator=gen, dtype=torch.float64) * 1.5
    q_logits = p_logits[:num_drafts] + spread * torch.randn(num_drafts, vocab, generator=gen, dtype=torch.float64)
    return torch.softmax(p_logits, -1), torch.softmax(q_logits, -1)


def test_block_accepts_at_least_as_many_drafts_as_token_wise_and_more_where_p_differs_from_q():
    vocab = 4
    alphas = []
    for num_drafts in (2, 4, 8):
        for spread in (0.3, 1.0, 2.0, 6.0):
            p, q = _setting(vocab, num_drafts, spread, seed=num_drafts * 100 + int(10 * spread))
            alpha = torch.minimum(p[:num_drafts], q).sum(-1)
            alphas.append(float(alpha.mean()))
            token = expected_accepted(p, q, "token")
            closed_form = float(torch.cumprod(alpha, 0).sum())  # sum_i prod_{j < i} alpha_j
            assert token == pytest.approx(closed_form, rel=1e-10)
            block = expected_accepted(p, q, "block")
            # strictly more whenever a draft with p/q < 1 can be followed by one with p/q > 1 (K >= 2, p != q)
            assert block > token + 1e-12, (num_drafts, spread, block, token)
            # what the reference accepts, measured over 3000 rounds, is that exact value (token-wise: the accepted-count
            # law of test_rejection_reference.py)
            rows = 3000
            case = _sample_round(p.log().float(), q.log().float(), rows, num_drafts, False, seed=num_drafts)
            _, accepted, _, _ = rejection_sample_reference(*case, torch.arange(rows) + 5,
                                                           torch.zeros(rows, dtype=torch.int64), 1.0,
                                                           verification="block")
            stderr = float(accepted.double().std()) / rows ** 0.5
            assert abs(float(accepted.double().mean()) - block) < 5 * stderr + 1e-9, (num_drafts, spread)
    assert min(alphas) < 0.3 and max(alphas) > 0.85  # the settings span acceptance 0.2 - 0.9


def test_identical_laws_accept_every_draft_under_both_schemes():
    p, _ = _setting(4, 8, 0.0, seed=3)
    assert expected_accepted(p, p[:8], "block") == pytest.approx(8.0, abs=1e-12)
    target, draft, drafts = _sample_round(p.log().float(), p[:8].log().float(), 2000, 8, False, seed=4)
    _, accepted, _, _ = rejection_sample_reference(target, draft, drafts, torch.arange(2000),
                                                   torch.zeros(2000, dtype=torch.int64), 1.0, verification="block")
    assert bool((accepted == 8).all())


# ---------------------------------------------------------------------------------------------------------------
# The definition on hand-computed rows, and what stays as token-wise


def test_block_weights_and_stop_on_hand_computed_rows():
    ratios = torch.tensor([[0.5, 4.0, 0.25], [0.5, 1.5, 0.25]])
    weights = block_log_weights(ratios.log())
    # P = (1, 0.5, min(1, 2) = 1, 0.25) and (1, 0.5, 0.75, 0.1875)
    torch.testing.assert_close(weights.exp(), torch.tensor([[1, 0.5, 1, 0.25], [1, 0.5, 0.75, 0.1875]]))
    assert float(weights[0, 2]) == 0.0  # a ratio product above 1 is capped exactly
    counts = torch.tensor([3, 3])

    def stop(uniforms, mass_1):
        masses = torch.tensor([[0.0, mass_1, 0.4]] * 2)
        return block_stop(weights, torch.tensor([uniforms] * 2), masses, counts).tolist()

    # eta_3 = 0.2 <= P_3 = 0.25 stops row 0 at 3; row 1 (P_3 = 0.1875) has no position with eta_i <= P_i
    assert stop([0.9, 0.9, 0.2], 0.2) == [3, 0]
    # row 0: eta_3 > P_3, P_2 = 1: position 2 stops whatever its mass; row 1: eta_2 = 0.9 > P_2, and at position 1
    # h_1 = W_1 / (W_1 + 1 - P_1) = 0.2 / 0.7 < 0.3 = eta_1: no position passes, stop 0; with W_1 = 0.3, h_1 = 0.375
    assert stop([0.3, 0.9, 0.3], 0.2) == [2, 0]
    assert stop([0.3, 0.9, 0.3], 0.3) == [2, 1]
    assert stop([0.3, 0.9, 0.3], 0.5e-6) == [2, 0]  # a mass <= RESIDUAL_MASS_EPS counts as 0
    # P_1 = 1 up to rounding is certain (h_1 = 0 / (0 + 1 - P_1) would be 0); a clear P_1 < 1 with no mass is not
    for log_p1, expected in ((-0.5 * BLOCK_CERTAIN_EPS, 1), (-2 * BLOCK_CERTAIN_EPS, 0)):
        near_one = block_log_weights(torch.tensor([[log_p1, -3.0]]))
        assert block_stop(near_one, torch.tensor([[0.5, 0.5]]), torch.zeros(1, 2), torch.tensor([2])).tolist() == [
            expected]


def _positional_case(vocab, num_drafts, rows, seed, temperature=1.0):
    gen = torch.Generator().manual_seed(seed)
    p_logits = torch.randn(num_drafts + 1, vocab, generator=gen) * 1.5
    q_logits = torch.randn(num_drafts + 1, vocab, generator=gen) * 1.5
    target, draft, drafts = _sample_round(p_logits, q_logits, rows, num_drafts, False, seed + 1, temperature)
    return target, draft, drafts, torch.arange(rows, dtype=torch.int64) * 31 + seed


def _both(target, draft, drafts, seeds, temperature, **kwargs):
    offsets = torch.zeros_like(seeds)
    return [rejection_sample_reference(target, draft, drafts, seeds, offsets, temperature, verification=scheme,
                                       **kwargs) for scheme in ("token", "block")]


def test_greedy_rows_keep_the_argmax_rule_and_one_draft_is_token_wise():
    target, draft, drafts, seeds = _positional_case(6, 4, 256, seed=20)
    token, block = _both(target, draft, drafts, seeds, 0.0)
    assert torch.equal(token[0], block[0]) and torch.equal(token[1], block[1])
    greedy_mask = torch.arange(256) % 3 == 0
    token, block = _both(target, draft, drafts, seeds, 0.8, greedy_mask=greedy_mask)
    assert torch.equal(token[0][greedy_mask], block[0][greedy_mask])
    sampled = _both(target, draft, drafts, seeds, 0.8)[1]
    assert torch.equal(block[0][~greedy_mask], sampled[0][~greedy_mask])
    assert not torch.equal(token[0][~greedy_mask], block[0][~greedy_mask])
    # K = 1: eta_1 is draft 0's accept uniform and the residual at 0 is max(0, p - q): the same decisions
    target, draft, drafts, seeds = _positional_case(6, 1, 4000, seed=21)
    token, block = _both(target, draft, drafts, seeds, 1.0)
    assert torch.equal(token[0], block[0])


def test_ragged_rows_end_the_block_at_their_last_draft():
    vocab, num_drafts, rows = 5, 4, 8000
    target, draft, drafts, seeds = _positional_case(vocab, num_drafts, rows, seed=22)
    cut = drafts.clone()
    cut[:, 2:] = -1
    counted = _both(target, draft, drafts, seeds, 1.0, num_draft_tokens=torch.full((rows,), 2))[1]
    minus_one = _both(target, draft, cut, seeds, 1.0)[1]
    assert torch.equal(counted[0], minus_one[0]) and int(minus_one[1].max()) == 2
    # the stop at n_b = 2 draws from p_2 (no draft there), and the block law of 2 drafts is followed
    reached = minus_one[1] == 2
    assert_follows(torch.bincount(minus_one[0][reached, 2], minlength=vocab), torch.softmax(target[0, 2].double(), -1),
                   what="token after the last real draft")
    law = round_law(positional(target[0].double()), positional(draft[0].double()), 2, vocab, "block")
    stop_law = torch.zeros(3, dtype=torch.float64)
    for tokens, mass in law.items():
        stop_law[len(tokens) - 1] += mass
    assert_follows(torch.bincount(minus_one[1], minlength=3), stop_law, what="accepted counts of 2-draft rows")
    none = _both(target[:4], draft[:4], torch.full((4, num_drafts), -1), seeds[:4], 1.0)[1]  # no drafts: p_0
    assert none[1].tolist() == [0] * 4 and bool((none[0][:, 0] >= 0).all())


def test_drafts_p_or_q_rules_out_end_the_block():
    vocab, num_drafts, rows = 6, 3, 3000
    target, draft, drafts, seeds = _positional_case(vocab, num_drafts, rows, seed=23)
    draft[:, 1, 2] = float("-inf")  # q(2) = 0 at position 1: a draft the drafter cannot have made is never kept
    drafts[:, 1] = 2
    target[:, 0, 3] = float("-inf")  # p(3) = 0 at position 0: P_1 = 0, nothing after it is kept either
    drafts[: rows // 2, 0] = 3
    accepted = _both(target, draft, drafts, seeds, 1.0)[1][1]
    assert int(accepted.max()) <= 1 and int(accepted[: rows // 2].max()) == 0
    # disjoint supports: every round stops at 0 and draws from p_0
    target, draft, drafts, seeds = _positional_case(vocab, num_drafts, rows, seed=24)
    target[..., :3] = float("-inf")
    draft[..., 3:] = float("-inf")
    drafts = drafts % 3
    tokens, accepted, _, _ = _both(target, draft, drafts, seeds, 1.0)[1]
    assert int(accepted.max()) == 0
    assert_follows(torch.bincount(tokens[:, 0], minlength=vocab), torch.softmax(target[0, 0].double(), -1),
                   what="recovered token")


def test_verification_must_be_token_or_block():
    target, draft, drafts, _ = _positional_case(4, 2, 2, seed=25)
    with pytest.raises(ValueError, match=r"verification must be one of \('token', 'block'\), got 'joint'"):
        specdec.rejection_sample(target, draft, drafts, verification="joint")
