#!/bin/bash
# Builds tools/grouped_gemm_probe (no torch): bash tools/grouped_gemm_probe.sh [out_dir] (default build/gprobe).
# Needs nvcc, the CUTLASS headers (the nvidia-cutlass package or TFP8_CUTLASS_INCLUDE) and cuBLASLt.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-build/gprobe}
mkdir -p "$OUT"
CUTLASS=${TFP8_CUTLASS_INCLUDE:-$(python3 -c "from importlib import metadata; print(metadata.distribution('nvidia-cutlass').locate_file('cutlass_library/source/include'))")}
FLAGS=(-std=c++17 -O3 -arch=sm_90a -Icsrc -I"$CUTLASS" --expt-relaxed-constexpr -DNDEBUG -Xptxas=-v)
JOBS=${MAX_JOBS:-2}
KERNELS=${PROBE_KERNELS:-0 1 2 3 4 5 6 7}
pids=()
for i in $KERNELS; do
  nvcc "${FLAGS[@]}" -DPROBE_KERNEL=$i -c tools/grouped_gemm_probe_kernels.cu -o "$OUT/kernel$i.o" \
    > "$OUT/kernel$i.log" 2>&1 &
  pids+=($!)
  if (( ${#pids[@]} >= JOBS )); then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
done
nvcc "${FLAGS[@]}" -c tools/grouped_gemm_probe.cu -o "$OUT/main.o"
nvcc "${FLAGS[@]}" -c csrc/grouped_gemm_rows.cu -o "$OUT/rows.o" > "$OUT/rows.log" 2>&1
nvcc "${FLAGS[@]}" -c csrc/grouped_shared.cu -o "$OUT/shared.o"
wait
nvcc -arch=sm_90a "$OUT"/*.o -o "$OUT/grouped_gemm_probe" -lcublasLt
nvcc "${FLAGS[@]}" tools/grouped_rows_occupancy.cu -o "$OUT/grouped_rows_occupancy" > /dev/null 2>&1
grep -h "spill\|C75" "$OUT"/kernel*.log "$OUT/rows.log" | sort | uniq -c | head -20
echo "built $OUT/grouped_gemm_probe"
