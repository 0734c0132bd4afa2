"""The fused Triton rejection sampler reproduces the torch reference exactly and is lossless.

On a machine without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by ``conftest.py``),
on small shapes. With a GPU the full matrix runs too: B in
{1, 7, 64}, K in {1, 4, 8}, V in {100, 8193, 32000, 151936}, fp32 and bf16, and every launch plan.

Exactness: tokens and accepted counts must be *equal* to the reference on the same (seeds, offsets) stream. The two
compute normalisers in a different order, so a decision could flip only on a near-tie (|margin| ~ 1e-6); with the
fixed seeds below none occurs. Launch plans are forced through the launcher's ``plan=`` argument. The launch
plan's rules are in ``test_rejection_plan_rules.py``, the staged and live-skip statistics in
``test_rejection_staged.py``, the shared cases in ``rejection_cases.py``.
"""


import pytest
import torch
from rejection_cases import (
    CUDA,
    DEVICE,
    StatsLaunchSpy,
    assert_matches_reference,
    gpu_only,
    make_case,
    plan_for,
)

import specdec
from specdec.fairness.metrics import acceptance_from_logits, accepted_count_distribution
from specdec.kernels.rejection_sampling import rejection_sample_triton
from specdec.kernels.rejection_sampling_plan import (
    grid_splits,
    plan_launch,
)
from specdec.kernels.rejection_sampling_reference import rejection_sample_reference

from stats import assert_follows

# ---------------------------------------------------------------------------------------------------------------
# Exact equality, CPU-sized


@pytest.mark.parametrize("batch,num_drafts", [(1, 1), (1, 4), (7, 1), (7, 4)])
@pytest.mark.parametrize("dtype,temperature", [(torch.float32, 1.0), (torch.bfloat16, 0.6)])
def test_exact_small(batch, num_drafts, dtype, temperature):
    case = make_case(batch, num_drafts, 100, dtype, seed=batch * 10 + num_drafts, temperature=temperature)
    ref = assert_matches_reference(*case, temperature)
    assert int(ref[1].min()) >= 0


def test_exact_fp16_logits():
    case = make_case(7, 4, 100, torch.float16, seed=74)
    assert_matches_reference(*case, 0.8, greedy_mask=torch.arange(7, device=DEVICE) % 3 == 1)


@gpu_only
@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("vocab", [32000, 151936])
def test_exact_fp16_logits_gpu(batch, vocab):
    # fp16 takes the 16-bit launch plans (at B <= 4 the folded statistics exponent)
    case = make_case(batch, 4, vocab, torch.float16, seed=batch + vocab)
    assert_matches_reference(*case, 1.0)
    assert_matches_reference(*case, 0.7, greedy_mask=torch.arange(batch, device=DEVICE) % 3 == 1)


@gpu_only
@pytest.mark.parametrize("temperature", [1e-2, 1e-4, 1e-5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_temperatures_are_exact_with_and_without_the_folded_exponent_gpu(temperature, dtype):
    # logits / T up to ~1e6: the statistics stay equal to the reference's only while each lane's maximum contributes
    # exactly 1 (a fused t (s log2 e) - m s log2 e exponent moves decisions at T = 1e-5)
    for batch, num_drafts, vocab in ((8, 8, 32000), (1, 4, 151936), (4, 8, 128256)):
        case = make_case(batch, num_drafts, vocab, dtype, seed=batch + vocab, temperature=temperature)
        for fold in (True, False):
            assert_matches_reference(*case, temperature, plan=plan_for(case[0], fold_scale=fold))


def test_exact_multi_tile_and_multi_split_with_ragged_last_tile():
    # V = 100 with 32-wide tiles: 4 tiles, the last one 4 lanes wide; 2 and 4 vocabulary chunks per row.
    case = make_case(7, 4, 100, torch.bfloat16, seed=3)
    assert_matches_reference(*case, 0.8, plan=plan_for(case[0], stats_block=32, stats_splits=2))
    assert_matches_reference(*case, 0.8, plan=plan_for(case[0], stats_block=32, stats_splits=4), compute_scores=True)


# Launch plans: none of them may change a token or an accepted count.
LAUNCH_PLANS = {
    "default": {},
    "race_tiles_2": dict(race_tiles=2, race_warps=2),
    "prefetch": dict(prefetch=True),  # its first tile is loaded before the row's draft ids are known
    "one_warp_race": dict(race_tiles=1, race_warps=1),  # the fp32 plan for B >= 32 on the GPU
    "l2_keep": dict(l2_keep=True, prefetch=True),  # both eviction branches of the prefetched statistics loop
    "l2_keep_no_prefetch": dict(l2_keep=True, prefetch=False),
    "one_launch": dict(stages=()),
}


@pytest.mark.parametrize("name", list(LAUNCH_PLANS))
def test_launch_plans_are_exact_with_scores_greedy_rows_and_ragged_drafts(name):
    # V = 2600: 11 race tiles of 256 ids in blocks of 256-1024 (the last one ragged), 2-4 race programs per row that
    # arrive at the fused finalize, 2-4 statistics chunks of 256-wide tiles; greedy rows, -1 drafts and per-row
    # counts share the batch.
    target, draft, drafts, seeds, offsets = make_case(7, 4, 2600, torch.bfloat16, seed=17)
    drafts[2, 2:] = -1
    counts = torch.tensor([4, 3, 4, 0, 2, 4, 1], device=DEVICE)
    greedy_mask = torch.arange(7, device=DEVICE) % 3 == 1
    for splits in (2, 4):
        plan = plan_for(target, stats_block=256, stats_splits=splits, race_splits=splits, **LAUNCH_PLANS[name])
        assert_matches_reference(target, draft, drafts, seeds, offsets, 0.8, plan=plan, greedy_mask=greedy_mask,
                                 num_draft_tokens=counts, compute_scores=True)
    assert_matches_reference(target, draft, drafts, seeds, offsets, 0.0, plan=plan_for(target, **LAUNCH_PLANS[name]))


@pytest.mark.parametrize("skip_bonus", [True, False])
@pytest.mark.parametrize("num_drafts", [1, 4])
def test_skipping_the_bonus_statistics_is_exact_and_launches_k_positions(num_drafts, skip_bonus, monkeypatch):
    # skip_bonus: without greedy rows the bonus position gets no statistics programs; its race (and the bonus token)
    # must not depend on them. Rows accept every draft (bonus) or stop earlier; ragged counts, with and without scores
    # (scores force one statistics launch; without them the interpreter's staged plan (positions 0-1, 2-3, 4-K) is
    # clipped to the positions launched), 1-4 splits.
    import specdec.kernels.rejection_sampling as launcher

    batch = 6
    spy = StatsLaunchSpy(launcher._stats_kernel, batch)
    monkeypatch.setattr(launcher, "_stats_kernel", spy)
    target, draft, drafts, seeds, offsets = make_case(batch, num_drafts, 700, torch.float32, seed=45 + num_drafts,
                                                      noise=0.2)
    counts = torch.tensor([num_drafts, 0, 1, num_drafts, num_drafts, 1], device=DEVICE)
    for splits, scores in ((1, True), (4, True), (2, False)):
        plan = plan_for(target, stats_block=64, stats_splits=splits, race_splits=min(splits, 2),
                        skip_bonus=skip_bonus)
        ref = assert_matches_reference(target, draft, drafts, seeds, offsets, 1.0, plan=plan,
                                       num_draft_tokens=counts, compute_scores=scores)
        assert bool((ref[1] == counts).any())  # some rows reach the bonus position
        assert spy.take() == (num_drafts if skip_bonus else num_drafts + 1)
    # greedy rows need the bonus arg-max: no skipping with a greedy mask or at T = 0. Drafts equal to the target's
    # arg-max make every greedy row accept all its drafts and take the bonus token.
    greedy_drafts = target[:, :num_drafts].float().argmax(dim=-1)
    plan = plan_for(target, stats_block=64, stats_splits=2, race_splits=2, skip_bonus=skip_bonus)
    for temperature, mask in ((0.0, None), (0.8, torch.arange(batch, device=DEVICE) % 2 == 0)):
        ref = rejection_sample_reference(target, draft, greedy_drafts, seeds, offsets, temperature, greedy_mask=mask)
        out = rejection_sample_triton(target, draft, greedy_drafts, seeds, offsets, temperature, greedy_mask=mask,
                                      plan=plan)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
        greedy_rows = torch.ones(batch, dtype=torch.bool, device=DEVICE) if mask is None else mask
        assert bool((out[1][greedy_rows] == num_drafts).all())  # they all reached the bonus position
        assert spy.take() == num_drafts + 1



@pytest.mark.parametrize("vocab", [1, 3])
def test_tiny_vocabularies_are_exact(vocab):
    # V below the statistics tile's 8-wide inner dimension (the interpreter sizes tiles from V)
    case = make_case(3, 2, vocab, seed=vocab)
    assert_matches_reference(*case, 1.0)


def test_exact_vocab_8193_not_a_multiple_of_the_tile():
    case = make_case(1, 1, 8193, torch.bfloat16, seed=4)
    assert_matches_reference(*case, 1.0)


def test_scores_match_reference():
    case = make_case(7, 4, 100, torch.float32, seed=5)
    assert_matches_reference(*case, 0.7, compute_scores=True)
    greedy_mask = torch.arange(7, device=DEVICE) % 3 == 0
    assert_matches_reference(*case, 0.7, compute_scores=True, greedy_mask=greedy_mask)


def test_greedy_accepts_argmax_ties_to_lowest_id_and_uses_no_randomness():
    target, draft, _, seeds, offsets = make_case(7, 4, 100, torch.bfloat16, seed=6)
    target[:, :, 10] = target.float().amax(-1).to(target.dtype)  # ties: ids 10 and the original arg-max
    argmax = target[:, :4].float().argmax(-1)
    drafts = argmax.clone()
    drafts[1, 2] = (argmax[1, 2] + 1) % 100  # row 1 rejects at position 2
    drafts[3, 0] = 11
    ref = assert_matches_reference(target, draft, drafts, seeds, offsets, 0.0)
    assert ref[1].tolist() == [4, 2, 4, 0, 4, 4, 4]
    other = rejection_sample_triton(target, draft, drafts, seeds + 1, offsets + 5, 0.0)
    assert torch.equal(other[0], ref[0])


def test_mixed_greedy_mask_rows_share_a_batch():
    case = make_case(7, 4, 100, torch.float32, seed=7)
    greedy_mask = torch.tensor([True, False, True, True, False, False, True], device=DEVICE)
    assert_matches_reference(*case, 0.9, greedy_mask=greedy_mask)


def test_minus_one_drafts_and_per_row_counts():
    target, draft, drafts, seeds, offsets = make_case(7, 4, 100, torch.float32, seed=8, noise=0.05)
    drafts[0, 0:] = -1
    drafts[1, 2:] = -1
    drafts[2, 3] = -1
    counts = torch.tensor([4, 4, 1, 0, 2, 3, 4], device=DEVICE)
    ref = assert_matches_reference(target, draft, drafts, seeds, offsets, 1.0, num_draft_tokens=counts)
    assert int(ref[1][0]) == 0 and int(ref[1][3]) == 0 and int(ref[1][1]) <= 2 and int(ref[1][2]) <= 1
    assert_matches_reference(target, draft, drafts, seeds, offsets, 0.0, num_draft_tokens=counts)


def test_draft_with_zero_drafter_probability_is_always_rejected():
    target, draft, drafts, seeds, offsets = make_case(7, 4, 100, torch.float32, seed=9, noise=0.0)
    draft[:, 1, 42] = float("-inf")
    drafts[:, 0] = target[:, 0].argmax(-1)  # position 0 accepted (q = p there)
    drafts[:, 1] = 42
    ref = assert_matches_reference(target, draft, drafts, seeds, offsets, 1.0)
    assert bool((ref[1] == 1).all())


def test_single_finite_logit_rows():
    target, draft, drafts, seeds, offsets = make_case(7, 4, 100, torch.bfloat16, seed=10)
    target[0] = float("-inf")
    target[0, :, 7] = 3.0  # p is one-hot on 7 at every position
    draft[1] = float("-inf")
    draft[1, :, 9] = 0.0  # q one-hot on 9
    drafts[1] = 9
    draft[2] = float("-inf")
    draft[2, :, 5] = 1.0
    target[2] = float("-inf")
    target[2, :, 5] = 1.0  # p == q one-hot: always accepted, bonus = 5
    drafts[2] = 5
    ref = assert_matches_reference(target, draft, drafts, seeds, offsets, 1.0)
    assert int(ref[0][0, int(ref[1][0])]) == 7
    assert ref[0][2].tolist() == [5] * 5


def test_identical_rows_fall_back_to_p_when_the_residual_is_empty():
    target, _, drafts, seeds, offsets = make_case(7, 4, 100, torch.float32, seed=11)
    target[:, 1, 42] = float("-inf")
    draft = target[:, :4].clone()  # q == p: position 0 is always accepted
    drafts[:, 1] = 42  # q(42) = p(42) = 0 at position 1: rejected, max(0, p - q) == 0, the race runs on p
    ref = assert_matches_reference(target, draft, drafts, seeds, offsets, 1.0)
    assert bool((ref[1] == 1).all())
    assert bool((ref[0][:, 1] != 42).all())


def _near_equal_case(kind, batch=16, num_drafts=2, vocab=4096, seed=15):
    """q == p up to rounding at every position, and a forced rejection at position 1 (p(42) = q(42) = 0)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    target = torch.randn(batch, num_drafts + 1, vocab, generator=gen, device=DEVICE) * 2.0
    if kind == "shift":
        # logits on a 2**-10 grid shifted by exactly 20: p == q in exact arithmetic, but the fp32 log-sum-exps
        # (~17 and ~37) round differently, so a kernel residual exp(t - L_t) - exp(d - L_d) is ~1e-6 noise
        target = torch.round((target + 10.0) * 1024) / 1024
        draft = target[:, :num_drafts] + 20.0
    else:
        # 1e-7 relative noise on the logits (about one fp32 ulp): TV(p, q) ~ 1e-7
        draft = target[:, :num_drafts] * (1 + 1e-7 * torch.randn(batch, num_drafts, vocab, generator=gen,
                                                                  device=DEVICE))
    target[:, 1, 42] = float("-inf")
    draft[:, 1, 42] = float("-inf")
    drafts = torch.randint(0, vocab, (batch, num_drafts), generator=gen, device=DEVICE)
    drafts[:, 0] = draft[:, 0].argmax(-1)
    drafts[:, 1] = 42  # q(42) = 0: always rejected
    seeds = torch.randint(0, 2**62, (batch,), generator=gen, device=DEVICE)
    offsets = torch.randint(0, 2**40, (batch,), generator=gen, device=DEVICE)
    return target, draft, drafts, seeds, offsets


@pytest.mark.parametrize("kind", ["shift", "relative_noise"])
def test_q_equal_p_up_to_rounding_matches_reference_exactly(kind):
    # With q == p up to rounding the residual is rounding noise; a rule "race on p only when the residual is exactly
    # 0" would make the backends disagree (the reference's residual can be exactly 0, the kernel's noise). Both race
    # on p unless the residual mass exceeds RESIDUAL_MASS_EPS.
    target, draft, drafts, seeds, offsets = _near_equal_case(kind)
    ref = assert_matches_reference(target, draft, drafts, seeds, offsets, 1.0)
    assert bool((ref[1] == 1).all())
    # the recovered token is p's race winner at position 1: a row with no drafts on the stream shifted by one
    p_race = rejection_sample_reference(target[:, 1:], draft[:, :1].clone(), torch.full_like(drafts[:, :1], -1),
                                        seeds, offsets + 1, 1.0)
    assert torch.equal(ref[0][:, 1], p_race[0][:, 0])


def test_residual_below_mass_threshold_races_on_p_above_it_on_the_residual():
    # q(42) = 0 forces a rejection; the residual max(0, p - q) is then p(42) (q renormalises the rest upwards).
    target, draft, drafts, seeds, offsets = _near_equal_case("shift", batch=8)
    target[:, 1, 42] = target[:, 1].amax(-1) - 30.0  # p(42) ~ 1e-13 / ~1e-4 below: mass <= 1e-6 -> race on p
    ref = assert_matches_reference(target, draft, drafts, seeds, offsets, 1.0)
    assert bool((ref[0][:, 1] != 42).all())
    target[:, 1, 42] = target[:, 1].amax(-1) - 2.0  # mass = p(42) ~ 1e-3 > 1e-6: the residual is one-hot on 42
    ref = assert_matches_reference(target, draft, drafts, seeds, offsets, 1.0)
    assert bool((ref[0][:, 1] == 42).all())


def test_launch_shape_invariance_row_alone_equals_row_in_a_batch_of_64():
    target, draft, drafts, seeds, offsets = make_case(64, 4, 100, torch.bfloat16, seed=12)
    full = rejection_sample_triton(target, draft, drafts, seeds, offsets, 1.0)
    for row in (0, 29, 63):
        sl = slice(row, row + 1)
        alone = rejection_sample_triton(target[sl], draft[sl], drafts[sl], seeds[sl], offsets[sl], 1.0)
        assert torch.equal(alone[0][0], full[0][row])


def test_nan_and_all_minus_inf_rows_never_yield_an_out_of_range_id():
    target, draft, drafts, seeds, offsets = make_case(7, 4, 100, torch.float32, seed=13)
    target[0] = float("nan")
    target[1] = float("-inf")
    draft[2] = float("nan")
    for temperature in (1.0, 0.0):
        tokens, accepted, _, _ = rejection_sample_triton(target, draft, drafts, seeds, offsets, temperature)
        assert bool(((tokens >= -1) & (tokens < 100)).all())
        assert bool(((accepted >= 0) & (accepted <= 4)).all())
    with pytest.raises(ValueError, match="NaN"):
        specdec.rejection_sample(target, draft, drafts, backend="triton")


def test_public_api_triton_backend_equals_torch_backend():
    target, draft, drafts, seeds, offsets = make_case(7, 4, 100, torch.bfloat16, seed=14)
    kwargs = dict(temperature=0.8, seeds=seeds, offsets=offsets, compute_scores=True,
                  num_draft_tokens=torch.tensor([4, 3, 2, 1, 0, 4, 4], device=DEVICE))
    tri = specdec.rejection_sample(target, draft, drafts, backend="triton", **kwargs)
    ref = specdec.rejection_sample(target, draft, drafts, backend="torch", **kwargs)
    assert torch.equal(tri.tokens, ref.tokens) and torch.equal(tri.num_accepted, ref.num_accepted)
    torch.testing.assert_close(tri.alpha, ref.alpha, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Statistics through the Triton backend: emitted tokens follow p, accepted counts follow the closed form


def _statistical_check(rows: int, temperature: float, seed: int, public: bool = False, vocab: int = 5,
                       support: list[int] | None = None, plan_changes: dict | None = None):
    """Many independent rows (distinct seeds) of one (p, q) pair over ``vocab`` ids, every logit outside
    ``support`` (default: all ids) ``-inf``."""
    num_drafts = 2
    support = list(range(vocab)) if support is None else support
    gen = torch.Generator().manual_seed(seed)
    target = torch.full((num_drafts + 1, vocab), float("-inf"))
    draft = torch.full((num_drafts, vocab), float("-inf"))
    target[:, support] = torch.randn(num_drafts + 1, len(support), generator=gen) * 1.5
    draft[:, support] = torch.randn(num_drafts, len(support), generator=gen) * 1.5
    target, draft = target.to(DEVICE), draft.to(DEVICE)
    q = torch.softmax(draft / temperature, -1).cpu()
    drafts = torch.stack([torch.multinomial(q[j], rows, replacement=True, generator=gen)
                          for j in range(num_drafts)], dim=1).to(DEVICE)
    seeds = torch.arange(rows, dtype=torch.int64, device=DEVICE) * 1_000_003 + seed
    batch_target, batch_draft = target.expand(rows, -1, -1), draft.expand(rows, -1, -1)
    if public:
        out = specdec.rejection_sample(batch_target, batch_draft, drafts, temperature=temperature, seeds=seeds,
                                       backend="triton")
        tokens, accepted = out.tokens.cpu(), out.num_accepted.cpu()
    else:
        plan = plan_for(batch_target, **(plan_changes or {}))
        offsets = torch.zeros_like(seeds)
        tokens, accepted, _, _ = rejection_sample_triton(batch_target, batch_draft, drafts, seeds, offsets,
                                                         temperature, plan=plan)
        ref = rejection_sample_reference(batch_target, batch_draft, drafts, seeds, offsets, temperature)
        assert torch.equal(tokens, ref[0]) and torch.equal(accepted, ref[1])
        tokens, accepted = tokens.cpu(), accepted.cpu()
    positions = torch.arange(num_drafts + 1)
    assert bool(((tokens >= 0) == (positions[None] <= accepted[:, None])).all())
    p = torch.softmax(target.double().cpu() / temperature, -1)
    for j in range(num_drafts + 1):
        reached = tokens[:, j] >= 0
        if int(reached.sum()) >= 100:
            assert_follows(torch.bincount(tokens[reached, j], minlength=vocab), p[j], what=f"position {j}")
    alpha = acceptance_from_logits(target[:num_drafts].cpu(), draft.cpu(), temperature).double()
    assert_follows(torch.bincount(accepted, minlength=num_drafts + 1), accepted_count_distribution(alpha),
                   what="accepted counts")


PUBLIC_STAT_ROWS = 20000 if CUDA else 1200
RACE_TILE_STAT_ROWS = 100_000 if CUDA else 400


def test_statistics_through_triton_backend():
    # the public entry point with its automatic plan (100k rows at two temperatures: test_statistics_gpu_many_rows)
    _statistical_check(PUBLIC_STAT_ROWS, 0.8, seed=21, public=True)


@gpu_only
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_statistics_gpu_many_rows(temperature):
    _statistical_check(100_000, temperature, seed=31)


@pytest.mark.parametrize("race_tiles", [1, 4])
def test_statistics_through_triton_with_two_level_race_across_tiles(race_tiles):
    # p and q live on 5 ids in 4 race tiles of 256 (two ids in tile 0, one in the ragged last tile), so level 1 of
    # the race decides every recovered and bonus token: race_tiles 1 loops over the tiles in 2 programs a row (the
    # fused finalize combines them), race_tiles 4 holds the row in one block (level 2 from registers)
    _statistical_check(RACE_TILE_STAT_ROWS, 0.8, seed=23 + race_tiles, vocab=1000, support=[5, 250, 300, 700, 999],
                       plan_changes=dict(race_tiles=race_tiles, race_warps=race_tiles,
                                         race_splits=2 if race_tiles == 1 else 1))


# ---------------------------------------------------------------------------------------------------------------
# GPU: the full matrix and large shapes


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", [100, 8193, 32000, 151936])
@pytest.mark.parametrize("num_drafts", [1, 4, 8])
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_exact_matrix_gpu(batch, num_drafts, vocab, dtype):
    case = make_case(batch, num_drafts, vocab, dtype, seed=batch * 1000 + num_drafts * 10 + (vocab % 7))
    assert_matches_reference(*case, 1.0)
    greedy_mask = torch.arange(batch, device=DEVICE) % 3 == 1
    assert_matches_reference(*case, 0.7, greedy_mask=greedy_mask)


GPU_LAUNCH_PLANS = dict(default={}, prefetch=dict(prefetch=True, stats_block=4096, stats_warps=16),
                        race_tiles4=dict(race_tiles=4, race_warps=4), race_splits8=dict(race_splits=8),
                        no_prefetch=dict(prefetch=False), one_warp_race=LAUNCH_PLANS["one_warp_race"],
                        pdl=dict(pdl=True), no_pdl=dict(pdl=False), no_fast_math=dict(fast_math=False,
                                                                                       fold_scale=False),
                        l2_keep=dict(l2_keep=True), fold_on=dict(fold_scale=True), fold_off=dict(fold_scale=False),
                        unpack_off=dict(unpack_bf16=False), unpack_fold=dict(unpack_bf16=True, fold_scale=True))


@gpu_only
@pytest.mark.parametrize("name", list(GPU_LAUNCH_PLANS))
@pytest.mark.parametrize("batch,num_drafts,vocab", [(1, 4, 151936), (64, 8, 32000)])
def test_launch_plans_gpu(name, batch, num_drafts, vocab):
    case = make_case(batch, num_drafts, vocab, torch.bfloat16, seed=batch + vocab)
    plan = plan_for(case[0], **GPU_LAUNCH_PLANS[name])
    assert_matches_reference(*case, 1.0, plan=plan)
    greedy_mask = torch.arange(batch, device=DEVICE) % 3 == 1
    assert_matches_reference(*case, 0.7, plan=plan, greedy_mask=greedy_mask, compute_scores=True)


@gpu_only
@pytest.mark.parametrize("batch,num_drafts,vocab,dtype",
                         [(8, 8, 32000, torch.bfloat16), (16, 4, 65536, torch.bfloat16),
                          (32, 4, 32000, torch.float32), (128, 8, 32000, torch.float32)],
                         ids=["bf16-few-race-8", "bf16-few-race-16", "fp32-l2-32", "fp32-l2-128"])
def test_few_race_programs_and_l2_keep_plans_gpu(batch, num_drafts, vocab, dtype):
    # the automatic plans with one race program per SM (16-bit, B = 8-16, V <= 65536) and with eviction hints
    # (fp32, B >= 32, small vocabularies), with greedy rows, scores and ragged drafts
    plan = plan_launch(batch, num_drafts, vocab, dtype, DEVICE)
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    if dtype == torch.bfloat16:  # these shapes do take the plan under test
        assert plan.race_splits == grid_splits(vocab, plan.race_tiles * 256, batch, sms)
    else:
        assert plan.l2_keep
    case = make_case(batch, num_drafts, vocab, dtype, seed=batch * 11 + num_drafts)
    assert_matches_reference(*case, 1.0)
    case[2][1, 2:] = -1
    greedy_mask = torch.arange(batch, device=DEVICE) % 3 == 1
    assert_matches_reference(*case, 0.7, greedy_mask=greedy_mask, compute_scores=True)


@gpu_only
@pytest.mark.parametrize("batch,num_drafts,vocab", [(32, 1, 32000), (32, 8, 32000), (64, 8, 151936),
                                                     (128, 1, 128256)])
def test_fp32_one_warp_race_plan_gpu(batch, num_drafts, vocab):
    # fp32 with B >= 32 takes the one-warp race plan automatically; scores and greedy rows too
    assert plan_launch(batch, num_drafts, vocab, torch.float32, DEVICE).race_warps == 1
    case = make_case(batch, num_drafts, vocab, torch.float32, seed=batch * 7 + vocab)
    assert_matches_reference(*case, 1.0)
    greedy_mask = torch.arange(batch, device=DEVICE) % 3 == 1
    assert_matches_reference(*case, 0.7, greedy_mask=greedy_mask, compute_scores=True)


@gpu_only
@pytest.mark.parametrize("vocab", [32000, 151936])
def test_large_shapes_gpu_scores_and_launch_invariance(vocab):
    target, draft, drafts, seeds, offsets = make_case(64, 8, vocab, torch.bfloat16, seed=vocab)
    assert_matches_reference(target, draft, drafts, seeds, offsets, 1.0, compute_scores=True)
    full = rejection_sample_triton(target, draft, drafts, seeds, offsets, 1.0)
    for row in (0, 33, 63):
        sl = slice(row, row + 1)
        alone = rejection_sample_triton(target[sl], draft[sl], drafts[sl], seeds[sl], offsets[sl], 1.0)
        assert torch.equal(alone[0][0], full[0][row])
