"""The microbenchmarks under pytest-benchmark: ``pytest benchmarks/ --benchmark-only`` (CUDA GPU).

The shapes are those of the README's tables. Each test times one (shape, provider) with ``benchmark.pedantic``, in
rounds that are each synchronised with the device, and writes the same rows as the scripts into
``results/rejection.csv`` and ``results/divergence.csv`` (``timing`` column ``pytest_benchmark``), replacing those of
the same GPU, dtype, shape and provider:

* rejection sampling: a round replays one CUDA graph of calls over rotated input sets (``common.capture_graph``,
  about 2 ms of work) and ends with ``torch.cuda.synchronize()``; the time per call is the round's over its calls;
* divergence: a round is one call and ``torch.cuda.synchronize()``.

Without a CUDA device every test is skipped.
"""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_divergence as bd  # noqa: E402
import bench_rejection as br  # noqa: E402
from common import capture_graph, environment, l2_cache_bytes, measure_copy_bandwidth, quantiles, upsert_rows  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="the microbenchmarks time Triton kernels on a CUDA GPU; none found")

# (dtype, V, B, K): the README's rejection-sampling table
REJECTION_SHAPES = [("bf16", 151936, 1, 4), ("bf16", 151936, 8, 4), ("bf16", 151936, 32, 4),
                    ("bf16", 151936, 128, 8), ("bf16", 128256, 128, 8), ("bf16", 32000, 1, 4),
                    ("bf16", 32000, 32, 8), ("bf16", 32000, 128, 1), ("fp32", 151936, 32, 8),
                    ("fp32", 151936, 128, 1), ("fp32", 32000, 8, 8), ("fp32", 32000, 32, 1),
                    ("fp32", 32000, 128, 1), ("fp32", 32000, 128, 8)]
# (op, N, V): the README's divergence table
DIVERGENCE_SHAPES = [("forward", 16384, 151936), ("forward", 4096, 151936), ("loss", 16384, 151936),
                     ("loss", 4096, 151936), ("loss", 1024, 151936), ("loss", 16384, 32000)]
ROUNDS = 15


@pytest.fixture(scope="module")
def bench_facts():
    """Environment, copy rate, L2 size and the rows written when the module ends."""
    facts = dict(env=environment(), copy_gbps=measure_copy_bandwidth(), l2_bytes=l2_cache_bytes(),
                 rejection=[], divergence=[])
    yield facts
    if facts["rejection"]:
        upsert_rows(br.CSV, facts["rejection"], br.KEY, br.FIELDS)
    if facts["divergence"]:
        upsert_rows(bd.CSV, facts["divergence"], bd.KEY, bd.FIELDS)


@functools.lru_cache(maxsize=1)
def _rejection_shape(batch: int, num_drafts: int, vocab: int, dtype: str, l2_bytes: int) -> br.Shape:
    return br.Shape(batch, num_drafts, vocab, dtype, l2_bytes)


@functools.lru_cache(maxsize=1)
def _flashinfer():
    return br.setup_flashinfer()


@functools.lru_cache(maxsize=1)
def _compiled_reference():
    return br.compiled_reference()


def _rounds_us(benchmark, calls: int) -> tuple[float, float, float] | None:
    """(median, p20, p80) microseconds per call from the rounds pytest-benchmark timed (None when disabled)."""
    if benchmark.stats is None:
        return None
    return quantiles(t * 1e6 / calls for t in benchmark.stats.stats.data)


@pytest.mark.parametrize("provider", br.PROVIDERS)
@pytest.mark.parametrize("dtype,vocab,batch,num_drafts", REJECTION_SHAPES)
def test_rejection_sampling(benchmark, bench_facts, dtype, vocab, batch, num_drafts, provider):
    flashinfer, fi_version = _flashinfer() if provider.startswith("flashinfer") else (None, "")
    if provider.startswith("flashinfer") and flashinfer is None:
        pytest.skip(f"FlashInfer {fi_version}")
    shape = _rejection_shape(batch, num_drafts, vocab, dtype, bench_facts["l2_bytes"])
    compiled = _compiled_reference() if provider == "torch_compile" else None
    graph, calls = capture_graph(shape.fns(provider, flashinfer, compiled))

    def replay():
        graph.replay()
        torch.cuda.synchronize()

    benchmark.pedantic(replay, rounds=ROUNDS, warmup_rounds=2, iterations=1)
    if provider.startswith("specdec"):  # the timed calls give the reference's tokens (also under --benchmark-disable)
        assert shape.specdec_result(br.VERIFICATION.get(provider, "token"))[1], \
            "specdec's tokens differ from the reference's"
    timing = _rounds_us(benchmark, calls)
    if timing is None:  # --benchmark-disable
        return
    version = br.provider_versions(fi_version)[provider]
    row = shape.row(provider, version, timing, "pytest_benchmark", bench_facts["env"], bench_facts["copy_gbps"])
    bench_facts["rejection"].append(row)


@functools.lru_cache(maxsize=1)
def _divergence_cases(n: int, vocab: int):
    liger, _ = _liger()
    return bd.cases(n, vocab, liger, _compiled_divergence()[0], _compiled_divergence()[1])


@functools.lru_cache(maxsize=1)
def _liger():
    return bd.liger_loss()


@functools.lru_cache(maxsize=1)
def _compiled_divergence():
    return torch.compile(bd.eager_forward, dynamic=True), torch.compile(bd.eager_loss, dynamic=True)


@pytest.mark.parametrize("op,n,vocab,provider", [(op, n, vocab, provider) for op, n, vocab in DIVERGENCE_SHAPES
                                                  for provider in bd.OP_PROVIDERS[op]])
def test_divergence(benchmark, bench_facts, op, n, vocab, provider):
    calls, drop_grads = _divergence_cases(n, vocab)
    found = [fn for case_op, case_provider, fn in calls if (case_op, case_provider) == (op, provider)]
    if not found:
        why = {"liger": "liger-kernel absent", "specdec_row": "the automatic plan is the row kernel here"}
        pytest.skip(f"no {provider} {op}: {why.get(provider, 'not built')}")
    fn = found[0]
    drop_grads()
    mem = bd.peak_extra_gib(fn)

    def call():
        fn()
        torch.cuda.synchronize()

    benchmark.pedantic(call, rounds=ROUNDS, warmup_rounds=2, iterations=1)
    timing = _rounds_us(benchmark, 1)
    if timing is not None:
        versions = bd.provider_versions(_liger()[1])
        bench_facts["divergence"].append(bd.row(bench_facts["env"], versions, op, provider, n, vocab, None,
                                                  tuple(t / 1e3 for t in timing), "pytest_benchmark", mem,
                                                  bench_facts["copy_gbps"]))
