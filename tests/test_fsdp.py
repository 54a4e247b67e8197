"""FSDP2 (torch.distributed.fsdp.fully_shard) with our modules: 2 processes (gloo on CPU; NCCL on 2 GPUs with
TFP8_DIST_BACKEND=nccl, see tests/dist_utils.py), one spawned job; plus single-process tests of the Float8Tensor
pieces FSDP2 relies on.

Each rank trains a model of our modules (Linear, LayerNormMLP; each module and the root fully_shard-ed) on its half
of every global batch for a few SGD steps inside fp8_autocast (delayed scaling, amaxes reduced over the world), and
the single-process model on the whole batch (loss divided by the world size: FSDP averages the gradients).
- high-precision parameters: losses, first-step gradients and final parameters equal the single-process run's.
- fp8_model_init weights (Float8Tensor parameters): each rank's shard stays a Float8Tensor, the all-gather moves FP8
  bytes (recorded in fsdp_post_all_gather), and training follows the single-process run within FP8 tolerance (each
  rank re-quantizes its shard after the optimizer step with its own scale, the single process the whole tensor).
"""
import pytest
import torch
import torch.distributed as dist

import transformer_fp8 as te
from transformer_fp8 import Float8Tensor, recipe
from tests.dist_utils import DEVICE, WORLD, run_workers
from tests.utils import FP8_RTOL, rel_error

TOKENS, HIDDEN, FFN, STEPS = 14, 32, 64, 3


def _model(fp8_params):
    torch.manual_seed(0)
    with te.fp8_model_init(fp8_params):
        return torch.nn.Sequential(te.Linear(HIDDEN, HIDDEN, params_dtype=torch.float32, device=DEVICE),
                                   te.LayerNormMLP(HIDDEN, FFN, params_dtype=torch.float32, device=DEVICE))


def _full(t):
    """A parameter or gradient as a full plain tensor (DTensors gathered, Float8Tensors dequantized)."""
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return (t.dequantize() if isinstance(t, Float8Tensor) else t).detach().flatten()


def _train(model, rank, loss_divisor, foreach):
    """STEPS SGD steps; rank None: the whole global batch. Returns (losses, first-step grads, final parameters)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, foreach=foreach)
    fp8_recipe = recipe.DelayedScaling(amax_history_len=4)
    losses, grads = [], None
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        x = torch.randn(WORLD * TOKENS, HIDDEN).to(DEVICE)
        x = x if rank is None else x.chunk(WORLD)[rank]
        with te.fp8_autocast(fp8_recipe=fp8_recipe, fp8_group=dist.group.WORLD):
            out = model(x)
        loss = out.square().sum() / loss_divisor
        loss.backward()
        if grads is None:
            grads = torch.cat([_full(p.grad) for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), grads, torch.cat([_full(p) for p in model.parameters()])


def _sharded(fp8_params):
    """The model with each module and the root fully_shard-ed, and the types of its weights' local shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(DEVICE, (WORLD,))
    model = _model(fp8_params)
    for module in model:
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    shards = [type(p.to_local()).__name__ for p in model.parameters() if p.dim() == 2]
    return model, shards


def _worker(rank):
    all_gathered = []
    post_all_gather = Float8Tensor.fsdp_post_all_gather

    def recording_post_all_gather(self, outputs, *args, **kwargs):
        all_gathered.append(outputs[0].dtype)
        return post_all_gather(self, outputs, *args, **kwargs)

    Float8Tensor.fsdp_post_all_gather = recording_post_all_gather
    try:
        local = {}
        for label, fp8_params, foreach in (("hp", False, False), ("fp8_params", True, False),
                                           ("fp8_params_foreach", True, True)):
            all_gathered.clear()
            model, local[f"{label}/shards"] = _sharded(fp8_params)
            local[f"{label}/fsdp"] = _train(model, rank, 1, foreach)
            local[f"{label}/all_gathered"] = list(all_gathered)
            local[f"{label}/single"] = _train(_model(fp8_params), None, WORLD, foreach)
        return local
    finally:
        Float8Tensor.fsdp_post_all_gather = post_all_gather


@pytest.fixture(scope="module")
def fsdp_results():
    return run_workers(_worker)


def test_high_precision_parameters_match_single_process(fsdp_results):
    for local in fsdp_results:
        (_, grads, params), (ref_losses, ref_grads, ref_params) = local["hp/fsdp"], local["hp/single"]
        assert local["hp/shards"] == ["Tensor"] * 3 and local["hp/all_gathered"] == []
        global_losses = torch.stack([r["hp/fsdp"][0] for r in fsdp_results]).sum(0)
        assert rel_error(global_losses[:1], ref_losses[:1] * WORLD) < 1e-5
        # FP8 GEMMs: float32 summation order (split batch) may flip an FP8 rounding of dy and of later weights
        assert rel_error(grads, ref_grads) < 5e-3
        assert rel_error(global_losses, ref_losses * WORLD) < 5e-3
        assert rel_error(params, ref_params) < 5e-3


@pytest.mark.parametrize("label", ["fp8_params", "fp8_params_foreach"])
def test_fp8_parameters_all_gather_fp8_and_train(fsdp_results, label):
    for local in fsdp_results:
        assert local[f"{label}/shards"] == ["Float8Tensor"] * 3  # the weights' shards (biases, norms: plain)
        # 3 weights per forward and per backward (re-gathered: reshard after forward), every step
        assert local[f"{label}/all_gathered"] == [torch.float8_e4m3fn] * (3 * 2 * STEPS)
        (_, grads, params), (ref_losses, ref_grads, ref_params) = local[f"{label}/fsdp"], \
            local[f"{label}/single"]
        global_losses = torch.stack([r[f"{label}/fsdp"][0] for r in fsdp_results]).sum(0)
        assert rel_error(global_losses[:1], ref_losses[:1] * WORLD) < 1e-5  # step 1: the same FP8 weights
        assert rel_error(grads, ref_grads) < 5e-3  # (summation order may flip an FP8 rounding)
        tol = FP8_RTOL[torch.float8_e4m3fn]  # then each weight re-quantized per shard vs as a whole
        assert rel_error(global_losses, ref_losses * WORLD) < tol
        assert rel_error(params, ref_params) < tol
        assert global_losses[-1] < global_losses[0]  # it trains
    assert torch.equal(fsdp_results[0][f"{label}/fsdp"][2], fsdp_results[1][f"{label}/fsdp"][2])


# --- single process: the Float8Tensor pieces FSDP2 uses ---
def test_view_ops_and_new_zeros_keep_float8_tensor():
    t = Float8Tensor.from_hp(torch.randn(6, 4))
    value = t.dequantize()
    pieces = torch.chunk(t, 2)
    assert all(isinstance(p, Float8Tensor) and p._scale_inv is t._scale_inv for p in pieces)
    assert torch.equal(torch.cat([p.dequantize() for p in pieces]), value)
    narrow, flat = t.narrow(0, 1, 3), t.view(-1)
    assert isinstance(narrow, Float8Tensor) and torch.equal(narrow.dequantize(), value[1:4])
    assert isinstance(flat, Float8Tensor) and torch.equal(flat.dequantize(), value.view(-1))
    zeros = t.new_zeros((3, 4))
    assert isinstance(zeros, Float8Tensor) and zeros._data.dtype == t._data.dtype and not zeros.dequantize().any()
    zeros.copy_(pieces[1])
    assert torch.equal(zeros.dequantize(), value[3:])


def test_foreach_in_place_ops_requantize_float8_tensors():
    hp = torch.randn(5, 3)
    t, plain = Float8Tensor.from_hp(hp), torch.zeros(4)
    torch._foreach_add_([t, plain], [torch.ones(5, 3), torch.ones(4)])
    assert isinstance(t, Float8Tensor) and torch.equal(plain, torch.ones(4))
    assert rel_error(t.dequantize(), hp + 1) < 0.06


def test_post_all_gather_rescales_to_the_largest_scale_inv():
    shards = [Float8Tensor.from_hp(torch.randn(2, 8) * s) for s in (1.0, 30.0)]  # two ranks, different scales
    data = torch.cat([s._data for s in shards])
    scale_invs = torch.cat([s._scale_inv for s in shards])
    expected = torch.cat([s.dequantize() for s in shards])
    full, inner = shards[0].fsdp_post_all_gather((data, scale_invs), None, torch.float32)
    assert isinstance(full, Float8Tensor) and full._data.dtype == torch.float8_e4m3fn
    assert full._scale_inv.item() == scale_invs.max().item()
    assert torch.equal(full.dequantize()[2:], expected[2:])  # the rank with the largest scale_inv: unchanged
    assert rel_error(full.dequantize(), expected) < 0.06
    full._data.zero_()
    assert full.fsdp_post_all_gather((data, scale_invs), None, torch.float32, out=full) is None
    assert torch.equal(full._data.view(torch.uint8), inner[0].view(torch.uint8))  # written into the same storage
    assert torch.equal(full.dequantize()[2:], expected[2:])
