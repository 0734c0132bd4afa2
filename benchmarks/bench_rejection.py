"""Rejection-sampling benchmark: specdec's fused Triton kernel vs torch (eager, compiled) vs FlashInfer.

Every provider runs in this one process on one card, on the same inputs, timed by CUDA-graph replay of calls over
rotated input sets (``benchmarks/common.time_graph``; ``do_bench`` only where a provider cannot be captured, noted
in the ``timing`` column). Inputs: target logits ``N(0, 2^2)``, draft logits = target + ``N(0, 0.7^2)`` (mean
acceptance alpha ~ 0.7, reported), drafts sampled from q, temperature 1.

Providers (``provider`` column):
  specdec         ``rejection_sample_triton`` (strategy "auto"), from logits
  specdec_split / specdec_seq   the two launch strategies forced
  torch_eager     ``rejection_sample_reference``
  torch_compile   ``torch.compile(rejection_sample_reference)``
  flashinfer      ``flashinfer.sampling.softmax`` on both logit tensors + ``chain_speculative_sampling``
  flashinfer_kernel  ``chain_speculative_sampling`` alone, handed precomputed probabilities

``gbps`` counts the logical input bytes ``B (2K+1) V esize`` once; ``gbps_read`` (specdec only) counts the bytes
the kernel reads on these inputs (early exit and the race's re-read of the stop row included; not the first tile a
prefetching statistics program loads before it finds its row stopped, a few % at most, so a slight undercount). With
``live_skip`` how far a program reads past a rejection depends on timing, so there it counts only the bytes every
plan of this kernel reads (``bytes_needed``: the statistics rows up to each request's stop and the race's stop row):
a lower bound on the bytes read, so ``gbps_read`` and ``frac_copy`` are lower bounds on the rate achieved (noted per
row). ``benchmarks/ncu_bytes_read.sh`` measures the bytes with Nsight Compute.

Usage: python benchmarks/bench_rejection.py [--quick] [--out benchmarks/results] [--max-seconds 420]
       [--dtypes bf16] [--shapes 151936:1:4,32000:8:1,...] (V:B:K triples) [--tag _v3] (CSV name suffix)
       [--sweep 151936:1:4,151936:128:8] (launch-plan sweep of the "split" strategy, before the main grid:
       ``SWEEP`` configurations, each timed and checked against the reference; ``rejection_sweep_<gpu><tag>.csv``,
       appended to when it exists)
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, measure_copy_bandwidth, time_do_bench, time_graph  # noqa: E402

from specdec.kernels.rejection_sampling import (  # noqa: E402
    TUNE_DEFAULT,
    _l2_keep,
    _live_skip,
    _logit_bytes,
    _race_plan,
    _stage_plan,
    rejection_sample_triton,
)
from specdec.kernels.rejection_sampling_reference import (  # noqa: E402
    TILE_INDEX_BASE,
    rejection_sample_reference,
    tile_sums,
)

BATCHES = (1, 8, 32, 128)
DRAFTS = (1, 4, 8)
VOCABS = (151936, 128256, 32000)  # the headline vocabulary first
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TEMPERATURE = 1.0
FIELDS = ["kernel", "provider", "B", "K", "V", "dtype", "median_us", "p20_us", "p80_us", "gbps", "gbps_read",
          "copy_gbps", "frac_copy", "alpha", "timing", "match_ref", "gpu", "torch", "triton", "flashinfer", "note"]


def make_inputs(batch, num_drafts, vocab, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    target = torch.randn(batch, num_drafts + 1, vocab, generator=gen, device="cuda") * 2.0
    draft = target[:, :num_drafts] + 0.7 * torch.randn(batch, num_drafts, vocab, generator=gen, device="cuda")
    gumbel = -torch.log(-torch.log(torch.rand(batch, num_drafts, vocab, generator=gen, device="cuda")))
    drafts = torch.argmax(draft / TEMPERATURE + gumbel, dim=-1)
    del gumbel
    seeds = torch.randint(0, 2**62, (batch,), generator=gen, device="cuda")
    offsets = torch.zeros(batch, dtype=torch.int64, device="cuda")
    return dict(target=target.to(dtype), draft=draft.to(dtype), drafts=drafts, seeds=seeds, offsets=offsets)


def bytes_read(strategy, num_accepted, num_drafts, vocab, esize, stages=None):
    """Bytes specdec reads on these inputs (sampled rows, all drafts real). ``stages``: the statistics launches
    (``_stage_plan``); a row reads the positions of a later launch only if it reaches it (ignoring near-ties)."""
    acc = num_accepted.double()
    rejected = (acc < num_drafts).double()
    if strategy == "split":
        plan = stages or [(0, num_drafts + 1)]
        stat_rows = sum(2 * max(0, min(lo + count, num_drafts) - lo) * (acc >= lo).double() for lo, count in plan)
        rows = stat_rows + 1 + rejected  # stats: target + draft rows of the positions read; race: stop row (+ draft)
    else:
        rows = torch.where(rejected > 0, 2 * (acc + 1) + 2, torch.full_like(acc, 2 * num_drafts + 1.0))
    return float(rows.sum()) * vocab * esize


LOWER_BOUND_NOTE = "gbps_read/frac_copy: lower bounds (live_skip reads at least the rows up to each stop)"


def bytes_needed(num_accepted: torch.Tensor, num_drafts: int, vocab: int, esize: int) -> float:
    """Bytes every plan of this kernel reads on these inputs (sampled rows, all drafts real): the target and draft
    rows of positions 0 .. min(n, K - 1) for a request that accepts n drafts (its accept tests need whole rows to
    normalise), then the race's row(s) at its stop position (the target row, plus the draft row after a rejection)."""
    acc = num_accepted.double()
    rejected = (acc < num_drafts).double()
    rows = 2 * torch.clamp(acc + 1, max=num_drafts) + 1 + rejected
    return float(rows.sum()) * vocab * esize


def statistics_launches(cfg: dict, batch: int, num_drafts: int, vocab: int, esize: int) -> tuple[bool, list]:
    """(live skip on, staged plan) that the "split" strategy picks with launch settings ``cfg`` for sampled rows
    without scores (the automatic rules of ``_live_skip`` and ``_stage_plan``)."""
    live = _live_skip(cfg["live_skip"], False, False, batch, num_drafts + 1, vocab, esize)
    return live, _stage_plan(num_drafts + 1, batch, False, cfg["stages"], vocab, esize)


def split_bytes(num_accepted, batch: int, num_drafts: int, vocab: int, esize: int, cfg: dict) -> tuple[float, str]:
    """Bytes the "split" strategy reads with launch settings ``cfg`` (sampled rows, T > 0) and the row's note: the
    staged count of ``bytes_read``, or with live skip the lower bound ``bytes_needed`` and ``LOWER_BOUND_NOTE``."""
    live, plan = statistics_launches(cfg, batch, num_drafts, vocab, esize)
    if live:
        return bytes_needed(num_accepted, num_drafts, vocab, esize), LOWER_BOUND_NOTE
    return bytes_read("split", num_accepted, num_drafts, vocab, esize, plan), ""


def diagnose(s0, out, ref, num_drafts):
    """Print the rows where specdec and the reference differ, with float64 decision margins (near-ties?)."""
    bad = (out[0] != ref[0]).any(1).nonzero().flatten().tolist()
    from specdec.kernels.rng import ACCEPT_INDEX, uniform

    for b in bad[:4]:
        t = s0["target"][b].double() / TEMPERATURE
        d = s0["draft"][b].double() / TEMPERATURE
        lp, lq = torch.log_softmax(t, -1), torch.log_softmax(d, -1)
        x = s0["drafts"][b]
        pos = torch.arange(num_drafts, device=x.device)
        lu = torch.log(uniform(s0["seeds"][b].expand(num_drafts), s0["offsets"][b] + pos,
                               torch.full_like(pos, ACCEPT_INDEX)).double())
        margin = (lp[pos, x] - lq[pos, x] - lu).tolist()
        stop = int(ref[1][b])
        resid = (lp[stop].exp() - (lq[min(stop, num_drafts - 1)].exp() if stop < num_drafts else 0)).clamp(min=0)
        weights = resid if stop < num_drafts else lp[stop].exp()
        masses = tile_sums(weights[None])[0]  # level 1 of the race: tile scores in float64
        tiles = torch.arange(masses.shape[0], device=t.device)
        noise = torch.log(-torch.log(uniform(s0["seeds"][b].expand_as(tiles), s0["offsets"][b] + stop,
                                             TILE_INDEX_BASE + tiles).double()))
        top = torch.topk(torch.log(masses) - noise, 2)
        gap = float(top.values[0] - top.values[1])
        print(f"#   row {b}: ref {ref[0][b].tolist()} got {out[0][b].tolist()} accept margins(f64) "
              f"{[f'{m:.2e}' for m in margin]} tile race top2 {top.indices.tolist()} gap {gap:.2e}", flush=True)


# Launch-plan sweep: name -> overrides of TUNE_DEFAULT. "stats:" rows time the stats kernel alone (the race +
# finalize time is the difference).
SWEEP = {
    "default": {},
    # session 10: L2 eviction priorities (tune['l2_keep']). The first sweeps (results/*_s10_{a,b}_*.csv) timed them
    # with three finer settings that no longer exist (keep_positions, stats_evict, race_evict; each row's tune column
    # has them): l2_keep=n is keep_positions=n, stats_evict=("evict_last", "evict_first"), race_evict="evict_first"
    "l2_off": dict(l2_keep=0),
    "l2_keep1": dict(l2_keep=1),
    "l2_keep2": dict(l2_keep=2),
    # session 11: the race kernel's logarithms as lg2.approx (tune['fast_log'], on by default since). The sweeps
    # results/*_s11_{b,c,d}_*.csv also timed a dropped setting 'race_group' (level-1 scores computed after the loop
    # for groups of tiles; results/rejection_grouped_scores_attempt_s11.txt): in their rows "default" means
    # grouped (one-warp plans; in _s11_b every plan), "group0" this tree's loop with libdevice logarithms
    # (no_fast_log) and "fastlog_group0" this tree's default
    "no_fast_log": dict(fast_log=False),
    # session 10: fewer race programs per row at small B (each combines (K + 1) x S statistics partials)
    **{f"race_prog{n}": dict(race_programs=n) for n in (1, 2, 3, 4)},
    **{f"race_t4w4_prog{n}": dict(race_tiles=4, race_warps=4, race_programs=n) for n in (1, 2)},
    "race_prog2_stats2": dict(race_programs=2, stats_programs=2),
    "race_prog1_stats2": dict(race_programs=1, stats_programs=2),
    "stats:default": dict(stats_only=True),
    "nofuse": dict(fuse=False),
    "race_t2w2": dict(race_tiles=2, race_warps=2),
    "race_t4w4": dict(race_tiles=4, race_warps=4),
    "race_t4w8": dict(race_tiles=4, race_warps=8),
    "race_t8w8": dict(race_tiles=8, race_warps=8),
    "race_prog8": dict(race_programs=8),
    "stats_prog8": dict(stats_programs=8),
    "stats_pf": dict(stats_prefetch=True),
    "stats_nopf": dict(stats_prefetch=False),
    "stats_b2048": dict(stats_block=2048, stats_warps=8),
    "stats_b2048pf": dict(stats_block=2048, stats_warps=8, stats_prefetch=True),
    "pdl0": dict(pdl=0),
    "pdl1": dict(pdl=1),
    "pdl2": dict(pdl=2),
    "stats_b1024": dict(stats_block=1024, stats_warps=4),
    "stats_b2048_pdl2": dict(stats_block=2048, stats_warps=8, pdl=2),
    "stats_b1024_pdl2": dict(stats_block=1024, stats_warps=4, pdl=2),
    "race_t2w2_pdl2": dict(race_tiles=2, race_warps=2, pdl=2),
    "stats_b1024pf": dict(stats_block=1024, stats_warps=4, stats_prefetch=True),
    "stats_b2048pf4": dict(stats_block=2048, stats_warps=4, stats_prefetch=True),
    "stats_b2048pf16": dict(stats_block=2048, stats_warps=16, stats_prefetch=True),
    "stages_off": dict(stages=()),
    "stages_1": dict(stages=(1,)),
    "stages_2": dict(stages=(2,)),
    "stages_3": dict(stages=(3,)),
    "stages_4": dict(stages=(4,)),
    "stages_1_3": dict(stages=(1, 3)),
    "stages_2_5": dict(stages=(2, 5)),
    "stages_1_3_6": dict(stages=(1, 3, 6)),
    "stages_2_4_6": dict(stages=(2, 4, 6)),
    # fp32 race layout: with 4-byte logits a warp covers 128 ids, so [tiles, 256] blocks put two warps on a tile
    # (its sums cross warps); one warp per program keeps every per-tile reduction inside the warp
    "race_t1w1": dict(race_tiles=1, race_warps=1),
    "race_t2w1": dict(race_tiles=2, race_warps=1),
    "race_t4w1": dict(race_tiles=4, race_warps=1),
    "race_t4w2": dict(race_tiles=4, race_warps=2),
    "race_prog16": dict(race_programs=16),
    "race_t2w1_prog8": dict(race_tiles=2, race_warps=1, race_programs=8),
    "race_t1w1_prog16": dict(race_tiles=1, race_warps=1, race_programs=16),
    "race_t4w4_prog8": dict(race_tiles=4, race_warps=4, race_programs=8),
    "stats_prog16": dict(stats_programs=16),
    "stats_prog8_b1024pf": dict(stats_programs=8, stats_block=1024, stats_warps=4, stats_prefetch=True),
    "race_t1w1_prog32": dict(race_tiles=1, race_warps=1, race_programs=32),
    "race_t2w1_prog16": dict(race_tiles=2, race_warps=1, race_programs=16),
    "no_skip_bonus": dict(skip_bonus=False),
    # statistics grid sizes around one wave (programs per SM target; the chunk rounding moves the real grid)
    "stats_prog2": dict(stats_programs=2),
    "stats_prog3": dict(stats_programs=3),
    "stats_prog4": dict(stats_programs=4),
    "stats_prog5": dict(stats_programs=5),
    "stats_prog6": dict(stats_programs=6),
    "stats:prog3": dict(stats_programs=3, stats_only=True),
    "stats:prog6": dict(stats_programs=6, stats_only=True),
    "skip_bonus": dict(skip_bonus=True),
    "skip_bonus_prog2": dict(skip_bonus=True, stats_programs=2),
    "no_skip_bonus_prog2": dict(skip_bonus=False, stats_programs=2),
    # session 9: exponentials without the subnormal fix-up (now the default), residual half of level 1 only in
    # rejected rows and a software-pipelined race loop (both dropped: results/rejection_branch_stages_attempt_s9.diff,
    # sweeps results/rejection_sweep_H100_80GB_HBM3_s9_{a,b}_*.csv); the speculative first statistics tile (now
    # always on) was timed with a setting 'spec' that no longer exists
    "ftz": dict(ftz=True),
    "noftz": dict(ftz=False),
    "stats:noftz": dict(ftz=False, stats_only=True),
    "noftz_pdl0": dict(ftz=False, pdl=0),
    # session 15: one position-major statistics launch whose programs skip rows already certainly rejected at an
    # earlier, completed position (tune['live_skip']); more programs per SM give the later positions' programs
    # more completed positions to check
    "live_off": dict(live_skip=False),
    **{f"live_p{n}": dict(live_skip=True, stats_programs=n) for n in (4, 8, 16, 32, 64)},
    **{f"live_p{n}_b1024": dict(live_skip=True, stats_programs=n, stats_block=1024, stats_warps=4,
                                stats_prefetch=True) for n in (16, 32)},
    **{f"stats:live_p{n}": dict(live_skip=True, stats_programs=n, stats_only=True) for n in (8, 32)},
    # session 17: warps of the statistics programs (session 17 read 247 registers at 8 warps for the prefetched 4096
    # plan, results/stats_kernel_registers_triton36_sm90.csv, but that compile lacked the 16-divisible arguments of the
    # benchmark's vocabularies; with them 61-63 bf16 / 122-126 fp32: ..._triton36_sm90_s20.txt)
    "stats_w16": dict(stats_warps=16),
    "stats_w16_prog2": dict(stats_warps=16, stats_programs=2),
    "stats_w4": dict(stats_warps=4),
    # session 19: the logit scale folded into the statistics exponent (tune['fold_scale'])
    "fold_off": dict(fold_scale=False),
    "fold_on": dict(fold_scale=True),
    # session 20: bf16 statistics tiles unpacked by a shift and a mask (tune['unpack'])
    "unpack_off": dict(unpack=False),
    "unpack_on": dict(unpack=True),
    "unpack_fold": dict(unpack=True, fold_scale=True),
    "unpack_off_fold": dict(unpack=False, fold_scale=True),
    # session 20: 8 statistics warps where the automatic plan takes 16 (B (K + 1) >= 4 programs per SM)
    "stats_w8": dict(stats_warps=8),
    # session 21: race programs per SM at B = 128 (the default 4 gives 5 programs a row at V = 32000, 640 programs:
    # more than one wave of 4 per SM); race_prog1-4, 8 and 16 are above
    **{f"race_prog{n}": dict(race_programs=n) for n in (6, 32)},
    # session 21: wider race blocks (more bytes in flight per program while the stop row is re-read)
    "race_t8w4": dict(race_tiles=8, race_warps=4),
    "race_t8w4_prog2": dict(race_tiles=8, race_warps=4, race_programs=2),
    "race_t8w8_prog2": dict(race_tiles=8, race_warps=8, race_programs=2),
    "race_t16w8": dict(race_tiles=16, race_warps=8),
}
# Earlier sweeps (results/rejection_sweep_H200_v5..v9*.csv) also timed other settings; every row records its tune.
SWEEP_SMALL = ("default", "stats_pf", "stats_nopf", "race_t4w4", "stats_prog8", "pdl0", "stats:default")
SWEEP_LARGE = ("default", "stats_nopf", "stats_b2048", "stats_b2048pf", "race_t2w2", "race_t4w8", "race_t8w8",
               "race_prog8", "stats:default")


def run_sweep(shapes, dtype_name, out_path, l2_bytes, copy_gbps, env, max_seconds, t_start, names=None):
    """Time every SWEEP configuration of the "split" strategy at each V:B:K shape (same inputs, same process)."""
    dtype = DTYPES[dtype_name]
    esize = torch.tensor([], dtype=dtype).element_size()
    fields = ["config", "B", "K", "V", "dtype", "median_us", "p20_us", "p80_us", "gbps_read", "copy_gbps",
              "frac_copy", "match_ref", "tune", "gpu", "torch", "triton", "note"]
    # append to a sweep file of the same name (two sweeps with one tag in one session, e.g. one per dtype, used to
    # overwrite the first one's rows); the header is written once
    fresh = not os.path.exists(out_path) or os.path.getsize(out_path) == 0
    if not fresh:
        with open(out_path, newline="") as existing:
            header = next(csv.reader(existing), [])
        if header != fields:
            raise ValueError(f"{out_path} exists with other columns ({header}); pick another --tag or --out")
        print(f"# appending to {out_path}", flush=True)
    with open(out_path, "a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        if fresh:
            writer.writeheader()
        budget = max_seconds - (time.time() - t_start)
        for vocab, batch, num_drafts in shapes:
            deadline = time.time() + budget / len(shapes)
            set_bytes = _logit_bytes(batch, num_drafts + 1, vocab, esize)
            n_sets = max(1, min(16, math.ceil(2 * l2_bytes / set_bytes)))
            sets = [make_inputs(batch, num_drafts, vocab, dtype, seed=s) for s in range(n_sets)]
            s0 = sets[0]
            ref = rejection_sample_reference(s0["target"], s0["draft"], s0["drafts"], s0["seeds"], s0["offsets"],
                                             TEMPERATURE)
            for name in names or (SWEEP_SMALL if batch <= 8 else SWEEP_LARGE):
                tune = SWEEP[name]
                if time.time() > deadline:
                    print(f"# sweep time budget reached at {name}", flush=True)
                    break
                note, match = "", ""
                fns = [lambda s=s, tune=tune: rejection_sample_triton(
                    s["target"], s["draft"], s["drafts"], s["seeds"], s["offsets"], TEMPERATURE, strategy="split",
                    tune=tune) for s in sets]
                try:
                    if not tune.get("stats_only"):
                        out = fns[0]()
                        match = str(bool(torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])))
                    med, p20, p80 = time_graph(fns)
                except Exception as exc:
                    torch.cuda.synchronize()
                    med = p20 = p80 = float("nan")
                    note = f"{type(exc).__name__}: {str(exc)[:200]}"
                cfg = dict(TUNE_DEFAULT, **tune)
                live, plan = statistics_launches(cfg, batch, num_drafts, vocab, esize)
                if tune.get("stats_only"):
                    read = _logit_bytes(batch, num_drafts + 1, vocab, esize)
                else:
                    read, bound_note = split_bytes(ref[1], batch, num_drafts, vocab, esize, cfg)
                    note = (note + " " + bound_note).strip()
                row = dict(config=name, B=batch, K=num_drafts, V=vocab, dtype=dtype_name, median_us=f"{med:.2f}",
                           p20_us=f"{p20:.2f}", p80_us=f"{p80:.2f}", gbps_read=f"{read / med / 1e3:.1f}",
                           copy_gbps=f"{copy_gbps:.0f}", frac_copy=f"{read / med / 1e3 / copy_gbps:.3f}",
                           match_ref=match, note=note, **env,
                           tune=str(dict(cfg, race_plan_resolved=_race_plan(esize, batch, cfg, None, False, vocab),
                                         l2_keep_resolved=_l2_keep(cfg["l2_keep"], esize, vocab, num_drafts,
                                                                   batch),
                                         # the launches the automatic rules pick (session 18's rows lack them)
                                         live_skip_resolved=live, stage_plan_resolved=plan)))
                writer.writerow(row)
                handle.flush()
                print(f"sweep {name:18s} {dtype_name} B={batch:3d} K={num_drafts} V={vocab:6d} {med:8.1f} us "
                      f"[{p20:.1f}, {p80:.1f}] {read / med / 1e3 / copy_gbps:5.2f} copy {match} {note}", flush=True)
            del sets, s0, ref
            torch.cuda.empty_cache()


def setup_flashinfer():
    """Import FlashInfer and JIT-build its sampling module; returns (module, note)."""
    try:
        import flashinfer
        import flashinfer.sampling as fs

        probs = torch.softmax(torch.randn(2, 3, 1000, device="cuda"), -1)
        fs.chain_speculative_sampling(probs[:, :2].contiguous(), torch.zeros(2, 2, dtype=torch.int32,
                                      device="cuda"), probs.contiguous())
        fs.softmax(torch.randn(4, 1000, device="cuda"), temperature=1.0)
        torch.cuda.synchronize()
        return fs, f"flashinfer {flashinfer.__version__}"
    except Exception as exc:  # recorded in the results
        traceback.print_exc()
        return None, f"flashinfer not run: {type(exc).__name__}: {str(exc)[:300]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--quick", action="store_true", help="V = 151936 only")
    parser.add_argument("--vocabs", default="", help="comma-separated vocabulary sizes (default: all)")
    parser.add_argument("--max-seconds", type=float, default=1e9, help="stop starting new shapes after this")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated subset of bf16,fp32")
    parser.add_argument("--shapes", default="", help="comma-separated V:B:K triples (default: the full grid)")
    parser.add_argument("--tag", default="", help="suffix of the CSV name, e.g. _v3")
    parser.add_argument("--sweep", default="", help="V:B:K triples for the launch-plan sweep (first dtype)")
    parser.add_argument("--sweep-seconds", type=float, default=1e9, help="stop the sweep after this")
    parser.add_argument("--sweep-only", action="store_true", help="run the sweep, not the provider grid")
    parser.add_argument("--sweep-configs", default="", help="comma-separated SWEEP names (default: by batch size)")
    parser.add_argument("--providers", default="specdec,specdec_split,specdec_seq,torch_eager,torch_compile,"
                                               "flashinfer,flashinfer_kernel")
    args = parser.parse_args()
    providers = args.providers.split(",")
    t_start = time.time()
    env = environment()
    gpu_tag = env["gpu"].replace("NVIDIA ", "").replace(" ", "_").replace("/", "_")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"rejection_{gpu_tag}{args.tag}.csv")
    copy_gbps = measure_copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 50 << 20)
    print(f"# {env}  copy {copy_gbps:.0f} GB/s  SMs {props.multi_processor_count}  L2 {l2_bytes >> 20} MiB", flush=True)
    if args.sweep:
        sweep_shapes = [tuple(int(x) for x in item.split(":")) for item in args.sweep.split(",") if item]
        sweep_path = os.path.join(args.out, f"rejection_sweep_{gpu_tag}{args.tag}.csv")
        run_sweep(sweep_shapes, args.dtypes.split(",")[0], sweep_path, l2_bytes, copy_gbps, env,
                  args.sweep_seconds, t_start, [n for n in args.sweep_configs.split(",") if n])
        if args.sweep_only:
            return
    fs, fi_note = setup_flashinfer() if any(p.startswith("flashinfer") for p in providers) else (None, "skipped")
    print("#", fi_note, flush=True)
    torch._dynamo.config.cache_size_limit = 256
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 256
    compiled = torch.compile(rejection_sample_reference)

    rows = []
    vocabs = (151936,) if args.quick else VOCABS
    if args.vocabs:
        vocabs = tuple(int(v) for v in args.vocabs.split(","))
    dtype_names = [name for name in args.dtypes.split(",") if name]
    if args.shapes:
        triples = [tuple(int(x) for x in item.split(":")) for item in args.shapes.split(",") if item]
        grid = [(name, v, k, b) for name in dtype_names for v, b, k in triples]
    else:
        grid = [(name, v, k, b) for name in dtype_names for v in vocabs for k in DRAFTS for b in BATCHES]
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS)
        writer.writeheader()
        for dtype_name, vocab, num_drafts, batch in grid:
            dtype = DTYPES[dtype_name]
            esize = torch.tensor([], dtype=dtype).element_size()
            if time.time() - t_start > args.max_seconds:
                print(f"# time budget reached, skipping {dtype_name} V={vocab} K={num_drafts} B={batch}")
                continue
            set_bytes = _logit_bytes(batch, num_drafts + 1, vocab, esize)
            n_sets = max(1, min(16, math.ceil(2 * l2_bytes / set_bytes)))
            sets = [make_inputs(batch, num_drafts, vocab, dtype, seed=s) for s in range(n_sets)]
            s0 = sets[0]
            ref = rejection_sample_reference(s0["target"], s0["draft"], s0["drafts"], s0["seeds"],
                                             s0["offsets"], TEMPERATURE)
            lp = torch.log_softmax(s0["target"][:, :num_drafts].float(), -1)
            lq = torch.log_softmax(s0["draft"].float(), -1)
            alpha = float(torch.minimum(lp, lq).exp().sum(-1).mean())
            del lp, lq
            logical = set_bytes
            if "flashinfer_kernel" in providers and fs is not None:
                for s in sets:
                    s["tp"] = torch.softmax(s["target"].float() / TEMPERATURE, -1)
                    s["dp"] = torch.softmax(s["draft"].float() / TEMPERATURE, -1)
                    s["d32"] = s["drafts"].to(torch.int32)
            elif fs is not None:
                for s in sets:
                    s["d32"] = s["drafts"].to(torch.int32)

            def fn_for(provider, s, batch=batch, num_drafts=num_drafts, vocab=vocab):
                args_ = (s["target"], s["draft"], s["drafts"], s["seeds"], s["offsets"], TEMPERATURE)
                if provider.startswith("specdec"):
                    strategy = {"specdec": "auto", "specdec_split": "split",
                                "specdec_seq": "seq"}[provider]
                    return lambda: rejection_sample_triton(*args_, strategy=strategy)
                if provider == "torch_eager":
                    return lambda: rejection_sample_reference(*args_)
                if provider == "torch_compile":
                    return lambda: compiled(*args_)
                if provider == "flashinfer":
                    def full():
                        tp = fs.softmax(s["target"].view(-1, vocab), temperature=TEMPERATURE)
                        dp = fs.softmax(s["draft"].view(-1, vocab), temperature=TEMPERATURE)
                        return fs.chain_speculative_sampling(
                            dp.view(batch, num_drafts, vocab), s["d32"],
                            tp.view(batch, num_drafts + 1, vocab))
                    return full
                if provider == "flashinfer_kernel":
                    return lambda: fs.chain_speculative_sampling(s["dp"], s["d32"], s["tp"])
                raise ValueError(provider)

            for provider in providers:
                if provider.startswith("flashinfer") and fs is None:
                    row = dict(note=fi_note)
                    med = p20 = p80 = float("nan")
                    timing = "not run"
                else:
                    note = ""
                    fns = [fn_for(provider, s) for s in sets]
                    try:
                        med, p20, p80 = time_graph(fns)
                        timing = "cuda_graph"
                    except Exception as exc:
                        torch.cuda.synchronize()
                        note = f"graph capture failed ({type(exc).__name__}); do_bench"
                        try:
                            med, p20, p80 = time_do_bench(fns)
                            timing = "do_bench"
                        except Exception as exc2:
                            med = p20 = p80 = float("nan")
                            timing = "failed"
                            note = f"{type(exc2).__name__}: {str(exc2)[:200]}"
                    row = dict(note=note)
                match = ""
                read = float("nan")
                if provider.startswith("specdec") and timing != "not run":
                    strategy = {"specdec": "auto", "specdec_split": "split", "specdec_seq": "seq"}[
                        provider]
                    out = rejection_sample_triton(s0["target"], s0["draft"], s0["drafts"], s0["seeds"],
                                                  s0["offsets"], TEMPERATURE, strategy=strategy)
                    match = str(bool(torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])))
                    if match == "False":
                        diagnose(s0, out, ref, num_drafts)
                    if strategy == "seq":
                        read = bytes_read("seq", out[1], num_drafts, vocab, esize)
                    else:
                        read, bound_note = split_bytes(out[1], batch, num_drafts, vocab, esize, TUNE_DEFAULT)
                        row["note"] = (row.get("note", "") + " " + bound_note).strip()
                row.update(kernel="rejection_sample", provider=provider, B=batch, K=num_drafts,
                           V=vocab, dtype=dtype_name, median_us=f"{med:.2f}", p20_us=f"{p20:.2f}",
                           p80_us=f"{p80:.2f}", gbps=f"{logical / med / 1e3:.1f}",
                           gbps_read=f"{read / med / 1e3:.1f}",
                           copy_gbps=f"{copy_gbps:.0f}", frac_copy=f"{read / med / 1e3 / copy_gbps:.3f}",
                           alpha=f"{alpha:.3f}", timing=timing, match_ref=match, **env)
                writer.writerow(row)
                handle.flush()
                rows.append(row)
                print(f"{provider:18s} {dtype_name} B={batch:3d} K={num_drafts} V={vocab:6d} "
                      f"{med:9.1f} us  [{p20:.1f}, {p80:.1f}]  {timing} {match} {row.get('note', '')}",
                      flush=True)
            del sets, s0, ref
            torch.cuda.empty_cache()
    summarize(rows, env, copy_gbps)
    print(f"# wrote {path} in {time.time() - t_start:.0f} s")


def summarize(rows, env, copy_gbps):
    """Ratio table: provider time / specdec time (>1 means specdec is faster)."""
    table = {}
    for row in rows:
        table[(row["provider"], row["B"], row["K"], row["V"], row["dtype"])] = float(row["median_us"])
    print(f"\n# {env['gpu']}  copy {copy_gbps:.0f} GB/s  (median us; x = provider / specdec)")
    print(f"{'dtype':5s} {'V':>6s} {'B':>4s} {'K':>2s} {'specdec':>9s} {'split':>8s} {'seq':>8s} {'eager':>9s} "
          f"{'compile':>9s} {'fi':>9s} {'fi_kern':>8s} {'x_eager':>7s} {'x_comp':>7s} {'x_fi':>6s} {'x_fik':>6s}")
    keys = sorted({k[1:] for k in table}, key=lambda k: (k[3], k[2], k[1], k[0]))
    for batch, num_drafts, vocab, dtype in keys:
        def get(provider, key=(batch, num_drafts, vocab, dtype)):
            return table.get((provider,) + key, float("nan"))
        s = get("specdec")
        print(f"{dtype:5s} {vocab:6d} {batch:4d} {num_drafts:2d} {s:9.1f} {get('specdec_split'):8.1f} "
              f"{get('specdec_seq'):8.1f} {get('torch_eager'):9.1f} {get('torch_compile'):9.1f} "
              f"{get('flashinfer'):9.1f} {get('flashinfer_kernel'):8.1f} {get('torch_eager') / s:7.1f} "
              f"{get('torch_compile') / s:7.1f} {get('flashinfer') / s:6.1f} {get('flashinfer_kernel') / s:6.2f}")


if __name__ == "__main__":
    main()
