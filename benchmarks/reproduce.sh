#!/usr/bin/env bash
# Rerun every benchmark that feeds a published number; see benchmarks/reproduce.py (--help) for the modes.
#   bash benchmarks/reproduce.sh --quick    # the headline figures, at most 7 minutes (--budget-s 420) after the build
#   bash benchmarks/reproduce.sh            # everything the published tables used (run it in parts with --only)
#   bash benchmarks/reproduce.sh --smoke    # the scripts' CPU smoke modes (no GPU)
# JSON per benchmark, its log and summary.md / summary.json land in benchmarks/results/<date>-reproduce-<mode>/
# (or --out DIR). Each benchmark runs in its own process with a time limit; failures are reported, not fatal.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # (NVLink multicast stays off)
exec "${PYTHON:-python3}" benchmarks/reproduce.py "$@"  # (PYTHON=... picks another interpreter)
