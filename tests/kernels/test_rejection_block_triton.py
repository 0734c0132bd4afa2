"""Block verification in the fused Triton sampler: equal to the torch reference token for token, and lossless.

The kernels run in Triton's interpreter on a machine without CUDA (small shapes: the interpreter runs every program
of a grid in Python), and on the GPU with the full matrix. Equality with the reference carries the reference's
statistical tests (``test_rejection_block.py``) over to the kernel; the statistics below check the kernel on its own
(few rows on the CPU, many on the GPU).
"""

from dataclasses import replace

import pytest
import torch
from rejection_cases import CUDA, DEVICE, H100, assert_matches_reference, gpu_only, make_case, plan_for

import specdec
from specdec.kernels.rejection_sampling import rejection_sample_triton
from specdec.kernels.rejection_sampling_plan import plan_launch, statistics_launches
from specdec.kernels.rejection_sampling_reference import rejection_sample_reference

from exact_laws import positional, round_law
from stats import assert_follows
from test_rejection_triton import LAUNCH_PLANS, _near_equal_case

BLOCK = dict(verification="block")


@pytest.mark.parametrize("batch,num_drafts", [(1, 1), (1, 4), (7, 4)])
@pytest.mark.parametrize("dtype,temperature", [(torch.float32, 1.0), (torch.bfloat16, 0.6)])
def test_block_exact_small(batch, num_drafts, dtype, temperature):
    case = make_case(batch, num_drafts, 100, dtype, seed=batch * 10 + num_drafts + 500, temperature=temperature)
    ref = assert_matches_reference(*case, temperature, **BLOCK)
    token = rejection_sample_reference(*case, temperature)
    if batch * num_drafts >= 7:  # the schemes differ somewhere: the block path really ran
        assert not torch.equal(ref[1], token[1])
        greedy = assert_matches_reference(*case, 0.0, **BLOCK)  # T = 0: the arg-max rule, as token-wise
        assert torch.equal(greedy[0], rejection_sample_reference(*case, 0.0)[0])


@pytest.mark.parametrize("name", ["default", "one_warp_race"])
def test_block_launch_plans_with_greedy_rows_ragged_drafts_and_scores(name):
    # V = 2600: 11 race tiles, 2 race programs a row racing in a loop (not one block) over the several rows a stop
    # can need, 2 statistics chunks; greedy rows, -1 drafts and per-row counts share the batch
    target, draft, drafts, seeds, offsets = make_case(7, 4, 2600, torch.bfloat16, seed=517, noise=0.4)
    drafts[2, 2:] = -1
    counts = torch.tensor([4, 3, 4, 0, 2, 4, 1], device=DEVICE)
    greedy_mask = torch.arange(7, device=DEVICE) % 3 == 1
    plan = plan_for(target, stats_block=256, stats_splits=2, race_splits=2, **LAUNCH_PLANS[name])
    assert_matches_reference(target, draft, drafts, seeds, offsets, 0.8, plan=plan, greedy_mask=greedy_mask,
                             num_draft_tokens=counts, compute_scores=True, **BLOCK)


def test_block_plans_read_every_position():
    # block verification can keep drafts after one with p/q < 1: no staged statistics, no live skip, whatever asked
    token = plan_launch(128, 8, 151936, torch.bfloat16, H100)
    block = plan_launch(128, 8, 151936, torch.bfloat16, H100, verification="block")
    assert token.live_skip and not block.live_skip and block.verification == "block"
    staged = plan_launch(32, 8, 151936, torch.float32, H100)
    assert staged.stages and not plan_launch(32, 8, 151936, torch.float32, H100, verification="block").stages
    forced = replace(staged, stages=(1, 2), live_skip=True)
    restricted = forced.restricted(batch=32, num_drafts=8, greedy_rows=False, scores=False, verification="block")
    assert statistics_launches(restricted, 8) == [(0, 8)] and not restricted.live_skip
    with pytest.raises(ValueError, match="verification"):
        replace(token, verification="joint")
    # a forced staged plan under block verification: turned off by the launcher, results exact
    case = make_case(7, 4, 300, torch.float32, seed=519)
    assert_matches_reference(*case, 1.0, plan=plan_for(case[0], stages=(1, 2)), **BLOCK)


@pytest.mark.parametrize("kind", ["shift", "relative_noise"])
def test_block_with_q_equal_p_up_to_rounding_matches_reference_exactly(kind):
    # P_1 is 1 up to rounding and the residual mass rounding noise: a certain stop, the same in both backends
    target, draft, drafts, seeds, offsets = _near_equal_case(kind, batch=8)
    ref = assert_matches_reference(target, draft, drafts, seeds, offsets, 1.0, **BLOCK)
    assert bool((ref[1] == 1).all())  # draft 1 has q = 0: the block ends after draft 0


def test_block_identical_laws_accept_everything_and_nan_rows_stay_in_range():
    target, _, drafts, seeds, offsets = make_case(5, 4, 100, torch.float32, seed=521)
    draft = target[:, :4].clone()
    ref = assert_matches_reference(target, draft, drafts, seeds, offsets, 1.0, **BLOCK)
    assert bool((ref[1] == 4).all())
    target[0] = float("nan")
    target[1] = float("-inf")
    draft[2] = float("nan")
    tokens, accepted, _, _ = rejection_sample_triton(target, draft, drafts, seeds, offsets, 1.0, **BLOCK)
    assert bool(((tokens >= -1) & (tokens < 100)).all()) and bool(((accepted >= 0) & (accepted <= 4)).all())


def test_block_public_api_triton_backend_equals_torch_backend_and_a_row_alone_equals_it_in_a_batch():
    target, draft, drafts, seeds, offsets = make_case(9, 4, 100, torch.bfloat16, seed=523)
    kwargs = dict(temperature=0.8, seeds=seeds, offsets=offsets, verification="block",
                  num_draft_tokens=torch.tensor([4, 3, 2, 1, 0, 4, 4, 4, 4], device=DEVICE))
    tri = specdec.rejection_sample(target, draft, drafts, backend="triton", **kwargs)
    ref = specdec.rejection_sample(target, draft, drafts, backend="torch", **kwargs)
    assert torch.equal(tri.tokens, ref.tokens) and torch.equal(tri.num_accepted, ref.num_accepted)
    for row in (0, 6):
        sl = slice(row, row + 1)
        alone = rejection_sample_triton(target[sl], draft[sl], drafts[sl], seeds[sl], offsets[sl], 1.0, **BLOCK)
        assert torch.equal(alone[0][0], rejection_sample_triton(target, draft, drafts, seeds, offsets, 1.0,
                                                                **BLOCK)[0][row])


def _block_statistics(rows: int, temperature: float, seed: int, vocab: int = 3, num_drafts: int = 2):
    """Rounds of one positional (p, q) pair through the Triton backend: the law of the emitted tokens and of the
    accepted counts against the exact enumeration, and the per-position laws."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(num_drafts + 1, vocab, generator=gen) * 1.5
    draft = torch.randn(num_drafts, vocab, generator=gen) * 1.5
    q = torch.softmax(draft.double() / temperature, -1)
    drafts = torch.stack([torch.multinomial(q[j], rows, replacement=True, generator=gen)
                          for j in range(num_drafts)], dim=1)
    seeds = torch.arange(rows, dtype=torch.int64) * 1_000_003 + seed
    out = specdec.rejection_sample(target.expand(rows, -1, -1).to(DEVICE), draft.expand(rows, -1, -1).to(DEVICE),
                                   drafts.to(DEVICE), temperature=temperature, seeds=seeds.to(DEVICE),
                                   backend="triton", verification="block")
    tokens, accepted = out.tokens.cpu(), out.num_accepted.cpu()
    law = round_law(positional(target.double() / temperature), positional(draft.double() / temperature),
                     num_drafts, vocab, "block")
    outcomes = {emitted: index for index, emitted in enumerate(law)}
    counts = torch.bincount(torch.tensor([outcomes[tuple(row[row >= 0].tolist())] for row in tokens]),
                            minlength=len(law))
    assert_follows(counts, torch.tensor(list(law.values())), what="emitted tokens of a round")
    stop_law = torch.zeros(num_drafts + 1, dtype=torch.float64)
    for emitted, mass in law.items():
        stop_law[len(emitted) - 1] += mass
    assert_follows(torch.bincount(accepted, minlength=num_drafts + 1), stop_law, what="accepted counts")
    p = torch.softmax(target.double() / temperature, -1)
    for j in range(num_drafts + 1):
        reached = tokens[:, j] >= 0
        assert_follows(torch.bincount(tokens[reached, j], minlength=vocab), p[j], what=f"position {j}")


def test_block_statistics_through_triton():
    # few rows (the interpreter runs about ten rows a second); 200000 on the GPU below
    _block_statistics(20000 if CUDA else 120, 0.8, seed=525)


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_block_statistics_gpu_many_rows(temperature):
    _block_statistics(200_000, temperature, seed=527, vocab=5, num_drafts=3)


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", [100, 32000, 151936])
@pytest.mark.parametrize("num_drafts", [1, 4, 8])
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_block_exact_matrix_gpu(batch, num_drafts, vocab, dtype):
    case = make_case(batch, num_drafts, vocab, dtype, seed=batch * 1000 + num_drafts * 10 + (vocab % 7) + 1)
    assert_matches_reference(*case, 1.0, **BLOCK)
    case[2][0, 2:] = -1
    greedy_mask = torch.arange(batch, device=DEVICE) % 3 == 1
    assert_matches_reference(*case, 0.7, greedy_mask=greedy_mask, compute_scores=True, **BLOCK)


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["default", "race_tiles4", "race_splits8", "one_warp_race", "no_pdl", "l2_keep"])
@pytest.mark.parametrize("batch,num_drafts,vocab", [(1, 4, 151936), (64, 8, 32000), (128, 8, 151936)])
def test_block_launch_plans_gpu(name, batch, num_drafts, vocab):
    changes = dict(default={}, race_tiles4=dict(race_tiles=4, race_warps=4), race_splits8=dict(race_splits=8),
                   one_warp_race=LAUNCH_PLANS["one_warp_race"], no_pdl=dict(pdl=False), l2_keep=dict(l2_keep=True))
    case = make_case(batch, num_drafts, vocab, torch.bfloat16, seed=batch + vocab + 1)
    assert_matches_reference(*case, 1.0, plan=plan_for(case[0], **changes[name]), **BLOCK)

