"""LayerNorm and RMSNorm modules on our norm kernels (high precision in and out), and the norm helpers the fused
modules share. Parameters: `weight` [hidden] (and `bias` [hidden] for LayerNorm); zero_centered_gamma stores
gamma - 1 (initialised to 0)."""
from typing import NamedTuple

import torch
import torch.nn as nn

from ..ops import tfp8
from ..quantization import FP8Operand
from .base import check_dtype, check_input, check_positive

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


class NormSpec(NamedTuple):
    """What a norm's kernels need besides the tensors (a fused module's norm settings, handed to its Function)."""

    normalization: str
    eps: float
    zero_centered_gamma: bool

    @classmethod
    def of(cls, module: nn.Module) -> "NormSpec":
        """Returns:
            The NormSpec of a module with normalization, eps and zero_centered_gamma attributes."""
        return cls(module.normalization, module.eps, module.zero_centered_gamma)


def norm_fwd(normalization, x, weight, bias, eps, zero_centered_gamma, scale=None, fp8_dtype=None, amax=None,
             scale_inv=None):
    """x [M, N] -> (out [M, N] in x's dtype or fp8_dtype, mean [M] or None, rstd [M])."""
    if normalization == "LayerNorm":
        return tfp8.layernorm_fwd(x, weight, bias, eps, zero_centered_gamma, scale, fp8_dtype, amax, scale_inv)
    out, rstd = tfp8.rmsnorm_fwd(x, weight, eps, zero_centered_gamma, scale, fp8_dtype, amax, scale_inv)
    return out, None, rstd


def norm_bwd(normalization, grad, x, mean, rstd, weight, zero_centered_gamma, dx_add=None):
    """-> (dx [M, N] (+ dx_add [M, N]), dgamma [N], dbeta [N] or None)."""
    extra = {} if dx_add is None else {"dx_add": dx_add}
    if normalization == "LayerNorm":
        return tfp8.layernorm_bwd(grad, x, mean, rstd, weight, zero_centered_gamma, **extra)
    dx, dgamma = tfp8.rmsnorm_bwd(grad, x, rstd, weight, zero_centered_gamma, **extra)
    return dx, dgamma, None


def norm_backward(spec, d_ln, grad_ln_out, x, mean, rstd, weight, inp_shape, dx_add=None):
    """The norm's backward at the end of LayerNormLinear / LayerNormMLP: the GEMM's input gradient d_ln plus the
    gradient of the returned norm output (either may be None) -> (dx in inp_shape, dgamma, dbeta), Nones if no grad.
    An empty grad_ln_out (that of the empty placeholder output) counts as None: torch.compile passes one.
    dx_add (x's shape, or None): another gradient of the input, added to dx inside the norm backward."""
    if grad_ln_out is not None and grad_ln_out.numel() == x.numel():
        d_ln = grad_ln_out.reshape(x.shape) if d_ln is None else d_ln + grad_ln_out.reshape(x.shape)
    if d_ln is None:
        return (None if dx_add is None else dx_add.view(inp_shape)), None, None
    dx, dgamma, dbeta = norm_bwd(spec.normalization, d_ln.contiguous(), x, mean, rstd, weight,
                                 spec.zero_centered_gamma, dx_add)
    return dx.view(inp_shape), dgamma, dbeta


def init_norm_params(module, hidden_size, normalization, zero_centered_gamma, prefix):
    """Register `<prefix>weight` (ones, or zeros when zero-centered) and, for LayerNorm, `<prefix>bias` (zeros)."""
    kwargs = {"dtype": module.params_dtype, "device": module._device}
    gamma = torch.zeros if zero_centered_gamma else torch.ones
    module.register_parameter(prefix + "weight", nn.Parameter(gamma(hidden_size, **kwargs)))
    bias = nn.Parameter(torch.zeros(hidden_size, **kwargs)) if normalization == "LayerNorm" else None
    module.register_parameter(prefix + "bias", bias)


class _NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, normalization, eps, zero_centered_gamma):
        x2d = x.reshape(-1, x.shape[-1])
        out, mean, rstd = norm_fwd(normalization, x2d, weight, bias, eps, zero_centered_gamma)
        ctx.save_for_backward(x2d, mean, rstd, weight)
        ctx.normalization, ctx.zero_centered_gamma = normalization, zero_centered_gamma
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x2d, mean, rstd, weight = ctx.saved_tensors
        dx, dgamma, dbeta = norm_bwd(ctx.normalization, grad.reshape(x2d.shape).contiguous(), x2d, mean, rstd, weight,
                                     ctx.zero_centered_gamma)
        return dx.view(grad.shape), dgamma, dbeta, None, None, None


class _Norm(nn.Module):
    normalization = None

    def __init__(self, hidden_size, eps=1e-5, zero_centered_gamma=False, params_dtype=None, device="cuda"):
        super().__init__()
        check_positive(hidden_size=hidden_size)
        self.hidden_size, self.eps, self.zero_centered_gamma = hidden_size, float(eps), bool(zero_centered_gamma)
        self.params_dtype, self._device = check_dtype(params_dtype), torch.device(device)
        init_norm_params(self, hidden_size, self.normalization, self.zero_centered_gamma, "")

    def forward(self, inp):
        check_input(inp, self.hidden_size)
        return _NormFunction.apply(inp.contiguous(), self.weight, self.bias, self.normalization, self.eps,
                                   self.zero_centered_gamma)

    def extra_repr(self):
        return f"{self.hidden_size}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class LayerNorm(_Norm):
    """y = (x - mean) / sqrt(var + eps) * gamma + beta over the last dim; `weight` = gamma, `bias` = beta."""

    normalization = "LayerNorm"


class RMSNorm(_Norm):
    """y = x / sqrt(mean(x^2) + eps) * gamma over the last dim; `weight` = gamma."""

    normalization = "RMSNorm"


def norm_to_fp8(spec, quantizer, x, ln_weight, ln_bias, need_transpose, keep_high_precision):
    """Normalise x [M, K] (NormSpec `spec`, norm weight and bias) and cast it with `quantizer`: (FP8Operand with data
    [M, K] and data_t [K, M] when need_transpose, high-precision output or None, mean or None, rstd).
    With a known scale (delayed scaling past its first update) the norm kernel emits FP8 directly; otherwise
    (current scaling, the calibrating first step) or when the high-precision output is wanted: norm, then one
    cast(-transpose)."""
    if quantizer.fused_norm_cast and not keep_high_precision:  # (block scaling: one kernel, no high-precision y)
        operand, mean, rstd = quantizer.cast_normalized(spec, x, ln_weight, ln_bias, transpose=need_transpose)
        return operand, None, mean, rstd
    args = (spec.normalization, x, ln_weight, ln_bias, spec.eps, spec.zero_centered_gamma)
    if keep_high_precision or not (quantizer.fused_per_tensor and quantizer.known_scale):
        out, mean, rstd = norm_fwd(*args)
        # (the high-precision output only where asked for: else it is freed here, before the next GEMM runs)
        return quantizer.cast(out, transpose=need_transpose), (out if keep_high_precision else None), mean, rstd
    fp8_args = quantizer.output_args()
    q, mean, rstd = norm_fwd(*args, *fp8_args)
    operand = FP8Operand(q, None, fp8_args[3], fp8_args[1])
    return (operand.with_transpose() if need_transpose else operand), None, mean, rstd
