#!/usr/bin/env bash
# The native decode runner on a GPU, one mode at a time (each under 4 minutes on an H200 unless said). Logs in $OUT.
#   bash benchmarks/tools/native_gpu.sh check   # native vs HF logits (tools/native_logits_check.py), then the step
#                                               # benchmark at batch 1 and 8 (llama-1b, 24x1024, 12x768)
#   bash benchmarks/tools/native_gpu.sh tests   # GPU tests: the native runner, its kernels and the decoding path
#   bash benchmarks/tools/native_gpu.sh sweep   # kernel profile of a llama-1b step and the plan variants
#                                               # (tools/native_step_sweep.py)
#   bash benchmarks/tools/native_gpu.sh bench   # the step benchmark at every shape and batch 1, 8, 32 (about 8 min)
# Rows of the step benchmark go to $OUT/generate_step.csv (copy them into benchmarks/results/ from a real GPU run).
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/native_gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.txt" 2>&1 || { cat "$OUT/pip.txt"; exit 1; }
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"
t0=$(date +%s)
case "${1:-check}" in
  check)
    timeout "${CHECK_SECONDS:-80}" python3 benchmarks/tools/native_logits_check.py > "$OUT/check.txt" 2>&1
    echo "check rc=$? in $(( $(date +%s) - t0 )) s"; grep -v "^ " "$OUT/check.txt" | tail -50
    for batch in 1 8; do
      timeout "${BENCH_SECONDS:-70}" python3 benchmarks/bench_generate.py --step --batches $batch \
        --step-models llama-1b,24x1024,12x768 --step-out "$OUT/generate_step.csv" >> "$OUT/bench.txt" 2>&1
      echo "bench batch $batch rc=$? in $(( $(date +%s) - t0 )) s"
    done
    grep "^{" "$OUT/bench.txt"; tail -3 "$OUT/bench.txt" ;;
  tests)
    timeout "${SECONDS_LIMIT:-230}" python3 -m pytest -q -p no:cacheprovider -W ignore::RuntimeWarning -rs \
      tests/native tests/kernels/test_rms_norm.py tests/kernels/test_gemv.py tests/kernels/test_rotary_cache_write.py \
      tests/kernels/test_decode_attention.py tests/decoding > "$OUT/tests.txt" 2>&1
    echo "pytest rc=$? in $(( $(date +%s) - t0 )) s"; tail -15 "$OUT/tests.txt" ;;
  sweep)
    timeout "${SECONDS_LIMIT:-230}" python3 benchmarks/tools/native_step_sweep.py > "$OUT/sweep.txt" 2>&1
    echo "sweep rc=$? in $(( $(date +%s) - t0 )) s"; grep -v -i warn "$OUT/sweep.txt" ;;
  bench)
    timeout "${SECONDS_LIMIT:-560}" python3 benchmarks/bench_generate.py --step --batches 1,8,32 \
      --step-out "$OUT/generate_step.csv" > "$OUT/bench.txt" 2>&1
    echo "bench rc=$? in $(( $(date +%s) - t0 )) s"; grep "^{" "$OUT/bench.txt"; tail -3 "$OUT/bench.txt" ;;
esac
