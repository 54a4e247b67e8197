"""Multi-process test harness: WORLD = 2 processes on gloo (CPU), or on NCCL with one GPU each when the environment
sets TFP8_DIST_BACKEND=nccl (tools/dist_check.sh runs them so on 2 GPUs).

run_workers(fn) spawns the processes; each initialises the default group, runs fn(rank) and hands back its result
(tensors moved to the CPU); a rank's exception fails the caller's test with that rank's traceback. On CUDA the
FP8 modules take their FP8 path at every size (as conftest.py arranges in-process).
"""
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._pytree import tree_map

WORLD = 2
BACKEND = os.environ.get("TFP8_DIST_BACKEND", "gloo")
if BACKEND not in ("gloo", "nccl"):
    raise ValueError(f"TFP8_DIST_BACKEND: expected 'gloo' or 'nccl', got {BACKEND!r}")
DEVICE = "cuda" if BACKEND == "nccl" else "cpu"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, port, fn, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if DEVICE == "cuda":
        from transformer_fp8.module import base

        torch.cuda.set_device(rank)
        base.FP8_MIN_GEMM_SIZE = 0
    dist.init_process_group(BACKEND, rank=rank, world_size=WORLD)
    try:
        out = fn(rank)
        results[rank] = tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, out)
    except Exception:
        results[rank] = {"exception": traceback.format_exc()}
    finally:
        dist.destroy_process_group()


def run_workers(fn):
    """[fn(0), fn(1)], each run in its own process of a WORLD-rank group."""
    if DEVICE == "cuda" and torch.cuda.device_count() < WORLD:
        pytest.skip(f"TFP8_DIST_BACKEND=nccl needs {WORLD} GPUs")
    shared = mp.get_context("spawn").Manager().dict()  # (not forked from a process that may hold CUDA threads)
    mp.spawn(_entry, args=(free_port(), fn, shared), nprocs=WORLD, join=True)
    results = [dict(shared[r]) for r in range(WORLD)]
    for rank, result in enumerate(results):
        assert "exception" not in result, f"rank {rank}:\n{result['exception']}"
    return results
