"""LayerNormLinear vs a float64 plain-PyTorch reference (norm -> linear)."""
import pytest
import torch

import transformer_fp8 as te
from tests.module.helpers import DEVICES, RECIPES, check_against_reference, params64, randomize_vectors, \
    reference_forward
from tests.utils import rel_error


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("bias,zero_centered_gamma,lead_shape", [(True, False, (32,)), (False, True, (3, 7))])
def test_fp8_matches_reference(device, recipe_name, normalization, bias, zero_centered_gamma, lead_shape):
    m = te.LayerNormLinear(64, 48, bias=bias, normalization=normalization, zero_centered_gamma=zero_centered_gamma,
                           params_dtype=torch.bfloat16, device=device)
    randomize_vectors(m)
    x = torch.randn(*lead_shape, 64, dtype=torch.bfloat16, device=device) * 3 + 1
    dy = torch.randn(*lead_shape, 48, dtype=torch.bfloat16, device=device)
    check_against_reference(m, x, dy, RECIPES[recipe_name])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_outside_autocast_matches_reference(device, normalization):
    m = te.LayerNormLinear(64, 32, normalization=normalization, params_dtype=torch.float32, device=device)
    randomize_vectors(m)
    x = torch.randn(2, 9, 64, device=device)
    assert rel_error(m(x), reference_forward(m, x.double(), params64(m))) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe_name", ["delayed-HYBRID", "current-HYBRID"])
def test_return_layernorm_output_and_its_gradient(device, recipe_name):
    m = te.LayerNormLinear(64, 32, return_layernorm_output=True, return_bias=True, params_dtype=torch.bfloat16,
                           device=device)
    randomize_vectors(m)
    x = torch.randn(24, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=RECIPES[recipe_name]):
        out, bias, ln_out = m(x)
    assert bias is m.bias and ln_out.dtype == x.dtype
    p = params64(m)
    x64 = x.detach().double().requires_grad_()
    ln64 = torch.nn.functional.layer_norm(x64, (64,), p["layer_norm_weight"], p["layer_norm_bias"], m.eps)
    assert rel_error(ln_out, ln64) < 1e-2
    assert rel_error(out, ln64 @ p["weight"].t()) < 0.1
    (out.float().sum() + ln_out.float().pow(2).sum()).backward()
    (ln64 @ p["weight"].t()).sum().add(ln64.pow(2).sum()).backward()
    assert rel_error(x.grad, x64.grad) < 0.1
