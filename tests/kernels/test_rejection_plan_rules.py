"""The automatic launch plan's rules of the Triton rejection sampler (asked for an H100 and for the interpreter), the
bf16-to-fp32 conversion of the statistics tiles, and target and draft logits of different dtypes."""


from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl
from rejection_cases import (
    _INTERPRET_ON,
    CUDA,
    DEVICE,
    H100,
    INTERPRETER,
    assert_matches_reference,
    gpu_only,
    h100_plan,
    make_case,
    plan_for,
)

from specdec.kernels.rejection_sampling_kernels import _to_f32
from specdec.kernels.rejection_sampling_plan import (
    FP32_SMALL_VOCAB,
    grid_splits,
    plan_launch,
)

# ---------------------------------------------------------------------------------------------------------------
# The automatic plan's rules (asked for an H100, and for the interpreter)


def test_skip_bonus_rule():
    assert h100_plan(1, 8, 151936, torch.bfloat16).skip_bonus and h100_plan(128, 1, 32000, torch.bfloat16).skip_bonus
    assert h100_plan(1, 4, FP32_SMALL_VOCAB).skip_bonus and h100_plan(1, 8, 151936).skip_bonus
    # fp32 small-vocabulary plan with K >= 8: no skip at B = 1 or B >= 16, skip at 2 <= B <= 8
    assert not h100_plan(1, 8, FP32_SMALL_VOCAB).skip_bonus and not h100_plan(16, 8, 32000).skip_bonus
    assert h100_plan(2, 8, 32000).skip_bonus and h100_plan(8, 12, 32000).skip_bonus
    assert h100_plan(1, 7, 32000).skip_bonus and h100_plan(64, 7, 32000).skip_bonus
    assert not h100_plan(8, 4, 32000, torch.bfloat16, greedy_rows=True).skip_bonus  # greedy rows need the arg-max
    forced = replace(h100_plan(8, 4, 32000), skip_bonus=True)
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
        assert h100_plan(batch, 4, 32000, torch.bfloat16).race_splits == grid_splits(32000, 1024, batch, 132)
        assert h100_plan(batch, 4, 65536, torch.bfloat16).race_splits == grid_splits(65536, 1024, batch, 132)
        # large vocabularies and fp32 keep 4 programs per SM
        assert h100_plan(batch, 4, 151936, torch.bfloat16).race_splits == grid_splits(151936, 1024, batch, 4 * 132)
        assert h100_plan(batch, 4, 32000).race_splits == grid_splits(32000, 1024, batch, 4 * 132)
    assert h100_plan(7, 4, 32000, torch.bfloat16).race_splits == grid_splits(32000, 1024, 7, 4 * 132)
    assert h100_plan(17, 4, 32000, torch.bfloat16).race_splits == grid_splits(32000, 1024, 17, 4 * 132)
    assert h100_plan(8, 4, 65537, torch.bfloat16).race_splits == grid_splits(65537, 1024, 8, 4 * 132)


def test_l2_keep_rule_keeps_position_0_for_fp32_batches_of_32_or_more_with_small_vocabularies():
    assert h100_plan(32, 4, 32000).l2_keep
    assert h100_plan(128, 8, 32000).l2_keep  # kept rows 2 * 128 * 32000 * 4 bytes <= 32 MiB
    assert not h100_plan(128, 8, 65536).l2_keep  # 67 MB kept: more than the rule allows
    assert h100_plan(64, 4, 65536).l2_keep  # exactly 32 MiB kept
    assert not h100_plan(32, 4, 65537).l2_keep
    assert not h100_plan(128, 1, 32000).l2_keep  # K < 4
    assert not h100_plan(16, 4, 32000).l2_keep  # B < 32
    assert not h100_plan(128, 4, 32000, torch.bfloat16).l2_keep  # bf16
    assert not h100_plan(32, 4, 128256).l2_keep  # large vocabulary


def test_fast_math_fold_and_unpack_rules():
    assert h100_plan(1, 4, 32000, torch.bfloat16).fold_scale and h100_plan(4, 4, 32000, torch.float16).fold_scale
    assert not h100_plan(5, 4, 32000, torch.bfloat16).fold_scale  # B > 4
    assert not h100_plan(1, 4, 32000).fold_scale  # fp32
    assert h100_plan(8, 4, 32000, torch.bfloat16).unpack_bf16 and h100_plan(8, 4, 151936, torch.bfloat16).unpack_bf16
    assert not h100_plan(8, 4, 32001, torch.bfloat16).unpack_bf16  # rows not provably 16-byte aligned
    assert h100_plan(8, 4, 32000).fast_math and h100_plan(8, 4, 32000).pdl and not h100_plan(9, 4, 32000).pdl
    assert not plan_launch(8, 4, 32000, torch.float32, replace(H100, major=8)).pdl  # PDL needs sm_90
    interpreted = plan_launch(1, 4, 32000, torch.bfloat16, INTERPRETER)  # no inline PTX in the interpreter
    assert not (interpreted.fast_math or interpreted.fold_scale or interpreted.unpack_bf16 or interpreted.pdl)
    assert interpreted.stats_block == 1024 and interpreted.stages == (2, 4)


def test_stats_splits_rule_halves_the_statistics_grid_for_small_fp32_batches_with_five_or_more_drafts():
    def per_sm(batch, num_drafts, vocab, dtype=torch.float32):
        plan = h100_plan(batch, num_drafts, vocab, dtype)
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
