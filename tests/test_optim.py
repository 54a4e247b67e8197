"""FusedAdamW against torch.optim.AdamW (CPU and CUDA), its groups, state and refusals."""
import copy

import pytest
import torch

import transformer_fp8 as te
from tests.utils import assert_close_rel

# ||ours - torch's|| / ||torch's|| after a few float32 steps on the same gradients: torch rounds otherwise (lerp,
# addcdiv). Missing weight decay alone would be ~1e-3.
CPU_RTOL = 2e-6


def models(seed=0, dtype=torch.float32, device="cpu"):
    """Two identical small models (a Linear and a LayerNorm: matrices, vectors, a bias)."""
    torch.manual_seed(seed)
    a = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.LayerNorm(40)).to(device=device, dtype=dtype)
    b = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.LayerNorm(40)).to(device=device, dtype=dtype)
    b.load_state_dict(a.state_dict())
    return a, b


def train(model, optimizer, steps, seed=1, device="cpu"):
    """`steps` optimizer steps on the same seeded random gradients for every model (a forward/backward would feed
    each optimizer's rounding back into its next gradient, and AdamW's m / sqrt(v) amplifies those where a gradient is
    near zero)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    for _ in range(steps):
        for p in model.parameters():
            grad = torch.randn(p.shape, generator=g) * 1e-2
            if p.requires_grad:
                p.grad = grad.to(device=device, dtype=p.dtype)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("maximize", [False, True])
def test_follows_torch_adamw_on_cpu(maximize):
    ours, theirs = models()
    train(ours, te.FusedAdamW(ours.parameters(), **HYPER, maximize=maximize), 6)
    train(theirs, torch.optim.AdamW(theirs.parameters(), **HYPER, maximize=maximize, foreach=False), 6)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert_close_rel(a, b, CPU_RTOL)


def test_groups_and_parameters_without_gradients():
    """Each group's own lr and weight decay; a parameter with no gradient keeps its value and gets no state."""
    ours, theirs = models()
    frozen_ours, frozen_theirs = ours[1].bias, theirs[1].bias
    frozen_ours.requires_grad_(False)
    frozen_theirs.requires_grad_(False)

    def groups(m):
        return [dict(params=[m[0].weight, m[0].bias], lr=1e-2), dict(params=[m[1].weight, m[1].bias],
                                                                      weight_decay=0.0)]
    optimizer = te.FusedAdamW(groups(ours), **HYPER)
    train(ours, optimizer, 4)
    train(theirs, torch.optim.AdamW(groups(theirs), **HYPER, foreach=False), 4)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert_close_rel(a, b, CPU_RTOL)
    assert frozen_ours not in optimizer.state
    assert optimizer.state[ours[0].weight]["step"] == 4


def test_loads_torch_adamw_state_and_continues_alike():
    ours, theirs = models()
    torch_optimizer = torch.optim.AdamW(theirs.parameters(), **HYPER, foreach=False)
    train(theirs, torch_optimizer, 3)
    ours.load_state_dict(theirs.state_dict())
    optimizer = te.FusedAdamW(ours.parameters(), **HYPER)
    optimizer.load_state_dict(copy.deepcopy(torch_optimizer.state_dict()))  # (else both update the same moments)
    train(ours, optimizer, 3, seed=5)
    train(theirs, torch_optimizer, 3, seed=5)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert_close_rel(a, b, CPU_RTOL)
    assert optimizer.state[ours[0].weight]["step"] == 6


@pytest.mark.parametrize("kwargs,match", [(dict(amsgrad=True), "amsgrad"), (dict(lr=-1.0), "lr: expected >= 0"),
                                          (dict(betas=(0.9, 1.0)), "betas: expected each in"),
                                          (dict(weight_decay=-1.0), "weight_decay: expected >= 0")])
def test_refuses_unsupported_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        te.FusedAdamW([torch.nn.Parameter(torch.zeros(3))], **kwargs)


def test_refuses_non_contiguous_parameters():
    p = torch.nn.Parameter(torch.zeros(4, 6).t())
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="parameters must be contiguous"):
        te.FusedAdamW([p]).step()


def test_closure_loss_is_returned():
    p = torch.nn.Parameter(torch.ones(3))
    optimizer = te.FusedAdamW([p], lr=0.1)

    def closure():
        optimizer.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss
    assert optimizer.step(closure).item() == 3.0
    assert (p < 1).all()


@pytest.mark.gpu
def test_bf16_model_on_cuda_follows_torch_fused_adamw():
    """BF16 parameters and moments: our trajectory stays within a few BF16 roundings of torch's fused AdamW."""
    ours, theirs = models(dtype=torch.bfloat16, device="cuda")
    train(ours, te.FusedAdamW(ours.parameters(), **HYPER), 5, device="cuda")
    train(theirs, torch.optim.AdamW(theirs.parameters(), **HYPER, fused=True), 5, device="cuda")
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)
