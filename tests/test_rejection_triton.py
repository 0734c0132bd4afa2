"""The fused Triton rejection sampler reproduces the torch reference exactly and is lossless.

On a machine without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by ``conftest.py``
and again here before anything imports Triton), on small shapes. With a GPU the full matrix of issue 3 runs too:
B in {1, 7, 64}, K in {1, 4, 8}, V in {100, 8193, 32000, 151936}, fp32 and bf16, both launch strategies.

Exactness: tokens and accepted counts must be *equal* to the reference on the same (seeds, offsets) stream. The two
compute normalisers in a different order, so a decision could flip only on a near-tie (|margin| ~ 1e-6); with the
fixed seeds below none occurs.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import specdec  # noqa: E402
from specdec.kernels.rejection_sampling import _rejected_before, _to_f32, rejection_sample_triton  # noqa: E402
from specdec.kernels.rejection_sampling_reference import rejection_sample_reference  # noqa: E402
from specdec.metrics import acceptance_from_logits, accepted_count_distribution  # noqa: E402

from stats import assert_follows  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
gpu_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (too slow in Triton's interpreter)")
_INTERPRET_ON = os.environ.get("TRITON_INTERPRET") == "1"
STRATEGIES = ("split", "seq")


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


def assert_matches_reference(target, draft, drafts, seeds, offsets, temperature, strategies=STRATEGIES, **kwargs):
    """Every strategy gives the reference's tokens and counts exactly; scores (split) agree to fp32 rounding."""
    scores = kwargs.pop("compute_scores", False)
    tuning = {key: kwargs.pop(key) for key in ("block_v", "num_splits", "tune") if key in kwargs}
    ref = rejection_sample_reference(target, draft, drafts, seeds, offsets, temperature, compute_scores=scores,
                                     **kwargs)
    for strategy in strategies:
        if scores and strategy == "seq":
            continue
        out = rejection_sample_triton(target, draft, drafts, seeds, offsets, temperature, compute_scores=scores,
                                      strategy=strategy, **kwargs, **tuning)
        bad = (out[0] != ref[0]).any(dim=1).nonzero().flatten().tolist()
        assert not bad, f"{strategy}: rows {bad[:8]} differ: {out[0][bad[:2]].tolist()} vs {ref[0][bad[:2]].tolist()}"
        assert torch.equal(out[1], ref[1]), strategy
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
    # exactly 1 (a fused t (s log2 e) - m s log2 e exponent moved decisions at T = 1e-5)
    for batch, num_drafts, vocab in ((8, 8, 32000), (1, 4, 151936), (4, 8, 128256)):
        case = make_case(batch, num_drafts, vocab, dtype, seed=batch + vocab, temperature=temperature)
        for fold in (True, False):
            assert_matches_reference(*case, temperature, strategies=("split",), tune=dict(fold_scale=fold))


def test_exact_multi_tile_and_multi_split_with_ragged_last_tile():
    # V = 100 with 32-wide tiles: 4 tiles, the last one 4 lanes wide; 2 vocabulary chunks per row.
    case = make_case(7, 4, 100, torch.bfloat16, seed=3)
    assert_matches_reference(*case, 0.8, block_v=32, num_splits=2)
    assert_matches_reference(*case, 0.8, block_v=32, num_splits=4, compute_scores=True)


# Launch plans of "split": none of them may change a token or an accepted count.
LAUNCH_PLANS = {
    "default": {},
    "no_fuse": dict(fuse=False),
    "race_tiles_2": dict(race_tiles=2),
    "prefetch": dict(stats_prefetch=True),  # its first tile is loaded before the row's draft ids are known
    "one_warp_race": dict(race_tiles=1, race_warps=1, race_programs=16),  # the fp32 plan for B >= 32 on the GPU
    "l2_keep": dict(l2_keep=2, stats_prefetch=True),  # both eviction branches of the prefetched statistics loop
    "l2_keep_no_prefetch": dict(l2_keep=2, stats_prefetch=False),
}


@pytest.mark.parametrize("plan", list(LAUNCH_PLANS))
def test_launch_plans_are_exact_with_scores_greedy_rows_and_ragged_drafts(plan):
    # V = 2600: 11 race tiles of 256 ids in 3 blocks of 1024 (the last ragged), 2-3 race programs per row that
    # arrive at the fused finalize, 2-4 stats chunks of 256-wide tiles; greedy rows, -1 drafts and per-row counts
    # share the batch.
    target, draft, drafts, seeds, offsets = make_case(7, 4, 2600, torch.bfloat16, seed=17)
    drafts[2, 2:] = -1
    counts = torch.tensor([4, 3, 4, 0, 2, 4, 1], device=DEVICE)
    greedy_mask = torch.arange(7, device=DEVICE) % 3 == 1
    tune = LAUNCH_PLANS[plan]
    for splits in (2, 4):
        assert_matches_reference(target, draft, drafts, seeds, offsets, 0.8, strategies=("split",), block_v=256,
                                 num_splits=splits, tune=tune, greedy_mask=greedy_mask, num_draft_tokens=counts,
                                 compute_scores=True)
    assert_matches_reference(target, draft, drafts, seeds, offsets, 0.0, strategies=("split",), tune=tune)


class _StatsLaunchSpy:
    """Stands in for ``_stats_kernel``: counts the positions the launches cover (grid ``(B * positions, S)``) and
    keeps the last launch's grid and statistics partials, then launches the real kernel."""

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
    # skip_bonus (the default): without greedy rows the bonus position gets no statistics programs; its race (and
    # the bonus token) must not depend on them. Rows accept every draft (bonus) or stop earlier; ragged counts,
    # with and without scores (scores force one statistics launch; without them the interpreter's staged plan
    # (positions 0-1, 2-3, 4-K) is clipped to the positions launched), 1-4 splits.
    import specdec.kernels.rejection_sampling as kernel

    batch = 6
    spy = _StatsLaunchSpy(kernel._stats_kernel, batch)
    monkeypatch.setattr(kernel, "_stats_kernel", spy)
    target, draft, drafts, seeds, offsets = make_case(batch, num_drafts, 700, torch.float32, seed=45 + num_drafts,
                                                      noise=0.2)
    counts = torch.tensor([num_drafts, 0, 1, num_drafts, num_drafts, 1], device=DEVICE)
    for splits, scores in ((1, True), (4, True), (2, False)):
        ref = assert_matches_reference(target, draft, drafts, seeds, offsets, 1.0, strategies=("split",),
                                       block_v=64, num_splits=splits, tune=dict(skip_bonus=skip_bonus),
                                       num_draft_tokens=counts, compute_scores=scores)
        assert bool((ref[1] == counts).any())  # some rows reach the bonus position
        assert spy.take() == (num_drafts if skip_bonus else num_drafts + 1)
    # greedy rows need the bonus arg-max: no skipping with a greedy mask or at T = 0. Drafts equal to the target's
    # arg-max make every greedy row accept all its drafts and take the bonus token.
    greedy_drafts = target[:, :num_drafts].float().argmax(dim=-1)
    for temperature, mask in ((0.0, None), (0.8, torch.arange(batch, device=DEVICE) % 2 == 0)):
        ref = rejection_sample_reference(target, draft, greedy_drafts, seeds, offsets, temperature, greedy_mask=mask)
        out = rejection_sample_triton(target, draft, greedy_drafts, seeds, offsets, temperature, greedy_mask=mask,
                                      num_splits=2, block_v=64, tune=dict(skip_bonus=skip_bonus))
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
        greedy_rows = torch.ones(batch, dtype=torch.bool, device=DEVICE) if mask is None else mask
        assert bool((out[1][greedy_rows] == num_drafts).all())  # they all reached the bonus position
        assert spy.take() == num_drafts + 1


def test_skip_bonus_rule():
    from specdec.kernels.rejection_sampling import FP32_SMALL_VOCAB, _skip_bonus

    assert _skip_bonus(None, 2, 151936, 8, False, 1) and _skip_bonus(None, 2, 32000, 1, False, 128)
    assert _skip_bonus(None, 4, FP32_SMALL_VOCAB, 4, False, 1) and _skip_bonus(None, 4, 151936, 8, False, 1)
    # fp32 small-vocabulary plan with K >= 8: no skip at B = 1 or B >= 16, skip at 2 <= B <= 8
    assert not _skip_bonus(None, 4, FP32_SMALL_VOCAB, 8, False, 1) and not _skip_bonus(None, 4, 32000, 8, False, 16)
    assert _skip_bonus(None, 4, 32000, 8, False, 2) and _skip_bonus(None, 4, 32000, 12, False, 8)
    assert _skip_bonus(None, 4, 32000, 7, False, 1) and _skip_bonus(None, 4, 32000, 7, False, 64)
    assert not _skip_bonus(True, 2, 32000, 4, True, 8)  # greedy rows need the bonus arg-max
    assert not _skip_bonus(True, 2, 32000, 0, False, 8) and not _skip_bonus(False, 2, 32000, 4, False, 8)


def test_race_plan_rule_picks_the_one_warp_race_for_fp32_batches_of_32_or_more():
    from specdec.kernels.rejection_sampling import FP32_ONE_WARP_RACE_BATCH, TUNE_DEFAULT, _race_plan

    cfg = dict(TUNE_DEFAULT)
    big = FP32_ONE_WARP_RACE_BATCH
    assert _race_plan(4, big, cfg, None, interpret=False) == (1, 1, 16)
    assert _race_plan(4, 128, cfg, None, interpret=False) == (1, 1, 16)
    assert _race_plan(4, big - 1, cfg, None, interpret=False) == (4, 4, 4)  # below the batch threshold
    assert _race_plan(2, big, cfg, None, interpret=False) == (4, 4, 4)  # bf16 / fp16 keep one warp per tile
    assert _race_plan(4, 2, cfg, None, interpret=False) == (2, 2, 4)
    assert _race_plan(4, big, cfg, None, interpret=True) == (4, 4, 4)  # the interpreter keeps the default plan
    # explicit settings win over the rule
    assert _race_plan(4, big, dict(cfg, race_tiles=2), None, interpret=False) == (2, 2, 4)
    assert _race_plan(4, big, dict(cfg, race_warps=2), None, interpret=False) == (4, 2, 4)
    assert _race_plan(4, big, cfg, 8, interpret=False) == (4, 8, 4)
    assert _race_plan(4, big, dict(cfg, race_programs=8), None, interpret=False) == (1, 1, 8)
    # small fp32 vocabularies below B = 128: two tiles per one-warp program, 8 programs per SM
    assert _race_plan(4, big, cfg, None, interpret=False, vocab=32000) == (2, 1, 8)
    assert _race_plan(4, 128, cfg, None, interpret=False, vocab=32000) == (1, 1, 16)
    assert _race_plan(2, big, cfg, None, interpret=False, vocab=32000) == (4, 4, 4)
    with pytest.raises(ValueError, match="race_programs"):
        _race_plan(4, big, dict(cfg, race_programs=0), None, interpret=False)


def test_race_plan_rule_gives_16_bit_logits_one_race_program_per_sm_at_batches_8_to_16_with_small_vocabularies():
    from specdec.kernels.rejection_sampling import BF16_FEW_RACE_BATCH, TUNE_DEFAULT, _race_plan

    cfg = dict(TUNE_DEFAULT)
    low, high = BF16_FEW_RACE_BATCH
    for batch in (low, high):
        assert _race_plan(2, batch, cfg, None, interpret=False, vocab=32000) == (4, 4, 1)
        assert _race_plan(2, batch, cfg, None, interpret=False, vocab=65536) == (4, 4, 1)
        assert _race_plan(2, batch, cfg, None, interpret=False, vocab=151936)[2] == 4  # large vocabulary
        assert _race_plan(4, batch, cfg, None, interpret=False, vocab=32000)[2] == 4  # fp32
    assert _race_plan(2, low - 1, cfg, None, interpret=False, vocab=32000)[2] == 4
    assert _race_plan(2, high + 1, cfg, None, interpret=False, vocab=32000)[2] == 4
    assert _race_plan(2, low, cfg, None, interpret=False, vocab=65537)[2] == 4
    assert _race_plan(2, low, dict(cfg, race_programs=4), None, interpret=False, vocab=32000)[2] == 4  # explicit


def test_l2_keep_rule_keeps_position_0_for_fp32_batches_of_32_or_more_with_small_vocabularies():
    from specdec.kernels.rejection_sampling import _l2_keep

    assert _l2_keep(None, 4, 32000, 4, 32) == 1
    assert _l2_keep(None, 4, 32000, 8, 128) == 1  # kept rows 2 * 128 * 32000 * 4 bytes <= 32 MiB
    assert _l2_keep(None, 4, 65536, 8, 128) == 0  # 67 MB kept: more than the rule allows
    assert _l2_keep(None, 4, 65536, 4, 64) == 1  # exactly 32 MiB kept
    assert _l2_keep(None, 4, 65537, 4, 32) == 0
    assert _l2_keep(None, 4, 32000, 1, 128) == 0  # K < 4
    assert _l2_keep(None, 4, 32000, 4, 16) == 0  # B < 32
    assert _l2_keep(None, 2, 32000, 4, 128) == 0  # bf16
    assert _l2_keep(None, 4, 128256, 4, 32) == 0  # large vocabulary
    assert _l2_keep(3, 2, 151936, 1, 1) == 3  # explicit settings win
    with pytest.raises(ValueError, match="l2_keep"):
        _l2_keep(-1, 4, 32000, 4, 32)


def test_fold_scale_rule_folds_the_scale_for_16_bit_logits_at_batches_up_to_4(monkeypatch):
    import specdec.kernels.rejection_sampling as kernel

    monkeypatch.setattr(kernel, "_INTERPRET", True)
    assert not kernel._fold_scale(None, 2, 1) and not kernel._fold_scale(True, 2, 1)  # never in the interpreter
    monkeypatch.setattr(kernel, "_INTERPRET", False)
    assert kernel._fold_scale(None, 2, 1) and kernel._fold_scale(None, 2, 4)
    assert not kernel._fold_scale(None, 2, 5)  # B > 4
    assert not kernel._fold_scale(None, 4, 1)  # fp32
    assert kernel._fold_scale(True, 4, 128) and not kernel._fold_scale(False, 2, 1)  # explicit settings win


@triton.jit
def _convert_kernel(src_ptr, dst_ptr, BLOCK: tl.constexpr, UNPACK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, _to_f32(tl.load(src_ptr + offs), UNPACK))


@pytest.mark.skipif(not CUDA or _INTERPRET_ON, reason="inline PTX, and a bit-exact bf16 conversion: the "
                    "interpreter has no PTX and flushes bf16 subnormals")
@pytest.mark.parametrize("unpack", [True, False])
def test_bf16_statistics_conversion_keeps_every_bit_pattern_gpu(unpack):
    """The statistics tiles' bf16 -> fp32 conversion (the inline-asm unpack of two ids a register, and the plain
    one) gives torch's fp32 bit pattern for all 65536 bf16 patterns, in order (a swapped pair would fail). GPU only:
    the interpreter has no inline assembly, and its own conversion flushes bf16 subnormals."""
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32, device=DEVICE).to(torch.int16)
    src = patterns.view(torch.bfloat16)
    dst = torch.empty(src.shape, dtype=torch.float32, device=DEVICE)
    _convert_kernel[(src.numel() // 1024,)](src, dst, BLOCK=1024, UNPACK=unpack)
    assert torch.equal(dst.view(torch.int32), src.float().view(torch.int32))


def test_unpack_rule_needs_a_bf16_tensor_and_a_16_divisible_vocabulary(monkeypatch):
    import specdec.kernels.rejection_sampling as kernel

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    monkeypatch.setattr(kernel, "_INTERPRET", True)
    assert not kernel._unpack(None, bf16, bf16, 32000) and not kernel._unpack(True, bf16, bf16, 32000)
    monkeypatch.setattr(kernel, "_INTERPRET", False)
    assert kernel._unpack(None, bf16, bf16, 32000) and kernel._unpack(None, bf16, bf16, 151936)
    assert kernel._unpack(None, bf16, fp32, 32000) and kernel._unpack(None, fp32, bf16, 32000)  # either tensor
    assert not kernel._unpack(None, fp16, fp16, 32000) and not kernel._unpack(None, fp32, fp32, 32000)
    assert not kernel._unpack(None, bf16, bf16, 32001)  # rows not provably 16-byte aligned
    assert kernel._unpack(True, bf16, bf16, 32001) and not kernel._unpack(False, bf16, bf16, 32000)
    assert not kernel._unpack(True, fp32, fp16, 32000)  # no bf16 tile to unpack


@gpu_only
@pytest.mark.parametrize("target_dtype,draft_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                                      (torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)])
@pytest.mark.parametrize("unpack", [True, False])
def test_target_and_draft_logits_of_different_dtypes_gpu(target_dtype, draft_dtype, unpack):
    """Each logit tensor takes its own conversion (a bf16 verifier with fp32 draft logits after top-k / top-p
    filtering is a real input): only the bf16 one goes through the unpack."""
    for batch, num_drafts, vocab in [(1, 4, 32000), (64, 8, 32000), (7, 4, 8193)]:
        target, draft, drafts, seeds, offsets = make_case(batch, num_drafts, vocab, seed=batch + vocab)
        case = (target.to(target_dtype), draft.to(draft_dtype), drafts, seeds, offsets)
        assert_matches_reference(*case, 1.0, strategies=("split",), tune=dict(unpack=unpack))
        greedy_mask = torch.arange(batch, device=DEVICE) % 3 == 1
        assert_matches_reference(*case, 0.7, strategies=("split",), tune=dict(unpack=unpack), greedy_mask=greedy_mask)


@pytest.mark.parametrize("key", ["ftz", "fast_log", "fold_scale", "unpack"])
def test_fast_math_settings_must_be_none_or_bool(key):
    case = make_case(1, 1, 100, seed=1)
    with pytest.raises(ValueError, match=key):
        rejection_sample_triton(*case, 1.0, tune={key: "no"})
    with pytest.raises(ValueError, match=key):
        rejection_sample_triton(*case, 1.0, tune={key: 0})
    rejection_sample_triton(*case, 1.0, tune={key: False})  # accepted (the interpreter ignores it)


def test_unknown_tune_key_is_an_error():
    case = make_case(1, 1, 100, seed=1)
    with pytest.raises(ValueError, match="unknown tune"):
        rejection_sample_triton(*case, 1.0, tune={"race_blok": 64})
    with pytest.raises(ValueError, match="race_tiles"):
        rejection_sample_triton(*case, 1.0, tune={"race_tiles": 3})
    with pytest.raises(TypeError, match=r"tune\['stages'\]"):
        rejection_sample_triton(*case, 1.0, tune={"stages": 3})
    with pytest.raises(ValueError, match=r"tune\['stages'\]"):
        rejection_sample_triton(*case, 1.0, tune={"stages": (0, 2)})
    with pytest.raises(ValueError, match=r"tune\['stats_programs'\]"):
        rejection_sample_triton(*case, 1.0, tune={"stats_programs": 0})


def test_stats_programs_rule_halves_the_statistics_grid_for_small_fp32_batches_with_five_or_more_drafts():
    from specdec.kernels.rejection_sampling import FP32_SMALL_VOCAB, _stats_programs

    assert _stats_programs(None, 4, 32000, 8, 8) == 2 and _stats_programs(None, 4, FP32_SMALL_VOCAB, 12, 1) == 2
    assert _stats_programs(None, 4, 32000, 5, 4) == 2
    assert _stats_programs(None, 4, 32000, 8, 16) == 4  # (32, 8, 32000) lost with 2
    assert _stats_programs(None, 4, 32000, 4, 8) == 4 and _stats_programs(None, 4, 151936, 8, 8) == 4
    assert _stats_programs(None, 2, 32000, 8, 8) == 4  # bf16 lost with 2
    assert _stats_programs(6, 2, 32000, 8, 8) == 6  # an explicit setting wins


@pytest.mark.parametrize("vocab", [1, 3])
def test_tiny_vocabularies_are_exact(vocab):
    # V below the stats tile's 8-wide inner dimension (the interpreter sizes tiles from V)
    case = make_case(3, 2, vocab, seed=vocab)
    assert_matches_reference(*case, 1.0)
    with pytest.raises(ValueError, match="block_v"):
        rejection_sample_triton(*case, 1.0, block_v=4)


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
    # Regression (GPU benchmark row 123 of (128, 8, 128256)): with q == p up to rounding the residual is rounding
    # noise; the reference's could be exactly 0 (race on p) while the kernel's was not (race on noise). Both now
    # race on p unless the residual mass exceeds RESIDUAL_MASS_EPS.
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
    full = {s: rejection_sample_triton(target, draft, drafts, seeds, offsets, 1.0, strategy=s) for s in STRATEGIES}
    assert torch.equal(full["split"][0], full["seq"][0])
    for row in (0, 29, 63):
        sl = slice(row, row + 1)
        alone = rejection_sample_triton(target[sl], draft[sl], drafts[sl], seeds[sl], offsets[sl], 1.0)
        assert torch.equal(alone[0][0], full["seq"][0][row])


def test_nan_and_all_minus_inf_rows_never_yield_an_out_of_range_id():
    target, draft, drafts, seeds, offsets = make_case(7, 4, 100, torch.float32, seed=13)
    target[0] = float("nan")
    target[1] = float("-inf")
    draft[2] = float("nan")
    for strategy in STRATEGIES:
        for temperature in (1.0, 0.0):
            tokens, accepted, _, _ = rejection_sample_triton(target, draft, drafts, seeds, offsets, temperature,
                                                             strategy=strategy)
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


def _statistical_check(strategy: str, rows: int, temperature: float, seed: int, tune: dict | None = None):
    vocab, num_drafts = 5, 2
    gen = torch.Generator().manual_seed(seed)
    target = (torch.randn(num_drafts + 1, vocab, generator=gen) * 1.5).to(DEVICE)
    draft = (torch.randn(num_drafts, vocab, generator=gen) * 1.5).to(DEVICE)
    q = torch.softmax(draft / temperature, -1).cpu()
    drafts = torch.stack([torch.multinomial(q[j], rows, replacement=True, generator=gen)
                          for j in range(num_drafts)], dim=1).to(DEVICE)
    seeds = torch.arange(rows, dtype=torch.int64, device=DEVICE) * 1_000_003 + seed
    if strategy == "public":
        out = specdec.rejection_sample(target.expand(rows, -1, -1), draft.expand(rows, -1, -1), drafts,
                                       temperature=temperature, seeds=seeds, backend="triton")
        tokens, accepted = out.tokens.cpu(), out.num_accepted.cpu()
    else:
        tokens, accepted, _, _ = rejection_sample_triton(
            target.expand(rows, -1, -1), draft.expand(rows, -1, -1), drafts, seeds, torch.zeros_like(seeds),
            temperature, strategy=strategy, tune=tune)
        tokens, accepted = tokens.cpu(), accepted.cpu()
    positions = torch.arange(num_drafts + 1)
    assert bool(((tokens >= 0) == (positions[None] <= accepted[:, None])).all())
    p = torch.softmax(target.double().cpu() / temperature, -1)
    for j in range(num_drafts + 1):
        reached = tokens[:, j] >= 0
        if int(reached.sum()) >= 100:
            assert_follows(torch.bincount(tokens[reached, j], minlength=vocab), p[j], what=f"{strategy} pos {j}")
    alpha = acceptance_from_logits(target[:num_drafts].cpu(), draft.cpu(), temperature).double()
    assert_follows(torch.bincount(accepted, minlength=num_drafts + 1), accepted_count_distribution(alpha),
                   what=f"{strategy} accepted counts")


PUBLIC_STAT_ROWS = 20000 if CUDA else 1200
RACE_TILE_STAT_ROWS = 100_000 if CUDA else 400


def test_statistics_through_triton_backend():
    # the public entry point; its "auto" strategy runs the split kernels with the default plan (the split strategy
    # on its own, at 100k rows and two temperatures: test_statistics_gpu_many_rows)
    _statistical_check("public", PUBLIC_STAT_ROWS, 0.8, seed=21)


@gpu_only
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_statistics_gpu_many_rows(strategy, temperature):
    _statistical_check(strategy, 100_000, temperature, seed=31)


@pytest.mark.parametrize("race_tiles", [1, 4])
def test_statistics_through_triton_with_two_level_race_across_tiles(race_tiles, monkeypatch):
    # 2-id race tiles (patched into the launcher): V = 5 has 3 tiles, the last ragged, so level 1 of the race decides
    # every recovered and bonus token; race_tiles 1 spreads them over 2 programs (loop path, fused finalize),
    # race_tiles 4 puts them in one block (level 2 from registers).
    import specdec.kernels.rejection_sampling as kernel

    monkeypatch.setattr(kernel, "RACE_TILE", 2)
    _statistical_check("split", RACE_TILE_STAT_ROWS, 0.8, seed=23 + race_tiles, tune=dict(race_tiles=race_tiles))


# ---------------------------------------------------------------------------------------------------------------
# GPU: the full matrix of issue 3 and large shapes


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


GPU_LAUNCH_PLANS = dict(default={}, no_fuse=LAUNCH_PLANS["no_fuse"],
                        prefetch=dict(stats_prefetch=True, stats_block=4096, stats_warps=16),
                        race_tiles4=dict(race_tiles=4, race_warps=4), race_programs8=dict(race_programs=8),
                        no_stats_prefetch=dict(stats_prefetch=False),
                        one_warp_race=LAUNCH_PLANS["one_warp_race"], pdl1=dict(pdl=1), pdl2=dict(pdl=2),
                        no_ftz=dict(ftz=False), l2_keep=dict(l2_keep=2), no_fast_log=dict(fast_log=False),
                        fold_on=dict(fold_scale=True), fold_off=dict(fold_scale=False),
                        unpack_off=dict(unpack=False), unpack_fold=dict(unpack=True, fold_scale=True))


@gpu_only
@pytest.mark.parametrize("plan", list(GPU_LAUNCH_PLANS))
@pytest.mark.parametrize("batch,num_drafts,vocab", [(1, 4, 151936), (64, 8, 32000)])
def test_launch_plans_gpu(plan, batch, num_drafts, vocab):
    case = make_case(batch, num_drafts, vocab, torch.bfloat16, seed=batch + vocab)
    tune = GPU_LAUNCH_PLANS[plan]
    assert_matches_reference(*case, 1.0, strategies=("split",), tune=tune)
    greedy_mask = torch.arange(batch, device=DEVICE) % 3 == 1
    assert_matches_reference(*case, 0.7, strategies=("split",), tune=tune, greedy_mask=greedy_mask,
                             compute_scores=True)


@gpu_only
@pytest.mark.parametrize("batch,num_drafts,vocab,dtype",
                         [(8, 8, 32000, torch.bfloat16), (16, 4, 65536, torch.bfloat16),
                          (32, 4, 32000, torch.float32), (128, 8, 32000, torch.float32)],
                         ids=["bf16-few-race-8", "bf16-few-race-16", "fp32-l2-32", "fp32-l2-128"])
def test_few_race_programs_and_l2_keep_plans_gpu(batch, num_drafts, vocab, dtype):
    # the automatic plans of BF16_FEW_RACE_BATCH (one race program per SM) and of _l2_keep (eviction hints), with
    # greedy rows, scores and ragged drafts
    from specdec.kernels.rejection_sampling import TUNE_DEFAULT, _l2_keep, _race_plan

    esize = torch.tensor([], dtype=dtype).element_size()
    if dtype == torch.bfloat16:  # these shapes do take the plan under test
        assert _race_plan(esize, batch, dict(TUNE_DEFAULT), None, interpret=False, vocab=vocab)[2] == 1
    else:
        assert _l2_keep(None, esize, vocab, num_drafts, batch) == 1
    case = make_case(batch, num_drafts, vocab, dtype, seed=batch * 11 + num_drafts)
    assert_matches_reference(*case, 1.0, strategies=("split",))
    case[2][1, 2:] = -1
    greedy_mask = torch.arange(batch, device=DEVICE) % 3 == 1
    assert_matches_reference(*case, 0.7, strategies=("split",), greedy_mask=greedy_mask, compute_scores=True)


@gpu_only
@pytest.mark.parametrize("batch,num_drafts,vocab", [(32, 1, 32000), (32, 8, 32000), (64, 8, 151936),
                                                     (128, 1, 128256)])
def test_fp32_one_warp_race_plan_gpu(batch, num_drafts, vocab):
    # fp32 with B >= FP32_ONE_WARP_RACE_BATCH takes the one-warp race plan automatically; scores and greedy rows too
    case = make_case(batch, num_drafts, vocab, torch.float32, seed=batch * 7 + vocab)
    assert_matches_reference(*case, 1.0, strategies=("split",))
    greedy_mask = torch.arange(batch, device=DEVICE) % 3 == 1
    assert_matches_reference(*case, 0.7, strategies=("split",), greedy_mask=greedy_mask, compute_scores=True)


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
                          offsets.to(DEVICE), packed, argmax, out, n_b, int(greedy), 1.0, vocab, k1 - 1, 1, pos_lo,
                          JP2=8, SP2=2)
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
    got = rejection_sample_triton(target, draft, tokens, seeds, offsets, 1.0, tune={"stages": stages})
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
    """tune['live_skip']: the statistics in one position-major launch (a [S, B * K] grid); the last program of a
    position certainly rejected marks the row, and programs of its later positions stop reading. No position a
    row can reach is ever cut short, and tokens and counts equal the reference's, at T = 1 with full and ragged
    draft counts; a batch with greedy rows, or at T = 0, falls back to the usual grid (the launcher never runs live
    skip with greedy rows) and is exact too. The interpreter runs the programs one after another, so there the
    skips are deterministic: with one split (all of a position's programs before the next position's) every
    position past a row's rejection reads nothing (its partials stay empty); with three (split s of every position
    after split s - 1 of all of them) only the last split of those positions does. On a GPU the programs overlap
    and which ones stop depends on timing."""
    import specdec.kernels.rejection_sampling as kernel

    spy = _StatsLaunchSpy(kernel._stats_kernel)
    monkeypatch.setattr(kernel, "_stats_kernel", spy)
    batch, num_drafts, vocab = 10, 4, 300
    target, draft, drafts, seeds, offsets, stops = _live_skip_case(batch, num_drafts, vocab, seed=31)
    # (stats_programs: the split count is num_splits)
    tune = dict(live_skip=True, skip_bonus=True, stats_programs=1000, stats_prefetch=splits == 3)
    ref = rejection_sample_reference(target, draft, drafts, seeds, offsets, 1.0)
    assert torch.equal(ref[1], stops)
    got = rejection_sample_triton(target, draft, drafts, seeds, offsets, 1.0, block_v=64, num_splits=splits,
                                  tune=tune)
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
                                      num_draft_tokens=counts, block_v=64, num_splits=splits, tune=tune)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        assert (spy.grid[0] == splits) == live  # position-major (splits, B * K) only without greedy rows


def test_auto_stages_rule(monkeypatch) -> None:
    """The automatic staged plan, as on the GPU. fp32 logits with V > 65536, K >= 4 and B < 48 from 100 MB:
    positions 0-1 first for K <= 7, 0-2 for K >= 8 (V <= 65536: K = 6-7 only, 0-1 first). Otherwise from 200 MB
    with K >= 6: 0-2 first, except fp32 with K = 6 (0-1 first). One launch elsewhere. Each negative case misses one
    condition."""
    import specdec.kernels.rejection_sampling as kernel
    from specdec.kernels.rejection_sampling import _auto_stages

    monkeypatch.setattr(kernel, "_INTERPRET", False)
    assert _auto_stages(9, 32, 151936, 4) == (3,)  # fp32 K = 8, 331 MB
    assert _auto_stages(9, 128, 151936, 2) == (3,)  # bf16 K = 8, 661 MB
    assert _auto_stages(8, 32, 151936, 4) == (2,)  # fp32 K = 7, 292 MB
    assert _auto_stages(7, 32, 128256, 4) == (2,)  # fp32 K = 6, 213 MB
    assert _auto_stages(7, 64, 151936, 2) == (3,)  # bf16 K = 6, 253 MB
    assert _auto_stages(7, 32, 100000, 4) == (2,)  # fp32 K = 6, 166 MB
    assert _auto_stages(5, 32, 128256, 4) == (2,)  # fp32 K = 4, 148 MB
    assert _auto_stages(9, 16, 151936, 4) == (3,)  # fp32 K = 8, 165 MB
    assert _auto_stages(9, 16, 90000, 4) == ()  # fp32 K = 8, 98 MB
    assert _auto_stages(9, 32, 65536, 4) == ()  # fp32 K = 8, 143 MB, but V <= 65536
    assert _auto_stages(8, 32, 65536, 4) == (2,)  # fp32 K = 7, V <= 65536, 126 MB
    assert _auto_stages(7, 32, 65536, 4) == (2,)  # fp32 K = 6, V <= 65536, 109 MB
    assert _auto_stages(7, 32, 48000, 4) == ()  # fp32 K = 6, V <= 65536, 80 MB
    assert _auto_stages(6, 40, 65536, 4) == ()  # fp32 K = 5, V <= 65536, 115 MB
    assert _auto_stages(5, 48, 128256, 4) == ()  # fp32 K = 4, 222 MB, but B = 48 (live skip's range)
    assert _auto_stages(4, 32, 151936, 4) == ()  # fp32 K = 3, 136 MB
    assert _auto_stages(9, 32, 151936, 2) == ()  # bf16 K = 8, 165 MB
    assert _auto_stages(9, 32, 32000, 4) == ()  # 70 MB
    assert _auto_stages(6, 128, 151936, 2) == ()  # bf16 K = 5, 428 MB


def test_live_skip_rule(monkeypatch) -> None:
    import specdec.kernels.rejection_sampling as kernel
    from specdec.kernels.rejection_sampling import _live_skip

    assert _live_skip(True, False, False, 32, 9, 151936, 2) and not _live_skip(False, False, False, 128, 9, 151936, 4)
    assert not _live_skip(True, True, False, 32, 9, 151936, 2)  # scores need every position
    assert not _live_skip(True, False, True, 32, 9, 151936, 2)  # greedy rows (barriers in their statistics loop)
    assert not _live_skip(True, False, False, 8192, 8, 100, 4)  # the grid's second dimension, B * (K + 1) < 65536
    assert not _live_skip(None, False, False, 128, 9, 151936, 4) or not kernel._INTERPRET  # never in the interpreter
    # automatic, as on the GPU: >= 500 MB of logits (fp32 with B >= 48: 200 MB) with K >= 4; each negative case
    # misses exactly one condition
    monkeypatch.setattr(kernel, "_INTERPRET", False)
    assert _live_skip(None, False, False, 128, 9, 151936, 4)  # 1.3 GB
    assert _live_skip(None, False, False, 128, 9, 151936, 2)  # 661 MB
    assert _live_skip(None, False, False, 128, 5, 151936, 4)  # K = 4, 700 MB
    assert not _live_skip(None, False, True, 128, 9, 151936, 4)  # greedy rows
    assert not _live_skip(None, True, False, 128, 9, 151936, 4)  # scores
    assert not _live_skip(None, False, False, 256, 4, 151936, 4)  # K = 3
    assert not _live_skip(None, False, False, 32, 9, 151936, 4)  # 331 MB of fp32, but B = 32
    assert _live_skip(None, False, False, 48, 5, 128256, 4)  # fp32, B = 48, 222 MB
    assert _live_skip(None, False, False, 128, 9, 32000, 4)  # fp32, 278 MB
    assert not _live_skip(None, False, False, 128, 5, 32000, 4)  # fp32, 147 MB
    assert not _live_skip(None, False, False, 64, 9, 151936, 2)  # bf16, 331 MB
    assert not _live_skip(None, False, False, 64, 4, 151936, 4)  # fp32, 272 MB, but K = 3


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stats_programs", [4, 32])
def test_live_skip_gpu_exact(stats_programs, dtype) -> None:
    """On the GPU the programs of a launch overlap, so which ones skip depends on timing: with few and with many
    statistics programs per SM, ragged counts and -1 drafts, repeated calls give the reference's tokens; batches
    with greedy rows and at T = 0 (which run the usual grid: the launcher never uses live skip with greedy rows)
    too."""
    batch = 32
    target, draft, drafts, seeds, offsets = make_case(batch, 8, 151936, dtype, seed=stats_programs, noise=0.4)
    drafts[0, 6:] = -1
    counts = torch.full((batch,), 8, dtype=torch.int64, device=DEVICE)
    counts[-1] = 5
    greedy_mask = torch.arange(batch, device=DEVICE) % 2 == 1
    tune = dict(live_skip=True, stats_programs=stats_programs)
    for temperature, mask in ((1.0, None), (0.7, greedy_mask), (0.0, None)):
        ref = rejection_sample_reference(target, draft, drafts, seeds, offsets, temperature, greedy_mask=mask,
                                         num_draft_tokens=counts)
        for _ in range(3 if mask is None and temperature > 0 else 1):  # (repeats: the live path's timing)
            got = rejection_sample_triton(target, draft, drafts, seeds, offsets, temperature, greedy_mask=mask,
                                          num_draft_tokens=counts, tune=tune)
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), temperature
    target, draft, drafts, seeds, offsets, stops = _live_skip_case(batch, 8, 151936, dtype, seed=5)
    got = rejection_sample_triton(target, draft, drafts, seeds, offsets, 1.0, tune=tune)
    assert torch.equal(got[1], stops)


@gpu_only
@pytest.mark.parametrize("batch,num_drafts,vocab,plan", [
    (32, 6, 128256, [(0, 2), (2, 5)]),  # fp32 K = 6 from 200 MB (213 MB)
    (32, 4, 128256, [(0, 2), (2, 3)]),  # fp32, V > 65536, B < 48, from 100 MB (148 MB), K <= 7
    (16, 8, 151936, [(0, 3), (3, 6)]),  # the same range with K >= 8 (165 MB)
    (32, 7, 65536, [(0, 2), (2, 6)]),  # V <= 65536 (the small-vocabulary statistics plan), K = 7 (126 MB)
])
def test_auto_stage_plans_gpu_fp32(batch, num_drafts, vocab, plan) -> None:
    """The plans the automatic rule picks for fp32 logits, on shapes it covers: sampled rows with ragged counts and
    -1 drafts, and a batch with greedy rows, equal the reference, twice each."""
    from specdec.kernels.rejection_sampling import _stage_plan

    assert _stage_plan(num_drafts + 1, batch, False, None, vocab, 4) == plan
    target, draft, drafts, seeds, offsets = make_case(batch, num_drafts, vocab, torch.float32, seed=61, noise=0.4)
    drafts[0, num_drafts - 2:] = -1
    counts = torch.full((batch,), num_drafts, dtype=torch.int64, device=DEVICE)
    counts[-1] = 3
    greedy_mask = torch.arange(batch, device=DEVICE) % 3 == 1
    for temperature, mask in ((1.0, None), (0.8, greedy_mask)):
        for _ in range(2):
            ref = assert_matches_reference(target, draft, drafts, seeds, offsets, temperature, strategies=("split",),
                                           greedy_mask=mask, num_draft_tokens=counts)
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
                                          num_draft_tokens=counts, tune={"stages": stages})
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (temperature, stages)
