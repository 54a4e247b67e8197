#!/usr/bin/env bash
# The example's 200-step loss, BF16 vs FP8, on the device (issue 21): ours and Transformer Engine's layers side by side.
# Run from the root of a device copy of the repo (e.g. .gpu_numerics) with `.te` carried beside it (one level up);
# writes everything under $OUT. Fits BUDGET_S seconds (default 585) in all: the runs that do not fit are cut.
#   carry: [".gpu_numerics", ".te"]; command: cd .gpu_numerics && bash tools/loss_seeds.sh
# Environment: RUNS_A (first group of runs, seed 0), SEEDS_B / RUNS_B (the second group), PROBE=0 skips the gradient
# probe, TE=0 skips Transformer Engine's install (no te_* runs then; `.te` still gives the cudnn-frontend wheel),
# EXTRA: more arguments for every run (e.g. "--warmup-steps 40"), BUDGET_S: the call's seconds (default 585).
# The loss driver is benchmarks/loss_numerics.py (run names: bf16, delayed, current, block, te_<recipe>,
# <recipe>+hp_qkv / +hp_proj / +hp_mlp / +hp_attn); the gradient probe benchmarks/loss_grad_error.py.
t0=$(date +%s)
cd "$(dirname "$0")/.." || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
python -m pip install -q --no-index --no-deps ../.te/deps/nvidia_cudnn_frontend-*.whl .wheels/*.whl 2>/dev/null
source tools/device_env.sh
te_pid=
if [[ "${TE:-1}" != 0 ]]; then (cd .. && MAX_JOBS=6 bash .te/install.sh > "$OUT/te_install.log" 2>&1) & te_pid=$!; fi
export TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=10 TFP8_ONLY=quantize,gemm,norm,activation,scaling,rope,loss,attention
python -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 ||
  { tail -50 "$OUT/build.log"; exit 1; }
echo "our build $(( $(date +%s) - t0 )) s"
python examples/stdlib_corpus.py /tmp/stdlib.jsonl
if [[ -n "$te_pid" ]]; then
  wait $te_pid
  echo "TE install done $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/te_install.log")"
fi
size=(--data /tmp/stdlib.jsonl --hidden 2048 --layers 8 --heads 16 --kv-heads 4 --ffn 5632 --seq 1024 --lr 3e-4
      ${EXTRA:-})
left() { echo $(( ${BUDGET_S:-585} - ($(date +%s) - t0) )); }  # seconds left of the call (t0: before the builds)
if [[ "${PROBE:-1}" != 0 ]]; then
  timeout 90 python benchmarks/loss_grad_error.py "${size[@]}" --batch 8 --warm 40 \
    --variants ${PROBE_VARIANTS:-bf16 delayed te_delayed block te_block} --json "$OUT/grad_error.json" 2>&1 |
    grep -v -i warn | tail -12
  echo "probe done $(( $(date +%s) - t0 )) s"
fi
timeout $(( $(left) - ${RESERVE_B_S:-0} )) python benchmarks/loss_numerics.py "${size[@]}" --batch 16 --seeds 0 \
  --runs ${RUNS_A:-te_delayed delayed bf16 te_block block delayed+hp_qkv current} --out "$OUT/loss_seed0.json" 2>&1 |
  grep -aoE "(seed [0-9]+ |TE swap).*"
echo "group A done $(( $(date +%s) - t0 )) s"
timeout $(left) python benchmarks/loss_numerics.py "${size[@]}" --batch 16 --seeds ${SEEDS_B:-1} \
  --runs ${RUNS_B:-bf16 delayed} --out "$OUT/loss_seed1.json" 2>&1 | grep -aoE "(seed [0-9]+ |TE swap).*"
echo "total $(( $(date +%s) - t0 )) s"
