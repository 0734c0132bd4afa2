#!/usr/bin/env bash
# One device call: the rejection benchmark at the headline shapes with its exactness check, then the whole
# test suite on the GPU (GPU-only tests included). Writes logs under $OUT (default benchmarks/results).
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD/.fi || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.txt" 2>&1 || { cat "$OUT/pip.txt"; exit 1; }
export FLASHINFER_CUDA_ARCH_LIST=9.0a
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"
timeout "${BENCH_SECONDS:-200}" python3 benchmarks/bench_rejection.py --out "$OUT" --tag _v9 --dtypes bf16 \
  --providers specdec,torch_eager,torch_compile,flashinfer,flashinfer_kernel \
  --shapes 151936:1:4,151936:8:4,151936:32:4,151936:128:8,128256:128:8,32000:1:4,32000:32:8,32000:128:1 > "$OUT/rejection_bench_log_v9.txt" 2>&1
echo "bench rc=$?"; tail -12 "$OUT/rejection_bench_log_v9.txt"
t0=$(date +%s)
timeout "${TEST_SECONDS:-500}" python3 -m pytest -q -p no:cacheprovider -W ignore::RuntimeWarning -rs tests \
  > "$OUT/gpu_full_tests.txt" 2>&1
echo "pytest rc=$? in $(( $(date +%s) - t0 )) s"; tail -4 "$OUT/gpu_full_tests.txt"; grep -E "^FAILED|^ERROR|SKIPPED" "$OUT/gpu_full_tests.txt" | head -20
