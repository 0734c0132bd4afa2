#!/usr/bin/env bash
# DRAM bytes each rejection-sampling kernel reads per call, from Nsight Compute (CUDA GPU). Under live skip how far a
# program reads past a certain rejection depends on timing, so the benchmark can only bound the bytes read; this
# measures them. ncu flushes the caches before each profiled kernel, so the race kernel's re-read of the stop row
# counts as DRAM traffic; clocks are left free (--clock-control none). Each case V:B:K:dtype runs with the automatic
# plan and with live skip off, three calls each (ncu_one_call.py): ncu_bytes_<V>_<B>_<K>_<dtype>_<plan>.csv in $OUT.
#   OUT=/tmp/ncu bash benchmarks/tools/ncu_bytes_read.sh 151936:128:8:bf16 128256:128:8:bf16
#   python benchmarks/tools/ncu_bytes_summary.py /tmp/ncu --gpu "NVIDIA H200"
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/ncu_bytes}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found"; exit 2; }
for case in "$@"; do
  IFS=: read -r vocab batch drafts dtype <<< "$case"
  for plan in default no_live; do
    flag=""
    [ "$plan" = no_live ] && flag="--no-live-skip"
    name="$OUT/ncu_bytes_${vocab}_${batch}_${drafts}_${dtype}_${plan}"
    "$NCU" --csv --print-units base --clock-control none --metrics dram__bytes_read.sum \
      --kernel-name regex:'_stats_kernel|_race_kernel' \
      python3 benchmarks/tools/ncu_one_call.py --shape "$vocab:$batch:$drafts" --dtype "$dtype" --calls 3 $flag \
      > "$name.csv" 2> "$name.log"
    echo "$case $plan rc=$? $(grep -c dram__bytes_read "$name.csv") kernels"
  done
done
