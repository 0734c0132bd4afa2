#!/usr/bin/env bash
# GPU validation in device calls of at most 10 minutes each. Writes logs under $OUT (default benchmarks/results).
#   bash benchmarks/run_gpu_validation.sh tests-rejection   # tests/test_rejection_triton.py (~7 min on an H200)
#   bash benchmarks/run_gpu_validation.sh tests-rest        # every other test module (~3 min)
#   bash benchmarks/run_gpu_validation.sh bench             # rejection benchmark at the README's shapes (~3 min)
#   bash benchmarks/run_gpu_validation.sh bench-divergence  # divergence benchmark, README shapes (~2 min on an H200)
# Optional, git-ignored inputs (the GPU machine is offline): .whl/*.whl (liger-kernel, pytest and their
# dependencies, from `pip download --no-deps`), .fi/ (FlashInfer's source tree, built by
# benchmarks/setup_flashinfer_tree.sh); without them the FlashInfer / Liger providers are skipped and noted in the CSV.
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
MODE=${1:-tests-rest}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
[ -d .fi ] && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/.fi FLASHINFER_CUDA_ARCH_LIST=9.0a
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.txt" 2>&1 || { cat "$OUT/pip.txt"; exit 1; }
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"
t0=$(date +%s)
case "$MODE" in
  tests-rejection)
    timeout "${SECONDS_LIMIT:-560}" python3 -m pytest -q -p no:cacheprovider -W ignore::RuntimeWarning -rs \
      tests/test_rejection_triton.py > "$OUT/gpu_tests_rejection.txt" 2>&1
    echo "pytest rc=$? in $(( $(date +%s) - t0 )) s"; tail -4 "$OUT/gpu_tests_rejection.txt" ;;
  tests-rest)
    timeout "${SECONDS_LIMIT:-560}" python3 -m pytest -q -p no:cacheprovider -W ignore::RuntimeWarning -rs tests \
      --ignore tests/test_rejection_triton.py > "$OUT/gpu_tests_rest.txt" 2>&1
    echo "pytest rc=$? in $(( $(date +%s) - t0 )) s"; tail -4 "$OUT/gpu_tests_rest.txt" ;;
  bench)
    timeout "${SECONDS_LIMIT:-560}" python3 benchmarks/bench_rejection.py --out "$OUT" --tag "${TAG:-_validation}" \
      --dtypes bf16 --providers specdec,torch_eager,torch_compile,flashinfer,flashinfer_kernel \
      --shapes 151936:1:4,151936:8:4,151936:32:4,151936:128:8,128256:128:8,32000:1:4,32000:32:8,32000:128:1 \
      > "$OUT/rejection_bench_log${TAG:-_validation}.txt" 2>&1
    echo "bench rc=$? in $(( $(date +%s) - t0 )) s"; tail -12 "$OUT/rejection_bench_log${TAG:-_validation}.txt" ;;
  bench-divergence)
    timeout "${SECONDS_LIMIT:-560}" python3 benchmarks/bench_divergence.py \
      --out "$OUT/divergence_$(python3 -c 'import torch; print(torch.cuda.get_device_name().replace(" ", "_"))')${TAG:-_validation}.csv" \
      > "$OUT/divergence_bench_log${TAG:-_validation}.txt" 2>&1
    echo "bench rc=$? in $(( $(date +%s) - t0 )) s"; tail -11 "$OUT/divergence_bench_log${TAG:-_validation}.txt" ;;
  *) echo "unknown mode $MODE (tests-rejection, tests-rest, bench, bench-divergence)"; exit 2 ;;
esac
grep -hE "^FAILED|^ERROR" "$OUT"/gpu_tests_*.txt 2>/dev/null | head -20
