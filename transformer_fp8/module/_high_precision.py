"""The fused modules' high-precision (BF16 / FP16 / FP32: outside fp8_autocast) path with lean saves: the backward
recomputes the tensors it can rebuild with one cheap elementwise pass instead of keeping them from the forward.

- norm_linear: out = norm(x) Wᵀ + b (LayerNormLinear, LayerNormMLP's FC1). Saves x, mean/rstd and nothing of
  norm(x) [M, K]: the backward runs the norm's forward kernel again (the same kernel on the same input: the same
  bits) for the wgrad, after the dgrad GEMM, and drops it after the wgrad.
- activation_linear: out = act(h) Wᵀ + b (LayerNormMLP's FC2 over FC1's output h). Saves h, which the activation's
  backward needs anyway, and nothing of act(h) [M, F]: the backward runs the activation kernel again for the FC2
  wgrad and drops it after.
Autograd's composition of the same ops (_NormFunction / fused_activation, then F.linear) keeps norm(x) and act(h)
as well, as Transformer Engine's BF16 modules do: one [tokens, hidden] tensor per norm and one [tokens, ffn] per MLP
more. The GEMMs and kernels are the composition's, so outputs and gradients are the same.
Opt-in (the modules' recompute_in_backward, default False: the recomputes cost kernel time that TE's BF16
modules, which keep both tensors, do not spend). Taken by the modules where nothing else needs the dropped tensor:
no tensor parallelism, no wgrad fusion into main_grad, no calibration (it reads them), no returned norm output, not
under torch.compile (which traces the composition), dtypes our norm / activation kernels take.
"""
import torch
import torch.nn.functional as F

from ..ops import activation_high_precision, tfp8
from .activation import KERNEL_DTYPES
from . import norm as norm_ops  # (its functions read at call time: tests record them)
from .norm import NormSpec


def _norm(spec, x2d, ln_weight, ln_bias):
    """(norm(x2d), mean or None, rstd) by the norm's forward kernel."""
    return norm_ops.norm_fwd(spec.normalization, x2d, ln_weight, ln_bias, spec.eps, spec.zero_centered_gamma)


class _NormLinear(torch.autograd.Function):
    """x [..., K], norm weight / bias [K], weight [N, K], bias [N] or None -> norm(x) Wᵀ + b [..., N]; saves x,
    mean/rstd and the weights (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, weight, bias, spec):
        x2d = x.reshape(-1, x.shape[-1])
        ln_out, mean, rstd = _norm(spec, x2d, ln_weight, ln_bias)
        out = F.linear(ln_out, weight, bias)
        ctx.save_for_backward(x2d, mean, rstd, ln_weight, ln_bias, weight)
        ctx.spec, ctx.x_shape = spec, x.shape
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x2d, mean, rstd, ln_weight, ln_bias, weight = ctx.saved_tensors
        spec, needs = ctx.spec, ctx.needs_input_grad
        dy = grad.reshape(-1, grad.shape[-1])
        d_ln = dy @ weight if any(needs[:3]) else None
        dw = dbias = None
        if needs[3]:  # (the norm output again, for the wgrad only: dropped right after it)
            ln_out = _norm(spec, x2d, ln_weight, ln_bias)[0]
            dw = dy.t() @ ln_out
            del ln_out
        if needs[4]:
            dbias = dy.sum(0)
        dx = dgamma = dbeta = None
        if d_ln is not None:
            dx, dgamma, dbeta = norm_ops.norm_bwd(spec.normalization, d_ln, x2d, mean, rstd, ln_weight,
                                         spec.zero_centered_gamma)
            dx = dx.view(ctx.x_shape)
        return dx, dgamma, dbeta, dw, dbias, None


class _ActivationLinear(torch.autograd.Function):
    """h [..., F1] (FC1's output), activation, weight [N, F], bias [N] or None -> act(h) Wᵀ + b [..., N]; saves h
    and the weight (see the module docstring)."""

    @staticmethod
    def forward(ctx, h, activation, weight, bias):
        h2d = h.reshape(-1, h.shape[-1])
        out = F.linear(activation_high_precision(h2d, activation), weight, bias)
        ctx.save_for_backward(h2d, weight)
        ctx.activation, ctx.h_shape = activation, h.shape
        return out.view(*h.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        h2d, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        dy = grad.reshape(-1, grad.shape[-1])
        d_act = dy @ weight if needs[0] else None
        dw = dbias = None
        if needs[2]:  # (the activation again, for the wgrad only: dropped right after it)
            act = activation_high_precision(h2d, ctx.activation)
            dw = dy.t() @ act
            del act
        if needs[3]:
            dbias = dy.sum(0)
        dh = None
        if d_act is not None:
            dh = tfp8.activation_bwd(d_act, h2d, ctx.activation).view(ctx.h_shape)
        return dh, None, dw, dbias


def applies(module: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether `module` (LayerNormLinear or LayerNormMLP, on its high-precision path) takes the lean-save Functions
    for input x: its `recompute_in_backward` is True, gradients are recorded, and none of what the module docstring
    excludes applies.

    Args:
        module: the calling module (attributes tp, fuse_wgrad_accumulation, return_layernorm_output,
            recompute_in_backward).
        x: its input.
    Returns:
        True to run norm_linear / activation_linear.
    """
    return (module.recompute_in_backward and torch.is_grad_enabled() and module.tp is None and
            not module.fuse_wgrad_accumulation and not module.return_layernorm_output and
            x.dtype in KERNEL_DTYPES and not torch.compiler.is_compiling())


def norm_linear(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor | None, weight: torch.Tensor,
                bias: torch.Tensor | None, spec: NormSpec) -> torch.Tensor:
    """norm(x) Wᵀ + b keeping no copy of norm(x) for the backward.

    Args:
        x: [..., K], contiguous.
        ln_weight, ln_bias: the norm's gamma [K] and beta [K] (None for RMSNorm).
        weight: [N, K]; bias: [N] or None.
        spec: the norm's NormSpec.
    Returns:
        [..., N] in x's dtype.
    """
    return _NormLinear.apply(x, ln_weight, ln_bias, weight, bias, spec)


def activation_linear(h: torch.Tensor, activation: str, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """act(h) Wᵀ + b keeping no copy of act(h) for the backward.

    Args:
        h: [..., F1] (F1 = 2F for swiglu, [gate | up]), float32 / float16 / bfloat16, contiguous.
        activation: "gelu" (tanh approximation), "relu" or "swiglu".
        weight: [N, F]; bias: [N] or None.
    Returns:
        [..., N] in h's dtype.
    """
    return _ActivationLinear.apply(h, activation, weight, bias)
