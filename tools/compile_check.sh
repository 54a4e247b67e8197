#!/usr/bin/env bash
# Compile (no link) one or more csrc files with the flags setup.py uses: a quick syntax/type check without a GPU.
# Usage: tools/compile_check.sh csrc/quantize.cu csrc/quantize_binding.cpp
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
inc=$(python3 -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-I'+p for p in include_paths('cuda')))")
cudnn=$(python3 -c "import nvidia.cudnn, os; print('-I'+os.path.join(list(nvidia.cudnn.__path__)[0], 'include'))" 2>/dev/null || true)
frontend=$(python3 -c "import importlib.metadata as m; print('-I' + str(m.distribution('nvidia-cudnn-frontend').locate_file('include')))" 2>/dev/null || true)
py=$(python3 -c "import sysconfig; print('-I'+sysconfig.get_paths()['include'])")
common="-Icsrc $inc $cudnn $frontend $py -DTFP8_WITH_CUDA=1 -D_GLIBCXX_USE_CXX11_ABI=1 -std=c++17"
for f in "$@"; do
  case "$f" in
    *.cu) nvcc -c "$f" -o "$out/$(basename "$f").o" $common -O3 --expt-relaxed-constexpr \
            -gencode=arch=compute_90a,code=sm_90a -Xptxas -v 2> >(grep -E "error|warning|registers|spill" >&2) ;;
    *.cpp) g++ -c "$f" -o "$out/$(basename "$f").o" $common -O1 -fPIC ;;
  esac
  echo "ok: $f"
done
rm -rf "$out"
