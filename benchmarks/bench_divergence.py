"""Benchmark of the fused divergence kernels against eager torch, torch.compile and Liger-Kernel, on one GPU.

Every provider runs in this one process on one card. Rows go to ``benchmarks/results/divergence_<gpu>.csv`` (or
``--out``): kernel, provider, N, V, dtype, pass, median_ms, p20_ms, p80_ms, peak_mem_gib, gpu, versions, plus
extra columns (inputs_gib, gbps = bytes of the inputs read once / median time).

``peak_mem_gib`` is the peak of ``torch.cuda.max_memory_allocated`` during one call *minus* the memory allocated
before it (inputs excluded), i.e. the extra memory the op needs, gradients included (``.grad`` is dropped first).

``specdec_v1`` is the first version's kernel (one program per row, 2048-column tiles, 4 warps, sums reduced per tile,
no pipelining: ``V1_SETTINGS``), timed in the same process for comparison; ``specdec_row`` is the current
one-program-per-row kernel with the cluster kernels of ``kernels/divergence_cluster.py`` turned off.
The loss rows (``ce_loss``) time
``divergence_loss(..., check_inputs=False)`` as the forward rows time ``divergence(..., check_inputs=False)``: like
the eager, compiled and Liger providers, no host sync; ``specdec_checked`` is the default ``check_inputs=True``
(one device sync to read the kernel's bad-row flags). The fused-linear rows also pass ``check_inputs=False``.
``--sweep`` first times launch settings at the target shape and keeps the best.

Usage: ``python benchmarks/bench_divergence.py [--quick] [--sweep] [--shapes NxV,...] [--no-fused] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import csv
import gc
import math
import os
import sys
import time

import torch
import torch.nn.functional as nnf
import triton
from triton.testing import do_bench

import specdec.divergences as sd
from specdec.kernels import divergence as kdiv

QUANTILES = [0.5, 0.2, 0.8]
V1_SETTINGS = dict(split=0, block=2048, num_warps=4, pass1=0, stages2=1, cluster=0)
ROW_SETTINGS = dict(cluster=0)  # without the cluster kernels (sessions 12-13): the row kernel's current code


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


def bench(fn, warmup: int = 10, rep: int = 100) -> tuple[float, float, float]:
    fn()
    torch.cuda.synchronize()
    med, p20, p80 = do_bench(fn, warmup=warmup, rep=rep, quantiles=QUANTILES)
    return med, p20, p80


def peak_extra_gib(fn) -> float:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=200, return_mode="median")
    return 2 * 2 * 2**30 / (ms * 1e-3) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one small shape, for a smoke run")
    parser.add_argument("--sweep", action="store_true", help="sweep Triton launch settings first, keep the best")
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--shapes", default=None, help="comma-separated NxV list, e.g. 16384x151936")
    parser.add_argument("--no-fused", action="store_true", help="skip the fused linear benchmark")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "the benchmark needs a CUDA GPU"
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    try:
        import liger_kernel
        from liger_kernel.transformers import LigerKLDIVLoss

        liger_version = getattr(liger_kernel, "__version__", None)
        if liger_version is None:
            from importlib.metadata import version

            liger_version = version("liger-kernel")
    except ImportError as exc:  # pragma: no cover - depends on the machine
        print("liger-kernel not importable:", exc, file=sys.stderr)
        LigerKLDIVLoss, liger_version = None, "absent"
    versions = f"torch={torch.__version__};triton={triton.__version__};liger={liger_version}"
    out_path = args.out or os.path.join(os.path.dirname(__file__), "results", f"divergence_{gpu}.csv")
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    rows: list[dict] = []
    copy_gbps = copy_bandwidth()
    print(f"gpu={gpu} {versions} copy={copy_gbps:.0f} GB/s", flush=True)
    dtype = torch.bfloat16

    def record(kernel, provider, n, v, pass_, timing, mem, inputs_bytes):
        med, p20, p80 = timing
        row = dict(kernel=kernel, provider=provider, N=n, V=v, dtype="bf16", **{"pass": pass_},
                   median_ms=round(med, 4), p20_ms=round(p20, 4), p80_ms=round(p80, 4),
                   peak_mem_gib=round(mem, 3), gpu=gpu, versions=versions, inputs_gib=round(inputs_bytes / 2**30, 3),
                   gbps=round(inputs_bytes / (med * 1e-3) / 1e9, 1) if med == med else float("nan"),
                   copy_gbps=round(copy_gbps, 1))
        rows.append(row)
        print(f"{kernel:14s} {provider:10s} N={n:6d} V={v:6d} {pass_:8s} {med:9.3f} ms "
              f"[{p20:.3f},{p80:.3f}] extra={mem:7.2f} GiB  {row['gbps']} GB/s", flush=True)

    def safe(kernel, provider, n, v, pass_, fn, inputs_bytes, rep=100, reset=None):
        try:
            if reset is not None:  # e.g. drop .grad left by the previous provider: its buffer is not "before"
                reset()
            mem = peak_extra_gib(fn)
            timing = bench(fn, rep=rep)
        except torch.OutOfMemoryError:
            timing, mem = (math.nan,) * 3, math.nan
            print(f"{kernel} {provider} N={n} V={v} {pass_}: out of memory", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
        record(kernel, provider, n, v, pass_, timing, mem, inputs_bytes)

    if args.sweep:
        # launch settings at the target shape, forward (CE/KL/TV/alpha) and loss (CE + gradient), specdec only;
        # the first entry is the one-program-per-row kernel of the first version, for comparison on this card
        n, v = (1024, 32000) if args.quick else (16384, 151936)
        g = torch.Generator(device="cuda").manual_seed(0)
        ver = (torch.randn(n, v, device="cuda", generator=g) * 2).to(dtype)
        dra = (torch.randn(n, v, device="cuda", generator=g) * 2).to(dtype)
        grad = torch.empty_like(dra)
        floor_fwd = 2 * ver.numel() * 2
        configs = [dict(V1_SETTINGS), dict(split=0)]
        configs += [dict(split=1, spin=1, block=b, num_warps=w, chunk_tiles=t, chunk_programs_per_sm=pps)
                    for b, w in ((2048, 4), (4096, 8), (1024, 4)) for t in (2, 4, 8) for pps in (0, 2)
                    if b * t <= 16384]
        configs += [dict(split=1, spin=0, chunk_tiles=4)]
        best = None
        reference = None
        for cfg in configs:
            kdiv.set_config()
            kdiv.set_config(**cfg)
            fwd = lambda: sd.divergence(ver, dra, check_inputs=False)  # noqa: B023, E731
            loss = lambda: kdiv.launch_divergence(ver, dra, 1.0, compute_tv=False, grad_out=grad)  # noqa: B023, E731
            try:
                fwd(), loss()  # compile; the second call runs on the grid sized from the compiled kernel
                out = fwd()
                t_fwd = bench(fwd, rep=60)[0]
                t_loss = bench(loss, rep=60)[0]
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile is skipped
                print("config failed", cfg, repr(exc)[:300], flush=True)
                continue
            vals = torch.stack([out.cross_entropy, out.kl, out.tv, out.alpha])
            if reference is None:
                reference = vals
            err = float((vals - reference).abs().max())
            ok = bool(torch.isfinite(vals).all()) and err < 1e-4
            print(f"sweep {cfg}: fwd {t_fwd:.3f} ms ({100 * floor_fwd / (t_fwd * 1e-3) / 1e9 / copy_gbps:.0f}% copy) "
                  f"loss-kernel {t_loss:.3f} ms  max|diff| vs first {err:.2e} {'ok' if ok else 'WRONG'}", flush=True)
            if ok and (best is None or t_fwd + t_loss < best[0]):
                best = (t_fwd + t_loss, cfg)
        kdiv.set_config()
        if best is not None:
            kdiv.set_config(**best[1])
            print(f"best config: {best[1]} fwd+loss kernels {best[0]:.3f} ms", flush=True)
        ver = dra = grad = reference = None
        gc.collect()
        torch.cuda.empty_cache()

    cfg = dict(kdiv._CONFIG)
    versions += (f";config=split{cfg['split']}_spin{cfg['spin']}_block{cfg['block']}_w{cfg['num_warps']}"
                 f"_pass1{cfg['pass1']}_stages2{cfg['stages2']}_tiles{cfg['chunk_tiles']}"
                 f"_pps{cfg['chunk_programs_per_sm']}")

    def with_config(overrides, fn, *fn_args):
        """Run fn(*fn_args) under other launch settings (the first version's kernel: ``split=0``), then restore."""
        previous = kdiv.set_config(**overrides)
        try:
            fn(*fn_args)
        finally:
            kdiv.set_config(**previous)

    compiled_fwd = None if args.no_compile else torch.compile(eager_forward, dynamic=True)
    compiled_loss = None if args.no_compile else torch.compile(eager_loss, dynamic=True)
    liger = LigerKLDIVLoss(reduction="batchmean", log_target=True) if LigerKLDIVLoss is not None else None

    shapes = [(1024, 32000)] if args.quick else [(16384, 32000), (1024, 151936), (4096, 151936), (16384, 151936)]
    if args.shapes:
        shapes = [tuple(int(x) for x in item.split("x")) for item in args.shapes.split(",")]
    for n, v in shapes:
        g = torch.Generator(device="cuda").manual_seed(n + v)
        ver = (torch.randn(n, v, device="cuda", generator=g) * 2).to(dtype)
        dra = (torch.randn(n, v, device="cuda", generator=g) * 2).to(dtype)
        inputs_bytes = 2 * ver.numel() * ver.element_size()
        rep = 100 if n * v < 2**30 else 300
        # ---- forward: CE, KL, TV (and alpha) per token ----
        safe("divergence", "specdec", n, v, "fwd", lambda: sd.divergence(ver, dra, check_inputs=False),  # noqa: B023
             inputs_bytes, rep)
        with_config(ROW_SETTINGS, safe, "divergence", "specdec_row", n, v, "fwd",
                    lambda: sd.divergence(ver, dra, check_inputs=False), inputs_bytes, rep)  # noqa: B023
        with_config(V1_SETTINGS, safe, "divergence", "specdec_v1", n, v, "fwd",
                    lambda: sd.divergence(ver, dra, check_inputs=False), inputs_bytes, rep)  # noqa: B023
        safe("divergence", "eager", n, v, "fwd", lambda: eager_forward(ver, dra), inputs_bytes, rep)  # noqa: B023
        if compiled_fwd is not None:
            safe("divergence", "compile", n, v, "fwd", lambda: compiled_fwd(ver, dra), inputs_bytes, rep)  # noqa: B023
        if liger is not None:
            def liger_fwd():
                return liger(torch.log_softmax(dra.float(), -1), torch.log_softmax(ver.float(), -1))  # noqa: B023

            safe("divergence", "liger", n, v, "fwd", liger_fwd, inputs_bytes, rep)
        # ---- forward + backward of the mean cross-entropy w.r.t. the drafter logits ----
        d_req = dra.clone().requires_grad_()

        def run_specdec():
            d_req.grad = None  # noqa: B023
            sd.divergence_loss(d_req, ver, reduction="mean", check_inputs=False).backward()  # noqa: B023

        def run_specdec_checked():
            d_req.grad = None  # noqa: B023
            sd.divergence_loss(d_req, ver, reduction="mean").backward()  # noqa: B023

        def run_eager():
            d_req.grad = None  # noqa: B023
            eager_loss(d_req, ver).backward()  # noqa: B023

        def run_compiled():
            d_req.grad = None  # noqa: B023
            compiled_loss(d_req, ver).backward()  # noqa: B023

        def run_liger():
            d_req.grad = None  # noqa: B023
            liger(torch.log_softmax(d_req.float(), -1), torch.log_softmax(ver.float(), -1)).backward()  # noqa: B023

        def drop_grad():
            d_req.grad = None  # noqa: B023

        safe("ce_loss", "specdec", n, v, "fwd+bwd", run_specdec, inputs_bytes, rep, drop_grad)
        safe("ce_loss", "specdec_checked", n, v, "fwd+bwd", run_specdec_checked, inputs_bytes, rep, drop_grad)
        with_config(ROW_SETTINGS, safe, "ce_loss", "specdec_row", n, v, "fwd+bwd", run_specdec, inputs_bytes,
                    rep, drop_grad)
        with_config(V1_SETTINGS, safe, "ce_loss", "specdec_v1", n, v, "fwd+bwd", run_specdec, inputs_bytes, rep,
                    drop_grad)
        safe("ce_loss", "eager", n, v, "fwd+bwd", run_eager, inputs_bytes, rep, drop_grad)
        if compiled_loss is not None:
            safe("ce_loss", "compile", n, v, "fwd+bwd", run_compiled, inputs_bytes, rep, drop_grad)
        if liger is not None:
            safe("ce_loss", "liger", n, v, "fwd+bwd", run_liger, inputs_bytes, rep, drop_grad)
        ver = dra = d_req = None
        gc.collect()
        torch.cuda.empty_cache()

    # ---- fused linear: LM head + loss, forward + backward ----
    if not args.no_fused:
        n, v, h = (1024, 32000, 256) if args.quick else (16384, 151936, 896)
        run_fused_linear(n, v, h, dtype, safe, liger)
    write_summary(rows, out_path, copy_gbps)


def run_fused_linear(n, v, h, dtype, safe, liger) -> None:
    g = torch.Generator(device="cuda").manual_seed(7)
    hidden = (torch.randn(n, h, device="cuda", generator=g)).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=g) / math.sqrt(h)).to(dtype).requires_grad_()
    ver = (torch.randn(n, v, device="cuda", generator=g) * 2).to(dtype)

    def fused():
        hidden.grad = weight.grad = None
        sd.fused_linear_divergence_loss(hidden, weight, ver, reduction="mean", check_inputs=False).backward()

    def eager_fused():
        hidden.grad = weight.grad = None
        eager_loss(hidden @ weight.t(), ver).backward()

    inputs_bytes = ver.numel() * 2
    def drop_grads():
        hidden.grad = weight.grad = None

    safe("fused_linear", "specdec", n, v, "fwd+bwd", fused, inputs_bytes, 300, drop_grads)
    safe("fused_linear", "eager", n, v, "fwd+bwd", eager_fused, inputs_bytes, 300, drop_grads)
    if liger is not None:
        def liger_fused():
            hidden.grad = weight.grad = None
            logits = hidden @ weight.t()
            liger(torch.log_softmax(logits.float(), -1), torch.log_softmax(ver.float(), -1)).backward()

        safe("fused_linear", "liger", n, v, "fwd+bwd", liger_fused, inputs_bytes, 300, drop_grads)


def write_summary(rows: list[dict], out_path: str, copy_gbps: float) -> None:
    with open(out_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    # ---- summary table: ratios against specdec ----
    print(f"\nwrote {out_path}; copy {copy_gbps:.0f} GB/s; {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'kernel':13s} {'N':>6s} {'V':>6s} {'pass':8s} {'specdec ms':>10s} {'%copy':>6s} "
          f"{'x eager':>8s} {'x compile':>9s} {'x liger':>8s} {'x v1':>6s} {'mem/eager':>9s} {'mem/liger':>9s}")
    keyed = {(r["kernel"], r["provider"], r["N"], r["V"]): r for r in rows}
    for r in rows:
        if r["provider"] != "specdec":
            continue
        key = (r["kernel"], r["N"], r["V"])

        def other(p, field, key=key):
            o = keyed.get((key[0], p, key[1], key[2]))
            return o[field] if o else math.nan

        ratio = lambda p, r=r: other(p, "median_ms") / r["median_ms"]  # noqa: E731
        mem = lambda p, r=r: r["peak_mem_gib"] / other(p, "peak_mem_gib")  # noqa: E731
        pct = 100 * r["gbps"] / copy_gbps
        print(f"{r['kernel']:13s} {r['N']:6d} {r['V']:6d} {r['pass']:8s} {r['median_ms']:10.3f} {pct:6.1f} "
              f"{ratio('eager'):8.1f} {ratio('compile'):9.1f} {ratio('liger'):8.1f} {ratio('specdec_v1'):6.2f} "
              f"{mem('eager'):9.3f} "
              f"{mem('liger'):9.3f}")


if __name__ == "__main__":
    main()
