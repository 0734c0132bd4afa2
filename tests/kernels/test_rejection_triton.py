"""The fused Triton rejection sampler reproduces the torch reference exactly and is lossless.

On a machine without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by ``conftest.py``
and again here before anything imports Triton), on small shapes. With a GPU the full matrix runs too: B in
{1, 7, 64}, K in {1, 4, 8}, V in {100, 8193, 32000, 151936}, fp32 and bf16, and every launch plan.

Exactness: tokens and accepted counts must be *equal* to the reference on the same (seeds, offsets) stream. The two
compute normalisers in a different order, so a decision could flip only on a near-tie (|margin| ~ 1e-6); with the
fixed seeds below none occurs. Launch plans are forced through the launcher's ``plan=`` argument.
"""

import os
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import specdec  # noqa: E402
from specdec.fairness.metrics import acceptance_from_logits, accepted_count_distribution  # noqa: E402
from specdec.kernels._device import DeviceFacts  # noqa: E402
from specdec.kernels.rejection_sampling import rejection_sample_triton  # noqa: E402
from specdec.kernels.rejection_sampling_kernels import _rejected_before, _to_f32  # noqa: E402
from specdec.kernels.rejection_sampling_plan import (  # noqa: E402
    FP32_SMALL_VOCAB,
    LaunchPlan,
    grid_splits,
    plan_launch,
    statistics_launches,
)
from specdec.kernels.rejection_sampling_reference import rejection_sample_reference  # noqa: E402

from stats import assert_follows  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
gpu_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (too slow in Triton's interpreter)")
_INTERPRET_ON = os.environ.get("TRITON_INTERPRET") == "1"
H100 = DeviceFacts(sm_count=132, major=9, name="NVIDIA H100 80GB HBM3", interpreter=False)
INTERPRETER = DeviceFacts(sm_count=4, major=0, name="", interpreter=True)


def make_case(batch, num_drafts, vocab, dtype=torch.float32, seed=0, scale=2.0, noise=0.7, temperature=1.0):
    """Correlated target/draft logits (alpha ~ 0.6-0.8), drafts sampled from q, random seeds and int64 offsets."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    target = torch.randn(batch, num_drafts + 1, vocab, generator=gen, device=DEVICE) * scale
    draft = target[:, :num_drafts] + noise * torch.randn(batch, num_drafts, vocab, generator=gen, device=DEVICE)
    target, draft = target.to(dtype), draft.to(dtype)
    gumbel = -torch.log(-torch.log(torch.rand(batch, num_drafts, vocab, generator=gen, device=DEVICE)))
    drafts = torch.argmax(draft.float() / max(temperature, 1e-3) + gumbel, dim=-1)
    seeds = torch.randint(0, 2**62, (batch,), generator=gen, device=DEVICE)
    offsets = torch.randint(0, 2**40, (batch,), generator=gen, device=DEVICE)
    return target, draft, drafts, seeds, offsets


def plan_for(target, **changes) -> LaunchPlan:
    """The automatic plan of ``target``'s shape and dtype on this device (sampled rows, no scores), with
    ``changes``; the launcher turns off what a call cannot use."""
    batch, positions, vocab = target.shape
    return replace(plan_launch(batch, positions - 1, vocab, target.dtype, DEVICE), **changes)


def assert_matches_reference(target, draft, drafts, seeds, offsets, temperature, plan=None, **kwargs):
    """The Triton sampler gives the reference's tokens and counts exactly; scores agree to fp32 rounding."""
    scores = kwargs.pop("compute_scores", False)
    ref = rejection_sample_reference(target, draft, drafts, seeds, offsets, temperature, compute_scores=scores,
                                     **kwargs)
    out = rejection_sample_triton(target, draft, drafts, seeds, offsets, temperature, compute_scores=scores,
                                  plan=plan, **kwargs)
    bad = (out[0] != ref[0]).any(dim=1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad[:8]} differ: {out[0][bad[:2]].tolist()} vs {ref[0][bad[:2]].tolist()}"
    assert torch.equal(out[1], ref[1])
    if scores:
        torch.testing.assert_close(out[2], ref[2], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out[3], ref[3], rtol=1e-4, atol=1e-5)
    return ref


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


class _StatsLaunchSpy:
    """Stands in for the statistics kernel in the launcher: counts the positions the launches cover (grid
    ``(B * positions, S)``) and keeps the last launch's grid and statistics partials, then launches the real
    kernel."""

    def __init__(self, kernel, batch: int = 1):
        self.kernel, self.batch, self.positions, self.grid, self.stats = kernel, batch, 0, None, None

    def __getitem__(self, grid):
        self.positions += grid[0] // self.batch
        self.grid = grid

        def launch(*args, **kwargs):
            self.stats = args[5]
            return self.kernel[grid](*args, **kwargs)
        return launch

    def take(self) -> int:
        """Positions launched since the last call."""
        positions, self.positions = self.positions, 0
        return positions


@pytest.mark.parametrize("skip_bonus", [True, False])
@pytest.mark.parametrize("num_drafts", [1, 4])
def test_skipping_the_bonus_statistics_is_exact_and_launches_k_positions(num_drafts, skip_bonus, monkeypatch):
    # skip_bonus: without greedy rows the bonus position gets no statistics programs; its race (and the bonus token)
    # must not depend on them. Rows accept every draft (bonus) or stop earlier; ragged counts, with and without scores
    # (scores force one statistics launch; without them the interpreter's staged plan (positions 0-1, 2-3, 4-K) is
    # clipped to the positions launched), 1-4 splits.
    import specdec.kernels.rejection_sampling as launcher

    batch = 6
    spy = _StatsLaunchSpy(launcher._stats_kernel, batch)
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


# ---------------------------------------------------------------------------------------------------------------
# The automatic plan's rules (asked for an H100, and for the interpreter)


def _gpu_plan(batch, num_drafts, vocab, dtype=torch.float32, **kwargs) -> LaunchPlan:
    return plan_launch(batch, num_drafts, vocab, dtype, H100, **kwargs)


def test_skip_bonus_rule():
    assert _gpu_plan(1, 8, 151936, torch.bfloat16).skip_bonus and _gpu_plan(128, 1, 32000, torch.bfloat16).skip_bonus
    assert _gpu_plan(1, 4, FP32_SMALL_VOCAB).skip_bonus and _gpu_plan(1, 8, 151936).skip_bonus
    # fp32 small-vocabulary plan with K >= 8: no skip at B = 1 or B >= 16, skip at 2 <= B <= 8
    assert not _gpu_plan(1, 8, FP32_SMALL_VOCAB).skip_bonus and not _gpu_plan(16, 8, 32000).skip_bonus
    assert _gpu_plan(2, 8, 32000).skip_bonus and _gpu_plan(8, 12, 32000).skip_bonus
    assert _gpu_plan(1, 7, 32000).skip_bonus and _gpu_plan(64, 7, 32000).skip_bonus
    assert not _gpu_plan(8, 4, 32000, torch.bfloat16, greedy_rows=True).skip_bonus  # greedy rows need the arg-max
    forced = replace(_gpu_plan(8, 4, 32000), skip_bonus=True)
    assert not forced.restricted(batch=8, num_drafts=4, greedy_rows=True, scores=False).skip_bonus
    assert forced.restricted(batch=8, num_drafts=4, greedy_rows=False, scores=True).skip_bonus


def test_race_plan_rule_picks_the_one_warp_race_for_fp32_batches_of_32_or_more():
    def race(batch, vocab=151936, dtype=torch.float32, facts=H100):
        """(race tiles, race warps, race splits) of the plan and the splits of ``n`` race programs per SM."""
        plan = plan_launch(batch, 4, vocab, dtype, facts)

        def per_sm(n):
            return grid_splits(vocab, plan.race_tiles * 256, batch, n * facts.sm_count)
        return plan.race_tiles, plan.race_warps, plan.race_splits, per_sm

    for batch in (32, 128):
        tiles, warps, splits, per_sm = race(batch)
        assert (tiles, warps, splits) == (1, 1, per_sm(16))
    tiles, warps, splits, per_sm = race(31)  # below the batch threshold
    assert (tiles, warps, splits) == (4, 4, per_sm(4))
    tiles, warps, splits, per_sm = race(32, dtype=torch.bfloat16)  # 16-bit logits keep one warp per tile
    assert (tiles, warps, splits) == (4, 4, per_sm(4))
    assert race(2)[:2] == (2, 2)  # B <= 2: smaller race blocks
    assert race(32, facts=INTERPRETER)[:2] == (4, 4)  # the interpreter keeps the general plan
    # small fp32 vocabularies below B = 128: two tiles per one-warp program, 8 programs per SM
    tiles, warps, splits, per_sm = race(32, vocab=32000)
    assert (tiles, warps, splits) == (2, 1, per_sm(8))
    tiles, warps, splits, per_sm = race(128, vocab=32000)
    assert (tiles, warps, splits) == (1, 1, per_sm(16))
    assert race(32, vocab=32000, dtype=torch.bfloat16)[:2] == (4, 4)


def test_race_plan_rule_gives_16_bit_logits_one_race_program_per_sm_at_batches_8_to_16_with_small_vocabularies():
    for batch in (8, 16):  # one race program per SM
        assert _gpu_plan(batch, 4, 32000, torch.bfloat16).race_splits == grid_splits(32000, 1024, batch, 132)
        assert _gpu_plan(batch, 4, 65536, torch.bfloat16).race_splits == grid_splits(65536, 1024, batch, 132)
        # large vocabularies and fp32 keep 4 programs per SM
        assert _gpu_plan(batch, 4, 151936, torch.bfloat16).race_splits == grid_splits(151936, 1024, batch, 4 * 132)
        assert _gpu_plan(batch, 4, 32000).race_splits == grid_splits(32000, 1024, batch, 4 * 132)
    assert _gpu_plan(7, 4, 32000, torch.bfloat16).race_splits == grid_splits(32000, 1024, 7, 4 * 132)
    assert _gpu_plan(17, 4, 32000, torch.bfloat16).race_splits == grid_splits(32000, 1024, 17, 4 * 132)
    assert _gpu_plan(8, 4, 65537, torch.bfloat16).race_splits == grid_splits(65537, 1024, 8, 4 * 132)


def test_l2_keep_rule_keeps_position_0_for_fp32_batches_of_32_or_more_with_small_vocabularies():
    assert _gpu_plan(32, 4, 32000).l2_keep
    assert _gpu_plan(128, 8, 32000).l2_keep  # kept rows 2 * 128 * 32000 * 4 bytes <= 32 MiB
    assert not _gpu_plan(128, 8, 65536).l2_keep  # 67 MB kept: more than the rule allows
    assert _gpu_plan(64, 4, 65536).l2_keep  # exactly 32 MiB kept
    assert not _gpu_plan(32, 4, 65537).l2_keep
    assert not _gpu_plan(128, 1, 32000).l2_keep  # K < 4
    assert not _gpu_plan(16, 4, 32000).l2_keep  # B < 32
    assert not _gpu_plan(128, 4, 32000, torch.bfloat16).l2_keep  # bf16
    assert not _gpu_plan(32, 4, 128256).l2_keep  # large vocabulary


def test_fast_math_fold_and_unpack_rules():
    assert _gpu_plan(1, 4, 32000, torch.bfloat16).fold_scale and _gpu_plan(4, 4, 32000, torch.float16).fold_scale
    assert not _gpu_plan(5, 4, 32000, torch.bfloat16).fold_scale  # B > 4
    assert not _gpu_plan(1, 4, 32000).fold_scale  # fp32
    assert _gpu_plan(8, 4, 32000, torch.bfloat16).unpack_bf16 and _gpu_plan(8, 4, 151936, torch.bfloat16).unpack_bf16
    assert not _gpu_plan(8, 4, 32001, torch.bfloat16).unpack_bf16  # rows not provably 16-byte aligned
    assert _gpu_plan(8, 4, 32000).fast_math and _gpu_plan(8, 4, 32000).pdl and not _gpu_plan(9, 4, 32000).pdl
    assert not plan_launch(8, 4, 32000, torch.float32, replace(H100, major=8)).pdl  # PDL needs sm_90
    interpreted = plan_launch(1, 4, 32000, torch.bfloat16, INTERPRETER)  # no inline PTX in the interpreter
    assert not (interpreted.fast_math or interpreted.fold_scale or interpreted.unpack_bf16 or interpreted.pdl)
    assert interpreted.stats_block == 1024 and interpreted.stages == (2, 4)


def test_stats_splits_rule_halves_the_statistics_grid_for_small_fp32_batches_with_five_or_more_drafts():
    def per_sm(batch, num_drafts, vocab, dtype=torch.float32):
        plan = _gpu_plan(batch, num_drafts, vocab, dtype)
        rows = batch * (num_drafts + 1)
        return next(n for n in (1, 2, 4, 8, 16, 32) if grid_splits(vocab, plan.stats_block, rows, n * 132)
                    == plan.stats_splits)

    assert per_sm(8, 8, 32000) == 2 and per_sm(1, 12, FP32_SMALL_VOCAB) == 2 and per_sm(4, 5, 32000) == 2
    assert per_sm(16, 8, 32000) == 4  # (32, 8, 32000) lost with 2
    assert per_sm(8, 4, 32000) == 4 and per_sm(8, 8, 151936) == 4
    assert per_sm(8, 8, 32000, torch.bfloat16) == 4  # bf16 lost with 2


def test_launch_plan_fields_are_checked():
    plan = plan_launch(1, 1, 100, torch.float32, INTERPRETER)
    for field, value in (("race_tiles", 3), ("stats_block", 4), ("stats_block", 48), ("stats_warps", 0),
                         ("stats_splits", 0), ("race_splits", 257), ("stages", (0, 2)), ("stages", 3),
                         ("prefetch", "no"), ("fast_math", 0), ("pdl", None)):
        with pytest.raises(ValueError, match=field):
            replace(plan, **{field: value})
    with pytest.raises(ValueError, match="fold_scale"):
        replace(plan, fast_math=False, fold_scale=True)
    case = make_case(3, 2, 5, seed=5)
    assert_matches_reference(*case, 1.0, plan=replace(plan, stats_block=8))  # V below one 8-id tile


@triton.jit
def _convert_kernel(src_ptr, dst_ptr, BLOCK: tl.constexpr, UNPACK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, _to_f32(tl.load(src_ptr + offs), UNPACK))


@pytest.mark.skipif(not CUDA or _INTERPRET_ON, reason="inline PTX, and a bit-exact bf16 conversion: the "
                    "interpreter has no PTX and flushes bf16 subnormals")
@pytest.mark.parametrize("unpack", [True, False])
def test_bf16_statistics_conversion_keeps_every_bit_pattern_gpu(unpack):
    """The statistics tiles' bf16 -> fp32 conversion (the inline-asm unpack of two ids a register, and the plain
    one) gives torch's fp32 bit pattern for all 65536 bf16 patterns, in order (a swapped pair would fail)."""
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32, device=DEVICE).to(torch.int16)
    src = patterns.view(torch.bfloat16)
    dst = torch.empty(src.shape, dtype=torch.float32, device=DEVICE)
    _convert_kernel[(src.numel() // 1024,)](src, dst, BLOCK=1024, UNPACK=unpack)
    assert torch.equal(dst.view(torch.int32), src.float().view(torch.int32))


@gpu_only
@pytest.mark.parametrize("target_dtype,draft_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                                      (torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)])
@pytest.mark.parametrize("unpack", [True, False])
def test_target_and_draft_logits_of_different_dtypes_gpu(target_dtype, draft_dtype, unpack):
    """Each logit tensor takes its own conversion (a bf16 verifier with fp32 draft logits after top-k / top-p
    filtering is a real input): only a bf16 one goes through the unpack."""
    for batch, num_drafts, vocab in [(1, 4, 32000), (64, 8, 32000), (7, 4, 8193)]:
        target, draft, drafts, seeds, offsets = make_case(batch, num_drafts, vocab, seed=batch + vocab)
        case = (target.to(target_dtype), draft.to(draft_dtype), drafts, seeds, offsets)
        plan = plan_for(case[0], unpack_bf16=unpack)
        assert_matches_reference(*case, 1.0, plan=plan)
        greedy_mask = torch.arange(batch, device=DEVICE) % 3 == 1
        assert_matches_reference(*case, 0.7, plan=plan, greedy_mask=greedy_mask)


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

    spy = _StatsLaunchSpy(launcher._stats_kernel)
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
    plan = _gpu_plan(batch, num_drafts, vocab, dtype)
    if expected == "live":
        assert plan.live_skip and len(statistics_launches(plan, num_drafts)) == 1
    else:
        assert not plan.live_skip
        assert [lo for lo, _ in statistics_launches(plan, num_drafts)] == list(expected)
    # greedy rows and scores never run live skip; scores need one launch
    assert not _gpu_plan(batch, num_drafts, vocab, dtype, greedy_rows=True).live_skip
    scored = _gpu_plan(batch, num_drafts, vocab, dtype, scores=True)
    assert not scored.live_skip and len(statistics_launches(scored, num_drafts)) == 1


def test_live_skip_is_never_planned_in_the_interpreter_or_for_huge_grids() -> None:
    assert not plan_launch(128, 8, 151936, torch.float32, INTERPRETER).live_skip
    forced = replace(_gpu_plan(32, 8, 151936, torch.bfloat16), live_skip=True)
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
