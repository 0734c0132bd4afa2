#!/usr/bin/env bash
# One device call: install, GPU correctness (full matrix + statistics), then the benchmark. Writes under $OUT.
# TAG (e.g. _v3) suffixes the CSV and log names; BENCH_ARGS restricts the benchmark (see bench_rejection.py --help).
# v3 call: TAG=_v3 BENCH_SECONDS=200 BENCH_ARGS="--dtypes bf16 --providers specdec,specdec_seq,torch_eager,\
#   torch_compile,flashinfer,flashinfer_kernel --shapes 151936:1:4,151936:8:4,151936:32:4,151936:128:8,\
#   128256:128:8,32000:1:1,32000:8:1,...,32000:128:8" bash benchmarks/run_rejection_gpu.sh
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
BENCH_SECONDS=${BENCH_SECONDS:-300}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv > "$OUT/nvsmi.txt" 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.txt" 2>&1 || { cat "$OUT/pip.txt"; exit 1; }
export PYTHONPATH="$PWD/.fi:${PYTHONPATH:-}" FLASHINFER_CUDA_ARCH_LIST=9.0a
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
t0=$(date +%s)
timeout "${TEST_SECONDS:-240}" python3 -m pytest tests/test_rejection_triton.py -q -p no:cacheprovider -W ignore::RuntimeWarning \
  -k "${TEST_FILTER:-}" > "$OUT/rejection_gpu_tests${TAG:-}.txt" 2>&1
echo "pytest rc=$? in $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|error" "$OUT/rejection_gpu_tests${TAG:-}.txt" | tail -3
grep -E "^FAILED|^ERROR" "$OUT/rejection_gpu_tests${TAG:-}.txt" | head -20
timeout $((BENCH_SECONDS + 120)) python3 benchmarks/bench_rejection.py --out "$OUT" --max-seconds "$BENCH_SECONDS" \
  --tag "${TAG:-}" ${BENCH_ARGS:-} > "$OUT/rejection_bench_log${TAG:-}.txt" 2>&1
echo "bench rc=$?"; grep -E "^#" "$OUT/rejection_bench_log${TAG:-}.txt" | head -5; sed -n '/^# .*median us/,$p' "$OUT/rejection_bench_log${TAG:-}.txt"
tail -3 "$OUT/rejection_bench_log${TAG:-}.txt"
