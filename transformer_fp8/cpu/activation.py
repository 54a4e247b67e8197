"""CPU reference kernels of the activation ops: activation_fwd(_keep_input), activation_bwd,
dact_cast_transpose(_kept_input).

Activations: "gelu" (tanh approximation), "relu", "swiglu" (input [..., 2F] = [gate | up] -> silu(gate) * up [..., F]).
Math in float32; FP8 outputs are saturate(y * scale) with amax = max|y| max-accumulated and scale_inv = 1 / scale.
A kept input (activation_fwd_keep_input) is the input in E4M3, 1 x KEEP_TILE tiles along each row, each tile
saturate(x * 448 / amax_tile) with scale_inv = amax_tile / 448 (1 for an all-zero tile).
"""
import math

import torch

from ._common import accumulate_amax, check_fp8_dtype, check_scalar_f32, register, saturating_cast

ACTIVATIONS = ("gelu", "relu", "swiglu")
KEEP_TILE = 128
E4M3_MAX = 448.0
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



def keep_input(x):
    """x [..., F_in] (F_in a multiple of KEEP_TILE) -> (E4M3 [..., F_in], float32 scale_inv [..., F_in / KEEP_TILE]):
    the kept copy's tiles, computed in float32 (the CUDA kernel's math: scale = 448 / amax, scale_inv = 1 / scale)."""
    tiles = x.float().reshape(*x.shape[:-1], x.shape[-1] // KEEP_TILE, KEEP_TILE)
    amax = tiles.abs().amax(dim=-1)
    # (tensor / tensor: IEEE division as the kernel's; a Python number / tensor is reciprocal() * number in torch)
    scale = torch.where(amax > 0, torch.full_like(amax, E4M3_MAX) / amax, torch.ones_like(amax))
    kept = saturating_cast(tiles * scale.unsqueeze(-1), torch.float8_e4m3fn).reshape(x.shape)
    return kept, 1.0 / scale


def dequantize_kept_input(kept, kept_scale_inv, dtype):
    """The kept input back in `dtype`: each byte's value times its tile's scale_inv, in float32."""
    tiles = kept.float().reshape(*kept.shape[:-1], kept.shape[-1] // KEEP_TILE, KEEP_TILE)
    return (tiles * kept_scale_inv.unsqueeze(-1)).reshape(kept.shape).to(dtype)


def _check_keep(input, activation):
    if input.dtype not in (torch.float16, torch.bfloat16) or \
            out_features(activation, input.shape[-1]) % KEEP_TILE != 0:
        raise ValueError(f"input: activation_fwd_keep_input needs a float16 or bfloat16 input whose output's last dim "
                         f"is a multiple of {KEEP_TILE}, got {input.dtype} of shape {tuple(input.shape)}")


@register("activation_fwd_keep_input")
def activation_fwd_keep_input(input, activation, scale, fp8_dtype, amax=None, scale_inv=None):
    check_activation(activation)
    _check_input(input, activation)
    _check_keep(input, activation)
    out = torch.ops.transformer_fp8.activation_fwd(input, activation, scale, fp8_dtype, amax, scale_inv)
    kept, kept_scale_inv = keep_input(input)
    return out, kept, kept_scale_inv


@register("dact_cast_transpose_kept_input")
def dact_cast_transpose_kept_input(grad_out, kept_input, kept_scale_inv, activation, scale, fp8_dtype, amax=None,
                                   scale_inv=None, compute_dbias=False, transpose=True):
    check_activation(activation)
    if kept_input.dtype != torch.float8_e4m3fn or kept_input.dim() != 2:
        raise ValueError(f"kept_input: expected a 2-D float8_e4m3fn tensor [M, F_in] (activation_fwd_keep_input's), "
                         f"got {kept_input.dtype} of shape {tuple(kept_input.shape)}")
    rows, in_cols = kept_input.shape
    if in_cols % KEEP_TILE != 0:
        raise ValueError(f"kept_input: expected a last dim that is a multiple of {KEEP_TILE}, got shape "
                         f"{tuple(kept_input.shape)}")
    if kept_scale_inv.dtype != torch.float32 or tuple(kept_scale_inv.shape) != (rows, in_cols // KEEP_TILE):
        raise ValueError(f"kept_scale_inv: expected float32 [{rows}, {in_cols // KEEP_TILE}], got "
                         f"{kept_scale_inv.dtype} of shape {tuple(kept_scale_inv.shape)}")
    if grad_out.dtype not in HIGH_PRECISION:
        raise TypeError(f"grad_out: expected a float32, float16 or bfloat16 tensor, got {grad_out.dtype}")
    input = dequantize_kept_input(kept_input, kept_scale_inv, torch.float32)
    expected = (rows, out_features(activation, in_cols))
    if tuple(grad_out.shape) != expected:
        raise ValueError(f"grad_out: expected shape {expected} for kept_input {tuple(kept_input.shape)}, got "
                         f"{tuple(grad_out.shape)}")
    check_fp8_dtype(fp8_dtype, "fp8_dtype")
    for t, arg in ((scale, "scale"), (amax, "amax"), (scale_inv, "scale_inv")):
        if t is not None:
            check_scalar_f32(t, grad_out, arg)
    dx = act_backward(grad_out.float(), input, activation)
    q = _quantize(dx, scale, fp8_dtype, amax, scale_inv)
    dbias = dx.sum(dim=0).to(grad_out.dtype) if compute_dbias else grad_out.new_empty((0,))
    return q, (q.t().contiguous() if transpose else q.new_empty((0,))), dbias
