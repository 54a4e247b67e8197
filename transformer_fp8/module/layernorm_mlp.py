"""LayerNormMLP: y = fc2(act(fc1(norm(x)))) with FP8 GEMMs inside fp8_autocast; the norm and the activation emit FP8
(GELU under delayed scaling: in FC1's GEMM epilogue).

Parameters: layer_norm_weight / layer_norm_bias [hidden], fc1_weight [F1, hidden] (F1 = ffn, or 2*ffn for swiglu
whose rows are [gate | up]), fc1_bias [F1], fc2_weight [hidden, ffn], fc2_bias [hidden].
Roles (quantization.Role, slot order): forward FC1_INPUT, FC1_WEIGHT, FC2_INPUT, FC2_WEIGHT; backward FC1_GRAD_OUTPUT,
FC2_GRAD_OUTPUT.
Returns out, plus fc2_bias (return_bias, not added) and ln_out (return_layernorm_output), in that order.
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import autocast
from ..distributed import TensorParallel, gather_from_sequence_parallel_region
from ..ops import tfp8
from ..cpu.activation import KEEP_TILE, dequantize_kept_input
from ..quantization import MLP_ROLES, FP8Operand, QuantizerSet, Role, gemm_gelu_to_fp8
from ._amax_passes import activation_amax, activation_grad_amax
from ._gemm import cast_grad_output, fp8_gemm_bias, gemm_grads, high_precision_linear
from ._high_precision import activation_linear, applies as lean_saves_apply, norm_linear
from ._row_parallel import epilogue_terms, sum_partials
from ._column_parallel import (check_sequence_block, dgrad_collective, gather_norm, gathered_shape, gathers_input,
                               start_dgrad_sum)
from .activation import KERNEL_DTYPES, fused_activation
from .base import (FP8ModuleBase, check_choice, check_input, check_positive, check_residual, fp8_weight,
                   fp8_weight_transpose, main_grad_of, pack_outputs, residual_rows)
from .norm import NORMALIZATIONS, NormSpec, _NormFunction, init_norm_params, norm_backward, norm_to_fp8


def _swiglu(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# plain PyTorch activations: the references, and the path for dtypes our kernels do not take (float64)
ACTIVATIONS = {"gelu": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "swiglu": _swiglu}


def _activation_to_fp8(quantizer, activation, fc1_out, need_transpose, keep_input):
    """act(fc1_out [M, F1]) cast by `quantizer` (FC2_INPUT): (an FP8Operand with data [M, F] (data_t [F, M] when
    need_transpose), the kept input or None). With a scale before the activation runs (delayed scaling: known, or on
    its first step calibrated from an amax pass over act(fc1_out), see _amax_passes.py) the activation kernel emits
    FP8 itself and, when keep_input, also writes fc1_out's kept E4M3 copy for the backward (1x128 tiles with their
    scales, see cpu/activation.py) in the same pass: (kept [M, F1], kept_scale_inv [M, F1 / 128]) instead of keeping
    fc1_out."""
    fp8_args = quantizer.output_args_for(activation_amax(fc1_out, activation), fc1_out.device) \
        if quantizer.fused_per_tensor else None
    if fp8_args is None:  # (unfused: the cast's scale comes from act)
        return quantizer.cast_activation(fc1_out, activation, transpose=need_transpose), None
    kept = None
    if keep_input and _can_keep(activation, fc1_out):
        act_data, *kept = tfp8.activation_fwd_keep_input(fc1_out, activation, *fp8_args)
    else:
        act_data = tfp8.activation_fwd(fc1_out, activation, *fp8_args)
    operand = FP8Operand(act_data, None, fp8_args[3], fp8_args[1])
    return (operand.with_transpose() if need_transpose else operand), kept


def _can_keep(activation, fc1_out):
    """Whether activation_fwd_keep_input takes fc1_out: 16-bit, the activation's output width a multiple of 128."""
    width = fc1_out.shape[-1] // 2 if activation == "swiglu" else fc1_out.shape[-1]
    return fc1_out.dtype in (torch.bfloat16, torch.float16) and width % KEEP_TILE == 0


def _gelu_epilogue_fits(quantizer, activation, dtype, fc1_bias):
    """Whether FC1's GEMM can apply GELU and emit the FP8 activation itself once the FC2_INPUT scale is known
    (cuBLASLt's GELU_AUX(_BIAS) epilogue with an E4M3 output, as TE's FC1; its aux output, the pre-activation, is
    what the backward keeps): gelu, a per-tensor quantizer, BF16."""
    return (activation == "gelu" and quantizer.fused_per_tensor and dtype == torch.bfloat16 and
            (fc1_bias is None or fc1_bias.dtype == dtype))


def _gelu_in_fc1_epilogue(quantizer, activation, dtype, fc1_bias):
    """True when FC1's GEMM itself applies GELU and emits the FP8 activation: _gelu_epilogue_fits and a known scale
    (delayed scaling after the first update: the output's scale must exist before the GEMM)."""
    return _gelu_epilogue_fits(quantizer, activation, dtype, fc1_bias) and quantizer.known_scale


def _take(stash, key):
    """stash.pop(key): the backward drops each stashed tensor after its last use. Under torch.compile, which cannot
    trace the pop of a dict made in the forward, stash[key] (the compiled backward frees its inputs itself)."""
    return stash[key] if torch.compiler.is_compiling() else stash.pop(key)


def _dact_to_fp8(quantizer, activation, d_act, fc1_out, kept, with_dbias, need_wgrad):
    """d(fc1_out) = act'(fc1_out) * d_act cast by `quantizer` (FC1_GRAD_OUTPUT): (FP8Operand, dbias or None). fc1_out
    is None when the forward kept its E4M3 copy instead (kept = (data, tile scale_inv)). With a scale before the
    kernel runs (delayed scaling: known, or on its first step calibrated from an amax pass, see _amax_passes.py) the
    fused kernel writes the rowwise data only: data_t (for the FC1 wgrad) is made from it after the FC1 dgrad, once
    fc1_out and d_act are gone, so that the backward's peak (here) holds half the FP8 bytes; from a kept input the
    kernel writes data_t too (the same peak: the kept input is half fc1_out's bytes)."""
    fp8_args = None
    if quantizer.fused_per_tensor:
        fp8_args = quantizer.output_args_for(activation_grad_amax(d_act, fc1_out, kept, activation), d_act.device)
    if fc1_out is None and fp8_args is None:  # (a kept input for a cast without the kept-input kernel)
        fc1_out = dequantize_kept_input(*kept, d_act.dtype)
    if quantizer.fused_dact_cast:  # (block scaling: one kernel, no high-precision d_fc1)
        return quantizer.cast_activation_grad(d_act, fc1_out, activation, transpose=need_wgrad, with_dbias=with_dbias)
    if fp8_args is None:  # (unfused: the cast's scale comes from d_fc1)
        d_fc1 = tfp8.activation_bwd(d_act, fc1_out, activation)
        return cast_grad_output(d_fc1, quantizer, with_dbias, True, need_wgrad)  # (data_t: the FC1 wgrad's only)
    scale, fp8_dtype, amax, scale_inv = fp8_args
    if fc1_out is None:  # (the kept input is half fc1_out's bytes: the transpose fits in the same peak, one pass)
        q, q_t, dbias = tfp8.dact_cast_transpose_kept_input(d_act, *kept, activation, scale, fp8_dtype, amax,
                                                            scale_inv, with_dbias, need_wgrad)
        return FP8Operand(q, q_t if need_wgrad else None, scale_inv, fp8_dtype), (dbias if with_dbias else None)
    q, _, dbias = tfp8.dact_cast_transpose(d_act, fc1_out, activation, scale, fp8_dtype, amax, scale_inv, with_dbias,
                                           False)
    return FP8Operand(q, None, scale_inv, fp8_dtype), (dbias if with_dbias else None)


class _MLPSetup(NamedTuple):
    """What _FP8LayerNormMLP needs of its module besides tensors."""

    quantizers: QuantizerSet
    tp: object  # distributed.TensorParallel or None
    spec: NormSpec
    activation: str
    weight_cache: dict
    fuse_wgrad: bool
    keep_ln_out: bool  # return_layernorm_output
    keep_fc1_fp8: bool  # keep fc1's output for the backward as its E4M3 copy where the activation kernel can


class _FP8LayerNormMLP(torch.autograd.Function):
    """Saves x, mean/rstd, fc1_out (high precision, for the activation backward) and the FP8 transposes. Casts by
    setup.quantizers (roles FC1_INPUT, FC1_WEIGHT, FC2_INPUT, FC2_WEIGHT, FC1_GRAD_OUTPUT, FC2_GRAD_OUTPUT). Sequence
    parallel: x, mean/rstd are this rank's block, norm(x) is all-gathered in FP8. Tensor parallel: the gradient of
    norm(x) is summed over the TP ranks (all-reduce, or SP reduce-scatter) while the FC1 wgrad GEMM runs, before the
    norm backward (see _column_parallel.py); FC2 is row-parallel: fc2_bias and the residual in rank 0's epilogue,
    the output all-reduced here, or reduce-scattered by the caller with SP (see _row_parallel.py)."""

    @staticmethod
    def forward(ctx, inp, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias, setup, training,
                is_first_microbatch, residual, adds_input):
        ctx.set_materialize_grads(False)
        needs = [training and n for n in ctx.needs_input_grad[:7]]
        need_dgrad, need_fc1_wgrad, need_fc2_wgrad = any(needs[:3]), needs[3], needs[5]
        need_fc2_dgrad = any(needs[:5])
        quantizers, tp, cache = setup.quantizers, setup.tp, setup.weight_cache
        x = inp.reshape(-1, inp.shape[-1])
        dtype, out_shape = inp.dtype, inp.shape
        ln_quantizer, act_quantizer = quantizers[Role.FC1_INPUT], quantizers[Role.FC2_INPUT]
        if tp is not None and tp.gathers_input:
            out_shape = gathered_shape(inp.shape, tp)
            ln_op, mean, rstd = gather_norm(quantizers, ln_quantizer, setup.spec, tp, x, ln_weight, ln_bias,
                                            need_fc1_wgrad)
            ln_out = None
        else:
            ln_op, ln_out, mean, rstd = norm_to_fp8(setup.spec, ln_quantizer, x, ln_weight, ln_bias, need_fc1_wgrad,
                                                    setup.keep_ln_out)
        w1_op = fp8_weight(cache, "fc1_weight", fc1_weight, quantizers[Role.FC1_WEIGHT], need_dgrad,
                           is_first_microbatch)
        kept = None
        if _gelu_in_fc1_epilogue(act_quantizer, setup.activation, dtype, fc1_bias):
            act_op, fc1_out = gemm_gelu_to_fp8(ln_op, w1_op, fc1_bias, act_quantizer)
            act_op = act_op.with_transpose() if need_fc2_wgrad else act_op
        else:
            fc1_out = fp8_gemm_bias(ln_op, w1_op, dtype, fc1_bias)
            # (where later steps run GELU in FC1's epilogue they keep fc1_out in 16 bits: so does the first step)
            keep_fp8 = training and setup.keep_fc1_fp8 and not _gelu_epilogue_fits(act_quantizer, setup.activation,
                                                                                     dtype, fc1_bias)
            act_op, kept = _activation_to_fp8(act_quantizer, setup.activation, fc1_out, need_fc2_wgrad, keep_fp8)
            fc1_out = None if kept is not None else fc1_out
        w2_op = fp8_weight(cache, "fc2_weight", fc2_weight, quantizers[Role.FC2_WEIGHT], need_fc2_dgrad,
                           is_first_microbatch)
        bias_here, residual_here = epilogue_terms(tp, fc2_bias, x if adds_input else residual_rows(residual))
        out = sum_partials(tp, fp8_gemm_bias(act_op, w2_op, dtype, bias_here, residual_here))
        ctx.has_residual, ctx.adds_input = residual is not None, adds_input
        if training:
            # The big intermediates sit outside save_for_backward so that the backward can drop each one right
            # after its last use (save_for_backward holds everything until the backward returns); inside a
            # checkpoint region they go through it, which the region frees until the recompute (see checkpoint.py).
            stash = dict(lnqt=ln_op.data_t, w1qt=w1_op.data_t, fc1_out=fc1_out, fc1_kept=kept and kept[0],
                         fc1_kept_scale_inv=kept and kept[1], aqt=act_op.data_t, w2qt=w2_op.data_t)
            if autocast.STATE.checkpoint is None:
                ctx.save_for_backward(x, mean, rstd, ln_weight)
                ctx.stash = stash
            else:
                ctx.save_for_backward(x, mean, rstd, ln_weight, *stash.values())
                ctx.stash = tuple(stash)  # (the keys)
            ctx.operands = tuple(op.transposed_only() for op in (ln_op, w1_op, act_op, w2_op))
            ctx.weights = (fc1_weight, fc2_weight)  # for main_grad, dtypes and the backward's Wᵀ casts
            ctx.setup, ctx.group = setup, autocast.STATE.group
            ctx.needs, ctx.inp_shape = needs, inp.shape
        out = out.view(*out_shape[:-1], out.shape[-1])
        return out, (ln_out.view(inp.shape) if ln_out is not None else inp.new_empty(0))

    @staticmethod
    def backward(ctx, grad, grad_ln_out):
        """FC2 wgrad, FC2 dgrad, activation backward, FC1 dgrad, FC1 wgrad, norm backward: in this order, each
        stashed tensor dropped after its last use, so that the peak (the activation backward: fc1_out, d_act and the
        FP8 d(fc1_out)) holds no other [tokens, ffn] tensor (the FP8 activation goes with the FC2 wgrad, the FP8
        d(fc1_out)ᵀ comes after the FC1 dgrad)."""
        x, mean, rstd, ln_weight, *stashed = ctx.saved_tensors
        if ctx.stash is None:
            raise RuntimeError("LayerNormMLP: backward ran twice through one forward (retain_graph is not supported)")
        stash, ctx.stash = (dict(zip(ctx.stash, stashed)) if stashed else ctx.stash), None
        ln_op, w1_op, act_op, w2_op = ctx.operands
        fc1_weight, fc2_weight = ctx.weights
        setup, needs, dtype = ctx.setup, ctx.needs, x.dtype
        quantizers, tp = setup.quantizers, setup.tp
        need_dgrad, need_fc2_dgrad = any(needs[:3]), any(needs[:5])
        main_grad1 = main_grad_of(fc1_weight) if setup.fuse_wgrad and needs[3] else None
        main_grad2 = main_grad_of(fc2_weight) if setup.fuse_wgrad and needs[5] else None
        dw1 = dbias1 = dw2 = dbias2 = d_ln = residual_grad = None
        if grad is not None:
            dy = grad.reshape(-1, grad.shape[-1]).contiguous()
            residual_grad = dy if ctx.adds_input else None  # (added to dx inside the norm backward)
            dy_op, dbias2 = cast_grad_output(dy, quantizers[Role.FC2_GRAD_OUTPUT], needs[6], need_fc2_dgrad,
                                             needs[5])
            quantizers.register_backward(ctx.group)
            _, dw2 = gemm_grads(dy_op, None, act_op.transposed_only(_take(stash, "aqt")), dtype, fc2_weight.dtype,
                                main_grad2, False, needs[5])
            del dy
            dy_op.data_t = None
            w2_op = w2_op.transposed_only(_take(stash, "w2qt"))
            w2_op = fp8_weight_transpose(fc2_weight, w2_op, quantizers[Role.FC2_WEIGHT]) if need_fc2_dgrad else None
            d_act, _ = gemm_grads(dy_op, w2_op, None, dtype, fc2_weight.dtype, None, need_fc2_dgrad, False)
            del dy_op, w2_op
            d_fc1 = None
            if d_act is not None:
                kept = (_take(stash, "fc1_kept"), _take(stash, "fc1_kept_scale_inv"))
                d_fc1 = _dact_to_fp8(quantizers[Role.FC1_GRAD_OUTPUT], setup.activation, d_act, _take(stash, "fc1_out"),
                                     kept, needs[4], needs[3])
                del d_act
            if d_fc1 is not None:
                d_fc1_op, dbias1 = d_fc1
                del d_fc1
                w1_op = w1_op.transposed_only(_take(stash, "w1qt"))
                w1_op = fp8_weight_transpose(fc1_weight, w1_op, quantizers[Role.FC1_WEIGHT]) if need_dgrad else None
                d_ln, _ = gemm_grads(d_fc1_op, w1_op, None, dtype, fc1_weight.dtype, None, need_dgrad, False)
                if needs[3]:
                    d_fc1_op.with_transpose()
                d_fc1_op.data = None
                del w1_op
                d_ln_sum = start_dgrad_sum(tp, dgrad_collective(tp, True), d_ln)
                _, dw1 = gemm_grads(d_fc1_op, None, ln_op.transposed_only(_take(stash, "lnqt")), dtype,
                                    fc1_weight.dtype, main_grad1, False, needs[3])
                del d_fc1_op
                d_ln = d_ln_sum.wait()
        del stash
        dx, dgamma, dbeta = norm_backward(setup.spec, d_ln, grad_ln_out if need_dgrad else None, x, mean, rstd,
                                          ln_weight, ctx.inp_shape, residual_grad)
        return (dx, dgamma, dbeta, dw1, dbias1, dw2, dbias2, None, None, None, (grad if ctx.has_residual else None),
                None)


class LayerNormMLP(FP8ModuleBase):
    """LayerNormMLP(hidden_size, ffn_hidden_size, eps=1e-5, bias=True, normalization="LayerNorm" | "RMSNorm",
    activation="gelu" | "swiglu" | "relu", zero_centered_gamma=False, return_layernorm_output=False,
    params_dtype=None, device="cuda", init_method=None, output_layer_init_method=None, fuse_wgrad_accumulation=False,
    return_bias=False, fp8_min_gemm_size=None, tp_group=None, tp_size=1, set_parallel_mode=False,
    sequence_parallel=False, keep_activation_input_in_fp8=True). forward(inp [..., hidden], is_first_microbatch=None,
    residual=None). gelu is the tanh approximation. residual: a tensor of the input's shape and dtype added to the
    output, inside fp8_autocast in the FC2 GEMM's epilogue (one rounding, no separate add); not with sequence
    parallelism. keep_activation_input_in_fp8 (an attribute too): inside fp8_autocast, where the activation kernel
    casts to FP8 itself (a known FC2_INPUT scale: delayed scaling) and the activation's width is a multiple of 128,
    the FC1 output the activation backward needs is kept as E4M3 in 1x128 tiles with a float32 scale each (written
    in the activation's own pass) instead of in 16 bits: about half the activation memory of the MLP, the
    activation gradient computed from the E4M3 values (as DeepSeek-V3 keeps its SwiGLU inputs). False keeps 16 bits.
    Small-shape automatic path: as Linear's, with M*K*N summed over both GEMMs (M*hidden*(fc1 width + ffn)).
    recompute_in_backward (attribute, default False): True makes the high-precision path (outside fp8_autocast)
    recompute norm(x) and act(fc1_out) in the backward for the weight gradients instead of keeping them from the
    forward (a [tokens, hidden] and a [tokens, ffn] tensor less per layer, one more norm and activation kernel; the
    same gradients), where _high_precision.applies says it can; False keeps them (autograd's composition, as
    Transformer Engine's BF16 LayerNormMLP). The trade on the Llama-shaped stack: see benchmarks/RESULTS.md.

    Tensor parallelism (set_parallel_mode=True and a tp_group of size tp > 1): FC1 column-parallel (fc1_weight
    [F1/tp, hidden], fc1_bias [F1/tp]; for swiglu this rank's gate rows then its up rows), FC2 row-parallel
    (fc2_weight [hidden, ffn/tp], fc2_bias [hidden] added once: inside fp8_autocast in rank 0's FC2 epilogue, see
    _row_parallel.py; else after the sum over ranks). The input is copied to every
    rank and the output all-reduced; or with sequence_parallel the input is this rank's dim-0 block, normalised on
    the block, the norm output all-gathered along dim 0 before FC1 (in FP8 inside fp8_autocast, else in high
    precision), and the output reduce-scattered back to the block. The norm's weight gradients are all-reduced over
    the TP group. Full checkpoints load (sliced by rank). return_layernorm_output is not supported with TP."""

    forward_roles, backward_roles = MLP_ROLES

    def __init__(self, hidden_size, ffn_hidden_size, eps=1e-5, bias=True, normalization="LayerNorm",
                 activation="gelu", zero_centered_gamma=False, return_layernorm_output=False, params_dtype=None,
                 device="cuda", init_method=None, output_layer_init_method=None, fuse_wgrad_accumulation=False,
                 return_bias=False, fp8_min_gemm_size=None, tp_group=None, tp_size=1, set_parallel_mode=False,
                 sequence_parallel=False, keep_activation_input_in_fp8=True):
        check_positive(hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
        check_choice("normalization", normalization, NORMALIZATIONS)
        check_choice("activation", activation, tuple(ACTIVATIONS))
        fc1_out = 2 * ffn_hidden_size if activation == "swiglu" else ffn_hidden_size
        tp = TensorParallel.create(tp_group, tp_size, "column" if set_parallel_mode else None, sequence_parallel)
        if tp is not None and return_layernorm_output:
            raise NotImplementedError("return_layernorm_output: not supported with tensor parallelism")
        local_ffn = ffn_hidden_size if tp is None else tp.local("ffn_hidden_size", ffn_hidden_size)
        blocks = 2 if activation == "swiglu" else 1
        super().__init__(params_dtype, device, fuse_wgrad_accumulation, blocks * local_ffn + local_ffn,
                         fp8_min_gemm_size)
        self.tp, self.set_parallel_mode, self.sequence_parallel = tp, bool(set_parallel_mode), bool(sequence_parallel)
        self.hidden_size, self.ffn_hidden_size, self.eps = hidden_size, ffn_hidden_size, float(eps)
        self.normalization, self.activation = normalization, activation
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.return_layernorm_output, self.return_bias = bool(return_layernorm_output), bool(return_bias)
        self.keep_activation_input_in_fp8 = bool(keep_activation_input_in_fp8)
        self.recompute_in_backward = False  # True: high precision recomputes norm(x), act(fc1) (_high_precision.py)
        init_norm_params(self, hidden_size, normalization, self.zero_centered_gamma, "layer_norm_")
        self.fc1_weight = self._weight_param((fc1_out, hidden_size), init_method, tp, 0, blocks)
        self.fc1_bias = self._vector_param(blocks * local_ffn, 0.0) if bias else None
        self.fc2_weight = self._weight_param((hidden_size, ffn_hidden_size), output_layer_init_method or init_method,
                                             tp, 1)
        self.fc2_bias = self._vector_param(hidden_size, 0.0) if bias else None
        if tp is not None:
            sharded = {"fc1_weight": (0, blocks), "fc1_bias": (0, blocks), "fc2_weight": (1, 1)}
            self.register_load_state_dict_pre_hook(tp.load_full_checkpoint_hook(sharded))

    def forward(self, inp, is_first_microbatch=None, residual=None):
        check_input(inp, self.hidden_size)
        tp = self.tp
        if residual is not None:
            check_residual(residual, inp, self.hidden_size, tp)
        if tp is not None and autocast.STATE.enabled:
            tp.check_amax_group(autocast.STATE.group)
        if tp is not None and tp.gathers_input:
            check_sequence_block(inp)
        out, ln_out = self._mlp(inp, None if self.return_bias else self.fc2_bias, is_first_microbatch, residual)
        # (sequence parallel: the unadded bias's gradient on this rank's block is a partial sum)
        bias = tp.replicated(self.fc2_bias) if tp is not None and tp.sequence_parallel else self.fc2_bias
        return pack_outputs(self, out, bias, ln_out)

    def _mlp(self, inp, fc2_bias, is_first_microbatch, residual):
        """(fc2(act(fc1(norm(inp)))) (+ fc2_bias) (+ residual), norm output) in FP8 inside fp8_autocast, summed over
        the TP ranks (all-reduced, or reduce-scattered to this rank's block with sequence_parallel, where inp is this
        rank's block and the norm output is all-gathered before FC1)."""
        adds_input = residual is inp  # (the MLP adds its own input: its gradient joins dx in the norm backward)
        inp = inp if inp.is_contiguous() else inp.contiguous()
        tp, gathers, state = self.tp, gathers_input(self), autocast.STATE
        ln_weight, ln_bias = self.layer_norm_weight, self.layer_norm_bias
        fp8 = state.enabled and self._runs_fp8(inp, tp.size if gathers else 1)
        if tp is not None and (gathers or not fp8):  # norm weights whose gradients are partial sums over ranks
            ln_weight, ln_bias = tp.replicated(ln_weight), tp.replicated(ln_bias)
        if fp8:  # (TP: the Function sums the norm output's gradient and, without SP, its output over the ranks)
            self._fp8_begin(state)
            setup = _MLPSetup(self.quantizers, tp, NormSpec.of(self), self.activation, self._weight_cache,
                              self.fuse_wgrad_accumulation, self.return_layernorm_output,
                              self.keep_activation_input_in_fp8)
            out, ln_out = _FP8LayerNormMLP.apply(inp, ln_weight, ln_bias, self.fc1_weight, self.fc1_bias,
                                                 self.fc2_weight, fc2_bias, setup, torch.is_grad_enabled(),
                                                 is_first_microbatch, None if adds_input else residual, adds_input)
            return (tp.row_output(out) if gathers else out), ln_out
        if self._last_forward_fp8:
            self._check_recompute_precision()
        if not state.calibrating and lean_saves_apply(self, inp):  # (saves no copy of norm(x) or act(fc1_out))
            fc1_out = norm_linear(inp, ln_weight, ln_bias, self.fc1_weight, self.fc1_bias, NormSpec.of(self))
            out = activation_linear(fc1_out, self.activation, self.fc2_weight, fc2_bias)
            return (out if residual is None else out + residual), None
        inp = tp.column_input(inp) if tp is not None and not gathers else inp
        ln_out = _NormFunction.apply(inp, ln_weight, ln_bias, self.normalization, self.eps, self.zero_centered_gamma)
        fc1_in = gather_from_sequence_parallel_region(ln_out, self.tp.group) if gathers else ln_out
        fc1_out = high_precision_linear(self, fc1_in, self.fc1_weight, self.fc1_bias)
        act = fused_activation(fc1_out, self.activation) if fc1_out.dtype in KERNEL_DTYPES else \
            ACTIVATIONS[self.activation](fc1_out)
        if state.calibrating:
            self._calibrate(fc1_in, self.fc1_weight, act, self.fc2_weight)
        out = high_precision_linear(self, act, self.fc2_weight, fc2_bias if tp is None else None)
        if tp is not None:
            out = tp.row_output(out)
            if fc2_bias is not None:
                out = out + (tp.replicated(fc2_bias) if tp.sequence_parallel else fc2_bias)
        return (out if residual is None else out + residual), ln_out

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"normalization={self.normalization}, activation={self.activation}")
