"""The first step of delayed scaling: scales calibrated from the step's own tensors (see base.ScalingState), so that
small gradients are not flushed to zero by the initial scale 1."""
import pytest
import torch

import transformer_fp8 as te
from tests.module.helpers import DEVICES, GRAD_TOL, fp8_steps, reference_grads
from tests.utils import rel_error
from transformer_fp8 import recipe

MODULES = {
    "Linear": lambda **kw: te.Linear(64, 48, **kw),
    "LayerNormLinear": lambda **kw: te.LayerNormLinear(64, 48, **kw),
    "LayerNormMLP": lambda **kw: te.LayerNormMLP(64, 96, **kw),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(MODULES))
@pytest.mark.parametrize("fp8_format", [recipe.Format.E4M3, recipe.Format.HYBRID])
def test_first_step_gradients_of_small_magnitude(device, name, fp8_format):
    """Gradients of ~1e-6 (as from a mean loss over many tokens) on a fresh module: the first step's input and weight
    gradients are within FP8 tolerance of the float64 reference (with the initial scale 1 they were all zero in
    E4M3)."""
    module = MODULES[name](params_dtype=torch.bfloat16, device=device, fp8_min_gemm_size=0)
    x = torch.randn(32, 64, dtype=torch.bfloat16, device=device)
    dy = torch.randn(32, module(x).shape[-1], dtype=torch.bfloat16, device=device) * 1e-6
    _, ref = reference_grads(module, x, dy)
    _, grads = fp8_steps(module, x, dy, recipe.DelayedScaling(fp8_format=fp8_format), steps=1)
    for key, want in ref.items():
        assert rel_error(grads[key], want) <= GRAD_TOL, key


@pytest.mark.parametrize("device", DEVICES)
def test_module_called_twice_in_its_first_step(device):
    """Two calls of one module in one autocast on its first step, on inputs 100x apart: the second call calibrates a
    smaller input scale, and the first call's saved FP8 input keeps the scale it was cast with (weight gradient
    within FP8 tolerance of float64)."""
    module = te.Linear(64, 48, bias=False, params_dtype=torch.float32, device=device, fp8_min_gemm_size=0)
    x1, x2 = torch.randn(32, 64, device=device), 100 * torch.randn(32, 64, device=device)
    dy1, dy2 = torch.randn(32, 48, device=device), torch.randn(32, 48, device=device)
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
        out1, out2 = module(x1), module(x2)
    torch.autograd.backward([out1, out2], [dy1, dy2])
    weight = module.weight.detach().double()
    ref = dy1.double().t() @ x1.double() + dy2.double().t() @ x2.double()
    assert rel_error(module.weight.grad, ref) <= GRAD_TOL
    assert rel_error(out1, x1.double() @ weight.t()) <= 0.1
