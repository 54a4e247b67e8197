#!/usr/bin/env bash
# One device call: build the wheel (tools/build_wheel.sh), install it into a fresh virtual environment (torch from the
# machine's own site-packages, no network), and run the GPU tests from it, outside the source tree (so that nothing
# is imported from the checkout). Carried: .whl/ (the cudnn-frontend wheel for the build; peft and its
# dependencies for the LoRA tests). Writes wheel.log and tests.log under $OUT.
# Usage: bash tools/gpu_wheel_check.sh [pytest args, default: -m gpu tests]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"; OUT=$(realpath "$OUT")
export MAX_JOBS=16 PYTHONUNBUFFERED=1
start=$(date +%s)
source tools/device_env.sh > "$OUT/wheel.log" 2>&1
python -m pip install -q --no-index --find-links .whl peft accelerate safetensors psutil >> "$OUT/wheel.log" 2>&1 ||
  echo "peft could not be installed from .whl" | tee -a "$OUT/wheel.log"
bash tools/build_wheel.sh dist >> "$OUT/wheel.log" 2>&1 || { tail -40 "$OUT/wheel.log"; exit 1; }
wheel=$(ls -t dist/transformer_fp8-*.whl | head -1)
echo "wheel: $wheel, $(du -h "$wheel" | cut -f1), built in $(( $(date +%s) - start )) s" | tee -a "$OUT/wheel.log"
venv=/tmp/tfp8-wheel-venv run_dir=/tmp/tfp8-wheel-run
# A fresh environment that sees the machine's packages (torch, transformers, pytest) through a .pth file (the
# machine's python may itself be a virtual environment, which --system-site-packages would skip), not this checkout.
python -m venv "$venv"
python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > \
  "$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/machine_packages.pth"
"$venv/bin/python" -m pip install -q --no-index --no-deps "$wheel" >> "$OUT/wheel.log" 2>&1 || {
  tail -20 "$OUT/wheel.log"; exit 1; }
mkdir -p "$run_dir" && cp -r tests examples notebooks benchmarks "$run_dir"/
cd "$run_dir"
"$venv/bin/python" -c "import transformer_fp8 as t; print('imported from', t.__file__, '| CUDA kernels:',
      t.cuda_kernels_available())" | tee -a "$OUT/wheel.log"
[ $# -gt 0 ] || set -- -m gpu tests
timeout "${TEST_TIMEOUT:-480}" "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider "$@" > "$OUT/tests.log" 2>&1
rc=$?
tail -30 "$OUT/tests.log"
echo "total: $(( $(date +%s) - start )) s"
exit $rc
