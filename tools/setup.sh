#!/usr/bin/env bash
# Set up a fresh machine for transformer_fp8 and build it in place (editable install).
# Installs torch 2.11 (CUDA 13 wheels from PyPI) only if no torch is present, the test and example dependencies, the
# cudnn-frontend headers, then builds the extension:
# with the CUDA kernels (sm_90a) when nvcc is found, else the CPU-only extension. MAX_JOBS defaults to all cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.11.0"
fi
"$PY" -m pip install -q numpy pytest ninja expecttest setuptools wheel
# the header-only cuDNN frontend for the attention family (only its headers are used: no dependencies)
"$PY" -m pip install -q --no-deps nvidia-cudnn-frontend
# for the examples and notebooks (the package itself needs none of them)
"$PY" -m pip install -q transformers tqdm matplotlib nbclient nbformat ipykernel

if command -v nvcc >/dev/null 2>&1; then
  nvcc_major=$(nvcc --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
  torch_major=$("$PY" -c "import torch; print((torch.version.cuda or '0').split('.')[0])")
  if [ "$nvcc_major" != "$torch_major" ]; then
    echo "tools/setup.sh: nvcc is CUDA $nvcc_major but torch was built for CUDA $torch_major;" \
         "install a torch for CUDA $nvcc_major (or set TFP8_FORCE_CPU=1 for a CPU-only build)" >&2
    exit 1
  fi
fi
MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install --no-build-isolation --no-deps -e .
"$PY" -c "import transformer_fp8 as t; print('transformer_fp8', t.__version__, '| CUDA kernels:', t.cuda_kernels_available())"
