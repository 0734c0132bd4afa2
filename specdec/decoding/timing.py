"""CUDA-graph capture and device timing of decoding steps, shared by the static path, the n-gram drafter's cost and
the benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

__all__ = ["capture_graph", "median_seconds"]


def capture_graph(fn: Callable[[], None], device: torch.device, pool: tuple | None = None) -> Callable[[], None]:
    """``fn`` captured as one CUDA graph (run once on a side stream first, so Triton kernels compile and lazily built
    tensors exist before capture); returns the graph's replay. ``pool``: a graph memory pool to share."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph.replay


def median_seconds(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after one warm-up: CUDA events on a CUDA device, the host clock
    elsewhere."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return sorted(times)[len(times) // 2]
