#!/usr/bin/env bash
# One device call on a machine with 2 GPUs (kind nvidia-h200-x2): build the extension for sm_90a, run the
# multi-process tests (tensor/sequence parallel, DDP, FSDP2) with NCCL on the 2 GPUs, then bench_distributed.py
# under torchrun (TP=1 on one GPU, TP=2, TP=2+SP, in the same run).
# Writes dist_check.log, build.log, tests.log, bench.log and bench_distributed.json under $OUT.
# Each step is bounded so that the whole script ends within DEADLINE seconds (default 450).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export MAX_JOBS=32 TORCH_CUDA_ARCH_LIST=9.0a PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast stays off
export TFP8_DIST_BACKEND=nccl  # tests/dist_utils.py: NCCL, one GPU per process
start=$(date +%s)
left() { echo $(( ${DEADLINE:-450} - ($(date +%s) - start) )); }
log="$OUT/dist_check.log"
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nvidia-smi topo -m;
  python -c "import torch; print('torch', torch.__version__, 'GPUs', torch.cuda.device_count(), 'NCCL', torch.cuda.nccl.version())"
} > "$log" 2>&1

source tools/device_env.sh > "$OUT/build.log" 2>&1
# No attention family (cuDNN, a slow compile): the multi-GPU tests and benchmark run attention on PyTorch SDPA.
export TFP8_ONLY=quantize,gemm,norm,activation,scaling,rope
python -m pip install --no-build-isolation --no-deps -e . >> "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s" | tee -a "$log"

tests_rc=0
for t in tests/test_tensor_parallel.py tests/test_data_parallel.py tests/test_fsdp.py tests/test_amax_reduction.py; do
  budget=$(( $(left) - 150 ))  # keep 150 s for the benchmark
  if (( budget < 30 )); then echo "$t: skipped (no time left)" | tee -a "$log"; tests_rc=1; continue; fi
  (( budget > 150 )) && budget=150
  t0=$(date +%s)
  echo "== $t (limit ${budget} s) ==" >> "$OUT/tests.log"
  timeout -k 10 "$budget" python -m pytest -q -rs "$t" >> "$OUT/tests.log" 2>&1
  rc=$?; (( rc != 0 )) && tests_rc=$rc
  echo "$t: rc $rc, $(( $(date +%s) - t0 )) s, $(grep -E '[0-9]+ (passed|failed)' "$OUT/tests.log" | tail -1)" | tee -a "$log"
done

budget=$(( $(left) - 10 ))
echo "== bench_distributed (limit ${budget} s) ==" | tee -a "$log"
timeout -k 10 "$budget" python -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_distributed.py \
  --json "$OUT/bench_distributed.json" > "$OUT/bench.log" 2>&1 || echo "bench_distributed failed or timed out" >> "$log"
grep -vE "^\s*$|OMP_NUM_THREADS|^\*+$" "$OUT/bench.log" | tail -15 >> "$log"
echo "total: $(( $(date +%s) - start )) s" >> "$log"
cat "$log"
exit $tests_rc
