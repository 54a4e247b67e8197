"""Data-parallel amax reduction with a real process group: 2 CPU processes (gloo), different inputs per rank.
With fp8_group the scales after a step are identical on both ranks and follow the global amax; without it they
follow each rank's own amax."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import transformer_fp8 as te
from transformer_fp8 import recipe

WORLD = 2


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, port, reduce, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)  # same weights on both ranks
        layer = te.Linear(32, 16, params_dtype=torch.float32, device="cpu")
        torch.manual_seed(100 + rank)
        x = torch.randn(24, 32) * (1 + 9 * rank)  # rank 1's input is ~10x larger
        fp8_recipe = recipe.DelayedScaling(amax_history_len=4, reduce_amax=reduce)
        with te.fp8_autocast(fp8_recipe=fp8_recipe, fp8_group=dist.group.WORLD):
            y = layer(x)
        y.sum().backward()
        results[rank] = (layer.fp8_fwd.scale.clone(), layer.fp8_bwd.scale.clone(), x.abs().max().item())
    finally:
        dist.destroy_process_group()


def _run(reduce):
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(_free_port(), reduce, results), nprocs=WORLD, join=True)
    return [results[r] for r in range(WORLD)]


def test_scales_are_identical_across_ranks_with_fp8_group():
    (fwd0, bwd0, amax0), (fwd1, bwd1, amax1) = _run(reduce=True)
    assert torch.equal(fwd0, fwd1) and torch.equal(bwd0, bwd1)
    # the input slot (0) follows the larger, global amax
    assert fwd0[0].item() == pytest.approx(448.0 / max(amax0, amax1), rel=1e-6)


def test_without_reduction_each_rank_keeps_its_own_scale():
    (fwd0, _, amax0), (fwd1, _, amax1) = _run(reduce=False)
    assert fwd0[0].item() == pytest.approx(448.0 / amax0, rel=1e-6)
    assert fwd1[0].item() == pytest.approx(448.0 / amax1, rel=1e-6)
    assert not torch.equal(fwd0, fwd1)
