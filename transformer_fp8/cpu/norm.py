"""CPU reference kernels of the norm ops: LayerNorm / RMSNorm forward (optionally with FP8 output) and backward.

Contract (the CUDA kernels in csrc/norm*.cu follow it too):
  input [M, N] contiguous float32/float16/bfloat16; weight (and LayerNorm bias, of weight's dtype) [N] contiguous, of
  input's dtype, or float32 with 16-bit input. All math in float32.
  LayerNorm: mean, rstd = 1 / sqrt(var + eps) (biased variance), y = (x - mean) * rstd * gamma' + beta.
  RMSNorm:   rstd = 1 / sqrt(mean(x^2) + eps), y = x * rstd * gamma'.   gamma' = gamma + 1 if zero_centered_gamma.
  Output in input's dtype, or with fp8_dtype: out = saturate(y * scale) in FP8 (scale required), scale_inv (optional)
  receives 1 / scale. amax (optional, with or without fp8_dtype) is max-accumulated with max|y|, y before scaling.
  mean / rstd: float32 [M]. Backward: dx in input's dtype, dgamma (and dbeta) in weight's dtype, summed in float32.
"""
import torch

from ._common import accumulate_amax, check_fp8_dtype, check_scalar_f32, register, saturating_cast

_HIGH_PRECISION = (torch.float32, torch.float16, torch.bfloat16)


def _check_input(input, arg="input"):
    if input.dtype not in _HIGH_PRECISION:
        raise TypeError(f"{arg}: expected a float32, float16 or bfloat16 tensor, got {input.dtype}")
    if input.dim() != 2:
        raise ValueError(f"{arg}: expected a 2-D tensor [M, N], got shape {tuple(input.shape)}")
    if input.shape[1] == 0:
        raise ValueError(f"{arg}: expected at least one column, got shape {tuple(input.shape)}")
    if not input.is_contiguous():
        raise ValueError(f"{arg}: expected a contiguous tensor (got strides {input.stride()})")


def _check_like(t, ref, arg, ref_arg="input"):
    """t: same shape, dtype and device as ref (grad_out vs input)."""
    if t.dtype != ref.dtype:
        raise TypeError(f"{arg}: expected dtype {ref.dtype} (the {ref_arg}'s), got {t.dtype}")
    if t.shape != ref.shape:
        raise ValueError(f"{arg}: expected shape {tuple(ref.shape)}, got {tuple(t.shape)}")
    if t.device != ref.device:
        raise ValueError(f"{arg}: expected a tensor on {ref.device}, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{arg}: expected a contiguous tensor (got strides {t.stride()})")


def _check_param(t, input, arg):
    """weight / bias: [N], input's dtype or float32, on input's device."""
    if t.dtype != input.dtype and t.dtype != torch.float32:
        raise TypeError(f"{arg}: expected dtype {input.dtype} (the input's) or torch.float32, got {t.dtype}")
    if t.shape != (input.shape[1],):
        raise ValueError(f"{arg}: expected shape ({input.shape[1]},), got {tuple(t.shape)}")
    if t.device != input.device:
        raise ValueError(f"{arg}: expected a tensor on {input.device}, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{arg}: expected a contiguous tensor (got strides {t.stride()})")


def _check_stat(t, input, arg):
    """mean / rstd: float32 [M] on input's device."""
    if t.dtype != torch.float32:
        raise TypeError(f"{arg}: expected a float32 tensor, got {t.dtype}")
    if t.shape != (input.shape[0],):
        raise ValueError(f"{arg}: expected shape ({input.shape[0]},), got {tuple(t.shape)}")
    if t.device != input.device:
        raise ValueError(f"{arg}: expected a tensor on {input.device}, got one on {t.device}")


def _check_fp8_args(input, scale, fp8_dtype, amax, scale_inv):
    if fp8_dtype is None:
        if scale is not None or scale_inv is not None:
            raise ValueError("fp8_dtype: scale and scale_inv are only taken with an FP8 output (fp8_dtype given)")
    else:
        check_fp8_dtype(fp8_dtype, "fp8_dtype")
        if scale is None:
            raise ValueError("scale: required when fp8_dtype is given")
    for t, arg in ((scale, "scale"), (amax, "amax"), (scale_inv, "scale_inv")):
        check_scalar_f32(t, input, arg)


def _gamma(weight, zero_centered_gamma):
    gamma = weight.float()
    return gamma + 1.0 if zero_centered_gamma else gamma


def _finish_fwd(y, input, scale, fp8_dtype, amax, scale_inv):
    """y float32 [M, N] -> out (input's dtype or FP8); updates amax and scale_inv."""
    accumulate_amax(amax, y)
    if fp8_dtype is None:
        return y.to(input.dtype)
    if scale_inv is not None:
        scale_inv.copy_(scale.reciprocal().reshape(scale_inv.shape))
    return saturating_cast(y * scale.reshape(()), fp8_dtype)


@register("layernorm_fwd")
def layernorm_fwd(input, weight, bias, eps, zero_centered_gamma=False, scale=None, fp8_dtype=None, amax=None,
                  scale_inv=None):
    _check_input(input)
    _check_param(weight, input, "weight")
    if bias is not None:
        _check_param(bias, input, "bias")
        if bias.dtype != weight.dtype:
            raise TypeError(f"bias: expected dtype {weight.dtype} (the weight's), got {bias.dtype}")
    _check_fp8_args(input, scale, fp8_dtype, amax, scale_inv)
    x = input.float()
    mean = x.mean(dim=1)
    xc = x - mean[:, None]
    rstd = torch.rsqrt((xc * xc).mean(dim=1) + eps)
    y = xc * rstd[:, None] * _gamma(weight, zero_centered_gamma)
    if bias is not None:
        y = y + bias.float()
    return _finish_fwd(y, input, scale, fp8_dtype, amax, scale_inv), mean, rstd


@register("rmsnorm_fwd")
def rmsnorm_fwd(input, weight, eps, zero_centered_gamma=False, scale=None, fp8_dtype=None, amax=None, scale_inv=None):
    _check_input(input)
    _check_param(weight, input, "weight")
    _check_fp8_args(input, scale, fp8_dtype, amax, scale_inv)
    x = input.float()
    rstd = torch.rsqrt((x * x).mean(dim=1) + eps)
    y = x * rstd[:, None] * _gamma(weight, zero_centered_gamma)
    return _finish_fwd(y, input, scale, fp8_dtype, amax, scale_inv), rstd


def _check_bwd(grad_out, input, rstd, weight, mean=None, dx_add=None):
    _check_input(input)
    _check_like(grad_out, input, "grad_out")
    if dx_add is not None:
        _check_like(dx_add, input, "dx_add")
    if mean is not None:
        _check_stat(mean, input, "mean")
    _check_stat(rstd, input, "rstd")
    _check_param(weight, input, "weight")


def _dx(g, xhat, rstd, center, dx_add=None):
    """dx = rstd * (g - [mean(g)] - xhat * mean(g * xhat)) (+ dx_add), g = dy * gamma'; the mean(g) term for LayerNorm
    only."""
    d = g - xhat * (g * xhat).mean(dim=1, keepdim=True)
    if center:
        d = d - g.mean(dim=1, keepdim=True)
    return d * rstd[:, None] if dx_add is None else d * rstd[:, None] + dx_add.float()


@register("layernorm_bwd")
def layernorm_bwd(grad_out, input, mean, rstd, weight, zero_centered_gamma=False, dx_add=None):
    _check_bwd(grad_out, input, rstd, weight, mean, dx_add)
    dy = grad_out.float()
    xhat = (input.float() - mean[:, None]) * rstd[:, None]
    dx = _dx(dy * _gamma(weight, zero_centered_gamma), xhat, rstd, center=True, dx_add=dx_add)
    dgamma = (dy * xhat).sum(dim=0)
    dbeta = dy.sum(dim=0)
    return dx.to(input.dtype), dgamma.to(weight.dtype), dbeta.to(weight.dtype)


@register("rmsnorm_bwd")
def rmsnorm_bwd(grad_out, input, rstd, weight, zero_centered_gamma=False, dx_add=None):
    _check_bwd(grad_out, input, rstd, weight, dx_add=dx_add)
    dy = grad_out.float()
    xhat = input.float() * rstd[:, None]
    dx = _dx(dy * _gamma(weight, zero_centered_gamma), xhat, rstd, center=False, dx_add=dx_add)
    dgamma = (dy * xhat).sum(dim=0)
    return dx.to(input.dtype), dgamma.to(weight.dtype)
