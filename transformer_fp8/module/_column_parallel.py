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
from ..ops import tfp8
from . import norm
from ._gemm import cast_grad_output, fused_grads, gemm_grads
from .base import cast_transpose

COLLECTIVES = {"reduce_scatter": start_reduce_scatter_first_dim, "all_reduce": start_all_reduce}


def gathers_input(module):
    """True when `module` all-gathers a sequence-parallel input itself."""
    return module.tp is not None and module.tp.gathers_input


def check_sequence_block(inp):
    if inp.dim() < 2:
        raise ValueError(f"inp: sequence_parallel needs at least 2 dims (dim 0 is split), got shape {tuple(inp.shape)}")


def gathered_shape(inp_shape, module):
    """The shape of the all-gathered input (dim 0 times the TP size)."""
    return (inp_shape[0] * module.tp.size, *inp_shape[1:])


def _scales_shared(module):
    return module.fp8_current or module._fp8_recipe.reduce_amax


def _with_transpose(q, scale_inv, need_transpose):
    return q, (tfp8.fp8_transpose(q) if need_transpose else None), scale_inv


def gather_cast(module, x, need_transpose):
    """x [m, K] high precision -> (q [tp * m, K], qT [K, tp * m] or None, scale_inv [1]) in forward slot 0."""
    group = module.tp.group
    if _scales_shared(module):
        q, _, scale_inv = cast_transpose(x, module.fp8_fwd, 0, module.fwd_dtype, module.fp8_current, transpose=False)
        return _with_transpose(all_gather_fp8(q, group), scale_inv, need_transpose)
    q, qt, scale_inv = cast_transpose(all_gather_first_dim(x, group), module.fp8_fwd, 0, module.fwd_dtype, False,
                                      transpose=need_transpose)
    return q, (qt if need_transpose else None), scale_inv


def gather_norm(module, x, need_transpose):
    """norm(x [m, K]) into forward slot 0, all-gathered: (q [tp * m, K], qT [K, tp * m] or None, scale_inv [1],
    mean [m] or None, rstd [m])."""
    if _scales_shared(module):
        q, _, scale_inv, _, mean, rstd = norm.norm_to_fp8(module, x, False, False)
        return (*_with_transpose(all_gather_fp8(q, module.tp.group), scale_inv, need_transpose), mean, rstd)
    out, mean, rstd = norm.norm_fwd(module.normalization, x, module.layer_norm_weight, module.layer_norm_bias,
                                    module.eps, module.zero_centered_gamma)
    q, qt, scale_inv = cast_transpose(all_gather_first_dim(out, module.tp.group), module.fp8_fwd, 0,
                                      module.fwd_dtype, False, transpose=need_transpose)
    return q, (qt if need_transpose else None), scale_inv, mean, rstd


def dgrad_collective(module, sums_copied_input):
    """How `module` sums its GEMM input's dgrad over the TP group: "reduce_scatter" (sequence parallel), "all_reduce"
    (a copied input whose gradient the module sums itself: sums_copied_input), or None."""
    if module.tp is None:
        return None
    return "reduce_scatter" if module.tp.gathers_input else "all_reduce" if sums_copied_input else None


def start_dgrad_sum(module, collective, dx):
    """Start `collective` (see dgrad_collective) on dx, this rank's partial dgrad: a distributed.Pending."""
    if collective is None or dx is None:
        return Pending(dx, None)
    return COLLECTIVES[collective](dx, module.tp.group)


def input_grads(module, collective, weight, dy_fp8, w_t, x_t, dx_dtype, need_dgrad, need_wgrad):
    """gemm_grads (same arguments after `collective`) with the dgrad summed by `collective` (see dgrad_collective)
    while the wgrad GEMM runs."""
    if collective is None:  # (the single-GPU hot path: one call)
        return gemm_grads(module, weight, dy_fp8, w_t, x_t, dx_dtype, need_dgrad, need_wgrad)
    dx, _ = gemm_grads(module, weight, dy_fp8, w_t, x_t, dx_dtype, need_dgrad, False)
    pending = start_dgrad_sum(module, collective, dx)
    _, dw = gemm_grads(module, weight, dy_fp8, w_t, x_t, dx_dtype, False, need_wgrad)
    return pending.wait(), dw


def output_grads(module, collective, weight, dy, with_dbias, w_t, x_t, dx_dtype):
    """The backward of a GEMM from its output gradient dy [M, N] (high precision, cast here into backward slot 0):
    (dx or None, dW or None, dbias or None). w_t / x_t: (FP8 Wᵀ / xᵀ, scale_inv), or None where dgrad / wgrad is
    not needed. Without a collective, one op call (fp8_linear_bwd); else input_grads' overlap."""
    need_dgrad, need_wgrad = w_t is not None, x_t is not None
    if collective is None:
        return fused_grads(module, weight, dy, with_dbias, w_t, x_t, dx_dtype)
    dq, dqt, dsinv, dbias = cast_grad_output(dy, module, 0, with_dbias, need_dgrad, need_wgrad)
    dx, dw = input_grads(module, collective, weight, (dq, dqt, dsinv), w_t or (None, None), x_t or (None, None),
                         dx_dtype, need_dgrad, need_wgrad)
    return dx, dw, dbias
