#!/usr/bin/env bash
# GPU validation of the kernels, each mode under 10 minutes on an H100 or H200. Logs go to $OUT (default /tmp/gpu_validation).
#   bash benchmarks/tools/run_gpu_validation.sh tests-rejection   # tests/kernels/test_rejection_{triton,plan_rules,staged}.py
#   bash benchmarks/tools/run_gpu_validation.sh tests-kernels     # the divergence, RNG, reference and statistics tests
#   bash benchmarks/tools/run_gpu_validation.sh tests-rest        # every other test module
#   bash benchmarks/tools/run_gpu_validation.sh bench             # rejection benchmark at the README's shapes
#   bash benchmarks/tools/run_gpu_validation.sh bench-divergence  # divergence benchmark at the README's shapes
#   bash benchmarks/tools/run_gpu_validation.sh tests-block       # block verification: kernel, reference, generate
#   bash benchmarks/tools/run_gpu_validation.sh bench-block       # block vs token-wise (automatic plan, and under the
#                                                                 # block plan: every row read) at the README's shapes
#   BATCH=1 bash benchmarks/tools/run_gpu_validation.sh bench-generate-block   # tokens/s block vs token (BATCH 1, 8;
#                                                    # NEW_TOKENS, REPEATS: longer runs measure alpha more precisely)
# The benchmarks write their rows into benchmarks/results/{rejection,divergence}.csv. Optional, git-ignored inputs
# for a machine without network: .whl/*.whl (liger-kernel, pytest-benchmark and their dependencies, from `pip download
# --no-deps`) and .fi/ (FlashInfer's source tree, from setup_flashinfer_tree.sh); without them the FlashInfer and
# Liger providers are left out.
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu_validation}
MODE=${1:-tests-rest}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
[ -d .fi ] && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/.fi FLASHINFER_CUDA_ARCH_LIST=9.0a
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.txt" 2>&1 || { cat "$OUT/pip.txt"; exit 1; }
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
REJECTION_TESTS="tests/kernels/test_rejection_triton.py tests/kernels/test_rejection_plan_rules.py tests/kernels/test_rejection_staged.py"
KERNEL_TESTS="tests/fairness/test_divergence.py tests/kernels/test_divergence_triton.py tests/kernels/test_divergence_cluster.py \
tests/kernels/test_rng.py tests/kernels/test_rejection_reference.py tests/test_stats_power.py tests/kernels/test_kernels_compile.py"
t0=$(date +%s)
pytest_run() {  # name, then pytest arguments
  local name=$1; shift
  timeout "${SECONDS_LIMIT:-560}" python3 -m pytest -q -p no:cacheprovider -W ignore::RuntimeWarning -rs "$@" \
    > "$OUT/$name.txt" 2>&1
  echo "pytest rc=$? in $(( $(date +%s) - t0 )) s"; tail -4 "$OUT/$name.txt"
}
case "$MODE" in
  tests-rejection) pytest_run tests_rejection $REJECTION_TESTS ;;
  tests-kernels) pytest_run tests_kernels $KERNEL_TESTS ;;
  tests-rest)
    pytest_run tests_rest tests $(printf -- "--ignore %s " $REJECTION_TESTS $KERNEL_TESTS) ;;
  bench)
    timeout "${SECONDS_LIMIT:-560}" python3 benchmarks/bench_rejection.py \
      --shapes 151936:1:4,151936:8:4,151936:32:4,151936:128:8,128256:128:8,32000:1:4,32000:32:8,32000:128:1 \
      --dtypes bf16 > "$OUT/bench_rejection_bf16.txt" 2>&1
    echo "bf16 rc=$?"
    timeout "${SECONDS_LIMIT:-560}" python3 benchmarks/bench_rejection.py \
      --shapes 151936:32:8,151936:128:1,32000:8:8,32000:32:1,32000:128:1,32000:128:8 \
      --dtypes fp32 > "$OUT/bench_rejection_fp32.txt" 2>&1
    echo "fp32 rc=$? in $(( $(date +%s) - t0 )) s"; tail -16 "$OUT/bench_rejection_bf16.txt" "$OUT/bench_rejection_fp32.txt" ;;
  bench-divergence)
    timeout "${SECONDS_LIMIT:-560}" python3 benchmarks/bench_divergence.py > "$OUT/bench_divergence.txt" 2>&1
    echo "bench rc=$? in $(( $(date +%s) - t0 )) s"; tail -12 "$OUT/bench_divergence.txt" ;;
  tests-block)
    pytest_run tests_block tests/kernels/test_rejection_block.py tests/kernels/test_rejection_block_triton.py \
      tests/decoding/test_generate_block.py ;;
  bench-block)
    timeout "${SECONDS_LIMIT:-560}" python3 benchmarks/bench_rejection.py --readme --providers specdec,specdec_block,specdec_every_row \
      > "$OUT/bench_rejection_block.txt" 2>&1
    echo "bench rc=$? in $(( $(date +%s) - t0 )) s"; tail -10 "$OUT/bench_rejection_block.txt" ;;
  bench-generate-block)
    timeout "${SECONDS_LIMIT:-560}" python3 benchmarks/bench_generate.py --batches "${BATCH:-1}" --alphas 0.5,0.75 \
      --ks 4,8 --temperature 1 --verification token,block --providers specdec_static --no-compiled \
      --new-tokens "${NEW_TOKENS:-128}" --repeats "${REPEATS:-3}" > "$OUT/bench_generate_block_${BATCH:-1}.txt" 2>&1
    echo "bench rc=$? in $(( $(date +%s) - t0 )) s"; grep -E "specdec_static" "$OUT/bench_generate_block_${BATCH:-1}.txt" ;;
  *) echo "unknown mode $MODE (tests-rejection, tests-kernels, tests-rest, bench, bench-divergence, tests-block,"\
       "bench-block, bench-generate-block)"; exit 2 ;;
esac
grep -hE "^FAILED|^ERROR" "$OUT"/tests_*.txt 2>/dev/null | head -20
