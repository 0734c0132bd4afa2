#!/usr/bin/env bash
# DRAM bytes each rejection-sampling kernel reads, from Nsight Compute (GPU only). With live_skip how far a program
# reads past a certain rejection depends on timing, so the benchmark can only bound the bytes read; this measures
# them. Caches are flushed before each profiled kernel (ncu's default), so the race kernel's re-read of the stop
# row counts as DRAM traffic, as the benchmark's gbps_read counts it; clocks are left free (--clock-control none).
#   OUT=/tmp/o bash benchmarks/ncu_bytes_read.sh 151936:128:8:bf16 151936:128:8:fp32 ...
# Each case V:B:K:dtype runs twice, with the default plan and with tune {"live_skip": false}; three calls each
# (ncu_one_call.py), every statistics / race / finalize kernel profiled: ncu_bytes_<V>_<B>_<K>_<dtype>_<plan>.csv.
set -uo pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found"; exit 2; }
for case in "$@"; do
  IFS=: read -r vocab batch drafts dtype <<< "$case"
  for plan in default no_live; do
    tune='{}'
    [ "$plan" = no_live ] && tune='{"live_skip": false}'
    "$NCU" --csv --print-units base --clock-control none --metrics dram__bytes_read.sum \
      --kernel-name regex:'_stats_kernel|_race_kernel|_finalize_kernel' \
      python3 benchmarks/ncu_one_call.py --shape "$vocab:$batch:$drafts" --dtype "$dtype" --calls 3 --tune "$tune" \
      > "$OUT/ncu_bytes_${vocab}_${batch}_${drafts}_${dtype}_${plan}.csv" 2> "$OUT/ncu_bytes_${vocab}_${batch}_${drafts}_${dtype}_${plan}.log"
    echo "$case $plan rc=$? $(grep -c dram__bytes_read "$OUT/ncu_bytes_${vocab}_${batch}_${drafts}_${dtype}_${plan}.csv") kernels"
  done
done
