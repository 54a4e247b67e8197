"""Multi-process test harness: WORLD = 2 processes on gloo (CPU), or on NCCL with one GPU each when the environment
sets TFP8_DIST_BACKEND=nccl (tools/dist_check.sh runs them so on 2 GPUs).

run_workers(fn) spawns the processes; each initialises the default group, runs fn(rank) and hands back its result
(tensors moved to the CPU); a rank's exception fails the caller's test with that rank's traceback. On CUDA the
FP8 modules take their FP8 path at every size (as conftest.py arranges in-process).
RankResults keeps every rank's {check: value} apart, so that a test checks each rank's value (floats, tensors, lists,
flags alike) and a failure names the rank: no rank's result is dropped in favour of another's.
"""
import os
import socket
import traceback
from typing import Any, Callable

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


def _same(a: Any, b: Any) -> bool:
    """Equality of results that may hold tensors (exact: same shape, dtype and values, NaNs equal) at any depth."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and
                a.dtype == b.dtype and bool(torch.equal(a, b) or (a.isnan() == b.isnan()).all() and
                                            torch.equal(a.nan_to_num(), b.nan_to_num())))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


class RankResults:
    """Every rank's {check: value} from run_workers, kept per rank. Read a check with each() (every rank's value),
    assert with check_each() / same_on_every_rank(); failures name the rank and show its value."""

    def __init__(self, per_rank: list[dict]):
        """per_rank: run_workers' list, rank r's dict at index r."""
        self.per_rank = per_rank

    def __contains__(self, key: str) -> bool:
        """Whether any rank has `key`."""
        return any(key in result for result in self.per_rank)

    def keys(self) -> list[str]:
        """Every key some rank has, in first-seen order."""
        return list(dict.fromkeys(k for result in self.per_rank for k in result))

    def each(self, key: str) -> list[tuple[int, Any]]:
        """[(rank, value)] of every rank; a rank without `key` fails the test, named."""
        missing = [r for r, result in enumerate(self.per_rank) if key not in result]
        assert not missing, f"{key}: missing on rank(s) {missing}"
        return [(r, result[key]) for r, result in enumerate(self.per_rank)]

    def check_each(self, key: str, check: Callable[[Any], bool], what: str = "") -> None:
        """Assert check(value) for every rank's value of `key`; the message lists each failing rank and value.
        Args: key: the check's name; check: the predicate; what: what the predicate expects (for the message)."""
        failures = [f"rank {r}: {key} = {value!r}" for r, value in self.each(key) if not check(value)]
        assert not failures, "; ".join(failures) + (f" (expected {what})" if what else "")

    def same_on_every_rank(self, key: str) -> Any:
        """The value of `key`, asserted equal (exactly, tensors included) on every rank; the message names the ranks
        that differ from rank 0. Returns: rank 0's value."""
        values = self.each(key)
        differ = [f"rank {r}: {value!r}" for r, value in values[1:] if not _same(value, values[0][1])]
        assert not differ, f"{key}: differs across ranks: rank 0: {values[0][1]!r}; " + "; ".join(differ)
        return values[0][1]

    def assert_absent(self, key: str) -> None:
        """Assert no rank has `key` (e.g. a case's exception); the message shows each rank's value."""
        present = [f"rank {r}:\n{result[key]}" for r, result in enumerate(self.per_rank) if key in result]
        assert not present, f"{key}:\n" + "\n".join(present)


def run_workers_per_rank(fn: Callable[[int], dict]) -> RankResults:
    """run_workers(fn), every rank's result kept (see RankResults). Args: fn(rank) -> {check: value}."""
    return RankResults(run_workers(fn))
