"""Staged and live-skip statistics of the Triton rejection sampler: a statistics launch skips only rows that are
certainly rejected before its positions, every stage plan gives the reference's result, and the statistics launch
rule."""


from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl
from rejection_cases import (
    CUDA,
    DEVICE,
    INTERPRETER,
    StatsLaunchSpy,
    assert_matches_reference,
    gpu_only,
    h100_plan,
    make_case,
    plan_for,
)

from specdec.kernels.rejection_sampling import rejection_sample_triton
from specdec.kernels.rejection_sampling_kernels import _rejected_before
from specdec.kernels.rejection_sampling_plan import (
    grid_splits,
    plan_launch,
    statistics_launches,
)
from specdec.kernels.rejection_sampling_reference import rejection_sample_reference


# ------------------------------------------------------------------------------------------ staged statistics
@triton.jit
def _probe_rejected_before(target, draft, tokens, seeds, offsets, stats, argmax, out, n_b, g, scale, V, K, S, pos_lo,
                           JP2: tl.constexpr, SP2: tl.constexpr):
    stopped = _rejected_before(target, draft, tokens, seeds, offsets, stats, argmax, tl.program_id(0), n_b, g, scale,
                               V, K, S, pos_lo, JP2, SP2)
    tl.store(out, stopped.to(tl.int32))


def _stopped_before(target, draft, tokens, seeds, offsets, pos_lo, n_b, greedy=False):
    """Run the staged-statistics skip rule on one row whose per-position statistics are computed in float64."""
    k1, vocab = target.shape[1], target.shape[2]
    stats = torch.stack([target.double().amax(-1), (target.double() - target.double().amax(-1, keepdim=True))
                         .exp().sum(-1)], -1)[0]
    dpad = torch.cat([draft, draft[:, -1:]], 1).double()
    dstats = torch.stack([dpad.amax(-1), (dpad - dpad.amax(-1, keepdim=True)).exp().sum(-1)], -1)[0]
    packed = torch.cat([stats, dstats], -1).float().reshape(k1, 1, 4).contiguous().to(DEVICE)
    argmax = target[0].argmax(-1).to(torch.int32).reshape(k1, 1).contiguous().to(DEVICE)
    out = torch.full((1,), -1, dtype=torch.int32, device=DEVICE)
    _probe_rejected_before[(1,)](target.to(DEVICE), draft.to(DEVICE), tokens.to(DEVICE), seeds.to(DEVICE),
                                 offsets.to(DEVICE), packed, argmax, out, n_b, int(greedy), 1.0, vocab, k1 - 1, 1,
                                 pos_lo, JP2=8, SP2=2)
    return bool(out.item())


def test_staged_statistics_skip_only_certain_rejections() -> None:
    """A later statistics launch skips a row only when a draft before it is rejected beyond rounding doubt: q(x) = 0,
    p(x) = 0, a clear sampled rejection, a greedy mismatch or a row that ends earlier; a near-tie (1e-6 from the
    threshold) or accepted drafts never skip (the race kernel, which decides, could reach those positions)."""
    from specdec.kernels.rng import ACCEPT_INDEX, uniform

    gen = torch.Generator().manual_seed(5)
    num_drafts, vocab = 4, 64
    seeds = torch.tensor([123], dtype=torch.int64)
    offsets = torch.tensor([7], dtype=torch.int64)
    log_u = torch.log(uniform(seeds.expand(num_drafts), offsets + torch.arange(num_drafts),
                              torch.full((num_drafts,), ACCEPT_INDEX, dtype=torch.int64))).double()

    def case(deltas):
        """Logits whose draft j sits ``deltas[j]`` above the accept threshold: log p(x_j) = log u_j + log q(x_j) + d."""
        target = torch.randn(1, num_drafts + 1, vocab, generator=gen, dtype=torch.float64)
        draft = torch.randn(1, num_drafts, vocab, generator=gen, dtype=torch.float64)
        tokens = torch.randint(0, vocab, (1, num_drafts), generator=gen)
        for j, delta in enumerate(deltas):
            x = int(tokens[0, j])
            lq = draft[0, j, x] - torch.logsumexp(draft[0, j], 0)
            want = log_u[j] + lq + delta
            others = torch.cat([target[0, j, :x], target[0, j, x + 1:]])
            target[0, j, x] = want + torch.logsumexp(others, 0) - torch.log1p(-torch.exp(want))
        return target.float(), draft.float(), tokens

    target, draft, tokens = case([0.5, 0.5, 0.5, 0.5])
    assert not _stopped_before(target, draft, tokens, seeds, offsets, pos_lo=3, n_b=4)
    target, draft, tokens = case([0.5, -1e-6, 0.5, 0.5])  # rejected in exact arithmetic, but a near-tie
    assert not _stopped_before(target, draft, tokens, seeds, offsets, pos_lo=3, n_b=4)
    target, draft, tokens = case([0.5, -0.05, 0.5, 0.5])
    assert _stopped_before(target, draft, tokens, seeds, offsets, pos_lo=3, n_b=4)
    assert not _stopped_before(target, draft, tokens, seeds, offsets, pos_lo=1, n_b=4)  # the rejection is later
    target, draft, tokens = case([0.5, 0.5, 0.5, 0.5])
    draft[0, 2, int(tokens[0, 2])] = float("-inf")  # q(x) = 0
    assert _stopped_before(target, draft, tokens, seeds, offsets, pos_lo=3, n_b=4)
    assert not _stopped_before(target, draft, tokens, seeds, offsets, pos_lo=2, n_b=4)
    target, draft, tokens = case([0.5, 0.5, 0.5, 0.5])
    target[0, 1, int(tokens[0, 1])] = float("-inf")  # p(x) = 0
    assert _stopped_before(target, draft, tokens, seeds, offsets, pos_lo=2, n_b=4)
    assert not _stopped_before(target, draft, tokens, seeds, offsets, pos_lo=1, n_b=4)
    target, draft, tokens = case([0.5, 0.5, 0.5, 0.5])
    assert _stopped_before(target, draft, tokens, seeds, offsets, pos_lo=3, n_b=2)  # the row ends at position 2
    assert not _stopped_before(target, draft, tokens, seeds, offsets, pos_lo=2, n_b=2)
    greedy_tokens = target[0, :num_drafts].argmax(-1)[None]
    assert not _stopped_before(target, draft, greedy_tokens, seeds, offsets, pos_lo=4, n_b=4, greedy=True)
    greedy_tokens[0, 1] = (greedy_tokens[0, 1] + 1) % vocab
    assert _stopped_before(target, draft, greedy_tokens, seeds, offsets, pos_lo=4, n_b=4, greedy=True)


@pytest.mark.parametrize("stages", [(), (1,), (2, 3), (1, 2, 3, 4, 5, 6, 7, 8)])
def test_stage_plans_give_the_same_result(stages) -> None:
    """Any staging of the statistics launches gives the reference's tokens (rows stop at every position here)."""
    target, draft, tokens, seeds, offsets = make_case(8, 8, 300, seed=11, noise=0.3)
    ref = rejection_sample_reference(target, draft, tokens, seeds, offsets, 1.0)
    got = rejection_sample_triton(target, draft, tokens, seeds, offsets, 1.0, plan=plan_for(target, stages=stages))
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert len(set(got[1].tolist())) >= 3  # several different stop positions


def _live_skip_case(batch: int, num_drafts: int, vocab: int, dtype=torch.float32, seed: int = 0):
    """Rows whose stop position is known: row b accepts its first ``b % (K + 1)`` drafts for certain (p(x) ~ 1 >=
    q(x)) and then, if it has a draft left, rejects it for certain (p(x) = 0)."""
    target, draft, drafts, seeds, offsets = make_case(batch, num_drafts, vocab, dtype, seed=seed)
    target = target.float()
    rows = torch.arange(batch, device=DEVICE)
    stops = rows % (num_drafts + 1)
    for j in range(num_drafts):
        ids = drafts[:, j]
        accept = j < stops
        target[rows[accept], j, ids[accept]] = 60.0
        target[rows[~accept & (j == stops)], j, ids[~accept & (j == stops)]] = float("-inf")
    return target.to(dtype), draft, drafts, seeds, offsets, stops


@pytest.mark.parametrize("splits", [1, 3])
def test_live_skip_reads_nothing_past_a_certain_rejection_and_stays_exact(splits, monkeypatch) -> None:
    """Live skip: the statistics in one position-major launch (a [S, B * K] grid); the last program of a position
    certainly rejected marks the row, and programs of its later positions stop reading. No position a row can reach
    is ever cut short, and tokens and counts equal the reference's, at T = 1 with full and ragged draft counts; a
    batch with greedy rows, or at T = 0, falls back to the usual grid (the launcher never runs live skip with greedy
    rows) and is exact too. The interpreter runs the programs one after another, so there the skips are
    deterministic: with one split (all of a position's programs before the next position's) every position past a
    row's rejection reads nothing (its partials stay empty); with three (split s of every position after split
    s - 1 of all of them) only the last split of those positions does. On a GPU the programs overlap and which ones
    stop depends on timing."""
    import specdec.kernels.rejection_sampling as launcher

    spy = StatsLaunchSpy(launcher._stats_kernel)
    monkeypatch.setattr(launcher, "_stats_kernel", spy)
    batch, num_drafts, vocab = 10, 4, 300
    target, draft, drafts, seeds, offsets, stops = _live_skip_case(batch, num_drafts, vocab, seed=31)
    plan = plan_for(target, live_skip=True, skip_bonus=True, stats_block=64, stats_splits=splits,
                    prefetch=splits == 3)
    ref = rejection_sample_reference(target, draft, drafts, seeds, offsets, 1.0)
    assert torch.equal(ref[1], stops)
    got = rejection_sample_triton(target, draft, drafts, seeds, offsets, 1.0, plan=plan)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert spy.grid == (splits, batch * num_drafts)  # position-major: (splits, B * K)
    stats = spy.stats.reshape(batch, num_drafts + 1, splits, 4)
    empty = (stats[..., 0] == float("-inf")) & (stats[..., 1] == 0)  # [B, K+1, S]: a program that read nothing
    positions = torch.arange(num_drafts, device=DEVICE)
    past = positions[None, :] > stops[:, None]  # [B, K]
    assert not empty[:, :num_drafts][~past].any()  # no position a row can reach was skipped
    if not CUDA:  # the interpreter's program order (see above)
        assert bool(past.any())
        assert torch.equal(empty[:, :num_drafts, -1], past)
        assert not empty[:, :num_drafts, :-1].any() if splits == 3 else empty[:, :num_drafts][past].all()
    # ragged draft counts (rows ending before, at and after their rejection), then greedy rows / T = 0
    counts = torch.tensor([4, 3, 4, 0, 2, 4, 1, 4, 4, 2], device=DEVICE)
    greedy_mask = torch.arange(batch, device=DEVICE) % 2 == 0
    for temperature, mask, live in ((1.0, None, True), (0.7, greedy_mask, False), (0.0, None, False)):
        ref = rejection_sample_reference(target, draft, drafts, seeds, offsets, temperature, greedy_mask=mask,
                                         num_draft_tokens=counts)
        got = rejection_sample_triton(target, draft, drafts, seeds, offsets, temperature, greedy_mask=mask,
                                      num_draft_tokens=counts, plan=plan)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        assert (spy.grid[0] == splits) == live  # position-major (splits, B * K) only without greedy rows


# (B, K, V, dtype) -> the statistics the automatic plan runs on an H100: "live" (one live-skip launch) or the
# positions where its launches start
STATISTICS_RULE = [
    ((32, 8, 151936, torch.float32), (0, 3)),  # fp32 K = 8, 331 MB
    ((128, 8, 151936, torch.bfloat16), "live"),  # bf16 K = 8, 661 MB: from 500 MB
    ((32, 7, 151936, torch.float32), (0, 2)),  # fp32 K = 7, 292 MB
    ((32, 6, 128256, torch.float32), (0, 2)),  # fp32 K = 6, 213 MB
    ((64, 6, 151936, torch.bfloat16), (0, 3)),  # bf16 K = 6, 253 MB
    ((32, 6, 100000, torch.float32), (0, 2)),  # fp32 K = 6, 166 MB
    ((32, 4, 128256, torch.float32), (0, 2)),  # fp32 K = 4, 148 MB
    ((16, 8, 151936, torch.float32), (0, 3)),  # fp32 K = 8, 165 MB
    ((16, 8, 90000, torch.float32), (0,)),  # fp32 K = 8, 98 MB
    ((32, 8, 65536, torch.float32), (0,)),  # fp32 K = 8, 143 MB, but V <= 65536
    ((32, 7, 65536, torch.float32), (0, 2)),  # fp32 K = 7, V <= 65536, 126 MB
    ((32, 6, 65536, torch.float32), (0, 2)),  # fp32 K = 6, V <= 65536, 109 MB
    ((32, 6, 48000, torch.float32), (0,)),  # fp32 K = 6, V <= 65536, 80 MB
    ((40, 5, 65536, torch.float32), (0,)),  # fp32 K = 5, V <= 65536, 115 MB
    ((48, 4, 128256, torch.float32), "live"),  # fp32 K = 4, B = 48, 222 MB: from 200 MB
    ((32, 3, 151936, torch.float32), (0,)),  # fp32 K = 3, 136 MB
    ((32, 8, 151936, torch.bfloat16), (0,)),  # bf16 K = 8, 165 MB
    ((32, 8, 32000, torch.float32), (0,)),  # 70 MB
    ((128, 5, 151936, torch.bfloat16), (0,)),  # bf16 K = 5, 428 MB
    ((128, 8, 32000, torch.float32), "live"),  # fp32, 278 MB
    ((128, 4, 32000, torch.float32), (0,)),  # fp32, 147 MB
    ((256, 3, 151936, torch.float32), (0,)),  # K = 3: never live
    ((128, 4, 151936, torch.float32), "live"),  # fp32 K = 4, 700 MB
    ((64, 8, 151936, torch.bfloat16), (0, 3)),  # bf16 K = 8, 330 MB: staged, not live
    ((64, 3, 151936, torch.float32), (0,)),  # fp32 272 MB, but K = 3
    ((32, 8, 151936, torch.float32), (0, 3)),  # 331 MB of fp32, but B = 32: staged, not live
]


@pytest.mark.parametrize("shape,expected", STATISTICS_RULE, ids=[str(s[:3]) for s, _ in STATISTICS_RULE])
def test_statistics_launch_rule(shape, expected) -> None:
    batch, num_drafts, vocab, dtype = shape
    plan = h100_plan(batch, num_drafts, vocab, dtype)
    if expected == "live":
        assert plan.live_skip and len(statistics_launches(plan, num_drafts)) == 1
    else:
        assert not plan.live_skip
        assert [lo for lo, _ in statistics_launches(plan, num_drafts)] == list(expected)
    # greedy rows and scores never run live skip; scores need one launch
    assert not h100_plan(batch, num_drafts, vocab, dtype, greedy_rows=True).live_skip
    scored = h100_plan(batch, num_drafts, vocab, dtype, scores=True)
    assert not scored.live_skip and len(statistics_launches(scored, num_drafts)) == 1


def test_live_skip_is_never_planned_in_the_interpreter_or_for_huge_grids() -> None:
    assert not plan_launch(128, 8, 151936, torch.float32, INTERPRETER).live_skip
    forced = replace(h100_plan(32, 8, 151936, torch.bfloat16), live_skip=True)
    assert not forced.restricted(batch=8192, num_drafts=7, greedy_rows=False, scores=False).live_skip  # 65536 pairs
    assert forced.restricted(batch=8191, num_drafts=7, greedy_rows=False, scores=False).live_skip


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("programs_per_sm", [4, 32])
def test_live_skip_gpu_exact(programs_per_sm, dtype) -> None:
    """On the GPU the programs of a launch overlap, so which ones skip depends on timing: with few and with many
    statistics programs per SM, ragged counts and -1 drafts, repeated calls give the reference's tokens; batches
    with greedy rows and at T = 0 (which run the usual grid) too."""
    batch = 32
    target, draft, drafts, seeds, offsets = make_case(batch, 8, 151936, dtype, seed=programs_per_sm, noise=0.4)
    drafts[0, 6:] = -1
    counts = torch.full((batch,), 8, dtype=torch.int64, device=DEVICE)
    counts[-1] = 5
    greedy_mask = torch.arange(batch, device=DEVICE) % 2 == 1
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    auto = plan_for(target)
    plan = replace(auto, live_skip=True,
                   stats_splits=grid_splits(151936, auto.stats_block, batch * 9, programs_per_sm * sms))
    for temperature, mask in ((1.0, None), (0.7, greedy_mask), (0.0, None)):
        ref = rejection_sample_reference(target, draft, drafts, seeds, offsets, temperature, greedy_mask=mask,
                                         num_draft_tokens=counts)
        for _ in range(3 if mask is None and temperature > 0 else 1):  # (repeats: the live path's timing)
            got = rejection_sample_triton(target, draft, drafts, seeds, offsets, temperature, greedy_mask=mask,
                                          num_draft_tokens=counts, plan=plan)
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), temperature
    target, draft, drafts, seeds, offsets, stops = _live_skip_case(batch, 8, 151936, dtype, seed=5)
    got = rejection_sample_triton(target, draft, drafts, seeds, offsets, 1.0, plan=plan)
    assert torch.equal(got[1], stops)


@gpu_only
@pytest.mark.parametrize("batch,num_drafts,vocab,launches", [
    (32, 6, 128256, [(0, 2), (2, 4)]),  # fp32 K = 6 from 200 MB (213 MB)
    (32, 4, 128256, [(0, 2), (2, 2)]),  # fp32, V > 65536, B < 48, from 100 MB (148 MB), K <= 7
    (16, 8, 151936, [(0, 3), (3, 5)]),  # the same range with K >= 8 (165 MB)
    (32, 7, 65536, [(0, 2), (2, 5)]),  # V <= 65536 (the small-vocabulary statistics plan), K = 7 (126 MB)
])
def test_auto_stage_plans_gpu_fp32(batch, num_drafts, vocab, launches) -> None:
    """The plans the automatic rule picks for fp32 logits, on shapes it covers: sampled rows with ragged counts and
    -1 drafts, and a batch with greedy rows, equal the reference, twice each."""
    assert statistics_launches(plan_launch(batch, num_drafts, vocab, torch.float32, DEVICE), num_drafts) == launches
    target, draft, drafts, seeds, offsets = make_case(batch, num_drafts, vocab, torch.float32, seed=61, noise=0.4)
    drafts[0, num_drafts - 2:] = -1
    counts = torch.full((batch,), num_drafts, dtype=torch.int64, device=DEVICE)
    counts[-1] = 3
    greedy_mask = torch.arange(batch, device=DEVICE) % 3 == 1
    for temperature, mask in ((1.0, None), (0.8, greedy_mask)):
        for _ in range(2):
            ref = assert_matches_reference(target, draft, drafts, seeds, offsets, temperature, greedy_mask=mask,
                                           num_draft_tokens=counts)
        assert 0 < int(ref[1].sum()) < batch * num_drafts  # both accepts and rejections occur


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", [2, 8])
def test_stage_plans_gpu_several_vocabulary_splits(batch, dtype):
    """Staged statistics with several vocabulary splits per position (the race kernel's combine then sums the
    splits in another order than the skip check's): every plan equals one launch and the reference, with sampled,
    greedy and temperature-0 rows, per-row draft counts and -1 drafts."""
    target, draft, drafts, seeds, offsets = make_case(batch, 8, 151936, dtype, seed=batch + 17, noise=0.4)
    drafts[0, 6:] = -1
    counts = torch.full((batch,), 8, dtype=torch.int64, device=DEVICE)
    counts[-1] = 5
    greedy_mask = torch.arange(batch, device=DEVICE) % 2 == 1
    for temperature, mask in ((1.0, None), (0.7, greedy_mask), (0.0, None)):
        ref = rejection_sample_reference(target, draft, drafts, seeds, offsets, temperature, greedy_mask=mask,
                                         num_draft_tokens=counts)
        for stages in ((), (2,), (3,), (1, 2, 3, 4, 5, 6, 7, 8)):
            got = rejection_sample_triton(target, draft, drafts, seeds, offsets, temperature, greedy_mask=mask,
                                          num_draft_tokens=counts, plan=plan_for(target, stages=stages))
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (temperature, stages)
