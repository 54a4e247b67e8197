"""LayerNormLinear: y = norm(x) Wᵀ + b, the norm emitting FP8 straight into the GEMM inside fp8_autocast.

Parameters: layer_norm_weight / layer_norm_bias [in] (bias only for LayerNorm), weight [out, in], bias [out].
Roles (quantization.Role): forward INPUT (the normalised input), WEIGHT; backward GRAD_OUTPUT.
Returns out, (out, bias) with return_bias, (out, ln_out) with return_layernorm_output, (out, bias, ln_out) with both.
"""
import torch

from .. import autocast
from ..distributed import TensorParallel, gather_from_sequence_parallel_region
from ..quantization import GEMM_ROLES, Role
from ._column_parallel import (check_sequence_block, dgrad_collective, gather_norm, gathered_shape, gathers_input,
                               output_grads)
from ._gemm import fp8_gemm_bias, high_precision_linear
from ._high_precision import applies as lean_saves_apply, norm_linear
from .base import (FP8ModuleBase, check_choice, check_input, check_positive, fp8_weight, fp8_weight_transpose,
                   main_grad_of, pack_outputs)
from .norm import NORMALIZATIONS, NormSpec, _NormFunction, init_norm_params, norm_backward, norm_to_fp8


class _FP8LayerNormLinear(torch.autograd.Function):
    """Saves x (high precision, for the norm backward), mean/rstd, and the FP8 norm(x)ᵀ and Wᵀ. Casts by
    `quantizers` (roles INPUT: the normalised input, WEIGHT, GRAD_OUTPUT). Tensor parallel (tp): the gradient of
    norm(x) is summed over the TP ranks before the norm backward (so the norm's weight gradients are complete);
    sequence parallel: x, mean/rstd are this rank's block, norm(x) is all-gathered in FP8 and its gradient
    reduce-scattered (see _column_parallel.py). spec: the norm's NormSpec; weight_cache: the module's FP8 weight
    cache; fuse_wgrad: the wgrad goes into weight.main_grad; keep_ln_out: return_layernorm_output."""

    @staticmethod
    def forward(ctx, inp, ln_weight, ln_bias, weight, bias, quantizers, tp, spec, weight_cache, fuse_wgrad,
                keep_ln_out, training, is_first_microbatch, relay):
        ctx.set_materialize_grads(False)
        need_dgrad = training and any(ctx.needs_input_grad[:3])
        need_wgrad = training and ctx.needs_input_grad[3]
        x = inp.reshape(-1, inp.shape[-1])
        out_shape = inp.shape
        ln_quantizer = quantizers[Role.INPUT]
        if tp is not None and tp.gathers_input:
            out_shape = gathered_shape(inp.shape, tp)
            ln_op, mean, rstd = gather_norm(quantizers, ln_quantizer, spec, tp, x, ln_weight, ln_bias, need_wgrad)
            ln_out = None
        else:
            ln_op, ln_out, mean, rstd = norm_to_fp8(spec, ln_quantizer, x, ln_weight, ln_bias, need_wgrad,
                                                    keep_ln_out)
        w_op = fp8_weight(weight_cache, "weight", weight, quantizers[Role.WEIGHT], need_dgrad, is_first_microbatch)
        out = fp8_gemm_bias(ln_op, w_op, inp.dtype, bias)
        if training:
            ctx.save_for_backward(x, mean, rstd, ln_weight, ln_op.data_t, w_op.data_t)
            # scale_inv snapshots: outside save_for_backward (see quantization/state.py), in data-less operands
            ctx.operands = (ln_op.transposed_only(), w_op.transposed_only())
            ctx.weight = weight  # for main_grad, its dtype and the backward's Wᵀ cast
            ctx.setup = (quantizers, tp, spec, fuse_wgrad, autocast.STATE.group)
            ctx.need, ctx.inp_shape = (need_dgrad, need_wgrad), inp.shape
            ctx.relay = relay
            if relay is not None:
                relay.armed = True  # (its gradient joins dx in the norm backward, see _residual_relay.py)
        out = out.view(*out_shape[:-1], out.shape[-1])
        return out, (ln_out.view(inp.shape) if ln_out is not None else inp.new_empty(0))

    @staticmethod
    def backward(ctx, grad, grad_ln_out):
        x, mean, rstd, ln_weight, ln_t, w_t = ctx.saved_tensors
        ln_op, w_op = (op.transposed_only(t) for op, t in zip(ctx.operands, (ln_t, w_t)))
        quantizers, tp, spec, fuse_wgrad, group = ctx.setup
        need_dgrad, need_wgrad = ctx.need
        weight = ctx.weight
        dw = dbias = d_ln = None
        if grad is not None:
            dy = grad.reshape(-1, grad.shape[-1]).contiguous()
            w_op = fp8_weight_transpose(weight, w_op, quantizers[Role.WEIGHT]) if need_dgrad else None
            main_grad = main_grad_of(weight) if need_wgrad and fuse_wgrad else None
            d_ln, dw, dbias = output_grads(tp, dgrad_collective(tp, True), quantizers[Role.GRAD_OUTPUT], dy,
                                           ctx.needs_input_grad[4], w_op, ln_op if need_wgrad else None, x.dtype,
                                           weight.dtype, main_grad)
            quantizers.register_backward(group)
        handed = ctx.relay.take() if ctx.relay is not None else None
        dx, dgamma, dbeta = norm_backward(spec, d_ln, grad_ln_out if need_dgrad else None, x, mean, rstd,
                                          ln_weight, ctx.inp_shape,
                                          None if handed is None else handed.reshape(x.shape).contiguous())
        return dx, dgamma, dbeta, dw, dbias, *(None,) * 9


class LayerNormLinear(FP8ModuleBase):
    """LayerNormLinear(in_features, out_features, eps=1e-5, bias=True, normalization="LayerNorm" | "RMSNorm",
    zero_centered_gamma=False, return_layernorm_output=False, params_dtype=None, device="cuda", init_method=None,
    fuse_wgrad_accumulation=False, return_bias=False, fp8_min_gemm_size=None, tp_group=None, tp_size=1,
    parallel_mode=None, sequence_parallel=False).
    forward(inp [..., in], is_first_microbatch=None). Small-shape automatic path: as Linear's (M*in*out).
    (residual_grad_relay: MultiheadAttention's, see _residual_relay.py.)

    Tensor parallelism: parallel_mode="column" only (as Linear's: weight [out/tp, in], bias [out/tp], output
    [..., out/tp]). The input is copied to every rank, or with sequence_parallel it is this rank's dim-0 block: the
    norm runs on the block and its output is all-gathered along dim 0 before the GEMM (in FP8 inside fp8_autocast,
    else in high precision), the output covering the whole dim 0. The norm's weight gradients are all-reduced over
    the TP group. return_layernorm_output is not supported with tensor parallelism.

    recompute_in_backward (attribute, default False): True makes the high-precision path (outside fp8_autocast)
    recompute norm(x) in the backward for the weight gradient instead of keeping it from the forward (one
    [tokens, in] tensor less per layer, one more norm kernel; the same gradients), where _high_precision.applies
    says it can; False keeps it (autograd's composition, as Transformer Engine's BF16 modules)."""

    forward_roles, backward_roles = GEMM_ROLES

    def __init__(self, in_features, out_features, eps=1e-5, bias=True, normalization="LayerNorm",
                 zero_centered_gamma=False, return_layernorm_output=False, params_dtype=None, device="cuda",
                 init_method=None, fuse_wgrad_accumulation=False, return_bias=False, fp8_min_gemm_size=None,
                 tp_group=None, tp_size=1, parallel_mode=None, sequence_parallel=False):
        check_positive(in_features=in_features, out_features=out_features)
        check_choice("normalization", normalization, NORMALIZATIONS)
        check_choice("parallel_mode", parallel_mode, (None, "column"))
        tp = TensorParallel.create(tp_group, tp_size, parallel_mode, sequence_parallel)
        if tp is not None and return_layernorm_output:
            raise NotImplementedError("return_layernorm_output: not supported with tensor parallelism")
        local_out = out_features if tp is None else tp.local("out_features", out_features)
        super().__init__(params_dtype, device, fuse_wgrad_accumulation, local_out, fp8_min_gemm_size)
        self.tp, self.parallel_mode, self.sequence_parallel = tp, parallel_mode, bool(sequence_parallel)
        self.in_features, self.out_features, self.eps = in_features, out_features, float(eps)
        self.normalization, self.zero_centered_gamma = normalization, bool(zero_centered_gamma)
        self.return_layernorm_output, self.return_bias = bool(return_layernorm_output), bool(return_bias)
        init_norm_params(self, in_features, normalization, self.zero_centered_gamma, "layer_norm_")
        self.weight = self._weight_param((out_features, in_features), init_method, tp, 0)
        self.bias = self._vector_param(local_out, 0.0) if bias else None
        if tp is not None:
            self.register_load_state_dict_pre_hook(tp.load_full_checkpoint_hook({"weight": (0, 1), "bias": (0, 1)}))
        self.recompute_in_backward = False  # True: high precision recomputes norm(x) (see _high_precision.py)

    def forward(self, inp, is_first_microbatch=None, residual_grad_relay=None):
        check_input(inp, self.in_features)
        ln_weight, ln_bias = self.layer_norm_weight, self.layer_norm_bias
        tp, gathers = self.tp, gathers_input(self)
        state = autocast.STATE
        if tp is not None:
            if gathers:
                check_sequence_block(inp)
            if state.enabled:
                tp.check_amax_group(state.group)
        inp = inp if inp.is_contiguous() else inp.contiguous()
        bias = None if self.return_bias else self.bias
        fp8 = state.enabled and self._runs_fp8(inp, tp.size if gathers else 1)
        if tp is not None and (gathers or not fp8):  # norm weights whose gradients are partial sums over ranks
            ln_weight, ln_bias = tp.replicated(ln_weight), tp.replicated(ln_bias)
        if fp8:  # (TP: the Function sums the input gradient over the ranks itself)
            self._fp8_begin(state)
            out, ln_out = _FP8LayerNormLinear.apply(inp, ln_weight, ln_bias, self.weight, bias, self.quantizers, tp,
                                                    NormSpec.of(self), self._weight_cache,
                                                    self.fuse_wgrad_accumulation, self.return_layernorm_output,
                                                    torch.is_grad_enabled(), is_first_microbatch, residual_grad_relay)
        else:
            if self._last_forward_fp8:
                self._check_recompute_precision()
            if not state.calibrating and lean_saves_apply(self, inp):  # (saves no copy of norm(x))
                out = norm_linear(inp, ln_weight, ln_bias, self.weight, bias, NormSpec.of(self))
                return pack_outputs(self, out, self.bias, None)
            inp = tp.column_input(inp) if tp is not None and not gathers else inp
            ln_out = _NormFunction.apply(inp, ln_weight, ln_bias, self.normalization, self.eps,
                                         self.zero_centered_gamma)
            gemm_in = gather_from_sequence_parallel_region(ln_out, tp.group) if gathers else ln_out
            if state.calibrating:
                self._calibrate(gemm_in, self.weight)
            out = high_precision_linear(self, gemm_in, self.weight, bias)
        return pack_outputs(self, out, self.bias, ln_out)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"normalization={self.normalization}")
