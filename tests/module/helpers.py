"""Shared pieces of the module tests: devices, recipes, float64 reference forwards, FP8 training steps."""
import pytest
import torch
import torch.nn.functional as F

import transformer_fp8 as te
from transformer_fp8 import recipe
from tests.utils import rel_error
from transformer_fp8.module.layernorm_mlp import ACTIVATIONS

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
RECIPES = {
    "delayed-E4M3": recipe.DelayedScaling(fp8_format=recipe.Format.E4M3, amax_history_len=4),
    "delayed-HYBRID": recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=4),
    "current-E4M3": recipe.Float8CurrentScaling(fp8_format=recipe.Format.E4M3),
    "current-HYBRID": recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID),
}
# ||out - ref|| / ||ref|| against float64 math. Forward: every GEMM operand is rounded once to E4M3 (relative error
# <= 2**-4, ~0.02 RMS), two operands per GEMM and up to three roundings in a row in LayerNormMLP (norm out,
# activation out, plus the BF16 output) measure 0.04-0.07; 0.1 leaves room for seeds. Gradients add the grad-output
# rounding (E5M2 in HYBRID: 2**-3, ~0.04 RMS) and chain two GEMMs in LayerNormMLP: measured 0.06-0.11, bound 0.2.
FWD_TOL, GRAD_TOL = 0.1, 0.2
# ReLU's derivative is a step: the FP8 error of fc1's output (~0.04 of its RMS) flips the sign of ~1.6% of the entries,
# each costing its whole gradient: sqrt(2 * 0.016) ~ 0.18 relative error upstream of it (measured 0.13-0.24).
RELU_GRAD_TOL = 0.3


def dequantized(p):
    return p.dequantize() if isinstance(p, te.Float8Tensor) else p


def randomize_vectors(module, scale=0.2):
    """Give biases and norm weights random values (zero or one would hide mistakes)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * scale)


def params64(module):
    return {n: dequantized(p).detach().double().requires_grad_() for n, p in module.named_parameters()}


def _norm64(module, x, p, prefix):
    gamma = p[prefix + "weight"] + (1 if module.zero_centered_gamma else 0)
    if module.normalization == "LayerNorm":
        return F.layer_norm(x, x.shape[-1:], gamma, p[prefix + "bias"], module.eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.eps) * gamma


def reference_forward(module, x, p):
    """Plain-PyTorch forward of `module` on float64 input x with float64 parameters p (the main output only)."""
    if isinstance(module, te.Linear):
        return F.linear(x, p["weight"], None if module.return_bias else p.get("bias"))
    if isinstance(module, (te.LayerNorm, te.RMSNorm)):
        return _norm64(module, x, p, "")
    ln = _norm64(module, x, p, "layer_norm_")
    if isinstance(module, te.LayerNormLinear):
        return F.linear(ln, p["weight"], p.get("bias"))
    act = ACTIVATIONS[module.activation](F.linear(ln, p["fc1_weight"], p.get("fc1_bias")))
    return F.linear(act, p["fc2_weight"], p.get("fc2_bias"))


def reference_grads(module, x, dy):
    """(out, {input and parameter name: grad}) of the float64 reference."""
    p = params64(module)
    x64 = x.detach().double().requires_grad_()
    out = reference_forward(module, x64, p)
    out.backward(dy.double())
    return out.detach(), {"input": x64.grad, **{n: t.grad for n, t in p.items()}}


def fp8_steps(module, x, dy, fp8_recipe, steps=2):
    """Run `steps` forward+backward steps in FP8 (the scales adapt under delayed scaling); (out, grads) of the last."""
    for _ in range(steps):
        module.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_()
        with te.fp8_autocast(fp8_recipe=fp8_recipe):
            out = module(xi)
        out.backward(dy)
    grads = {"input": xi.grad, **{n: q.grad for n, q in module.named_parameters()}}
    return out.detach(), grads


def check_against_reference(module, x, dy, fp8_recipe, grad_tol=GRAD_TOL):
    ref_out, ref_grads = reference_grads(module, x, dy)
    out, grads = fp8_steps(module, x, dy, fp8_recipe)
    assert out.dtype == x.dtype and out.shape == ref_out.shape
    err = rel_error(out, ref_out)
    assert 1e-3 < err <= FWD_TOL, f"forward: relative error {err:.3e} (FP8 should be visible but within {FWD_TOL})"
    for name, ref in ref_grads.items():
        got = grads[name]
        assert got is not None and got.shape == ref.shape, name
        rel = rel_error(got, ref)
        assert rel <= grad_tol, f"grad of {name}: relative error {rel:.3e} > {grad_tol}"


def check_linear_against_reference(device, fp8_recipe, bias, lead_shape, in_f, out_f):
    """A BF16 Linear(in_f, out_f) with random vectors, random x [*lead_shape, in_f] and dy, against float64 under
    fp8_recipe (check_against_reference)."""
    m = te.Linear(in_f, out_f, bias=bias, params_dtype=torch.bfloat16, device=device)
    randomize_vectors(m)
    x = torch.randn(*lead_shape, in_f, dtype=torch.bfloat16, device=device)
    dy = torch.randn(*lead_shape, out_f, dtype=torch.bfloat16, device=device)
    check_against_reference(m, x, dy, fp8_recipe)
