"""CPU reference kernels of the fused block casts (recipe Float8BlockScaling, 1x128 tiles): norm_block_cast (LayerNorm
/ RMSNorm forward, then block_cast of its float32 output) and dact_block_cast (the activation backward in float32,
then block_cast). Contracts in csrc/ops.cpp; the norm and activation math are the references of cpu/norm.py and
cpu/activation.py, the cast is cpu/block.py's, so each op equals its unfused composition without the rounding of the
intermediate to the input dtype."""
import torch

from ._common import register
from .activation import act_backward, check_activation, out_features
from .block import _cast_blocks, _check_cast_input
from .norm import _check_param, _gamma

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def normalized(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layernorm: bool, eps: float,
               zero_centered_gamma: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The norm's float32 output and statistics (cpu/norm.py's math).

    Args:
        x: the input [M, K], float32.
        weight: gamma [K]; bias: beta [K] or None (LayerNorm only).
        layernorm: LayerNorm (else RMSNorm).
        eps: added to the variance (the mean square) before the square root.
        zero_centered_gamma: gamma' = weight + 1.

    Returns:
        (y [M, K] float32, mean [M] or None (RMSNorm), rstd [M]).
    """
    mean = x.mean(dim=1) if layernorm else None
    xc = x - mean[:, None] if layernorm else x
    rstd = torch.rsqrt((xc * xc).mean(dim=1) + eps)
    y = xc * rstd[:, None] * _gamma(weight, zero_centered_gamma)
    return (y + bias.float() if bias is not None else y), mean, rstd


@register("norm_block_cast")
def norm_block_cast(input, weight, bias, normalization, eps, zero_centered_gamma, fp8_dtype, rowwise=True,
                    transpose=False, amax_epsilon=0.0, power_2_scale=True):
    """norm(input) [M, K] cast with 1x128 tiles -> (q, scale_inv, qt, scale_inv_t, mean or empty, rstd)."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization: expected 'LayerNorm' or 'RMSNorm', got {normalization!r}")
    _check_cast_input(input, fp8_dtype, amax_epsilon)
    if input.shape[1] == 0:
        raise ValueError(f"input: expected at least one column, got shape {tuple(input.shape)}")
    _check_param(weight, input, "weight")
    layernorm = normalization == "LayerNorm"
    if bias is not None:
        if not layernorm:
            raise ValueError("bias: RMSNorm takes no bias")
        _check_param(bias, input, "bias")
        if bias.dtype != weight.dtype:
            raise TypeError(f"bias: expected dtype {weight.dtype} (the weight's), got {bias.dtype}")
    if not (eps >= 0.0 and eps != float("inf")):
        raise ValueError(f"eps: expected a finite number >= 0, got {eps}")
    y, mean, rstd = normalized(input.float(), weight, bias, layernorm, eps, zero_centered_gamma)
    cast = _cast_blocks(y, fp8_dtype, 1, rowwise, transpose, amax_epsilon, power_2_scale)
    return (*cast, mean if layernorm else input.new_empty((0,), dtype=torch.float32), rstd)


@register("dact_block_cast")
def dact_block_cast(grad_out, input, activation, fp8_dtype, rowwise=True, transpose=False, amax_epsilon=0.0,
                    power_2_scale=True, compute_dbias=False):
    """act'(input) * grad_out [M, F or 2F] in float32, cast with 1x128 tiles -> (q, scale_inv, qt, scale_inv_t,
    dbias: its column sums in grad_out's dtype when compute_dbias, else empty)."""
    check_activation(activation)
    _check_cast_input(input, fp8_dtype, amax_epsilon)
    if activation == "swiglu" and input.shape[1] % 2 != 0:
        raise ValueError(f"input: swiglu expects an even last dimension [M, 2F], got shape {tuple(input.shape)}")
    if grad_out.dtype != input.dtype:
        raise TypeError(f"grad_out: expected dtype {input.dtype} (input's), got {grad_out.dtype}")
    expected = (input.shape[0], out_features(activation, input.shape[1]))
    if tuple(grad_out.shape) != expected:
        raise ValueError(f"grad_out: expected shape {expected} for input {tuple(input.shape)} and {activation}, got "
                         f"{tuple(grad_out.shape)}")
    if grad_out.device != input.device:
        raise ValueError(f"grad_out: expected a tensor on {input.device}, got one on {grad_out.device}")
    if not grad_out.is_contiguous():
        raise ValueError(f"grad_out: expected a contiguous tensor (got strides {grad_out.stride()})")
    d_input = act_backward(grad_out.float(), input.float(), activation)
    dbias = d_input.sum(dim=0).to(grad_out.dtype) if compute_dbias else grad_out.new_empty((0,))
    return (*_cast_blocks(d_input, fp8_dtype, 1, rowwise, transpose, amax_epsilon, power_2_scale), dbias)
