"""CPU reference kernels of the activation ops: activation_fwd, activation_bwd, dact_cast_transpose.

Activations: "gelu" (tanh approximation), "relu", "swiglu" (input [..., 2F] = [gate | up] -> silu(gate) * up [..., F]).
Math in float32; FP8 outputs are saturate(y * scale) with amax = max|y| max-accumulated and scale_inv = 1 / scale.
"""
import math

import torch

from ._common import accumulate_amax, check_fp8_dtype, check_scalar_f32, register, saturating_cast

ACTIVATIONS = ("gelu", "relu", "swiglu")
HIGH_PRECISION = (torch.float32, torch.float16, torch.bfloat16)
_GELU_K = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715


def check_activation(activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")


def out_features(activation, in_features):
    return in_features // 2 if activation == "swiglu" else in_features


def _check_input(input, activation, arg="input"):
    if input.dtype not in HIGH_PRECISION:
        raise TypeError(f"{arg}: expected a float32, float16 or bfloat16 tensor, got {input.dtype}")
    if input.dim() < 1:
        raise ValueError(f"{arg}: expected at least one dimension, got shape {tuple(input.shape)}")
    if not input.is_contiguous():
        raise ValueError(f"{arg}: expected a contiguous tensor (got strides {input.stride()})")
    if activation == "swiglu" and input.shape[-1] % 2 != 0:
        raise ValueError(f"{arg}: swiglu expects an even last dimension [..., 2F], got shape {tuple(input.shape)}")


def _check_grad(grad_out, input, activation):
    if grad_out.dtype != input.dtype:
        raise TypeError(f"grad_out: expected dtype {input.dtype} (input's), got {grad_out.dtype}")
    if grad_out.device != input.device:
        raise ValueError(f"grad_out: expected a tensor on {input.device}, got one on {grad_out.device}")
    if not grad_out.is_contiguous():
        raise ValueError(f"grad_out: expected a contiguous tensor (got strides {grad_out.stride()})")
    expected = (*input.shape[:-1], out_features(activation, input.shape[-1]))
    if tuple(grad_out.shape) != expected:
        raise ValueError(f"grad_out: expected shape {expected} for input {tuple(input.shape)} and {activation}, "
                         f"got {tuple(grad_out.shape)}")


def act_forward(x, activation):
    """y = act(x) in float32 (x float32)."""
    if activation == "gelu":
        return 0.5 * x * (1.0 + torch.tanh(_GELU_K * (x + _GELU_C * x * x * x)))
    if activation == "relu":
        return torch.clamp_min(x, 0.0)
    gate, up = x.chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def act_backward(dy, x, activation):
    """d(input) = dy * act'(x) in float32 (dy, x float32)."""
    if activation == "gelu":
        t = torch.tanh(_GELU_K * (x + _GELU_C * x * x * x))
        dt = _GELU_K * (1.0 + 3.0 * _GELU_C * x * x) * (1.0 - t * t)
        return dy * (0.5 * (1.0 + t) + 0.5 * x * dt)
    if activation == "relu":
        return torch.where(x > 0.0, dy, torch.zeros_like(dy))
    gate, up = x.chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    dgate = dy * up * sig * (1.0 + gate * (1.0 - sig))
    dup = dy * gate * sig
    return torch.cat([dgate, dup], dim=-1)


def _quantize(y, scale, fp8_dtype, amax, scale_inv):
    accumulate_amax(amax, y)
    if scale_inv is not None:
        scale_inv.copy_((1.0 / scale).reshape(scale_inv.shape))
    return saturating_cast(y * scale.reshape(()), fp8_dtype)


@register("activation_fwd")
def activation_fwd(input, activation, scale=None, fp8_dtype=None, amax=None, scale_inv=None):
    check_activation(activation)
    _check_input(input, activation)
    if fp8_dtype is None:
        for t, arg in ((scale, "scale"), (amax, "amax"), (scale_inv, "scale_inv")):
            if t is not None:
                raise ValueError(f"{arg}: given without fp8_dtype (only an FP8 output takes it)")
        return act_forward(input.float(), activation).to(input.dtype)
    check_fp8_dtype(fp8_dtype, "fp8_dtype")
    if scale is None:
        raise ValueError("scale: required when fp8_dtype is given")
    for t, arg in ((scale, "scale"), (amax, "amax"), (scale_inv, "scale_inv")):
        if t is not None:
            check_scalar_f32(t, input, arg)
    return _quantize(act_forward(input.float(), activation), scale, fp8_dtype, amax, scale_inv)


@register("activation_bwd")
def activation_bwd(grad_out, input, activation):
    check_activation(activation)
    _check_input(input, activation)
    _check_grad(grad_out, input, activation)
    return act_backward(grad_out.float(), input.float(), activation).to(input.dtype)


@register("dact_cast_transpose")
def dact_cast_transpose(grad_out, input, activation, scale, fp8_dtype, amax=None, scale_inv=None,
                        compute_dbias=False, transpose=True):
    check_activation(activation)
    _check_input(input, activation)
    if input.dim() != 2:
        raise ValueError(f"input: expected a 2-D tensor [M, F_in], got shape {tuple(input.shape)}")
    _check_grad(grad_out, input, activation)
    check_fp8_dtype(fp8_dtype, "fp8_dtype")
    for t, arg in ((scale, "scale"), (amax, "amax"), (scale_inv, "scale_inv")):
        if t is not None:
            check_scalar_f32(t, input, arg)
    dx = act_backward(grad_out.float(), input.float(), activation)
    q = _quantize(dx, scale, fp8_dtype, amax, scale_inv)
    dbias = dx.sum(dim=0).to(grad_out.dtype) if compute_dbias else grad_out.new_empty((0,))
    return q, (q.t().contiguous() if transpose else q.new_empty((0,))), dbias

