"""Linear vs a float64 plain-PyTorch reference: FP8 inside fp8_autocast, exact high precision outside."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import transformer_fp8 as te
from tests.module.helpers import (DEVICES, RECIPES, check_against_reference, check_linear_against_reference,
                                  randomize_vectors)
from tests.utils import OpCalls, rel_error


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead_shape,in_f,out_f", [((32,), 64, 48), ((3, 7), 128, 32)])  # 21 tokens: not % 16
def test_fp8_matches_reference(device, recipe_name, bias, lead_shape, in_f, out_f):
    check_linear_against_reference(device, RECIPES[recipe_name], bias, lead_shape, in_f, out_f)


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_io_adds_bias_in_fp32(device):
    m = te.Linear(64, 32, params_dtype=torch.float32, device=device)
    randomize_vectors(m)
    x = torch.randn(40, 64, device=device)
    check_against_reference(m, x, torch.randn(40, 32, device=device), RECIPES["delayed-HYBRID"])


@pytest.mark.parametrize("device", DEVICES)
def test_outside_autocast_is_nn_linear(device):
    m = te.Linear(64, 48, params_dtype=torch.float32, device=device)
    ref = nn.Linear(64, 48, device=device)
    m.load_state_dict(ref.state_dict(), strict=True)  # nn.Linear's state dict loads: same names, no FP8 state
    x = torch.randn(5, 9, 64, device=device, requires_grad=True)
    torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0)
    m(x).sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(m.weight.grad, ref.weight.grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [True, False])
def test_high_precision_path_follows_replaced_and_parametrized_weights(device, bias):
    """The high-precision path reads the parameters from _parameters: a weight or bias replaced by assignment, and a
    weight moved out by torch.nn.utils.parametrize, are what it uses."""
    m = te.Linear(64, 48, bias=bias, params_dtype=torch.float32, device=device)
    x = torch.randn(5, 64, device=device)
    m.weight = nn.Parameter(torch.randn(48, 64, device=device))
    if bias:
        m.bias = nn.Parameter(torch.randn(48, device=device))
    torch.testing.assert_close(m(x), F.linear(x, m.weight, m.bias), rtol=0, atol=0)
    torch.nn.utils.parametrize.register_parametrization(m, "weight", _Doubled())
    assert "weight" not in m._parameters
    torch.testing.assert_close(m(x), F.linear(x, 2 * m.parametrizations.weight.original, m.bias), rtol=0, atol=0)


class _Doubled(nn.Module):
    def forward(self, w):
        return 2 * w


@pytest.mark.parametrize("device", DEVICES)
def test_return_bias_leaves_bias_out(device):
    m = te.Linear(64, 32, return_bias=True, params_dtype=torch.bfloat16, device=device)
    randomize_vectors(m)
    x = torch.randn(16, 64, dtype=torch.bfloat16, device=device)
    with te.fp8_autocast():
        out, bias = m(x)
    assert bias is m.bias
    plain = torch.nn.functional.linear(x.float(), m.weight.float())
    assert rel_error(out, plain) < 0.1


@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_makes_no_transpose(device):
    m = te.Linear(64, 32, params_dtype=torch.bfloat16, device=device)
    x = torch.randn(16, 64, dtype=torch.bfloat16, device=device)
    with OpCalls("cast_transpose", lambda a: a["transpose"]) as calls, torch.no_grad(), te.fp8_autocast():
        m(x)
    assert calls.seen == [False, False]
    # training, input needs no grad: x gets a transpose (wgrad), the weight none (no dgrad)
    with OpCalls("cast_transpose", lambda a: a["transpose"]) as calls, te.fp8_autocast():
        m(x)
    assert calls.seen == [True, False]


@pytest.mark.parametrize("device", DEVICES)
def test_saves_only_fp8_tensors_for_backward(device):
    m = te.Linear(64, 32, params_dtype=torch.bfloat16, device=device)
    x = torch.randn(48, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), te.fp8_autocast():
        m(x)
    activations = [t for t in saved if t.numel() == x.numel()]
    assert activations and all(t.dtype == torch.float8_e4m3fn for t in activations)
    assert not any(t is x or t.dtype == torch.bfloat16 and t.numel() == x.numel() for t in saved)
