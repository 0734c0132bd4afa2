"""Shared benchmark helpers: CUDA-graph timing over rotated inputs, copy bandwidth, versions, the result CSVs."""

from __future__ import annotations

import csv
import datetime
import os
import statistics
import subprocess
from collections.abc import Callable, Iterable

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# columns every result row starts with; each op adds its shape columns, then ``provider`` and its timings
ENV_FIELDS = ["date", "gpu", "torch", "triton", "provider_version", "dtype"]


def measure_copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written (median of ``repeats``)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    return 2 * nbytes / statistics.median(times) / 1e9


def capture_graph(fns: list[Callable[[], object]], target_ms: float = 2.0) -> tuple[torch.cuda.CUDAGraph, int]:
    """One CUDA graph of several passes over ``fns`` (one callable per rotated input set), lasting about
    ``target_ms``; returns it and the calls it makes. Under a graph the host's launch overhead is excluded, and the
    rotation reads more memory than the L2 cache holds."""
    for fn in fns:  # warm-up: compilation, autotuning, allocator growth
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for fn in fns:
        fn()
    end.record()
    end.synchronize()
    per_call_ms = max(start.elapsed_time(end) / len(fns), 1e-3)
    passes = max(1, min(50, int(target_ms / (per_call_ms * len(fns)))))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for fn in fns:  # warm-up on the side stream before capture
            fn()
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(passes):
                for fn in fns:
                    fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    return graph, passes * len(fns)


def time_graph(fns: list[Callable[[], object]], replays: int = 15) -> tuple[float, float, float]:
    """(median, p20, p80) microseconds per call of ``fns``: CUDA-event times of ``replays`` replays of
    :func:`capture_graph`'s graph, divided by the calls per replay."""
    graph, calls = capture_graph(fns)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return quantiles(samples)


def time_do_bench(fns: list[Callable[[], object]], *, warmup: int = 25, rep: int = 100,
                  unit: str = "us") -> tuple[float, float, float]:
    """(median, p20, p80) per call of ``fns`` (taken in rotation) by ``triton.testing.do_bench``, host launch
    overhead included, in ``unit`` ("us" or "ms"), after one warm-up call of each; for providers that cannot be
    captured in a CUDA graph, and for the divergence benchmark (``warmup`` and ``rep``: do_bench's, ms)."""
    import triton

    scale = {"us": 1e3, "ms": 1.0}[unit]
    for fn in fns:  # compilation and allocator growth before do_bench sizes its repetitions
        fn()
    torch.cuda.synchronize()
    state = {"i": 0}

    def call():
        fns[state["i"] % len(fns)]()
        state["i"] += 1

    med, p20, p80 = triton.testing.do_bench(call, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])
    return med * scale, p20 * scale, p80 * scale


def quantiles(samples: Iterable[float]) -> tuple[float, float, float]:
    """(median, p20, p80) of ``samples`` (at least two), linearly interpolated between the sorted values."""
    deciles = statistics.quantiles(samples, n=10, method="inclusive")
    return deciles[4], deciles[1], deciles[7]


def l2_cache_bytes(device: int = 0) -> int:
    """L2 cache size of a CUDA device in bytes (50 MiB where torch does not report it)."""
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)


def specdec_version() -> str:
    """``specdec``'s version with the source's commit (``0.1.0+g1234abc``): the checkout's, or ``$SPECDEC_COMMIT``
    for a tree without ``.git`` (a ``git archive`` copied to a GPU machine); the bare version when neither is known."""
    import specdec

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=os.path.dirname(RESULTS),
                                capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    commit = commit or os.environ.get("SPECDEC_COMMIT", "").strip()
    return f"{specdec.__version__}+g{commit}" if commit else specdec.__version__


def environment() -> dict[str, str]:
    """Date, GPU name and library versions for the result rows."""
    import triton

    return {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__}


def upsert_rows(path: str, rows: list[dict], key: list[str], fields: list[str] | None = None) -> None:
    """Write ``rows`` into the CSV at ``path``, replacing the rows they supersede: those with the same values in the
    ``key`` columns (GPU, dtype, shape, provider). Columns: ``fields``, then any others of the file or the rows."""
    old: list[dict] = []
    fields = list(fields or [])
    if os.path.exists(path) and os.path.getsize(path) > 0:
        with open(path, newline="") as handle:
            reader = csv.DictReader(handle)
            fields += [name for name in reader.fieldnames or [] if name not in fields]
            old = list(reader)
    for row in rows:
        fields += [name for name in row if name not in fields]
    new_keys = {tuple(str(row.get(name, "")) for name in key) for row in rows}
    kept = [row for row in old if tuple(str(row.get(name, "")) for name in key) not in new_keys]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(kept + rows)
