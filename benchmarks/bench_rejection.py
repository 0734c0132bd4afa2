"""Rejection-sampling benchmark: specdec's fused Triton sampler against eager torch, torch.compile and FlashInfer.

Every provider runs in this one process on one card, on the same inputs, timed by CUDA-graph replay of calls over
rotated input sets (``common.time_graph``; ``triton.testing.do_bench`` only where a provider cannot be captured,
noted in the ``timing`` column). Inputs: target logits ``N(0, 2^2)``, draft logits = target + ``N(0, 0.7^2)`` (mean
acceptance alpha ~ 0.73, reported), drafts sampled from q, temperature 1.

Providers (``provider`` column; ``verification`` says how each verifies the drafts):
  specdec            ``rejection_sample_triton`` with its automatic launch plan, from logits
  specdec_block      the same with ``verification="block"`` (block verification: every position's statistics,
                     the race over the rows a stop can need)
  specdec_every_row  token-wise verification under block verification's launch plan (every position's statistics:
                     no stages, no live skip), so that against specdec_block only the verification differs
  torch_eager        ``rejection_sample_reference``
  torch_compile      ``torch.compile(rejection_sample_reference)``
  flashinfer         ``flashinfer.sampling.softmax`` on both logit tensors + ``chain_speculative_sampling``
  flashinfer_kernel  ``chain_speculative_sampling`` alone, handed precomputed probabilities

``read_GBps`` (specdec only) is the bytes the sampler reads on these inputs (the statistics rows up to each
request's stop under staged statistics, and the race's re-read of the stop row) per second; with live skip, how far
a program reads past a rejection depends on timing, so it counts the bytes every plan reads (a lower bound, noted);
block verification reads every statistics row, and its race may read a few candidate rows beyond the stop row (a
lower bound, noted). ``mean_accepted`` (specdec only) is the mean accepted drafts per request on the first input set.
``tools/ncu_bytes_read.sh`` measures the bytes with Nsight Compute. Rows go into ``results/rejection.csv``,
replacing those of the same GPU, dtype, shape and provider.

    python benchmarks/bench_rejection.py [--quick] [--shapes V:B:K,...] [--dtypes bf16,fp32] [--providers ...]
    python benchmarks/bench_rejection.py --readme --providers specdec,specdec_block   # block vs token-wise
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    ENV_FIELDS,
    RESULTS,
    environment,
    l2_cache_bytes,
    measure_copy_bandwidth,
    specdec_version,
    time_do_bench,
    time_graph,
    upsert_rows,
)

from specdec.kernels.rejection_sampling import rejection_sample_triton  # noqa: E402
from specdec.kernels.rejection_sampling_plan import logit_bytes, plan_launch, statistics_launches  # noqa: E402
from specdec.kernels.rejection_sampling_reference import rejection_sample_reference  # noqa: E402

BATCHES = (1, 8, 32, 128)
DRAFTS = (1, 4, 8)
VOCABS = (151936, 128256, 32000)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PROVIDERS = ("specdec", "specdec_block", "specdec_every_row", "torch_eager", "torch_compile", "flashinfer",
             "flashinfer_kernel")
VERIFICATION = {"specdec_block": "block"}  # every other provider verifies token by token
README_SHAPES = [("bf16", 151936, 1, 4), ("bf16", 151936, 32, 4), ("bf16", 151936, 128, 8), ("bf16", 32000, 32, 8),
                 ("fp32", 151936, 32, 8), ("fp32", 32000, 128, 8)]  # (dtype, V, B, K) of the README's table
TEMPERATURE = 1.0
CSV = os.path.join(RESULTS, "rejection.csv")
FIELDS = [*ENV_FIELDS, "B", "K", "V", "provider", "verification", "median_us", "p20_us", "p80_us", "timing",
          "match_ref", "alpha", "mean_accepted", "read_GBps", "copy_GBps", "note"]
KEY = ["gpu", "dtype", "B", "K", "V", "provider"]
LOWER_BOUND_NOTE = "read_GBps: lower bound (live skip reads at least the rows up to each stop)"
BLOCK_BOUND_NOTE = "read_GBps: lower bound (block: the race may read candidate rows beyond the stop row)"


def make_inputs(batch: int, num_drafts: int, vocab: int, dtype: torch.dtype, seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    target = torch.randn(batch, num_drafts + 1, vocab, generator=gen, device="cuda") * 2.0
    draft = target[:, :num_drafts] + 0.7 * torch.randn(batch, num_drafts, vocab, generator=gen, device="cuda")
    gumbel = -torch.log(-torch.log(torch.rand(batch, num_drafts, vocab, generator=gen, device="cuda")))
    drafts = torch.argmax(draft / TEMPERATURE + gumbel, dim=-1)
    del gumbel
    seeds = torch.randint(0, 2**62, (batch,), generator=gen, device="cuda")
    offsets = torch.zeros(batch, dtype=torch.int64, device="cuda")
    return dict(target=target.to(dtype), draft=draft.to(dtype), drafts=drafts, seeds=seeds, offsets=offsets)


def bytes_read(num_accepted: torch.Tensor, batch: int, num_drafts: int, vocab: int, dtype: torch.dtype,
               verification: str = "token") -> tuple[float, bool]:
    """Bytes the automatic plan reads on these inputs (sampled rows, all drafts real), and whether that is a lower
    bound (live skip, block verification). A row reads a later statistics launch's positions only if it reaches them
    (ignoring near-ties); then the race's target row at the stop position (and the draft row after a rejection)."""
    esize = dtype.itemsize
    plan = plan_launch(batch, num_drafts, vocab, dtype, torch.device("cuda"), verification=verification)
    acc = num_accepted.double()
    rejected = (acc < num_drafts).double()
    if verification == "block":  # every position's statistics, then at least the stop row
        return float((2 * num_drafts + 1 + rejected).sum()) * vocab * esize, True
    if plan.live_skip:  # every plan reads positions 0 .. min(n, K - 1) whole (the accept tests normalise them)
        rows = 2 * torch.clamp(acc + 1, max=num_drafts) + 1 + rejected
    else:
        rows = 1 + rejected
        for lo, count in statistics_launches(plan, num_drafts):
            rows = rows + 2 * max(0, min(lo + count, num_drafts) - lo) * (acc >= lo).double()
    return float(rows.sum()) * vocab * esize, plan.live_skip


def setup_flashinfer():
    """Import FlashInfer and JIT-build its sampling module; returns (module or None, version or why not)."""
    try:
        import flashinfer
        import flashinfer.sampling as fs

        probs = torch.softmax(torch.randn(2, 3, 1000, device="cuda"), -1)
        fs.chain_speculative_sampling(probs[:, :2].contiguous(), torch.zeros(2, 2, dtype=torch.int32,
                                      device="cuda"), probs.contiguous())
        fs.softmax(torch.randn(4, 1000, device="cuda"), temperature=1.0)
        torch.cuda.synchronize()
        return fs, flashinfer.__version__
    except Exception as exc:  # recorded in the rows' note
        traceback.print_exc()
        return None, f"not run: {type(exc).__name__}: {str(exc)[:200]}"


class Shape:
    """One benchmark shape: rotated input sets (together more than twice the L2), the reference's result on the
    first, and one callable per (provider, set)."""

    def __init__(self, batch: int, num_drafts: int, vocab: int, dtype_name: str, l2_bytes: int):
        self.batch, self.num_drafts, self.vocab, self.dtype_name = batch, num_drafts, vocab, dtype_name
        self.dtype = DTYPES[dtype_name]
        set_bytes = logit_bytes(batch, num_drafts, vocab, self.dtype.itemsize)
        self.logit_bytes = set_bytes
        self.sets = [make_inputs(batch, num_drafts, vocab, self.dtype, seed=s)
                     for s in range(max(1, min(16, math.ceil(2 * l2_bytes / set_bytes))))]
        s0 = self.sets[0]
        self.refs = {verification: rejection_sample_reference(s0["target"], s0["draft"], s0["drafts"], s0["seeds"],
                                                              s0["offsets"], TEMPERATURE, verification=verification)
                     for verification in ("token", "block")}
        self.ref = self.refs["token"]
        lp = torch.log_softmax(s0["target"][:, :num_drafts].float(), -1)
        lq = torch.log_softmax(s0["draft"].float(), -1)
        self.alpha = float(torch.minimum(lp, lq).exp().sum(-1).mean())

    def fns(self, provider: str, flashinfer=None, compiled=None) -> list:
        """One callable per input set."""
        b, k, v = self.batch, self.num_drafts, self.vocab
        out = []
        for s in self.sets:
            args = (s["target"], s["draft"], s["drafts"], s["seeds"], s["offsets"], TEMPERATURE)
            if provider == "specdec":
                out.append(lambda args=args: rejection_sample_triton(*args))
            elif provider == "specdec_block":
                out.append(lambda args=args: rejection_sample_triton(*args, verification="block"))
            elif provider == "specdec_every_row":
                plan = dataclasses.replace(plan_launch(b, k, v, s["target"].dtype, s["target"].device,
                                                       verification="block"), verification="token")
                out.append(lambda args=args, plan=plan: rejection_sample_triton(*args, plan=plan))
            elif provider == "torch_eager":
                out.append(lambda args=args: rejection_sample_reference(*args))
            elif provider == "torch_compile":
                out.append(lambda args=args: compiled(*args))
            elif provider == "flashinfer":
                s["d32"] = s["drafts"].to(torch.int32)

                def full(s=s):
                    tp = flashinfer.softmax(s["target"].view(-1, v), temperature=TEMPERATURE)
                    dp = flashinfer.softmax(s["draft"].view(-1, v), temperature=TEMPERATURE)
                    return flashinfer.chain_speculative_sampling(dp.view(b, k, v), s["d32"], tp.view(b, k + 1, v))
                out.append(full)
            elif provider == "flashinfer_kernel":
                s["d32"] = s["drafts"].to(torch.int32)
                s["tp"] = torch.softmax(s["target"].float() / TEMPERATURE, -1)
                s["dp"] = torch.softmax(s["draft"].float() / TEMPERATURE, -1)
                out.append(lambda s=s: flashinfer.chain_speculative_sampling(s["dp"], s["d32"], s["tp"]))
            else:
                raise ValueError(f"unknown provider {provider!r}")
        return out

    def specdec_result(self, verification: str = "token") -> tuple[tuple, bool]:
        """specdec's outputs on the first input set, and whether its tokens and accepted counts are the
        reference's."""
        s0 = self.sets[0]
        out = rejection_sample_triton(s0["target"], s0["draft"], s0["drafts"], s0["seeds"], s0["offsets"],
                                      TEMPERATURE, verification=verification)
        ref = self.refs[verification]
        return out, bool(torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]))

    def row(self, provider: str, version: str, timing: tuple[float, float, float], how: str, env: dict,
            copy_gbps: float, note: str = "") -> dict:
        """The result row of ``provider`` (for specdec: exactness against the reference and the bytes read)."""
        med, p20, p80 = timing
        match, read, accepted = "", float("nan"), ""
        verification = VERIFICATION.get(provider, "token")
        if provider.startswith("specdec"):
            out, matches = self.specdec_result(verification)
            match = str(matches)
            accepted = f"{float(out[1].double().mean()):.3f}"
            reads = "block" if provider == "specdec_every_row" else verification  # (every statistics row)
            nbytes, bound = bytes_read(out[1], self.batch, self.num_drafts, self.vocab, self.dtype, reads)
            read = nbytes / med / 1e3
            bound_note = BLOCK_BOUND_NOTE if reads == "block" else LOWER_BOUND_NOTE
            note = (note + " " + bound_note).strip() if bound else note
        return dict(**env, provider_version=version, dtype=self.dtype_name, B=self.batch, K=self.num_drafts,
                    V=self.vocab, provider=provider, verification=verification, median_us=f"{med:.2f}",
                    p20_us=f"{p20:.2f}", p80_us=f"{p80:.2f}", timing=how, match_ref=match, alpha=f"{self.alpha:.3f}",
                    mean_accepted=accepted, read_GBps=f"{read:.1f}" if read == read else "",
                    copy_GBps=f"{copy_gbps:.0f}", note=note)


def provider_versions(flashinfer_version: str) -> dict[str, str]:
    torch_version = torch.__version__
    return {"specdec": specdec_version(), "specdec_block": specdec_version(),
            "specdec_every_row": specdec_version(), "torch_eager": torch_version,
            "torch_compile": torch_version,
            "flashinfer": flashinfer_version, "flashinfer_kernel": flashinfer_version}


def compiled_reference():
    torch._dynamo.config.cache_size_limit = 256
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 256
    return torch.compile(rejection_sample_reference)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="V = 151936, bf16 only")
    parser.add_argument("--readme", action="store_true", help="the README table's (dtype, V, B, K) only")
    parser.add_argument("--shapes", default="", help="comma-separated V:B:K triples (default: the full grid)")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated subset of bf16,fp32")
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--out", default=CSV, help="the CSV the rows go into")
    parser.add_argument("--max-seconds", type=float, default=1e9, help="start no new shape after this")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_rejection.py times Triton kernels on a CUDA GPU; none found")
    t_start = time.time()
    providers = args.providers.split(",")
    env = environment()
    copy_gbps = measure_copy_bandwidth()
    l2_bytes = l2_cache_bytes()
    print(f"# {env}  copy {copy_gbps:.0f} GB/s  L2 {l2_bytes >> 20} MiB", flush=True)
    flashinfer, fi_version = setup_flashinfer() if any(p.startswith("flashinfer") for p in providers) else (None, "")
    versions = provider_versions(fi_version)
    compiled = compiled_reference() if "torch_compile" in providers else None
    dtype_names = ["bf16"] if args.quick else [name for name in args.dtypes.split(",") if name]
    if args.shapes:
        triples = [tuple(int(x) for x in item.split(":")) for item in args.shapes.split(",") if item]
    else:
        triples = [(v, b, k) for v in ((151936,) if args.quick else VOCABS) for k in DRAFTS for b in BATCHES]
    cases = [(d, *t) for d in dtype_names for t in triples]
    if args.readme:
        cases = [(d, v, b, k) for d, v, b, k in README_SHAPES if d in dtype_names]
    rows = []
    for dtype_name, vocab, batch, num_drafts in cases:
        if time.time() - t_start > args.max_seconds:
            print(f"# time budget reached: {dtype_name} V={vocab} B={batch} K={num_drafts} not run", flush=True)
            continue
        shape = Shape(batch, num_drafts, vocab, dtype_name, l2_bytes)
        for provider in providers:
            if provider.startswith("flashinfer") and flashinfer is None:
                continue
            fns = shape.fns(provider, flashinfer, compiled)
            note = ""
            try:
                timing, how = time_graph(fns), "cuda_graph"
            except Exception as exc:  # a provider that cannot be captured
                torch.cuda.synchronize()
                note = f"graph capture failed ({type(exc).__name__})"
                timing, how = time_do_bench(fns), "do_bench"
            row = shape.row(provider, versions[provider], timing, how, env, copy_gbps, note)
            rows.append(row)
            print(f"{provider:18s} {dtype_name} B={batch:3d} K={num_drafts} V={vocab:6d} {row['median_us']:>9s} us"
                  f" [{row['p20_us']}, {row['p80_us']}] {how} {row['match_ref']} accepted {row['mean_accepted']}"
                  f" {row['note']}", flush=True)
        del shape
        torch.cuda.empty_cache()
    upsert_rows(args.out, rows, KEY, FIELDS)
    summarize(rows)
    print(f"# {len(rows)} rows into {args.out} in {time.time() - t_start:.0f} s")


def summarize(rows: list[dict]) -> None:
    """Provider time / specdec time per shape (> 1: specdec is faster; specdec_block: block over token-wise)."""
    table = {(r["provider"], r["dtype"], r["V"], r["B"], r["K"]): float(r["median_us"]) for r in rows}
    shapes = sorted({key[1:] for key in table}, key=lambda s: (s[0], -s[1], s[2], s[3]))
    others = [p for p in PROVIDERS if p != "specdec"]
    print(f"\n{'dtype':5s} {'V':>6s} {'B':>4s} {'K':>2s} {'specdec us':>10s} " + " ".join(f"{p:>17s}" for p in others))
    for shape in shapes:
        base = table.get(("specdec", *shape))
        if base is None:
            continue
        ratios = " ".join(f"{table.get((p, *shape), math.nan) / base:16.2f}x" for p in others)
        print(f"{shape[0]:5s} {shape[1]:6d} {shape[2]:4d} {shape[3]:2d} {base:10.1f} {ratios}")


if __name__ == "__main__":
    main()
