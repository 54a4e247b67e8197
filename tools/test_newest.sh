#!/usr/bin/env bash
# Build and test transformer_fp8 against the newest torch we support and the oldest supported transformers, in a
# virtual environment of their own and a copy of this checkout (so that the main environment's build stays as it is).
# CI runs it after the README's test command (which covers the pinned torch 2.11 and the newest transformers).
# Environment: TORCH_SPEC (default "torch>=2.11,<2.16": the newest release in the supported range),
# TRANSFORMERS_SPEC (default "transformers==5.17.0"), VENV (default ~/.cache/transformer_fp8/venv-newest, reused),
# TESTS (default: the whole suite).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_SPEC=${TORCH_SPEC:-"torch>=2.11,<2.16"}
TRANSFORMERS_SPEC=${TRANSFORMERS_SPEC:-"transformers==5.17.0"}
VENV=${VENV:-$HOME/.cache/transformer_fp8/venv-newest}
COPY=$(mktemp -d)/transformer_fp8
trap 'rm -rf "$(dirname "$COPY")"' EXIT

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade "$TORCH_SPEC" "$TRANSFORMERS_SPEC"
mkdir -p "$COPY"
tar --exclude=./build --exclude='*.so' --exclude=./.git --exclude='*.egg-info' -cf - . | tar -xf - -C "$COPY"
cd "$COPY"
PYTHON="$VENV/bin/python" bash tools/setup.sh
"$VENV/bin/python" -c "import torch, transformers; print('newest-torch run: torch', torch.__version__, '| transformers',
      transformers.__version__)"
# shellcheck disable=SC2086  (TESTS splits into paths on purpose)
"$VENV/bin/python" -m pytest -q -p no:cacheprovider ${TESTS:-tests}
