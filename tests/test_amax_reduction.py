"""Data-parallel amax reduction with a real process group: 2 processes (gloo on CPU; NCCL on 2 GPUs under
tools/dist_check.sh), different inputs per rank. With fp8_group the scales after a step are identical on both ranks
and follow the global amax; without it they follow each rank's own amax."""
import functools

import pytest
import torch
import torch.distributed as dist

import transformer_fp8 as te
from tests.dist_utils import DEVICE, run_workers
from transformer_fp8 import recipe


def _step_scales(rank, reduce):
    torch.manual_seed(0)  # same weights on both ranks
    layer = te.Linear(32, 16, params_dtype=torch.float32, device=DEVICE)
    torch.manual_seed(100 + rank)
    x = torch.randn(24, 32, device=DEVICE) * (1 + 9 * rank)  # rank 1's input is ~10x larger
    fp8_recipe = recipe.DelayedScaling(amax_history_len=4, reduce_amax=reduce)
    with te.fp8_autocast(fp8_recipe=fp8_recipe, fp8_group=dist.group.WORLD):
        y = layer(x)
    y.sum().backward()
    return {"fwd": layer.fp8_fwd.scale.clone(), "bwd": layer.fp8_bwd.scale.clone(), "amax": x.abs().max().item()}


def _run(reduce):
    results = run_workers(functools.partial(_step_scales, reduce=reduce))
    for r in results:
        assert "exception" not in r, r.get("exception")
    return results


def test_scales_are_identical_across_ranks_with_fp8_group():
    r0, r1 = _run(reduce=True)
    assert torch.equal(r0["fwd"], r1["fwd"]) and torch.equal(r0["bwd"], r1["bwd"])
    # the input slot (0) follows the larger, global amax
    assert r0["fwd"][0].item() == pytest.approx(448.0 / max(r0["amax"], r1["amax"]), rel=1e-6)


def test_without_reduction_each_rank_keeps_its_own_scale():
    r0, r1 = _run(reduce=False)
    assert r0["fwd"][0].item() == pytest.approx(448.0 / r0["amax"], rel=1e-6)
    assert r1["fwd"][0].item() == pytest.approx(448.0 / r1["amax"], rel=1e-6)
    assert not torch.equal(r0["fwd"], r1["fwd"])
