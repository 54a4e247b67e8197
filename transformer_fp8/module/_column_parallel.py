"""The input side of a column-parallel FP8 GEMM (Linear, LayerNormLinear, LayerNormMLP with tensor parallelism),
inside the module's autograd Function.

Sequence parallel: the input x [m, K] is this rank's block of rows (m = all rows / tp). It is cast (Linear) or
normalised (the norm modules: mean/rstd of the block only) into FP8 forward slot 0 on the block, with the scale every
TP rank shares (see distributed.TensorParallel), and the FP8 rows are all-gathered: q [tp * m, K], one byte an
element. The GEMM runs on q; for the wgrad the forward keeps qT [K, tp * m] (what a non-SP module keeps).
A delayed-scaling recipe with reduce_amax=False has per-rank scales: the block is then gathered in high precision and
the gathered rows cast.
Backward (input_grads): the dgrad of the GEMM's input is this rank's partial sum over the TP ranks; its
reduce-scatter back to the block (SP) or its all-reduce starts right after the dgrad GEMM and runs while the wgrad
GEMM does.
"""
from ..distributed import (Pending, all_gather_first_dim, all_gather_fp8, start_all_reduce,
                           start_reduce_scatter_first_dim)
from ..quantization import FP8Operand
from . import norm
from ._gemm import cast_grad_output, fused_grads, gemm_grads

COLLECTIVES = {"reduce_scatter": start_reduce_scatter_first_dim, "all_reduce": start_all_reduce}


def gathers_input(module):
    """True when `module` all-gathers a sequence-parallel input itself."""
    return module.tp is not None and module.tp.gathers_input


def check_sequence_block(inp):
    if inp.dim() < 2:
        raise ValueError(f"inp: sequence_parallel needs at least 2 dims (dim 0 is split), got shape {tuple(inp.shape)}")


def gathered_shape(inp_shape, tp):
    """The shape of the all-gathered input (dim 0 times the TP size of `tp`, a distributed.TensorParallel)."""
    return (inp_shape[0] * tp.size, *inp_shape[1:])


def _gathered(operand, group, need_transpose):
    """A rowwise FP8Operand of this rank's block -> the FP8Operand of the all-gathered rows (data_t when asked)."""
    gathered = FP8Operand(all_gather_fp8(operand.data, group), None, operand.scale_inv, operand.fp8_dtype)
    return gathered.with_transpose() if need_transpose else gathered


def gather_cast(quantizers, quantizer, tp, x, need_transpose):
    """x [m, K] high precision -> the FP8Operand of the gathered rows (data [tp * m, K], data_t [K, tp * m] when
    need_transpose) cast by `quantizer` (of the set `quantizers`) for the TP group of `tp`."""
    if quantizers.same_scale_on_every_rank():
        return _gathered(quantizer.cast(x), tp.group, need_transpose)
    return quantizer.cast(all_gather_first_dim(x, tp.group), transpose=need_transpose)


def gather_norm(quantizers, quantizer, spec, tp, x, ln_weight, ln_bias, need_transpose):
    """norm(x [m, K]) cast by `quantizer`, all-gathered over the TP group of `tp`: (FP8Operand of the gathered rows,
    mean [m] or None, rstd [m]). spec: the norm's NormSpec."""
    if quantizers.same_scale_on_every_rank():
        operand, _, mean, rstd = norm.norm_to_fp8(spec, quantizer, x, ln_weight, ln_bias, False, False)
        return _gathered(operand, tp.group, need_transpose), mean, rstd
    out, mean, rstd = norm.norm_fwd(spec.normalization, x, ln_weight, ln_bias, spec.eps, spec.zero_centered_gamma)
    return quantizer.cast(all_gather_first_dim(out, tp.group), transpose=need_transpose), mean, rstd


def dgrad_collective(tp, sums_copied_input):
    """How a module with TP `tp` (or None) sums its GEMM input's dgrad over the TP group: "reduce_scatter" (sequence
    parallel), "all_reduce" (a copied input whose gradient the module sums itself: sums_copied_input), or None."""
    if tp is None:
        return None
    return "reduce_scatter" if tp.gathers_input else "all_reduce" if sums_copied_input else None


def start_dgrad_sum(tp, collective, dx):
    """Start `collective` (see dgrad_collective) on dx, this rank's partial dgrad: a distributed.Pending."""
    if collective is None or dx is None:
        return Pending(dx, None)
    return COLLECTIVES[collective](dx, tp.group)


def input_grads(tp, collective, dy, w_t, x_t, dx_dtype, dw_dtype, main_grad, need_dgrad, need_wgrad):
    """gemm_grads (same arguments after `collective`) with the dgrad summed by `collective` (see dgrad_collective)
    while the wgrad GEMM runs."""
    if collective is None:  # (the single-GPU hot path: one call)
        return gemm_grads(dy, w_t, x_t, dx_dtype, dw_dtype, main_grad, need_dgrad, need_wgrad)
    dx, _ = gemm_grads(dy, w_t, x_t, dx_dtype, dw_dtype, main_grad, need_dgrad, False)
    pending = start_dgrad_sum(tp, collective, dx)
    _, dw = gemm_grads(dy, w_t, x_t, dx_dtype, dw_dtype, main_grad, False, need_wgrad)
    return pending.wait(), dw


def output_grads(tp, collective, dy_quantizer, dy, with_dbias, w_t, x_t, dx_dtype, dw_dtype, main_grad):
    """The backward of a GEMM from its output gradient dy [M, N] (high precision, cast here by dy_quantizer):
    (dx or None, dW or None, dbias or None). w_t / x_t: the FP8Operands with Wᵀ / xᵀ as data_t, or None where dgrad
    / wgrad is not needed; main_grad: the FP32 tensor the wgrad accumulates into, or None. Without a collective,
    one op call (fp8_linear_bwd) when the quantizer is per-tensor; else input_grads' overlap."""
    need_dgrad, need_wgrad = w_t is not None, x_t is not None
    if collective is None and dy_quantizer.fused_per_tensor:
        return fused_grads(dy_quantizer, dy, with_dbias, w_t, x_t, dx_dtype, dw_dtype, main_grad)
    dy_op, dbias = cast_grad_output(dy, dy_quantizer, with_dbias, need_dgrad, need_wgrad)
    dx, dw = input_grads(tp, collective, dy_op, w_t, x_t, dx_dtype, dw_dtype, main_grad, need_dgrad, need_wgrad)
    return dx, dw, dbias
