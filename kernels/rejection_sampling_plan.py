"""Launch plan of the fused rejection sampler: one frozen :class:`LaunchPlan` chosen by :func:`plan_launch`.

A plan moves work between programs and launches; it never changes a token or an accepted count (results depend on
it only through the fp32 summation order of the normalisers, the residual mass and alpha, see the launcher's module
docstring). :func:`plan_launch` is a function of the batch ``B``, the draft count ``K``, the vocabulary ``V``, the
logits' dtype and the device (plus whether the batch may hold greedy rows and whether scores are asked for, which
some plans cannot serve). Its rules were measured on H100 and H200 GPUs (``docs/rejection_sampling.md``); each
carries a one-line reason. The interpreter (``TRITON_INTERPRET=1``) gets small tiles, two vocabulary splits and
staged statistics, so that the CPU tests run every multi-tile, multi-split and staged path on small shapes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton

from ._device import DeviceFacts, device_facts
from .rejection_sampling_reference import RACE_TILE, VERIFICATIONS

__all__ = ["LaunchPlan", "grid_splits", "logit_bytes", "plan_launch", "statistics_launches", "vocabulary_chunk"]

MAX_SPLITS = 256  # vocabulary chunks per row at most (the combine tiles are that wide)
FP32_SMALL_VOCAB = 65536  # fp32 logits up to this V are latency-bound: several rules single them out
FP32_ONE_WARP_RACE_BATCH = 32  # fp32 logits from this B race with one warp per program
BF16_FEW_RACE_BATCH = (8, 16)  # 16-bit logits with B in this range and V <= FP32_SMALL_VOCAB: 1 race program / SM
FOLD_MAX_BATCH = 4  # 16-bit logits up to this B fold the logit scale into the statistics exponent
LIVE_SKIP_BYTES = 500e6  # logits from which the statistics run as one live-skip launch (K >= 4)
LIVE_SKIP_FP32_BYTES = 200e6  # ... fp32 logits with B >= LIVE_SKIP_FP32_BATCH: from this size
LIVE_SKIP_FP32_BATCH = 48
LIVE_SKIP_STATS_PROGRAMS = (16, 32)  # statistics programs per SM under live skip: fp32 / 16-bit logits
STAGES_BYTES = 200e6  # logits from which the statistics run in two launches (K >= 6)
STAGES_FP32_BYTES = 100e6  # ... fp32 logits with B < LIVE_SKIP_FP32_BATCH: from this size (K >= 4)
L2_KEEP_BYTES = 32 << 20  # position-0 rows (target and draft) kept in L2 up to this size


@dataclass(frozen=True)
class LaunchPlan:
    """How one call of :func:`~specdec.kernels.rejection_sampling.rejection_sample_triton` is launched.

    Attributes:
        stats_block: vocabulary ids per statistics tile (a power of two >= 8; tiles are ``[stats_block // 8, 8]``).
        stats_warps: warps per statistics program.
        stats_splits: vocabulary chunks per (row, position) in the statistics kernel (1 .. 256; a chunk is a whole
            number of tiles, so fewer may result).
        prefetch: the statistics loop issues the next tile's loads before this tile's arithmetic.
        skip_bonus: no statistics programs for the bonus position (only without greedy rows).
        stages: positions where a later statistics launch starts (staged statistics), e.g. ``(3,)``: positions
            0-2, then 3-K for the rows not certainly stopped before 3; ``()``: one launch.
        live_skip: the statistics as one position-major launch whose programs stop reading a row once an earlier
            position of it is certainly rejected (replaces ``stages``; not with greedy rows or scores).
        l2_keep: statistics loads of position 0 ``evict_last``, the other statistics loads and the race's level-1
            loads ``evict_first`` (the likeliest stop row stays in L2 for the race).
        fast_math: per-element exponentials as ``ex2.approx.ftz`` and race logarithms as ``lg2.approx`` (inline
            PTX: GPU only).
        fold_scale: the statistics exponent folds in the logit scale (needs ``fast_math``).
        unpack_bf16: bf16 statistics tiles converted two ids a register by a shift and a mask (inline PTX, exact;
            no effect on other dtypes).
        pdl: the race kernel is launched with programmatic dependent launch (sm_90+).
        race_tiles: race tiles of 256 ids per race-loop iteration (a power of two).
        race_warps: warps per race program.
        race_splits: vocabulary chunks per row in the race kernel (1 .. 256).
        verification: ``"token"`` or ``"block"`` (the race kernel's ``BLOCK_VERIFY``; block verification can keep
            drafts after one whose ratio ``p/q`` is below 1, so it reads every position: no stages, no live skip).
    """

    stats_block: int
    stats_warps: int
    stats_splits: int
    prefetch: bool
    skip_bonus: bool
    stages: tuple[int, ...]
    live_skip: bool
    l2_keep: bool
    fast_math: bool
    fold_scale: bool
    unpack_bf16: bool
    pdl: bool
    race_tiles: int
    race_warps: int
    race_splits: int
    verification: str = "token"

    def __post_init__(self) -> None:
        for name in ("stats_block", "stats_warps", "race_tiles", "race_warps"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1 or value & (value - 1):
                raise ValueError(f"LaunchPlan.{name} must be a power of two >= 1, got {value!r}")
        if self.stats_block < 8:
            raise ValueError(f"LaunchPlan.stats_block must be >= 8 (tiles are [block // 8, 8]), got {self.stats_block}")
        for name in ("stats_splits", "race_splits"):
            value = getattr(self, name)
            if not _is_int(value) or not 1 <= value <= MAX_SPLITS:
                raise ValueError(f"LaunchPlan.{name} must be an int in [1, {MAX_SPLITS}], got {value!r}")
        for name in ("prefetch", "skip_bonus", "live_skip", "l2_keep", "fast_math", "fold_scale", "unpack_bf16",
                     "pdl"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LaunchPlan.{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.stages, tuple) or not all(_is_int(p) and p >= 1 for p in self.stages):
            raise ValueError(f"LaunchPlan.stages must be a tuple of positions >= 1 (position 0 starts the first "
                             f"launch), got {self.stages!r}")
        if self.fold_scale and not self.fast_math:
            raise ValueError("LaunchPlan.fold_scale needs fast_math (the folded exponent is an ex2.approx)")
        if self.verification not in VERIFICATIONS:
            raise ValueError(f"LaunchPlan.verification must be one of {VERIFICATIONS}, got {self.verification!r}")

    def restricted(self, *, batch: int, num_drafts: int, greedy_rows: bool, scores: bool,
                   verification: str = "token") -> LaunchPlan:
        """This plan for a call's ``verification``, with what the call cannot use turned off: greedy rows need the
        bonus statistics (their arg-max) and no live skip (block-wide barriers in their loop); scores need every
        position in one launch; block verification every position (no stages, no live skip); the position-major
        grid holds fewer than 65536 (row, position) pairs."""
        pairs = batch * (num_drafts + 1)
        block = verification == "block"
        return replace(self, skip_bonus=self.skip_bonus and not greedy_rows and num_drafts >= 1,
                       live_skip=self.live_skip and not (scores or greedy_rows or block or pairs >= 65536),
                       stages=() if scores or block else self.stages, verification=verification)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def statistics_launches(plan: LaunchPlan, num_drafts: int) -> list[tuple[int, int]]:
    """The statistics launches of ``plan`` as ``(first position, number of positions)``: one launch over positions
    0 .. K (0 .. K - 1 with ``skip_bonus``), or one per stage; stage positions past the last one are ignored."""
    positions = num_drafts if plan.skip_bonus else num_drafts + 1
    starts = [] if plan.live_skip else sorted({p for p in plan.stages if p < positions})
    bounds = [0, *starts, positions]
    return [(lo, hi - lo) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


def vocabulary_chunk(vocab: int, block: int, splits: int) -> tuple[int, int]:
    """``(chunk, splits)``: ids per program (a multiple of ``block``) for about ``splits`` chunks, and the number
    of chunks that results."""
    chunk = triton.cdiv(triton.cdiv(vocab, splits), block) * block
    return chunk, triton.cdiv(vocab, chunk)


def grid_splits(vocab: int, block: int, rows: int, target_programs: int, max_splits: int = MAX_SPLITS) -> int:
    """Vocabulary chunks per row (of ``block``-id multiples, at most ``max_splits``) for a grid of about
    ``target_programs`` programs over ``rows`` rows."""
    splits = max(1, min(triton.cdiv(vocab, block), triton.cdiv(target_programs, rows), max_splits))
    return vocabulary_chunk(vocab, block, splits)[1]


def logit_bytes(batch: int, num_drafts: int, vocab: int, element_size: int) -> int:
    """Bytes of one call's logits: ``B (K + 1)`` target rows and ``B K`` draft rows of ``V`` entries."""
    return batch * (2 * num_drafts + 1) * vocab * element_size


def plan_launch(batch: int, num_drafts: int, vocab: int, dtype: torch.dtype, device: torch.device | DeviceFacts, *,
                greedy_rows: bool = False, scores: bool = False, verification: str = "token") -> LaunchPlan:
    """The launch plan of one call.

    Parameters
    ----------
    batch, num_drafts, vocab : int
        ``B`` rows, ``K`` draft positions, ``V`` vocabulary ids.
    dtype : torch.dtype
        The target logits' dtype (fp32, bf16 or fp16).
    device : torch.device or DeviceFacts
        Where the call runs; :class:`~specdec.kernels._device.DeviceFacts` asks what a given GPU would get.
    greedy_rows : bool
        The batch may hold greedy rows (a greedy mask, or ``T = 0``).
    scores : bool
        The call computes ``log p(draft)`` and alpha.
    verification : str
        ``"token"`` or ``"block"`` (block verification reads every position: no stages, no live skip).

    Returns
    -------
    LaunchPlan
        Cached per arguments.
    """
    return _plan(batch, num_drafts, vocab, dtype.itemsize, device_facts(device),
                 greedy_rows, scores, verification)


@functools.lru_cache(maxsize=4096)
def _plan(batch: int, num_drafts: int, vocab: int, esize: int, facts: DeviceFacts, greedy_rows: bool,
          scores: bool, verification: str) -> LaunchPlan:
    gpu = not facts.interpreter
    sms = facts.sm_count
    pairs = batch * (num_drafts + 1)
    nbytes = logit_bytes(batch, num_drafts, vocab, esize)
    fp32 = esize == 4
    fp32_small = fp32 and vocab <= FP32_SMALL_VOCAB

    # live skip: on large inputs skipping rows inside the launch beats a second launch; small ones pay its checks
    live_skip = gpu and num_drafts >= 4 and (
        nbytes >= LIVE_SKIP_BYTES or (fp32 and batch >= LIVE_SKIP_FP32_BATCH and nbytes >= LIVE_SKIP_FP32_BYTES))
    live_skip = live_skip and not (scores or greedy_rows or pairs >= 65536)
    stages = _stages(batch, num_drafts, vocab, esize, nbytes) if gpu else ((2, 4) if num_drafts >= 2 else ())

    # statistics grid: 4 programs per SM; fp32 small-vocabulary batches up to 8 with K >= 5 take 2 (each race
    # program combines (K + 1) x S partials); live skip takes more, so later positions find earlier ones complete
    if live_skip:
        stats_programs = LIVE_SKIP_STATS_PROGRAMS[0 if fp32 else 1]
    else:
        stats_programs = 2 if (fp32_small and num_drafts >= 5 and batch <= 8) else 4
    if not gpu:
        block = min(1024, max(8, triton.next_power_of_2(vocab)))  # several tiles a row on small test shapes
    elif fp32_small:
        block = 2048  # latency-bound: fewer, wider loads per program
    else:
        block = 4096 if pairs * triton.cdiv(vocab, 4096) >= 4 * sms else 1024  # 4096 once the grid fills the SMs
    # prefetch pays once each program streams several tiles (B >= 16 with 4096 tiles) and on the fp32 small plan
    prefetch = gpu and (fp32_small or (block == 4096 and batch >= 16))
    warps = 8 if block >= 4096 else 4
    if prefetch and not fp32_small and pairs >= stats_programs * sms:
        warps = 16  # one program per (row, position) already fills the SMs: more loads in flight per program

    # race: one warp per 256-id tile (tile sums are warp reductions); fp32 from B = 32 one warp per program, since a
    # warp covers only 128 fp32 ids of a [tiles, 256] block and two warps per tile would sum across warps
    one_warp = gpu and fp32 and batch >= FP32_ONE_WARP_RACE_BATCH
    two_tiles = one_warp and fp32_small and batch < 128  # small fp32 vocabularies: 2 tiles, 8 programs per SM
    if one_warp:
        race_tiles, race_warps, race_programs = (2, 1, 8) if two_tiles else (1, 1, 16)
    else:
        race_tiles = 2 if batch <= 2 else 4  # B <= 2: more, smaller programs (latency)
        race_warps, race_programs = race_tiles, 4
    low, high = BF16_FEW_RACE_BATCH
    if esize <= 2 and low <= batch <= high and vocab <= FP32_SMALL_VOCAB:
        race_programs = 1  # fewer race programs per row: each combines (K + 1) x S partials
    max_splits = MAX_SPLITS if gpu else 2  # the interpreter: two splits exercise the cross-program combines

    plan = LaunchPlan(
        stats_block=block,
        stats_warps=warps,
        stats_splits=grid_splits(vocab, block, pairs, stats_programs * sms, max_splits),
        prefetch=prefetch,
        # no statistics for the bonus position (nothing reads them without greedy rows), except fp32 small
        # vocabularies with K >= 8 at B = 1 or B >= 16, whose prefetched 2048-id plan measured faster with them
        skip_bonus=not (fp32_small and num_drafts >= 8 and (batch == 1 or batch >= 16)),
        stages=() if live_skip else stages,
        live_skip=live_skip,
        # keep position 0 (the likeliest stop row, which the race reads again) in L2 where it fits
        l2_keep=fp32_small and num_drafts >= 4 and batch >= 32 and 2 * batch * vocab * esize <= L2_KEEP_BYTES,
        fast_math=gpu,  # inline PTX: never in the interpreter
        fold_scale=gpu and esize == 2 and batch <= FOLD_MAX_BATCH,  # one multiply less per element, latency-bound
        unpack_bf16=gpu and vocab % 16 == 0,  # needs 16-byte aligned rows, provable when V % 16 == 0
        pdl=gpu and batch <= 8 and facts.major >= 9,  # small batches are latency-bound; PDL needs sm_90+
        race_tiles=race_tiles,
        race_warps=race_warps,
        race_splits=grid_splits(vocab, race_tiles * RACE_TILE, batch, race_programs * sms, max_splits),
    )
    return plan.restricted(batch=batch, num_drafts=num_drafts, greedy_rows=greedy_rows, scores=scores,
                           verification=verification)


def _stages(batch: int, num_drafts: int, vocab: int, esize: int, nbytes: int) -> tuple[int, ...]:
    """Staged statistics where reading fewer rows beats one more launch and its skip checks."""
    if esize == 4 and batch < LIVE_SKIP_FP32_BATCH and nbytes >= STAGES_FP32_BYTES:
        if vocab > FP32_SMALL_VOCAB and num_drafts >= 4:
            return (2,) if num_drafts <= 7 else (3,)  # fp32 large vocabularies from 100 MB: 0-1 or 0-2 first
        if num_drafts in (6, 7):
            return (2,)  # fp32 small vocabularies: only K = 6-7 gained
    if num_drafts < 6 or nbytes < STAGES_BYTES:
        return ()  # below 200 MB, or K < 6, the second launch costs more than it saves
    if esize == 4 and num_drafts == 6:
        return (2,)
    return (3,)
