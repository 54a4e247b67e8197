"""Data parallelism under torch.nn.parallel.DistributedDataParallel: 2 processes (gloo on CPU; NCCL on 2 GPUs with
TFP8_DIST_BACKEND=nccl, see tests/dist_utils.py), one spawned job.

Each rank trains the same small model of our modules (Linear, LayerNormMLP) on its half of every global batch for a
few SGD steps inside fp8_autocast(fp8_group=WORLD) (delayed scaling). Both ranks also train the single-process model
on the whole batch (identical on both ranks, so its amax all-reduces agree). DDP averages the gradients over the ranks,
so the single-process loss is divided by the world size: the same parameter gradients. The gradients of the
activations (dy) are then WORLD times the single-process ones (DDP averages only the parameter gradients), so the
backward scales are 1/WORLD of the single-process ones: a power of two, the FP8 bytes are the same.
Checked: parameters and FP8 scales identical on both ranks, and equal to the single-process run's (float32 summation
order aside), with FP8 visibly different from a float32 run.
"""
import json
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import transformer_fp8 as te
from transformer_fp8 import recipe
from tests.dist_utils import DEVICE, WORLD, free_port, run_workers
from tests.utils import checkout_env, rel_error

TOKENS, HIDDEN, FFN, STEPS = 14, 32, 64, 3
# Under torchrun with gloo, rank 1 of bench_distributed.py sometimes aborts at interpreter exit, after
# destroy_process_group and its atexit handlers (about 1 run in 12 on the CPU machine, with this commit's benchmark
# and the previous one; a bare torch.distributed script did not reproduce it). Its stderr then holds this line.
GLOO_EXIT_ABORT = "terminate called without an active exception"


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(te.Linear(HIDDEN, HIDDEN, params_dtype=torch.float32, device=DEVICE),
                                te.LayerNormMLP(HIDDEN, FFN, params_dtype=torch.float32, device=DEVICE))
    with torch.no_grad():  # non-trivial norm and bias parameters
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.5 + (1 if "layer_norm_weight" in str(p.shape) else 0))
    return model


def _scales(model):
    """(forward scales, backward scales) of every module, concatenated."""
    return torch.cat([m.fp8_fwd.scale for m in model]), torch.cat([m.fp8_bwd.scale for m in model])


def _train(model, rank, fp8, loss_divisor):
    """STEPS SGD steps; rank None: the whole global batch. Returns (losses, parameters, scales or None)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    fp8_recipe = recipe.DelayedScaling(amax_history_len=4)
    losses = []
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        x = torch.randn(WORLD * TOKENS, HIDDEN).to(DEVICE)
        x = x if rank is None else x.chunk(WORLD)[rank]
        with te.fp8_autocast(enabled=fp8, fp8_recipe=fp8_recipe, fp8_group=dist.group.WORLD):
            out = model(x)
        loss = out.square().sum() / loss_divisor
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    params = torch.cat([p.detach().flatten() for p in inner.parameters()])
    return torch.stack(losses), params, (_scales(inner) if fp8 else None)


def _worker(rank):
    local = {}
    for label, fp8 in (("hp", False), ("fp8", True)):
        ddp = torch.nn.parallel.DistributedDataParallel(_model())
        local[f"{label}/ddp"] = _train(ddp, rank, fp8, 1)
        local[f"{label}/single"] = _train(_model(), None, fp8, WORLD)
    return local


@pytest.fixture(scope="module")
def dp_results():
    return run_workers(_worker)


@pytest.mark.parametrize("label", ["hp", "fp8"])
def test_parameters_and_scales_stay_identical_across_ranks(dp_results, label):
    (_, params0, scales0), (_, params1, scales1) = (r[f"{label}/ddp"] for r in dp_results)
    assert torch.equal(params0, params1)
    if label == "fp8":
        assert torch.equal(scales0[0], scales1[0]) and torch.equal(scales0[1], scales1[1])
        assert (torch.cat(scales0) != 1).float().mean() > 0.5  # the updates ran on the reduced amaxes


# FP8 on CUDA: cuBLASLt sums the half-batch and whole-batch wgrads in different orders, and a float32 difference in a
# weight can flip its FP8 rounding at the next step's cast: parameters 2.7e-4 and scales (amaxes of those weights and
# of what they compute) 1.9e-5 apart, seen on 2 H200s with NCCL
@pytest.mark.parametrize("label, tol", [("hp", 1e-5), ("fp8", 1e-4 if DEVICE == "cpu" else 1e-3)])
def test_matches_single_process_on_the_whole_batch(dp_results, label, tol):
    for rank_results in dp_results:
        ddp_losses, ddp_params, ddp_scales = rank_results[f"{label}/ddp"]
        ref_losses, ref_params, ref_scales = rank_results[f"{label}/single"]
        local_total = torch.stack([r[f"{label}/ddp"][0] for r in dp_results]).sum(0)  # the global loss per step
        assert rel_error(local_total, ref_losses * WORLD) < tol
        assert rel_error(ddp_params, ref_params) < tol
        if label == "fp8":
            scale_tol = 1e-5 if DEVICE == "cpu" else tol
            assert rel_error(ddp_scales[0], ref_scales[0]) < scale_tol
            assert rel_error(ddp_scales[1] * WORLD, ref_scales[1]) < scale_tol


def test_fp8_ran(dp_results):
    fp8_losses, hp_losses = dp_results[0]["fp8/ddp"][0], dp_results[0]["hp/ddp"][0]
    assert rel_error(fp8_losses, hp_losses) > 1e-3


def test_bench_distributed_smoke(tmp_path):
    """benchmarks/bench_distributed.py under torchrun (tiny config; CPU and gloo, or the GPUs with NCCL): the
    variants time, and the counted SP collectives move the activations twice per step each way. Forward: 2
    all-gathers (QKV, FC1 inputs) in FP8 (one byte an element) and 2 reduce-scatters (proj, FC2 outputs); backward:
    2 all-gathers of the output gradients and 2 reduce-scatters of the gathered inputs' gradients; each of
    [seq, batch, hidden] elements, high precision ones in the parameter dtype. With per-rank scales
    (reduce_amax=False) the forward all-gathers are high precision too."""
    root = pathlib.Path(__file__).resolve().parents[1]
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-port",
           str(free_port()), str(root / "benchmarks" / "bench_distributed.py"), "--device", DEVICE, "--tiny",
           "--warmup", "1", "--iters", "2", "--json", str(out)]
    env = checkout_env()
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=180, env=env)
    if done.returncode != 0 and GLOO_EXIT_ABORT in done.stderr:  # (see GLOO_EXIT_ABORT) once more
        done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {row["variant"]: row for row in result["rows"]}
    assert list(rows) == ["TP=1", "TP=2", "TP=2+SP", "TP=2+SP per-rank scales"]
    assert all(row["ms"] > 0 for row in rows.values())
    elements, hp = 16 * 2 * 64, result["dtype"].removeprefix("torch.")  # tiny: seq 16, batch 2, hidden 64
    itemsize = torch.empty(0, dtype=getattr(torch, hp)).element_size()
    assert rows["TP=1"]["bytes"] == {}
    assert rows["TP=2"]["bytes"][f"all_reduce[{hp}]"] >= 4 * elements * itemsize
    sp = rows["TP=2+SP"]["bytes"]
    assert sp["all_gather_into_tensor[uint8]"] == 2 * elements  # forward, FP8
    assert sp[f"all_gather_into_tensor[{hp}]"] == 2 * elements * itemsize  # backward
    assert sp[f"reduce_scatter_tensor[{hp}]"] == 4 * elements * itemsize
    per_rank = rows["TP=2+SP per-rank scales"]["bytes"]
    assert "all_gather_into_tensor[uint8]" not in per_rank
    assert per_rank[f"all_gather_into_tensor[{hp}]"] == 4 * elements * itemsize
