"""Probe: is the divergence loss kernel bound by its memory traffic or by its arithmetic? (issue 4, GPU only)

Times, in one process on one card, at N x V bf16 (default 16384 x 151936):

* ``copy``: a device-to-device copy of one [N, V] bf16 tensor (the bandwidth yardstick);
* ``traffic``: kernels with the loss kernel's access pattern but almost no arithmetic: pass 1 reads both rows,
  pass 2 re-reads them (in reverse or forward tile order) and writes an [N, V] result; one program per row
  (occupancy-limited, like the real kernel) or a persistent grid of ``programs_per_sm`` per SM, with or without
  ``tl.range(num_stages=...)`` pipelining;
* ``loss_kernel`` / ``forward_kernel``: the real kernel (``launch_divergence``) for comparison;
* the public ``divergence_loss`` forward (+ backward) with and without ``check_inputs`` (its status sync).

Usage: ``python benchmarks/probe_divergence_traffic.py [--n 16384] [--v 151936] [--out DIR]``; writes
``divergence_traffic_probe_<gpu>.csv``.
"""

from __future__ import annotations

import argparse
import csv
import os

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

import specdec.divergences as sd
from specdec.kernels import divergence as kdiv


@triton.jit
def _traffic_kernel(v_ptr, d_ptr, g_ptr, out_ptr, n_rows, vocab, num_programs,
                    REVERSE: tl.constexpr, WRITE: tl.constexpr, SECOND_PASS: tl.constexpr,
                    BLOCK: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    n_tiles = tl.cdiv(vocab, BLOCK)
    for row in range(pid, n_rows, num_programs):
        row64 = tl.cast(row, tl.int64)
        v_row = v_ptr + row64 * vocab
        d_row = d_ptr + row64 * vocab
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for t in tl.range(0, n_tiles, num_stages=STAGES):
            cols = t * BLOCK + offs
            inb = cols < vocab
            x = tl.load(v_row + cols, mask=inb, other=0.0).to(tl.float32)
            y = tl.load(d_row + cols, mask=inb, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, x + y)
        total = tl.max(acc, 0)
        if SECOND_PASS:
            for i in tl.range(0, n_tiles, num_stages=STAGES):
                if REVERSE:
                    cols = (n_tiles - 1 - i) * BLOCK + offs
                else:
                    cols = i * BLOCK + offs
                inb = cols < vocab
                x = tl.load(v_row + cols, mask=inb, other=0.0, eviction_policy="evict_first").to(tl.float32)
                y = tl.load(d_row + cols, mask=inb, other=0.0, eviction_policy="evict_first").to(tl.float32)
                if WRITE:
                    tl.store(g_ptr + row64 * vocab + cols, (y - x + total).to(g_ptr.dtype.element_ty), mask=inb)
                else:
                    acc = tl.maximum(acc, x - y)
            total = tl.max(acc, 0)
        tl.store(out_ptr + row64, total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--v", type=int, default=151936)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--no-traffic", action="store_true", help="skip the traffic-only kernels")
    parser.add_argument("--sweep-kernel", action="store_true",
                        help="time the real kernel over pass-1 variant x tile x grid x pipelining stages")
    parser.add_argument("--configs", default="0:512:1:3:1,2:512:1:3:1",
                        help="settings for --sweep-kernel: "
                             "pass1:block:num_warps:stages2:stages1,...")
    parser.add_argument("--no-api", action="store_true", help="skip the public divergence_loss timings")
    args = parser.parse_args()
    n, v = args.n, args.v
    gpu = torch.cuda.get_device_name()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(0)
    ver = (torch.randn(n, v, device="cuda", generator=g) * 3).to(torch.bfloat16)
    dra = (torch.randn(n, v, device="cuda", generator=g) * 3).to(torch.bfloat16)
    grad = torch.empty_like(dra)
    out = torch.empty(n, dtype=torch.float32, device="cuda")
    unit_gb = n * v * 2 / 1e9
    rows = []

    def record(name: str, fn, units: float, note: str = "") -> None:
        fn()
        torch.cuda.synchronize()
        med, p20, p80 = do_bench(fn, warmup=5, rep=60, quantiles=[0.5, 0.2, 0.8])
        gbps = units * unit_gb / (med * 1e-3)
        rows.append(dict(probe=name, N=n, V=v, dtype="bf16", median_ms=round(med, 4), p20_ms=round(p20, 4),
                         p80_ms=round(p80, 4), traffic_units=units, gbps_if_traffic=round(gbps, 1), note=note,
                         gpu=gpu, torch=torch.__version__, triton=triton.__version__))
        print(f"{name:58s} {med:8.3f} ms  ({units} units -> {gbps:7.1f} GB/s) {note}", flush=True)

    record("copy", lambda: grad.copy_(dra), 2)
    for block, warps in (() if args.no_traffic else ((2048, 4), (4096, 8))):
        for second, write, reverse in ((False, False, False), (True, False, True), (True, False, False),
                                       (True, True, True), (True, True, False)):
            units = 2 + (2 if second else 0) + (1 if write else 0)
            for grid_name, programs in (("row", n), ("1/SM", sms), ("2/SM", 2 * sms)):
                for stages in (1, 3):
                    if grid_name == "row" and stages == 3:
                        continue
                    name = (f"traffic p2={'rev' if reverse else 'fwd'}{'+write' if write else ''} "
                            if second else "traffic pass1 only ")
                    name += f"b{block}w{warps} {grid_name} st{stages}"

                    def fn(programs=programs, second=second, write=write, reverse=reverse, stages=stages,
                           block=block, warps=warps):
                        _traffic_kernel[(programs,)](ver, dra, grad, out, n, v, programs, REVERSE=reverse,
                                                     WRITE=write, SECOND_PASS=second, BLOCK=block, STAGES=stages,
                                                     num_warps=warps)
                    try:
                        record(name, fn, units)
                    except Exception as exc:  # noqa: BLE001 - a probe setting that does not compile is noted
                        print(f"{name}: failed {type(exc).__name__}: {exc}"[:300], flush=True)
    if args.sweep_kernel:
        ce_ref = kdiv.launch_divergence(ver, dra, 1.0, compute_tv=False, grad_out=grad)[0].clone()
        grad_ref = grad.clone()
        fwd_ref = kdiv.launch_divergence(ver, dra, 1.0)
        for item in args.configs.split(","):
            fields = [int(part) for part in item.split(":")]
            names = ("pass1", "block", "num_warps", "stages2", "stages1")
            cfg = dict(zip(names, fields, strict=False))
            previous = kdiv.set_config(**cfg)
            try:
                ce = kdiv.launch_divergence(ver, dra, 1.0, compute_tv=False, grad_out=grad)[0]
                loss_err = max(float((ce - ce_ref).abs().max()),
                               float((grad.float() - grad_ref.float()).abs().max()))
                fwd = kdiv.launch_divergence(ver, dra, 1.0)
                fwd_err = max(float((a - b).abs().max()) for a, b in zip(fwd[:4], fwd_ref[:4], strict=True))
                tag = " ".join(f"{k}={val}" for k, val in cfg.items())
                record(f"loss_kernel {tag}", lambda: kdiv.launch_divergence(
                    ver, dra, 1.0, compute_tv=False, grad_out=grad), 5, f"max|diff| {loss_err:.2e}")
                record(f"fwd_kernel {tag}", lambda: kdiv.launch_divergence(ver, dra, 1.0), 4,
                       f"max|diff| {fwd_err:.2e}")
            except Exception as exc:  # noqa: BLE001 - a setting that does not compile is noted
                print(f"{cfg}: failed {type(exc).__name__}: {exc}"[:300], flush=True)
            finally:
                kdiv.set_config(**previous)
        grad_ref = ce_ref = fwd_ref = None
    if args.no_api:
        return write_rows(rows, args.out, gpu, n)
    record("loss_kernel (launch_divergence, grad)",
           lambda: kdiv.launch_divergence(ver, dra, 1.0, compute_tv=False, grad_out=grad), 5)
    record("forward_kernel (launch_divergence, TV)", lambda: kdiv.launch_divergence(ver, dra, 1.0), 4)
    d_req = dra.clone().requires_grad_()
    for check in (False, True):
        def fwd(check=check):
            d_req.grad = None
            sd.divergence_loss(d_req, ver, reduction="mean", check_inputs=check)

        def fwd_bwd(check=check):
            d_req.grad = None
            sd.divergence_loss(d_req, ver, reduction="mean", check_inputs=check).backward()
        record(f"divergence_loss fwd check_inputs={check}", fwd, 5)
        record(f"divergence_loss fwd+bwd check_inputs={check}", fwd_bwd, 5)
    write_rows(rows, args.out, gpu, n)


def write_rows(rows: list[dict], out: str, gpu: str, n: int) -> None:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"divergence_traffic_probe_{gpu.replace(' ', '_')}_N{n}.csv")
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print("wrote", path)


if __name__ == "__main__":
    main()
