#!/usr/bin/env bash
# Set up a machine for transformer_fp8 and build it in place (editable install).
#
# Installs torch 2.11 (CUDA 13 wheels from PyPI) only if no torch is present (any torch from 2.11 to 2.15 is taken as
# it is), the build tools, the test and example dependencies and the cudnn-frontend headers, then builds the
# extension: with the CUDA kernels (sm_90a; TORCH_CUDA_ARCH_LIST overrides) when nvcc is found, else the CPU-only
# extension (TFP8_FORCE_CPU=1 forces that).
# Idempotent: when nothing the build depends on changed since the last successful build (tools/build_stamp.py: the
# sources, torch, nvcc, the build settings), the build is skipped; otherwise it runs in place in ./build, where ninja
# recompiles only the sources that changed (and ccache, when installed, serves other clones of the same sources).
# The build's output goes to build/tfp8_build.log.
# Environment: PYTHON (default python3), MAX_JOBS (default: all cores), TFP8_SKIP_EXTRAS=1 (no examples/notebook
# packages), TFP8_REBUILD=1 (build even when up to date).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PINNED_TORCH="torch==2.11.0"
LOG=build/tfp8_build.log STAMP=build/tfp8_build.stamp

if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "$PINNED_TORCH"
fi
# The torch versions this package is built and tested with (keep in step with pyproject.toml).
"$PY" - <<'PYTHON'
import sys
import torch
version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
if not (2, 11) <= version < (2, 16):
    sys.exit(f"tools/setup.sh: torch {torch.__version__} is installed; transformer_fp8 supports torch 2.11 to 2.15: "
             f"install one of those (pip install 'torch>=2.11,<2.16') or use a fresh virtual environment")
PYTHON
missing() {  # the distributions among "$@" that are not installed
  "$PY" -c 'import sys; from importlib import metadata as m
def absent(name):
    try:
        m.distribution(name.split("==")[0])
    except m.PackageNotFoundError:
        return True
print(" ".join(n for n in sys.argv[1:] if absent(n)))' "$@"
}
install_missing() {  # pip install those of "$@" (distribution names) that are missing; pip is slow even when not
  local wanted
  wanted=$(missing "$@")
  if [ -n "$wanted" ]; then "$PY" -m pip install -q ${PIP_FLAGS:-} $wanted; fi
}
install_missing numpy pytest expecttest setuptools wheel ninja
# header-only libraries, only their headers are used (no dependencies): the cuDNN frontend for the attention family,
# CUTLASS for the grouped family (our grouped FP8 GEMM; without it GroupedLinear keeps torch's grouped kernel)
PIP_FLAGS=--no-deps install_missing nvidia-cudnn-frontend "nvidia-cutlass==4.2.0.0"
if [ "${TFP8_SKIP_EXTRAS:-0}" != 1 ]; then
  # for the examples, notebooks and integrations (the package itself needs none of them)
  install_missing transformers tqdm matplotlib nbclient nbformat ipykernel peft safetensors
fi

if [ "${TFP8_FORCE_CPU:-0}" != 1 ] && command -v nvcc >/dev/null 2>&1; then
  nvcc_major=$(nvcc --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
  torch_major=$("$PY" -c "import torch; print((torch.version.cuda or '0').split('.')[0])")
  if [ "$nvcc_major" != "$torch_major" ]; then
    echo "tools/setup.sh: nvcc is CUDA $nvcc_major but torch was built for CUDA $torch_major;" \
         "install a torch for CUDA $nvcc_major (or set TFP8_FORCE_CPU=1 for a CPU-only build)" >&2
    exit 1
  fi
fi

mkdir -p build
stamp=$("$PY" tools/build_stamp.py)
installed_here() {  # the package imports from this checkout also outside it (pip knows it: an editable install)
  (here=$(realpath transformer_fp8) && cd / &&
    "$PY" -c "import os, sys, transformer_fp8 as t; sys.exit(os.path.dirname(t.__file__) != sys.argv[1])" "$here") \
    2>/dev/null
}
if [ "${TFP8_REBUILD:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$stamp" ] && installed_here; then
  echo "tools/setup.sh: the extension is up to date (no change to its sources, torch, nvcc or build settings): not rebuilt"
else
  rm -f "$STAMP"
  if command -v ccache >/dev/null 2>&1 && [ -x "/usr/lib/ccache/${CXX:-c++}" ]; then
    # (ccache's compiler links: torch's compiler check needs CXX to be one executable; paths relative to the
    # checkout, so that another clone of the same sources hits the cache)
    export CXX="/usr/lib/ccache/${CXX:-c++}" PYTORCH_NVCC="ccache nvcc" CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=1
  fi
  echo "tools/setup.sh: building the extension (log: $LOG)"
  # In place, in ./build: ninja recompiles only the sources that changed since the last build.
  if ! MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" setup.py build_ext --inplace > "$LOG" 2>&1; then
    grep -i -E "error|failed" "$LOG" | tail -40 >&2 || tail -40 "$LOG" >&2
    echo "tools/setup.sh: the build failed; the whole output is in $LOG" >&2
    exit 1
  fi
  if ! installed_here; then  # register the checkout with pip (editable), without building again
    TFP8_NO_EXTENSION=1 "$PY" -m pip install -q --no-build-isolation --no-deps -e . >> "$LOG" 2>&1
  fi
  echo "$stamp" > "$STAMP"
fi
"$PY" -c "import transformer_fp8 as t; print('transformer_fp8', t.__version__, '| CUDA kernels:', t.cuda_kernels_available())"
