"""torch.compile (default, graph breaks allowed) of a training step gives the eager results bit for bit: outputs,
input gradients and both scaling states, over several delayed-scaling steps. (fullgraph=True is not supported yet:
the backward's autograd-engine callback and the update's Python bookkeeping break the graph.)"""
import copy

import pytest
import torch

import transformer_fp8 as te


def _step(module, x):
    with te.fp8_autocast():
        return module(x)


@pytest.mark.parametrize("make", [
    lambda: te.Linear(32, 16, device="cpu", params_dtype=torch.float32),
    lambda: te.LayerNormMLP(32, 64, device="cpu", params_dtype=torch.float32),
], ids=["Linear", "LayerNormMLP"])
def test_compiled_step_equals_eager(make):
    torch._dynamo.reset()
    eager = make()
    compiled_module = copy.deepcopy(eager)
    compiled_step = torch.compile(_step, backend="aot_eager")
    for _ in range(3):
        x = torch.randn(24, 32)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        ye, yc = _step(eager, xe), compiled_step(compiled_module, xc)
        ye.square().sum().backward()
        yc.square().sum().backward()
        assert torch.equal(ye, yc)
        assert torch.equal(xe.grad, xc.grad)
        for name in ("fp8_fwd", "fp8_bwd"):
            assert torch.equal(getattr(eager, name).scale, getattr(compiled_module, name).scale)
    assert not torch.equal(eager.fp8_bwd.scale, torch.ones_like(eager.fp8_bwd.scale))  # the scales did move
