"""Pieces of an FP8 GEMM's backward shared by the modules, and the high-precision linear with main_grad fusion.

For y = x Wᵀ (x [M, K], W [N, K], dy [M, N]); GEMMs are TN (both operands K-major):
  dgrad dx [M, K] = fp8_gemm(dy [M, N], Wᵀ [K, N]);  wgrad dW [N, K] = fp8_gemm(dyᵀ [N, M], xᵀ [K, M]).
"""
import torch
import torch.nn.functional as F

from .. import autocast
from ..ops import tfp8
from ..float8_tensor import Float8Tensor
from ._compiled_backward import queue_backward_update
from .base import cast_args


def fp8_gemm_bias(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, residual=None):
    """The forward GEMM: out [M, N] = a bᵀ (+ bias [N]) (+ residual [M, N] of out_dtype, in the GEMM epilogue) in
    out_dtype, with FP8 fast accumulation (as TE's and torchao's forward GEMMs; the backward's dgrad and wgrad GEMMs
    keep the split accumulator, whose float32 promotion their longer and smaller-valued sums need). The bias
    rides in the GEMM epilogue for 16-bit outputs (cast to out_dtype); a float32 output gets it added afterwards in
    float32 (cuBLASLt takes no float32 bias there): in place, except under torch.compile, whose autograd.Function
    support drops the gradient of a forward output that was modified in place (torch 2.11: it arrives as zeros)."""
    extra = {"use_split_accumulator": False} if residual is None else {"use_split_accumulator": False,
                                                                        "residual": residual}
    if bias is None or out_dtype != torch.float32:
        bias = bias.to(out_dtype) if bias is not None and bias.dtype != out_dtype else bias
        return tfp8.fp8_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, **extra)[0]
    out = tfp8.fp8_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, **extra)[0]
    return out + bias if torch.compiler.is_compiling() else out.add_(bias)


def cast_grad_output(dy, module, slot, with_dbias, rowwise, transpose):
    """dy [M, N] -> (q [M, N], qT [N, M], scale_inv [1], dbias [N] or None) in backward slot `slot` of `module`."""
    scale, amax, scale_inv = cast_args(dy, module.fp8_bwd, slot, module.bwd_dtype, module.fp8_current)
    if not with_dbias:
        q, qt = tfp8.cast_transpose(dy, scale, module.bwd_dtype, rowwise, transpose, amax, scale_inv)
        return q, qt, scale_inv, None
    q, qt, dbias = tfp8.cast_transpose_dbias(dy, scale, module.bwd_dtype, amax, scale_inv)
    return q, qt, scale_inv, dbias


def fused_forward_applies(weight, bias, out_dtype, is_first_microbatch):
    """Whether a plain GEMM's forward can be the one op fp8_linear_fwd: a high-precision weight cast at this call (no
    FP8 weight cache, no Float8Tensor) and a bias the GEMM epilogue takes (see fp8_gemm_bias)."""
    return is_first_microbatch is None and not isinstance(weight, Float8Tensor) and (
        bias is None or out_dtype != torch.float32)


def fused_forward(module, x, weight, bias, out_dtype, need_x_t, need_w_t, residual):
    """fp8_linear_fwd in forward slots (0 input, 1 weight): x [M, K] @ weight [N, K]ᵀ (+ bias) (+ residual [M, N])
    -> (out [M, N], (xqT [K, M] or None, x scale_inv), (wqT [K, N] or None, w scale_inv)). need_w_t: as
    FP8ModuleBase._fp8_weight decides for an uncached weight."""
    state, fp8_dtype, current = module.fp8_fwd, module.fwd_dtype, module.fp8_current
    x_scale, x_amax, x_sinv = cast_args(x, state, 0, fp8_dtype, current)
    w_scale, w_amax, w_sinv = cast_args(weight, state, 1, fp8_dtype, current)
    bias = bias.to(out_dtype) if bias is not None and bias.dtype != out_dtype else bias
    out, xqt, wqt = tfp8.fp8_linear_fwd(x, weight, x_scale, w_scale, fp8_dtype, x_amax, x_sinv, w_amax, w_sinv,
                                        need_x_t, need_w_t, out_dtype, bias, residual)
    return out, (xqt if need_x_t else None, x_sinv), (wqt if need_w_t else None, w_sinv)


def fused_grads(module, weight, dy, with_dbias, w_t, x_t, dx_dtype):
    """fp8_linear_bwd in backward slot 0: dy [M, N] -> (dx [M, K] or None, dW [N, K] or None, dbias [N] or None).
    w_t = (Wᵀ [K, N] FP8, scale_inv) or None (no dgrad), x_t likewise for the wgrad; with fuse_wgrad_accumulation
    the wgrad goes into weight.main_grad and dW is None."""
    scale, amax, scale_inv = cast_args(dy, module.fp8_bwd, 0, module.bwd_dtype, module.fp8_current)
    need_dgrad, need_wgrad = w_t is not None, x_t is not None
    main_grad = module._main_grad(weight) if need_wgrad and module.fuse_wgrad_accumulation else None
    dx, dw, dbias = tfp8.fp8_linear_bwd(dy, scale, module.bwd_dtype, amax, scale_inv, with_dbias,
                                        w_t[0] if need_dgrad else None, w_t[1] if need_dgrad else scale_inv, dx_dtype,
                                        x_t[0] if need_wgrad else None, x_t[1] if need_wgrad else scale_inv,
                                        weight.dtype, main_grad)
    return (dx if need_dgrad else None, dw if need_wgrad and main_grad is None else None,
            dbias if with_dbias else None)


def register_backward(module, recipe, group):
    """Queue the module's gradient state for the update after this backward (delayed scaling only). Call after the
    backward's casts of that state. Traced by torch.compile: the op queue_backward_update queues it when the compiled
    backward runs (see _compiled_backward.py)."""
    if module.fp8_current:
        return
    if torch.compiler.is_compiling():
        state = module.fp8_bwd
        queue_backward_update(state.amaxes[0], id(state))
    else:
        autocast.register_backward(module.fp8_bwd, recipe, group)


def gemm_grads(module, weight, dy_fp8, w_t, x_t, dx_dtype, need_dgrad, need_wgrad):
    """dgrad and wgrad of one GEMM from FP8 operands, each given as (data, scale_inv).
    dy_fp8 = (q, qT, scale_inv). With fuse_wgrad_accumulation the wgrad goes into weight.main_grad (FP32)
    and None is returned for it."""
    dq, dqt, dsinv = dy_fp8
    dx = tfp8.fp8_gemm(dq, dsinv, w_t[0], w_t[1], dx_dtype)[0] if need_dgrad else None
    dw = None
    if need_wgrad:
        if module.fuse_wgrad_accumulation:
            tfp8.fp8_gemm_accumulate(dqt, dsinv, x_t[0], x_t[1], module._main_grad(weight))
        else:
            dw = tfp8.fp8_gemm(dqt, dsinv, x_t[0], x_t[1], weight.dtype)[0]
    return dx, dw


class LinearMainGrad(torch.autograd.Function):
    """High-precision y = x Wᵀ + b whose weight gradient is accumulated (FP32) into weight.main_grad."""

    @staticmethod
    def forward(ctx, x, weight, bias, module):
        ctx.save_for_backward(x, weight)
        ctx.module = module
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dy = grad.reshape(-1, grad.shape[-1])
        dx = (grad @ weight) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            main_grad = ctx.module._main_grad(weight)
            main_grad.add_(dy.float().t() @ x.reshape(-1, x.shape[-1]).float())
        dbias = dy.sum(0) if ctx.needs_input_grad[2] else None
        return dx, None, dbias, None


def high_precision_linear(module, x, weight, bias):
    """F.linear, or LinearMainGrad when the module fuses wgrad accumulation and a weight gradient is needed."""
    if module.fuse_wgrad_accumulation and weight.requires_grad and torch.is_grad_enabled():
        return LinearMainGrad.apply(x, weight, bias, module)
    return F.linear(x, weight, bias)
