"""Shared GPU benchmark helpers: CUDA-graph timing over rotated inputs, copy bandwidth, environment facts."""

from __future__ import annotations

import csv
import statistics
from collections.abc import Callable

import torch


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


def time_graph(fns: list[Callable[[], object]], replays: int = 15,
               target_ms: float = 2.0) -> tuple[float, float, float]:
    """(median, p20, p80) microseconds per call of ``fns`` (one callable per rotated input set).

    The calls are captured in one CUDA graph (several passes over the rotation so a replay lasts ~``target_ms``),
    so launch overhead on the host is excluded and inputs rotate through more memory than the L2 cache holds.
    Each replay is timed with CUDA events; the quantiles are over replays, divided by the calls per replay.
    """
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
    calls = passes * len(fns)
    samples = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    samples.sort()
    return _quantile(samples, 0.5), _quantile(samples, 0.2), _quantile(samples, 0.8)


def time_do_bench(fns: list[Callable[[], object]]) -> tuple[float, float, float]:
    """Fallback when a provider cannot be captured: ``triton.testing.do_bench`` (host launch overhead included)."""
    import triton

    state = {"i": 0}

    def call():
        fns[state["i"] % len(fns)]()
        state["i"] += 1

    med, p20, p80 = triton.testing.do_bench(call, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])
    return med * 1e3, p20 * 1e3, p80 * 1e3


def _quantile(sorted_values: list[float], q: float) -> float:
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def environment() -> dict[str, str]:
    """GPU name and library versions for the result rows."""
    import triton

    try:
        import flashinfer

        fi_version = flashinfer.__version__
    except Exception as exc:  # reported in the rows, not raised
        fi_version = f"unavailable ({type(exc).__name__})"
    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "flashinfer": fi_version,
    }


def write_csv(path: str, rows: list[dict]) -> None:
    """Result rows (dicts with the same keys, in order) as a CSV file with a header."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
