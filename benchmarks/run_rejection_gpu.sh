#!/usr/bin/env bash
# One device call: install, GPU correctness (full matrix + statistics), then the benchmark. Writes under $OUT.
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
BENCH_SECONDS=${BENCH_SECONDS:-300}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv > "$OUT/nvsmi.txt" 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.txt" 2>&1 || { cat "$OUT/pip.txt"; exit 1; }
export PYTHONPATH="$PWD/.fi:${PYTHONPATH:-}" FLASHINFER_CUDA_ARCH_LIST=9.0a
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
t0=$(date +%s)
timeout "${TEST_SECONDS:-240}" python3 -m pytest tests/test_rejection_triton.py -q -p no:cacheprovider -W ignore::RuntimeWarning \
  -k "${TEST_FILTER:-}" > "$OUT/rejection_gpu_tests.txt" 2>&1
echo "pytest rc=$? in $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|error" "$OUT/rejection_gpu_tests.txt" | tail -3
grep -E "^FAILED|^ERROR" "$OUT/rejection_gpu_tests.txt" | head -20
timeout $((BENCH_SECONDS + 120)) python3 benchmarks/bench_rejection.py --out "$OUT" --max-seconds "$BENCH_SECONDS" \
  ${BENCH_ARGS:-} > "$OUT/bench_log.txt" 2>&1
echo "bench rc=$?"; grep -E "^#" "$OUT/bench_log.txt" | head -5; sed -n '/^# .*median us/,$p' "$OUT/bench_log.txt"
tail -3 "$OUT/bench_log.txt"
