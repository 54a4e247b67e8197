"""forward(..., residual=) of Linear, LayerNormMLP and MultiheadAttention (the add in the GEMM's epilogue), and
TransformerLayer's use of it: the same results as the separate add, the residual's gradient is the output's (added
inside the norm backward when the residual is the module's own normalised input), and bad residuals are
rejected."""
import copy

import pytest
import torch

import transformer_fp8 as te
from tests.module.helpers import DEVICES
from tests.utils import rel_error
from transformer_fp8.module import norm as norm_ops
from transformer_fp8.module.transformer import TransformerLayer

BF16 = torch.bfloat16


def make(which, device):
    torch.manual_seed(0)
    if which == "Linear":
        return te.Linear(64, 48, params_dtype=BF16, device=device, fp8_min_gemm_size=0), (3, 10, 64), (3, 10, 48)
    if which == "LayerNormMLP":
        return te.LayerNormMLP(64, 128, params_dtype=BF16, device=device, fp8_min_gemm_size=0), (30, 64), (30, 64)
    return (te.MultiheadAttention(64, 4, attention_dropout=0.0, input_layernorm=True, params_dtype=BF16,
                                  device=device, attn_mask_type="causal"), (10, 3, 64), (10, 3, 64))


def run(module, x, residual, dy, fp8):
    x = x.clone().requires_grad_()
    residual = None if residual is None else residual.clone().requires_grad_()
    with te.fp8_autocast(enabled=fp8):
        out = module(x) if residual is None else module(x, residual=residual)
    out.backward(dy)
    return out.detach(), x.grad, (None if residual is None else residual.grad), [p.grad for p in module.parameters()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("which", ["Linear", "LayerNormMLP", "MultiheadAttention"])
@pytest.mark.parametrize("fp8", [True, False])
def test_residual_equals_a_separate_add(device, which, fp8):
    module, in_shape, out_shape = make(which, device)
    twin = copy.deepcopy(module)  # the same FP8 state: the same scales in both runs
    x = torch.randn(in_shape, device=device, dtype=BF16)
    residual = torch.randn(out_shape, device=device, dtype=BF16) * 3
    dy = torch.randn(out_shape, device=device, dtype=BF16)
    fused, dx, dres, grads = run(module, x, residual, dy, fp8)
    plain, dx_plain, _, grads_plain = run(twin, x, None, dy, fp8)
    separate = (plain.float() + residual.float()).to(BF16)
    # one rounding (fused) against two: a BF16 ulp here and there
    assert rel_error(fused, separate) < 4e-3 if fp8 else torch.equal(fused, separate)
    assert torch.equal(dres, dy)
    assert torch.equal(dx, dx_plain)
    for g, g_plain in zip(grads, grads_plain):
        assert (g is None and g_plain is None) or torch.equal(g, g_plain)


@pytest.mark.parametrize("device", DEVICES)
def test_transformer_layer_adds_residuals_in_gemms_only_without_dropout(device):
    layer = TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=BF16,
                             device=device)
    assert layer._adds_residuals_in_gemms()
    assert not TransformerLayer(64, 128, 4, hidden_dropout=0.1, params_dtype=BF16,
                                device=device)._adds_residuals_in_gemms()
    assert TransformerLayer(64, 128, 4, hidden_dropout=0.1, params_dtype=BF16,
                            device=device).eval()._adds_residuals_in_gemms()
    assert not TransformerLayer(64, 128, 4, hidden_dropout=0.0, params_dtype=BF16, device=device,
                                apply_residual_connection_post_layernorm=True)._adds_residuals_in_gemms()
    twin = copy.deepcopy(layer)
    twin._adds_residuals_in_gemms = lambda: False
    x = torch.randn(10, 3, 64, device=device, dtype=BF16)
    dy = torch.randn_like(x)
    # (the inner sum differs by a BF16 rounding; downstream FP8 casts can turn that into an FP8 step: E5M2 has 2
    # mantissa bits, and a 64-element bias gradient averages few of them)
    for fp8, out_tol, grad_tol in ((False, 4e-3, 1e-2), (True, 2e-2, 0.1)):
        fused, dx, _, grads = run(layer, x, None, dy, fp8)
        plain, dx_plain, _, grads_plain = run(twin, x, None, dy, fp8)
        assert rel_error(fused, plain) < out_tol and rel_error(dx, dx_plain) < grad_tol
        for g, g_plain in zip(grads, grads_plain):
            assert rel_error(g, g_plain) < grad_tol
        for module in (layer, twin):
            module.zero_grad(set_to_none=True)


@pytest.mark.parametrize("which", ["Linear", "LayerNormMLP"])
def test_bad_residual_names_the_argument(which):
    module, in_shape, out_shape = make(which, "cpu")
    x = torch.randn(in_shape, dtype=BF16)
    with pytest.raises(TypeError, match="residual"):
        module(x, residual=3.0)
    with pytest.raises(ValueError, match="residual: expected shape"):
        module(x, residual=torch.zeros(out_shape[:-1] + (7,), dtype=BF16))
    with pytest.raises(ValueError, match="residual: expected shape"):
        module(x, residual=torch.zeros(out_shape))  # float32, the input is bfloat16


@pytest.mark.parametrize("device", DEVICES)
def test_residual_may_be_the_input(device):
    """mlp(x, residual=x): x's gradient is the MLP's input gradient plus the output's, added inside the norm
    backward (torch.compile: see tests/test_compile.py's TransformerLayer)."""
    module, in_shape, out_shape = make("LayerNormMLP", device)
    twin = copy.deepcopy(module)
    x = torch.randn(in_shape, device=device, dtype=BF16)
    dy = torch.randn(out_shape, device=device, dtype=BF16)
    both = x.clone().requires_grad_()
    with te.fp8_autocast():
        out = module(both, residual=both)
    out.backward(dy)
    _, dx_plain, _, _ = run(twin, x, None, dy, True)
    assert rel_error(both.grad, dx_plain.float() + dy.float()) < 4e-3  # (added inside the norm backward)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", [True, False])
def test_attention_residual_may_be_the_input(device, fp8, monkeypatch):
    """mha(x, residual=x) with input_layernorm: x's gradient is the attention block's input gradient plus the
    output's; inside fp8_autocast the projection hands the output's to the QKV norm backward (dx_add), so autograd
    does no separate add."""
    module, in_shape, out_shape = make("MultiheadAttention", device)
    twin = copy.deepcopy(module)
    x = torch.randn(in_shape, device=device, dtype=BF16)
    dy = torch.randn(out_shape, device=device, dtype=BF16)
    dx_adds = []
    real_norm_bwd = norm_ops.norm_bwd

    def recording(normalization, grad, x, mean, rstd, weight, zero_centered_gamma, dx_add=None):
        dx_adds.append(dx_add is not None)
        return real_norm_bwd(normalization, grad, x, mean, rstd, weight, zero_centered_gamma, dx_add)
    monkeypatch.setattr(norm_ops, "norm_bwd", recording)
    both = x.clone().requires_grad_()
    with te.fp8_autocast(enabled=fp8):
        out = module(both, residual=both)
    out.backward(dy)
    _, dx_plain, _, grads_plain = run(twin, x, None, dy, fp8)
    assert rel_error(both.grad, dx_plain.float() + dy.float()) < 4e-3
    for p, g_plain in zip(module.parameters(), grads_plain):
        assert torch.equal(p.grad, g_plain)
    assert dx_adds[0] is fp8  # (the high-precision path's norm is a separate autograd node: autograd adds there)

