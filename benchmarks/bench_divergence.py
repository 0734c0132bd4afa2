"""Divergence benchmark: specdec's fused kernels against eager torch, torch.compile and Liger-Kernel.

Every provider runs in this one process on one card, bf16 logits ``N(0, 2^2)``, timed by ``triton.testing.do_bench``
(medians and quantiles of its repetitions, milliseconds). Ops (``op`` column):
  forward       per-token H(p, q), KL, TV (and alpha for specdec) of [N, V] verifier and drafter logits
  loss          mean drafter cross-entropy against the verifier, forward + backward to the drafter logits
  fused_linear  the loss of ``hidden @ lm_head.T`` (H = hidden size), forward + backward to both

Providers (``provider`` column):
  specdec          ``specdec.divergence`` / ``divergence_loss`` / ``fused_linear_divergence_loss`` with
                   ``check_inputs=False`` (no host sync, like the others) and the automatic plan: on Hopper the
                   thread-block-cluster kernels for 16-bit logits from V = 32000
  specdec_row      the one-program-per-row kernel, forced (what other GPUs run); only where the plan differs
  specdec_checked  the loss with ``check_inputs=True`` (one device sync to read the kernel's bad-row flags)
  eager            float32 log-softmaxes, ``kl_div`` and cross-entropy with soft targets
  compile          ``torch.compile`` of the eager code (dynamic shapes)
  liger            ``LigerKLDIVLoss`` on torch log-softmaxes

``peak_mem_GiB``: the peak of ``torch.cuda.max_memory_allocated`` during one call minus the memory allocated before
it (inputs excluded, gradients included). ``read_GBps``: both logit inputs read once per call (the forward's and the
loss's lower bound), per second. Rows go into ``results/divergence.csv``, replacing those of the same GPU, dtype, op,
shape and provider.

    python benchmarks/bench_divergence.py [--quick] [--shapes NxV,...] [--no-fused] [--no-compile]
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as nnf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    ENV_FIELDS,
    RESULTS,
    environment,
    measure_copy_bandwidth,
    specdec_version,
    time_do_bench,
    upsert_rows,
)

import specdec.fairness.divergences as sd  # noqa: E402
from specdec.kernels import divergence as kdiv  # noqa: E402

SHAPES = ((16384, 32000), (1024, 151936), (4096, 151936), (16384, 151936))
QUICK_SHAPES = ((1024, 32000),)
FUSED_SHAPE = (16384, 151936, 896)  # N, V, H
QUICK_FUSED_SHAPE = (1024, 32000, 256)
CSV = os.path.join(RESULTS, "divergence.csv")
FIELDS = [*ENV_FIELDS, "op", "N", "V", "H", "provider", "median_ms", "p20_ms", "p80_ms", "timing", "peak_mem_GiB",
          "read_GBps", "copy_GBps"]
KEY = ["gpu", "dtype", "op", "N", "V", "H", "provider"]
DTYPE = torch.bfloat16
# the providers :func:`cases` builds for each op (specdec_row only where the automatic plan takes the cluster
# kernels; compile and liger only where available)
OP_PROVIDERS = {"forward": ("specdec", "specdec_row", "eager", "compile", "liger"),
                "loss": ("specdec", "specdec_checked", "specdec_row", "eager", "compile", "liger")}


def eager_forward(v: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CE, KL and TV per row the usual way: float32 log-softmaxes, kl_div, cross-entropy with soft targets."""
    log_p = torch.log_softmax(v.float(), dim=-1)
    log_q = torch.log_softmax(d.float(), dim=-1)
    p = log_p.exp()
    ce = -(p * log_q).sum(-1)
    kl = nnf.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)
    tv = 0.5 * (p - log_q.exp()).abs().sum(-1)
    return ce, kl, tv


def eager_loss(d: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the drafter against the verifier (soft targets), verifier detached."""
    return nnf.cross_entropy(d.float(), torch.softmax(v.float(), dim=-1).detach())


def liger_loss():
    """``(LigerKLDIVLoss instance or None, version or "absent")``."""
    try:
        from importlib.metadata import version

        from liger_kernel.transformers import LigerKLDIVLoss
    except ImportError as exc:  # recorded as absent
        print("liger-kernel not importable:", exc, file=sys.stderr)
        return None, "absent"
    return LigerKLDIVLoss(reduction="batchmean", log_target=True), version("liger-kernel")


def peak_extra_gib(fn: Callable[[], object]) -> float:
    """Extra memory of one call of ``fn`` over what was allocated before it, GiB."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def backward_call(drop_grads: Callable[[], None], loss_fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
    """A call that drops the previous call's gradients, then runs ``loss_fn`` forward and backward."""
    def run():
        drop_grads()
        loss_fn().backward()
    return run


def cases(n: int, v: int, liger, compiled_forward, compiled_loss) -> tuple[list, Callable[[], None]]:
    """``(op, provider, callable)`` of every provider at one [N, V] shape, and a callable that drops the gradients
    a loss call leaves (before a memory measurement: the previous provider's gradient is not "before")."""
    g = torch.Generator(device="cuda").manual_seed(n + v)
    ver = (torch.randn(n, v, device="cuda", generator=g) * 2).to(DTYPE)
    dra = (torch.randn(n, v, device="cuda", generator=g) * 2).to(DTYPE)
    d_req = dra.clone().requires_grad_()
    auto = kdiv.divergence_plan(n, v, DTYPE, ver.device, loss=False)
    auto_loss = kdiv.divergence_plan(n, v, DTYPE, ver.device, loss=True)

    def drop_grad() -> None:
        d_req.grad = None

    loss_call = functools.partial(backward_call, drop_grad)
    out = [("forward", "specdec", lambda: sd.divergence(ver, dra, check_inputs=False))]
    if auto.cluster:
        row = replace(auto, cluster=False)
        out.append(("forward", "specdec_row", lambda: kdiv.launch_divergence(ver, dra, 1.0, plan=row)))
    out.append(("forward", "eager", lambda: eager_forward(ver, dra)))
    if compiled_forward is not None:
        out.append(("forward", "compile", lambda: compiled_forward(ver, dra)))
    if liger is not None:
        out.append(("forward", "liger",
                    lambda: liger(torch.log_softmax(dra.float(), -1), torch.log_softmax(ver.float(), -1))))
    out.append(("loss", "specdec",
                loss_call(lambda: sd.divergence_loss(d_req, ver, reduction="mean", check_inputs=False))))
    out.append(("loss", "specdec_checked", loss_call(lambda: sd.divergence_loss(d_req, ver, reduction="mean"))))
    if auto_loss.cluster:
        row_loss = replace(auto_loss, cluster=False)
        out.append(("loss", "specdec_row", loss_call(
            lambda: kdiv.divergence_loss_triton(d_req, ver, None, None, 1.0, "mean", plan=row_loss))))
    out.append(("loss", "eager", loss_call(lambda: eager_loss(d_req, ver))))
    if compiled_loss is not None:
        out.append(("loss", "compile", loss_call(lambda: compiled_loss(d_req, ver))))
    if liger is not None:
        out.append(("loss", "liger", loss_call(
            lambda: liger(torch.log_softmax(d_req.float(), -1), torch.log_softmax(ver.float(), -1)))))
    return out, drop_grad


def fused_cases(n: int, v: int, h: int, liger) -> tuple[list, Callable[[], None]]:
    """``(op, provider, callable)`` of the fused LM head + loss, forward + backward to hidden states and weight, and
    a callable that drops the gradients."""
    g = torch.Generator(device="cuda").manual_seed(7)
    hidden = torch.randn(n, h, device="cuda", generator=g).to(DTYPE).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=g) / math.sqrt(h)).to(DTYPE).requires_grad_()
    ver = (torch.randn(n, v, device="cuda", generator=g) * 2).to(DTYPE)

    def drop_grads() -> None:
        hidden.grad = weight.grad = None

    call = functools.partial(backward_call, drop_grads)
    out = [("fused_linear", "specdec", call(lambda: sd.fused_linear_divergence_loss(
        hidden, weight, ver, reduction="mean", check_inputs=False))),
        ("fused_linear", "eager", call(lambda: eager_loss(hidden @ weight.t(), ver)))]
    if liger is not None:
        out.append(("fused_linear", "liger", call(lambda: liger(
            torch.log_softmax((hidden @ weight.t()).float(), -1), torch.log_softmax(ver.float(), -1)))))
    return out, drop_grads


def row(env: dict, versions: dict, op: str, provider: str, n: int, v: int, h: int | None,
        timing: tuple[float, float, float], how: str, mem: float, copy_gbps: float) -> dict:
    med, p20, p80 = timing
    read = 2 * n * v * DTYPE.itemsize / (med * 1e-3) / 1e9
    return dict(**env, provider_version=versions[provider], dtype="bf16", op=op, N=n, V=v,
                H="" if h is None else h, provider=provider, median_ms=f"{med:.4f}", p20_ms=f"{p20:.4f}",
                p80_ms=f"{p80:.4f}", timing=how, peak_mem_GiB=f"{mem:.3f}",
                read_GBps=f"{read:.1f}" if read == read and op != "fused_linear" else "", copy_GBps=f"{copy_gbps:.0f}")


def provider_versions(liger_version: str) -> dict[str, str]:
    own = specdec_version()
    return {"specdec": own, "specdec_row": own, "specdec_checked": own, "eager": torch.__version__,
            "compile": torch.__version__, "liger": liger_version}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one small shape, for a smoke run")
    parser.add_argument("--shapes", default=None, help="comma-separated NxV list, e.g. 16384x151936")
    parser.add_argument("--no-fused", action="store_true", help="skip the fused linear loss")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--out", default=CSV, help="the CSV the rows go into")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_divergence.py times Triton kernels on a CUDA GPU; none found")
    t_start = time.time()
    env = environment()
    copy_gbps = measure_copy_bandwidth()
    liger, liger_version = liger_loss()
    versions = provider_versions(liger_version)
    print(f"# {env} liger {liger_version} copy {copy_gbps:.0f} GB/s", flush=True)
    compiled_forward = None if args.no_compile else torch.compile(eager_forward, dynamic=True)
    compiled_loss = None if args.no_compile else torch.compile(eager_loss, dynamic=True)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in item.split("x")) for item in args.shapes.split(",")]
    work = [((n, v, None), lambda n=n, v=v: cases(n, v, liger, compiled_forward, compiled_loss)) for n, v in shapes]
    if not args.no_fused:
        n, v, h = QUICK_FUSED_SHAPE if args.quick else FUSED_SHAPE
        work.append(((n, v, h), lambda n=n, v=v, h=h: fused_cases(n, v, h, liger)))
    rows = []
    for (n, v, h), make in work:
        rep = 100 if n * v < 2**30 else 300
        calls, drop_grads = make()
        for op, provider, fn in calls:
            try:
                drop_grads()
                mem = peak_extra_gib(fn)
                timing = time_do_bench([fn], warmup=10, rep=rep, unit="ms")
            except torch.OutOfMemoryError:
                timing, mem = (math.nan,) * 3, math.nan
            rows.append(row(env, versions, op, provider, n, v, h, timing, "do_bench", mem, copy_gbps))
            print(f"{op:12s} {provider:15s} N={n:6d} V={v:6d} {timing[0]:9.3f} ms [{timing[1]:.3f}, {timing[2]:.3f}]"
                  f" extra {mem:6.2f} GiB", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    upsert_rows(args.out, rows, KEY, FIELDS)
    summarize(rows, copy_gbps)
    print(f"# {len(rows)} rows into {args.out} in {time.time() - t_start:.0f} s")


def summarize(rows: list[dict], copy_gbps: float) -> None:
    """Provider time / specdec time (> 1: specdec is faster) and specdec's share of the copy rate."""
    table = {(r["op"], r["N"], r["V"], r["provider"]): float(r["median_ms"]) for r in rows}
    print(f"\n{'op':12s} {'N':>6s} {'V':>6s} {'specdec ms':>10s} {'%copy':>6s} {'x eager':>8s} {'x compile':>9s} "
          f"{'x liger':>8s} {'x row':>6s}")
    for r in rows:
        if r["provider"] != "specdec":
            continue
        base = float(r["median_ms"])

        def ratio(provider, r=r, base=base):
            return table.get((r["op"], r["N"], r["V"], provider), math.nan) / base
        share = 100 * float(r["read_GBps"]) / copy_gbps if r["read_GBps"] else math.nan
        print(f"{r['op']:12s} {r['N']:6d} {r['V']:6d} {base:10.3f} {share:6.1f} {ratio('eager'):8.1f} "
              f"{ratio('compile'):9.1f} {ratio('liger'):8.1f} {ratio('specdec_row'):6.2f}")


if __name__ == "__main__":
    main()
