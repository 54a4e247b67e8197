# Sourced by the device scripts (gpu_check.sh, dist_check.sh) before they build.
# - The device image's default C++ compiler (/opt/gcc/bin/g++) puts its own copy of libstdc++'s stream code into our
#   library, and that copy crashes formatting numbers (torch's error messages, cudnn-frontend's plan names) against the
#   libstdc++ torch loads. The system g++ links the shared libstdc++.
# - The device has no network: the cudnn-frontend headers (attention family) come from a carried wheel folder .whl/
#   (made with: python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
#    --platform manylinux_2_28_x86_64 nvidia-cudnn-frontend -d .whl), when there.
if [[ -x /usr/bin/g++ && "${CXX:-}" != /usr/bin/g++ ]]; then export CXX=/usr/bin/g++; fi
if ls .whl/nvidia_cudnn_frontend-*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-deps --no-index .whl/nvidia_cudnn_frontend-*.whl ||
    echo "tools/device_env.sh: installing the carried cudnn-frontend wheel failed"
fi
