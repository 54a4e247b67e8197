#!/usr/bin/env bash
# On the GPU machine: put a library made by tools/prebuilt_so.sh in place and check that it loads.
# Usage: bash tools/use_prebuilt_so.sh SO.gz or SO.xz   (exit status 1, and no library left behind, when it does not
#        load: then build there instead)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
so=transformer_fp8/_C$(python -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
if [[ "$1" == *.xz ]]; then  # (python's lzma: the machine may lack the xz tool)
  python -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" "$1" "$so" ||
    { rm -f "$so"; exit 1; }
else
  gunzip -c "$1" > "$so" || { rm -f "$so"; exit 1; }
fi
if ! python -c "import transformer_fp8" > /dev/null 2>&1; then
  python -c "import transformer_fp8" 2>&1 | tail -1
  rm -f "$so"
  exit 1
fi
echo "use_prebuilt_so.sh: $so loaded"
