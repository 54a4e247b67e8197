#!/usr/bin/env bash
# Build the extension on this machine (tools/setup.sh) and relink it for the GPU machine's Python, so a device call
# can load it instead of compiling for minutes there. Only the translation units that include Python.h (ninja's
# dependency log says which) are compiled again against the other Python's headers; every CUDA object is reused.
# Needs the same torch on both machines (the library links against torch's, as a build there would).
# Usage: bash tools/prebuilt_so.sh [OUT.so.gz | OUT.so.xz]   (default .gpu_lead/so/main.so.gz; .xz: half gzip's size
#        (~5 MB), for calls that carry a lot else; TARGET_PYTHON_INCLUDE overrides the target Python's include folder,
#        default that of pyenv's 3.12)
# On the device: bash tools/use_prebuilt_so.sh OUT.so.gz || pip install --no-build-isolation --no-deps -e .
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.gpu_lead/so/main.so.gz}
target_include=${TARGET_PYTHON_INCLUDE:-$(ls -d /root/.pyenv/versions/3.12*/include/python3.12 2>/dev/null | tail -1)}
[[ -f $target_include/Python.h ]] || { echo "prebuilt_so.sh: no Python.h under '$target_include' (set TARGET_PYTHON_INCLUDE)"; exit 1; }
MAX_JOBS=${MAX_JOBS:-2} bash tools/setup.sh > /dev/null
build=$(ls -d build/temp.linux-x86_64-cpython-3* | head -1)
own_include=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
cflags=$(sed -n 's/^cflags = //p' "$build/build.ninja" | sed "s#$own_include#$target_include#g")
post_cflags=$(sed -n 's/^post_cflags = //p' "$build/build.ninja")
ninja_bin=$(command -v ninja || echo "python3 -m ninja")
python_objects=$($ninja_bin -C "$build" -t deps | awk '/^[^ ]/{target=$1} /Python\.h/{sub(":", "", target); print target}' | sort -u)
work=$(mktemp -d)
objects=()
for object in "$build"/csrc/*.o; do
  name=$(basename "$object" .o)
  # (an object whose source is gone, or not in this build's family selection, is a stale leftover: not linked)
  grep -q "csrc/$name\.o:" "$build/build.ninja" || continue
  if grep -qx "$(realpath "$object")" <<< "$python_objects"; then
    # shellcheck disable=SC2086 # (the flags split into words on purpose)
    ${CXX:-c++} $cflags -c "csrc/$name.cpp" -o "$work/$name.o" $post_cflags
    objects+=("$work/$name.o")
  else
    objects+=("$object")
  fi
done
# the link line of the last build, with this machine's objects and another output
link=$(grep -- " -shared " build/tfp8_build.log | tail -1 | tr ' ' '\n' | grep -v '\.o$' | grep -v '^-o$' | grep -v '\.so$' |
       grep -v '^/usr/lib/ccache' | grep -v '^c++$\|^g++$' | tr '\n' ' ')
# shellcheck disable=SC2086 # (the link flags split into words on purpose)
${CXX:-c++} "${objects[@]}" $link -o "$work/_C.so"  # (objects first: libraries linked as needed)
strip --strip-unneeded "$work/_C.so"
mkdir -p "$(dirname "$out")"
if [[ "$out" == *.xz ]]; then xz -9 -T2 -c "$work/_C.so" > "$out"; else gzip -c "$work/_C.so" > "$out"; fi
echo "prebuilt_so.sh: $out ($(du -h "$out" | cut -f1); Python.h units recompiled: $(wc -w <<< "$python_objects"))"
rm -rf "$work"
