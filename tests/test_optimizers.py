"""te.optimizers.FusedAdam (TE's arguments) against torch's Adam / AdamW: AdamW and L2 modes, float32 and 16-bit
moments, master weights, bias correction off, zero_grad, refusals; on the GPU against torch's fused AdamW."""
import pytest
import torch

import transformer_fp8 as te
from tests.test_optim import models, train
from tests.utils import assert_close_rel

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CPU_RTOL = 2e-6  # (float32 steps rounded otherwise than torch's: lerp, addcdiv)


def test_is_exported_as_te_names_it():
    assert te.optimizers.FusedAdam is te.optimizers.__dict__["FusedAdam"]
    assert te.optimizers.FusedAdamW is te.FusedAdamW


@pytest.mark.parametrize("adam_w_mode,reference", [(True, torch.optim.AdamW), (False, torch.optim.Adam)])
def test_float32_follows_torch(adam_w_mode, reference):
    ours, theirs = models()
    train(ours, te.optimizers.FusedAdam(ours.parameters(), adam_w_mode=adam_w_mode, **HYPER), steps=5)
    train(theirs, reference(theirs.parameters(), **HYPER), steps=5)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert_close_rel(a, b, CPU_RTOL)


def test_bf16_parameters_keep_float32_moments_by_default_and_masters_on_request():
    ours, reference = models(dtype=torch.bfloat16)
    master = [p.detach().float().clone().requires_grad_() for p in reference.parameters()]
    optimizer = te.optimizers.FusedAdam(ours.parameters(), master_weights=True, **HYPER)
    torch_optimizer = torch.optim.AdamW(master, **HYPER)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        for p, m in zip(ours.parameters(), master):
            grad = (torch.randn(p.shape, generator=g) * 1e-2).bfloat16()
            p.grad, m.grad = grad, grad.float()
        optimizer.step()
        torch_optimizer.step()
        optimizer.zero_grad()
    for p, m in zip(ours.parameters(), master):
        state = optimizer.state[p]
        assert state["exp_avg"].dtype == torch.float32 and state["master_param"].dtype == torch.float32
        assert_close_rel(state["master_param"], m, CPU_RTOL)  # the float32 trajectory, as torch's on float32 copies
        assert torch.equal(p.detach(), state["master_param"].bfloat16())
        assert p.grad is None  # (set_grad_none)


def test_moments_in_the_parameter_dtype_and_no_bias_correction():
    ours, _ = models(dtype=torch.bfloat16)
    optimizer = te.optimizers.FusedAdam(ours.parameters(), exp_avg_dtype=torch.bfloat16,
                                        exp_avg_sq_dtype=torch.bfloat16, bias_correction=False, **HYPER)
    start = [p.detach().double().clone() for p in ours.parameters()]
    train(ours, optimizer, steps=1)
    g = torch.Generator().manual_seed(1)
    for p, p0 in zip(ours.parameters(), start):
        grad = (torch.randn(p.shape, generator=g) * 1e-2).bfloat16().double()
        assert optimizer.state[p]["exp_avg"].dtype == torch.bfloat16
        m, v = 0.1 * grad, 0.05 * grad * grad  # (one step, no bias correction)
        want = p0 * (1 - HYPER["lr"] * HYPER["weight_decay"]) - HYPER["lr"] * m / (v.sqrt() + HYPER["eps"])
        assert_close_rel(p.detach(), want, 4e-3)


def test_state_dict_round_trip_keeps_float32_moments_and_masters():
    """torch's load_state_dict casts state to the parameter's dtype: FusedAdam restores its float32 tensors, and the
    next step equals the step of an optimizer that was never saved (bit for bit)."""
    ours, other = models(dtype=torch.bfloat16)
    kwargs = dict(master_weights=True, **HYPER)
    optimizer = te.optimizers.FusedAdam(ours.parameters(), **kwargs)
    train(ours, optimizer, steps=2)
    other.load_state_dict(ours.state_dict())
    restored = te.optimizers.FusedAdam(other.parameters(), **kwargs)
    restored.load_state_dict(optimizer.state_dict())
    for p in other.parameters():
        state = restored.state[p]
        assert state["exp_avg"].dtype == torch.float32 and state["master_param"].dtype == torch.float32
    train(ours, optimizer, steps=1, seed=7)
    train(other, restored, steps=1, seed=7)
    for a, b in zip(ours.parameters(), other.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(optimizer.state[a]["master_param"], restored.state[b]["master_param"])


def test_zero_grad_zeroes_without_set_grad_none():
    ours, _ = models()
    optimizer = te.optimizers.FusedAdam(ours.parameters(), set_grad_none=False)
    for p in ours.parameters():
        p.grad = torch.ones_like(p)
    optimizer.zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in ours.parameters())


@pytest.mark.parametrize("kwargs,match", [
    (dict(amsgrad=True), r"amsgrad: FusedAdam supports False only"),
    (dict(capturable=True), r"capturable: FusedAdam supports False only"),
    (dict(master_weights=True, master_weight_dtype=torch.bfloat16), r"master_weight_dtype: .*torch.float32 only"),
    (dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8), r"exp_avg_dtype: FusedAdam supports"),
    (dict(exp_avg_sq_dtype=torch.bfloat16), r"exp_avg_sq_dtype: .*the same dtype as exp_avg_dtype"),
    (dict(use_decoupled_grad=True), r"use_decoupled_grad"),
    (dict(store_param_remainders=True), r"store_param_remainders"),
    (dict(lr=-1.0), r"lr: FusedAdam supports >= 0"),
])
def test_refuses_unsupported_arguments(kwargs, match):
    ours, _ = models()
    with pytest.raises(ValueError, match=match):
        te.optimizers.FusedAdam(ours.parameters(), **kwargs)


def test_refuses_16_bit_moments_of_other_parameters_at_the_first_step():
    ours, _ = models()  # float32 parameters
    optimizer = te.optimizers.FusedAdam(ours.parameters(), exp_avg_dtype=torch.bfloat16,
                                        exp_avg_sq_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"exp_avg_dtype: .*torch.bfloat16 for a torch.float32 parameter"):
        train(ours, optimizer, steps=1)


@pytest.mark.gpu
def test_bf16_model_on_cuda_with_masters_follows_torch_fused_adamw_on_float32_copies():
    ours, _ = models(dtype=torch.bfloat16, device="cuda")
    master = [p.detach().float().clone().requires_grad_() for p in ours.parameters()]
    optimizer = te.optimizers.FusedAdam(ours.parameters(), master_weights=True, **HYPER)
    torch_optimizer = torch.optim.AdamW(master, fused=True, **HYPER)
    g = torch.Generator().manual_seed(3)
    for _ in range(6):
        for p, m in zip(ours.parameters(), master):
            grad = (torch.randn(p.shape, generator=g) * 1e-2).bfloat16().cuda()
            p.grad, m.grad = grad, grad.float()
        optimizer.step()
        torch_optimizer.step()
    for p, m in zip(ours.parameters(), master):
        assert_close_rel(optimizer.state[p]["master_param"], m, 2e-6)
        assert torch.equal(p.detach(), optimizer.state[p]["master_param"].bfloat16())
