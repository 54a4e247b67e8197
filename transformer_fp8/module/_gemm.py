"""Pieces of an FP8 GEMM's backward shared by the modules, and the high-precision linear with main_grad fusion.

For y = x Wᵀ (x [M, K], W [N, K], dy [M, N]); GEMMs are TN (both operands K-major):
  dgrad dx [M, K] = fp8_gemm(dy [M, N], Wᵀ [K, N]);  wgrad dW [N, K] = fp8_gemm(dyᵀ [N, M], xᵀ [K, M]).
"""
import torch
import torch.nn.functional as F

from ..float8_tensor import Float8Tensor
from ..ops import tfp8
from ..quantization import FP8Operand, gemm, gemm_accumulate
from .base import main_grad_of


def fp8_gemm_bias(a, b, out_dtype, bias, residual=None):
    """The forward GEMM of FP8Operands a [M, K] and b [N, K] (rowwise data): out [M, N] = a bᵀ (+ bias [N])
    (+ residual [M, N] of out_dtype, in the GEMM epilogue) in out_dtype, with FP8 fast accumulation (as TE's and
    torchao's forward GEMMs; the backward's dgrad and wgrad GEMMs keep the split accumulator, whose float32 promotion
    their longer and smaller-valued sums need). The bias rides in the GEMM epilogue for 16-bit outputs (cast to
    out_dtype); a float32 output gets it added afterwards in float32 (cuBLASLt takes no float32 bias there): in
    place, except under torch.compile, whose autograd.Function support drops the gradient of a forward output that
    was modified in place (torch 2.11: it arrives as zeros)."""
    if bias is None or out_dtype != torch.float32:
        bias = bias.to(out_dtype) if bias is not None and bias.dtype != out_dtype else bias
        return gemm(a, b, out_dtype, bias=bias, residual=residual, use_split_accumulator=False)
    out = gemm(a, b, out_dtype, residual=residual, use_split_accumulator=False)
    return out + bias if torch.compiler.is_compiling() else out.add_(bias)


def cast_grad_output(dy, quantizer, with_dbias, rowwise, transpose):
    """dy [M, N] -> (FP8Operand (data when rowwise, data_t when transpose), dbias [N] or None) with `quantizer` (a
    gradient role's)."""
    if not with_dbias:
        return quantizer.cast(dy, rowwise=rowwise, transpose=transpose), None
    return quantizer.cast_with_dbias(dy)


def fused_forward_applies(quantizers, weight, bias, out_dtype, is_first_microbatch):
    """Whether a plain GEMM's forward can be the one op fp8_linear_fwd: per-tensor quantizers (fused_per_tensor), a
    high-precision weight cast at this call (no FP8 weight cache, no Float8Tensor) and a bias the GEMM epilogue takes
    (see fp8_gemm_bias)."""
    return quantizers.fused_per_tensor and is_first_microbatch is None and not isinstance(weight, Float8Tensor) and (
        bias is None or out_dtype != torch.float32)


def fused_forward(x_quantizer, w_quantizer, x, weight, bias, out_dtype, need_x_t, need_w_t, residual):
    """fp8_linear_fwd: x [M, K] @ weight [N, K]ᵀ (+ bias) (+ residual [M, N]), both cast by their (per-tensor)
    quantizers -> (out [M, N], x's FP8Operand (data_t [K, M] or None), the weight's FP8Operand (data_t [K, N] or
    None)); the rowwise data stay inside the op. need_w_t: as base.fp8_weight decides for an uncached weight."""
    x_scale, x_amax, x_sinv = x_quantizer.cast_args(x)
    w_scale, w_amax, w_sinv = w_quantizer.cast_args(weight)
    fp8_dtype = x_quantizer.fp8_dtype
    bias = bias.to(out_dtype) if bias is not None and bias.dtype != out_dtype else bias
    out, xqt, wqt = tfp8.fp8_linear_fwd(x, weight, x_scale, w_scale, fp8_dtype, x_amax, x_sinv, w_amax, w_sinv,
                                        need_x_t, need_w_t, out_dtype, bias, residual)
    return (out, FP8Operand(None, xqt if need_x_t else None, x_sinv, fp8_dtype),
            FP8Operand(None, wqt if need_w_t else None, w_sinv, w_quantizer.fp8_dtype))


def fused_grads(dy_quantizer, dy, with_dbias, w_t, x_t, dx_dtype, dw_dtype, main_grad):
    """fp8_linear_bwd: dy [M, N] cast by dy_quantizer -> (dx [M, K] or None, dW [N, K] or None, dbias [N] or None).
    w_t: the weight's FP8Operand with data_t (Wᵀ [K, N]), or None (no dgrad); x_t likewise (xᵀ) for the wgrad;
    main_grad: the FP32 tensor the wgrad accumulates into (then dW is None), or None."""
    scale, amax, scale_inv = dy_quantizer.cast_args(dy)
    need_dgrad, need_wgrad = w_t is not None, x_t is not None
    main_grad = main_grad if need_wgrad else None
    w_data, w_scale_inv = (w_t.data_t, w_t.scale_inv_t) if need_dgrad else (None, scale_inv)
    x_data, x_scale_inv = (x_t.data_t, x_t.scale_inv_t) if need_wgrad else (None, scale_inv)
    dx, dw, dbias = tfp8.fp8_linear_bwd(dy, scale, dy_quantizer.fp8_dtype, amax, scale_inv, with_dbias, w_data,
                                        w_scale_inv, dx_dtype, x_data, x_scale_inv, dw_dtype, main_grad)
    return (dx if need_dgrad else None, dw if need_wgrad and main_grad is None else None,
            dbias if with_dbias else None)


def gemm_grads(dy, w_t, x_t, dx_dtype, dw_dtype, main_grad, need_dgrad, need_wgrad):
    """dgrad and wgrad of one GEMM from FP8Operands: dy (data for the dgrad, data_t for the wgrad), w_t (Wᵀ as
    data_t), x_t (xᵀ as data_t). With main_grad (FP32) the wgrad is accumulated into it and None is returned for it.
    Returns (dx or None, dW or None)."""
    dx = gemm(dy, w_t, dx_dtype, transpose_b=True) if need_dgrad else None
    dw = None
    if need_wgrad:
        if main_grad is not None:
            gemm_accumulate(dy, x_t, main_grad, transpose_a=True, transpose_b=True)
        else:
            dw = gemm(dy, x_t, dw_dtype, transpose_a=True, transpose_b=True)
    return dx, dw


class LinearMainGrad(torch.autograd.Function):
    """High-precision y = x Wᵀ + b whose weight gradient is accumulated (FP32) into weight.main_grad."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dy = grad.reshape(-1, grad.shape[-1])
        dx = (grad @ weight) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            main_grad = main_grad_of(weight)
            main_grad.add_(dy.float().t() @ x.reshape(-1, x.shape[-1]).float())
        dbias = dy.sum(0) if ctx.needs_input_grad[2] else None
        return dx, None, dbias


def high_precision_linear(module, x, weight, bias):
    """F.linear, or LinearMainGrad when the module fuses wgrad accumulation and a weight gradient is needed."""
    if module.fuse_wgrad_accumulation and weight.requires_grad and torch.is_grad_enabled():
        return LinearMainGrad.apply(x, weight, bias)
    return F.linear(x, weight, bias)
