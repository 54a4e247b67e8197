#!/usr/bin/env bash
# One device call: build with all cores for sm_90a, run every test (GPU tests included), run the benchmarks.
# Writes build.log, tests.log, bench.log and the benchmarks' JSON under $OUT (the device tool brings them back).
# Usage: bash tools/gpu_check.sh [pytest args...]   (BENCH="gemm quantize modules" picks benchmarks, an entry
# "name:args" passes args, + for spaces: BENCH="transformer_layer:--no-compile modules:--skip+training
# llama:--variants+ours-fp8,hf-eager";
# BENCH= skips them;
# TEST_TIMEOUT / BENCH_TIMEOUT bound each step in seconds; PREBUILT_SO=path.so.gz loads a library made here by
# tools/prebuilt_so.sh instead of building: minutes of device time saved, the build runs only if it fails to load)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a PYTHONUNBUFFERED=1
start=$(date +%s)
source tools/device_env.sh > "$OUT/build.log" 2>&1
{ nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader; "${CXX:-g++}" --version | head -1;
  python -c "import sysconfig; print('LDSHARED:', sysconfig.get_config_var('LDSHARED'))"
  python -c "import sysconfig; print('LDCXXSHARED:', sysconfig.get_config_var('LDCXXSHARED'))"
} | tee "$OUT/bench.log"
if [[ -z ${PREBUILT_SO:-} ]] || ! bash tools/use_prebuilt_so.sh "$PREBUILT_SO" >> "$OUT/build.log" 2>&1; then
  python -m pip install --no-build-isolation --no-deps -e . >> "$OUT/build.log" 2>&1 || { tail -80 "$OUT/build.log"; exit 1; }
fi
echo "build: $(( $(date +%s) - start )) s"
timeout ${TEST_TIMEOUT:-400} python -m pytest -q -rs "${@:-tests}" > "$OUT/tests.log" 2>&1
tests_rc=$?
tail -25 "$OUT/tests.log"
for entry in ${BENCH-gemm quantize modules}; do
  b=${entry%%:*}; args=$([[ $entry == *:* ]] && echo "${entry#*:}" | tr '+' ' ')
  echo "== bench_$b $args ==" | tee -a "$OUT/bench.log"
  # shellcheck disable=SC2086  (args split into words on purpose)
  timeout ${BENCH_TIMEOUT:-300} python "benchmarks/bench_$b.py" $args --json "$OUT/bench_$b.json" >> "$OUT/bench.log" 2>&1 ||
    echo "bench_$b failed or timed out" >> "$OUT/bench.log"
done
cat "$OUT/bench.log"
exit $tests_rc
