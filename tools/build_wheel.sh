#!/usr/bin/env bash
# Build a wheel of transformer_fp8 with its CUDA kernels (sm_90a: H100/H200; TORCH_CUDA_ARCH_LIST overrides), for
# users without nvcc: `pip install dist/transformer_fp8-*.whl` into an environment with the same torch minor version
# (the wheel requires it: the extension is compiled against torch's C++ API) and a CUDA 13 torch.
# Needs what tools/setup.sh installs (torch, setuptools, wheel, ninja, nvidia-cudnn-frontend) and nvcc.
# Usage: bash tools/build_wheel.sh [output dir, default dist]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DIST=${1:-dist}
if ! command -v nvcc >/dev/null 2>&1; then
  echo "tools/build_wheel.sh: nvcc not found: a wheel is built with the CUDA kernels (install the CUDA 13 toolkit)" >&2
  exit 1
fi
mkdir -p build "$DIST"
if command -v ccache >/dev/null 2>&1 && [ -x /usr/lib/ccache/c++ ]; then
  export CXX=/usr/lib/ccache/c++ PYTORCH_NVCC="ccache nvcc" CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=1
fi
export TFP8_WHEEL=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-$(nproc)}
if ! "$PY" -m pip wheel --no-build-isolation --no-deps -w "$DIST" . > build/tfp8_wheel.log 2>&1; then
  grep -i -E "error|failed" build/tfp8_wheel.log | tail -40 >&2 || tail -40 build/tfp8_wheel.log >&2
  echo "tools/build_wheel.sh: the build failed; the whole output is in build/tfp8_wheel.log" >&2
  exit 1
fi
wheel=$(ls -t "$DIST"/transformer_fp8-*.whl | head -1)
"$PY" - "$wheel" <<'PYTHON'
import sys
import zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    names = wheel.namelist()
    requires = [line for line in wheel.read(next(n for n in names if n.endswith("METADATA"))).decode().splitlines()
                if line.startswith("Requires-Dist")]
if not any(name.startswith("transformer_fp8/_C") for name in names):
    sys.exit(f"tools/build_wheel.sh: {sys.argv[1]} has no compiled extension")
print(f"{sys.argv[1]}: {len(names)} files; " + "; ".join(requires))
PYTHON
