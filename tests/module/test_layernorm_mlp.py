"""LayerNormMLP vs a float64 plain-PyTorch reference (norm -> fc1 -> activation -> fc2)."""
import pytest
import torch

import transformer_fp8 as te
from tests.module.helpers import DEVICES, GRAD_TOL, RECIPES, RELU_GRAD_TOL, check_against_reference, params64, \
    randomize_vectors, reference_forward
from tests.utils import rel_error


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("activation", ["gelu", "swiglu", "relu"])
@pytest.mark.parametrize("normalization,bias,lead_shape", [("LayerNorm", True, (32,)), ("RMSNorm", False, (3, 7))])
def test_fp8_matches_reference(device, recipe_name, activation, normalization, bias, lead_shape):
    m = te.LayerNormMLP(64, 96, bias=bias, normalization=normalization, activation=activation,
                        params_dtype=torch.bfloat16, device=device)
    randomize_vectors(m)
    x = torch.randn(*lead_shape, 64, dtype=torch.bfloat16, device=device)
    dy = torch.randn(*lead_shape, 64, dtype=torch.bfloat16, device=device)
    check_against_reference(m, x, dy, RECIPES[recipe_name], RELU_GRAD_TOL if activation == "relu" else GRAD_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ["gelu", "swiglu", "relu"])
def test_outside_autocast_matches_reference(device, activation):
    m = te.LayerNormMLP(64, 96, activation=activation, params_dtype=torch.float32, device=device)
    randomize_vectors(m)
    x = torch.randn(2, 9, 64, device=device)
    assert rel_error(m(x), reference_forward(m, x.double(), params64(m))) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_parameter_shapes_and_return_values(device):
    m = te.LayerNormMLP(64, 96, activation="swiglu", return_bias=True, return_layernorm_output=True,
                        params_dtype=torch.bfloat16, device=device)
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes == {"layer_norm_weight": (64,), "layer_norm_bias": (64,), "fc1_weight": (192, 64),
                      "fc1_bias": (192,), "fc2_weight": (64, 96), "fc2_bias": (64,)}
    x = torch.randn(16, 64, dtype=torch.bfloat16, device=device)
    with te.fp8_autocast():
        out, bias, ln_out = m(x)
    assert out.shape == x.shape and bias is m.fc2_bias and ln_out.shape == x.shape
