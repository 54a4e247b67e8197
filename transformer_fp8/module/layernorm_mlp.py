"""LayerNormMLP: y = fc2(act(fc1(norm(x)))) with FP8 GEMMs inside fp8_autocast; the norm and the activation emit FP8.

Parameters: layer_norm_weight / layer_norm_bias [hidden], fc1_weight [F1, hidden] (F1 = ffn, or 2*ffn for swiglu
whose rows are [gate | up]), fc1_bias [F1], fc2_weight [hidden, ffn], fc2_bias [hidden].
FP8 forward slots: 0 fc1 input, 1 fc1 weight, 2 fc2 input, 3 fc2 weight; backward: 0 fc1 grad_output, 1 fc2 grad_output.
Returns out, plus fc2_bias (return_bias, not added) and ln_out (return_layernorm_output), in that order.
"""
import torch
import torch.nn.functional as F

from .. import autocast
from ..distributed import TensorParallel
from ..ops import tfp8
from ._gemm import cast_grad_output, fp8_gemm_bias, gemm_grads, high_precision_linear, register_backward
from .base import (FP8ModuleBase, cast_transpose, check_choice, check_input, check_positive, fp8_output_args,
                   pack_outputs)
from .norm import NORMALIZATIONS, _NormFunction, init_norm_params, norm_backward, norm_to_fp8


def _swiglu(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


ACTIVATIONS = {"gelu": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "swiglu": _swiglu}


def _activation_to_fp8(module, fc1_out, need_transpose):
    """act(fc1_out [M, F1]) into FP8 forward slot 2: (q [M, F], qT [F, M] or None, scale_inv [1])."""
    if module.fp8_current:
        act = tfp8.activation_fwd(fc1_out, module.activation)
        q, qt, scale_inv = cast_transpose(act, module.fp8_fwd, 2, module.fwd_dtype, True, transpose=need_transpose)
        return q, (qt if need_transpose else None), scale_inv
    fp8_args = fp8_output_args(module.fp8_fwd, 2, module.fwd_dtype)
    q = tfp8.activation_fwd(fc1_out, module.activation, *fp8_args)
    return q, (tfp8.fp8_transpose(q) if need_transpose else None), fp8_args[3]


def _dact_to_fp8(module, d_act, fc1_out, with_dbias):
    """d(fc1_out) = act'(fc1_out) * d_act into FP8 backward slot 0: (q, qT, scale_inv, dbias or None)."""
    if module.fp8_current:
        d_fc1 = tfp8.activation_bwd(d_act, fc1_out, module.activation)
        return cast_grad_output(d_fc1, module, 0, with_dbias, True, True)
    scale, fp8_dtype, amax, scale_inv = fp8_output_args(module.fp8_bwd, 0, module.bwd_dtype)
    q, qt, dbias = tfp8.dact_cast_transpose(d_act, fc1_out, module.activation, scale, fp8_dtype, amax, scale_inv,
                                            with_dbias)
    return q, qt, scale_inv, (dbias if with_dbias else None)


class _FP8LayerNormMLP(torch.autograd.Function):
    """Saves x, mean/rstd, fc1_out (high precision, for the activation backward) and the FP8 transposes."""

    @staticmethod
    def forward(ctx, inp, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias, module, training,
                is_first_microbatch):
        ctx.set_materialize_grads(False)
        needs = [training and n for n in ctx.needs_input_grad[:7]]
        need_dgrad, need_fc1_wgrad, need_fc2_wgrad = any(needs[:3]), needs[3], needs[5]
        need_fc2_dgrad = any(needs[:5])
        x = inp.reshape(-1, inp.shape[-1])
        dtype = inp.dtype
        lnq, lnqt, lnsinv, ln_out, mean, rstd = norm_to_fp8(module, x, need_fc1_wgrad, module.return_layernorm_output)
        w1q, w1qt, w1sinv = module._fp8_weight("fc1_weight", fc1_weight, 1, need_dgrad, is_first_microbatch)
        fc1_out = fp8_gemm_bias(lnq, lnsinv, w1q, w1sinv, dtype, fc1_bias)
        aq, aqt, asinv = _activation_to_fp8(module, fc1_out, need_fc2_wgrad)
        w2q, w2qt, w2sinv = module._fp8_weight("fc2_weight", fc2_weight, 3, need_fc2_dgrad, is_first_microbatch)
        out = fp8_gemm_bias(aq, asinv, w2q, w2sinv, dtype, fc2_bias)
        if training:
            ctx.save_for_backward(x, mean, rstd, ln_weight, lnqt, w1qt, fc1_out, aqt, w2qt)
            ctx.scale_invs = (lnsinv, w1sinv, asinv, w2sinv)  # snapshots: outside save_for_backward (see base.py)
            ctx.weights = (fc1_weight, fc2_weight)  # for main_grad and dtypes; backward uses the FP8 copies
            ctx.module, ctx.fp8_state = module, (autocast.STATE.recipe, autocast.STATE.group)
            ctx.needs, ctx.inp_shape = needs, inp.shape
        out = out.view(*inp.shape[:-1], out.shape[-1])
        return out, (ln_out.view(inp.shape) if ln_out is not None else inp.new_empty(0))

    @staticmethod
    def backward(ctx, grad, grad_ln_out):
        x, mean, rstd, ln_weight, lnqt, w1qt, fc1_out, aqt, w2qt = ctx.saved_tensors
        lnsinv, w1sinv, asinv, w2sinv = ctx.scale_invs
        fc1_weight, fc2_weight = ctx.weights
        module, needs = ctx.module, ctx.needs
        need_dgrad, need_fc2_dgrad = any(needs[:3]), any(needs[:5])
        dw1 = dbias1 = dw2 = dbias2 = d_ln = None
        if grad is not None:
            dy = grad.reshape(-1, grad.shape[-1]).contiguous()
            dy_fp8 = cast_grad_output(dy, module, 1, needs[6], need_fc2_dgrad, needs[5])
            register_backward(module, *ctx.fp8_state)
            d_act, dw2 = gemm_grads(module, fc2_weight, dy_fp8[:3], (w2qt, w2sinv), (aqt, asinv), x.dtype,
                                    need_fc2_dgrad, needs[5])
            dbias2 = dy_fp8[3]
            if d_act is not None:
                dq1, dqt1, dsinv1, dbias1 = _dact_to_fp8(module, d_act, fc1_out, needs[4])
                d_ln, dw1 = gemm_grads(module, fc1_weight, (dq1, dqt1, dsinv1), (w1qt, w1sinv), (lnqt, lnsinv),
                                       x.dtype, need_dgrad, needs[3])
        dx, dgamma, dbeta = norm_backward(module, d_ln, grad_ln_out if need_dgrad else None, x, mean, rstd,
                                          ln_weight, ctx.inp_shape)
        return dx, dgamma, dbeta, dw1, dbias1, dw2, dbias2, None, None, None


class LayerNormMLP(FP8ModuleBase):
    """LayerNormMLP(hidden_size, ffn_hidden_size, eps=1e-5, bias=True, normalization="LayerNorm" | "RMSNorm",
    activation="gelu" | "swiglu" | "relu", zero_centered_gamma=False, return_layernorm_output=False,
    params_dtype=None, device="cuda", init_method=None, output_layer_init_method=None, fuse_wgrad_accumulation=False,
    return_bias=False, fp8_min_gemm_size=None, tp_group=None, tp_size=1, set_parallel_mode=False,
    sequence_parallel=False). forward(inp [..., hidden], is_first_microbatch=None). gelu is the tanh approximation.
    Small-shape automatic path: as Linear's, with M*K*N summed over both GEMMs (M*hidden*(fc1 width + ffn)).

    Tensor parallelism (set_parallel_mode=True and a tp_group of size tp > 1): FC1 column-parallel (fc1_weight
    [F1/tp, hidden], fc1_bias [F1/tp]; for swiglu this rank's gate rows then its up rows), FC2 row-parallel
    (fc2_weight [hidden, ffn/tp], fc2_bias [hidden] added after the sum over ranks). The input is copied, or with
    sequence_parallel all-gathered along dim 0 before the norm (every rank normalises the whole sequence; the norm's
    weight gradients are all-reduced over the TP group), and the output all-reduced, or reduce-scattered along
    dim 0. Full checkpoints load (sliced by rank). return_layernorm_output is not supported with TP."""

    def __init__(self, hidden_size, ffn_hidden_size, eps=1e-5, bias=True, normalization="LayerNorm",
                 activation="gelu", zero_centered_gamma=False, return_layernorm_output=False, params_dtype=None,
                 device="cuda", init_method=None, output_layer_init_method=None, fuse_wgrad_accumulation=False,
                 return_bias=False, fp8_min_gemm_size=None, tp_group=None, tp_size=1, set_parallel_mode=False,
                 sequence_parallel=False):
        check_positive(hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
        check_choice("normalization", normalization, NORMALIZATIONS)
        check_choice("activation", activation, tuple(ACTIVATIONS))
        fc1_out = 2 * ffn_hidden_size if activation == "swiglu" else ffn_hidden_size
        tp = TensorParallel.create(tp_group, tp_size, "column" if set_parallel_mode else None, sequence_parallel)
        if tp is not None and return_layernorm_output:
            raise NotImplementedError("return_layernorm_output: not supported with tensor parallelism")
        local_ffn = ffn_hidden_size if tp is None else tp.local("ffn_hidden_size", ffn_hidden_size)
        blocks = 2 if activation == "swiglu" else 1
        super().__init__(2, params_dtype, device, fuse_wgrad_accumulation, blocks * local_ffn + local_ffn,
                         fp8_min_gemm_size)
        self.tp, self.set_parallel_mode, self.sequence_parallel = tp, bool(set_parallel_mode), bool(sequence_parallel)
        self.hidden_size, self.ffn_hidden_size, self.eps = hidden_size, ffn_hidden_size, float(eps)
        self.normalization, self.activation = normalization, activation
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.return_layernorm_output, self.return_bias = bool(return_layernorm_output), bool(return_bias)
        init_norm_params(self, hidden_size, normalization, self.zero_centered_gamma, "layer_norm_")
        self.fc1_weight = self._weight_param((fc1_out, hidden_size), init_method, tp, 0, blocks)
        self.fc1_bias = self._vector_param(blocks * local_ffn, 0.0) if bias else None
        self.fc2_weight = self._weight_param((hidden_size, ffn_hidden_size), output_layer_init_method or init_method,
                                             tp, 1)
        self.fc2_bias = self._vector_param(hidden_size, 0.0) if bias else None
        if tp is not None:
            sharded = {"fc1_weight": (0, blocks), "fc1_bias": (0, blocks), "fc2_weight": (1, 1)}
            self.register_load_state_dict_pre_hook(tp.load_full_checkpoint_hook(sharded))

    def forward(self, inp, is_first_microbatch=None):
        check_input(inp, self.hidden_size)
        if self.tp is not None:
            return self._parallel_forward(inp, is_first_microbatch)
        out, ln_out = self._local_mlp(inp, self.layer_norm_weight, self.layer_norm_bias,
                                      None if self.return_bias else self.fc2_bias, is_first_microbatch)
        return pack_outputs(self, out, self.fc2_bias, ln_out)

    def _local_mlp(self, inp, ln_weight, ln_bias, fc2_bias, is_first_microbatch):
        """(fc2(act(fc1(norm(inp)))) with this rank's weights, norm output) in FP8 inside fp8_autocast."""
        inp = inp if inp.is_contiguous() else inp.contiguous()
        state = autocast.STATE
        if state.enabled and self._runs_fp8(inp):
            self._fp8_begin(state)
            return _FP8LayerNormMLP.apply(inp, ln_weight, ln_bias, self.fc1_weight, self.fc1_bias, self.fc2_weight,
                                          fc2_bias, self, torch.is_grad_enabled(), is_first_microbatch)
        ln_out = _NormFunction.apply(inp, ln_weight, ln_bias, self.normalization, self.eps, self.zero_centered_gamma)
        act = ACTIVATIONS[self.activation](high_precision_linear(self, ln_out, self.fc1_weight, self.fc1_bias))
        return high_precision_linear(self, act, self.fc2_weight, fc2_bias), ln_out

    def _parallel_forward(self, inp, is_first_microbatch):
        """Copy / all-gather, the local MLP (partial sums), all-reduce / reduce-scatter, then fc2_bias."""
        tp = self.tp
        if autocast.STATE.enabled:
            tp.check_amax_group(autocast.STATE.group)
        partial, _ = self._local_mlp(tp.column_input(inp), tp.replicated(self.layer_norm_weight),
                                     tp.replicated(self.layer_norm_bias), None, is_first_microbatch)
        out = tp.row_output(partial)
        bias = tp.replicated(self.fc2_bias) if tp.sequence_parallel else self.fc2_bias
        if self.return_bias:
            return out, bias
        return out if bias is None else out + bias

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"normalization={self.normalization}, activation={self.activation}")
