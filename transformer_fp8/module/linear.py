"""Linear: y = x Wᵀ + b with TE's arguments; FP8 GEMMs inside fp8_autocast, plain F.linear outside.

Parameters `weight` [out, in] and `bias` [out] (names and shapes of nn.Linear: its state dict loads).
Roles (quantization.Role): forward INPUT, WEIGHT; backward GRAD_OUTPUT.
"""
import torch
import torch.nn.functional as F

from .. import _C, autocast
from ..distributed import TensorParallel
from ..float8_tensor import Float8Tensor
from ..quantization import GEMM_ROLES, FP8Operand, Role, update
from ._column_parallel import check_sequence_block, dgrad_collective, gather_cast, gathered_shape, output_grads
from ._gemm import fp8_gemm_bias, fused_forward, fused_forward_applies, high_precision_linear
from ._row_parallel import epilogue_terms, sum_partials
from . import base
from .base import (FP8ModuleBase, check_input, check_positive, check_residual, fp8_weight, fp8_weight_transpose,
                   main_grad_of, residual_rows)

# A plain FP8 Linear (see Linear._native_node_applies) runs through the C++ autograd node of csrc/autograd_linear.cpp:
# one Python call per step instead of a Python autograd.Function's forward, backward and engine round trips (the host
# time of small layers). Results are the Function's bit for bit. Read at each call; False: always the Function.
NATIVE_NODE = True
_C.set_backward_registrar(autocast.register_backward)
# A Linear with an FP8 weight (fp8_model_init) that needs no gradient (no_grad / inference_mode, or nothing requires
# grad) runs its forward as one call of the op fp8_linear_inference (csrc/linear_inference.cpp: the input's cast and
# the GEMM) instead of the autograd Function: a small layer's inference is host-bound (issue 22, target 5). The same
# ops in the same order, so the outputs and the scaling state are the Function's bit for bit. Read at each call;
# False: always the Function (benchmarks/bench_fp8_inference.py times both).
INFERENCE_PATH = True
# Delayed scaling on that path: the forward state's update runs inside the op's cast launch (see ScalingState.
# updated_inline) instead of at the autocast's exit. Read at each call; False: queued for the exit's update as the
# Function's path does (benchmarks/bench_fp8_inference.py times both).
INLINE_UPDATE = True
_INPUT = Role.INPUT  # (an enum member's lookup costs a dict lookup's time again: read once)
_NO_UPDATE = (None, None, None, None, 0.0, True)  # linear_inference's state arguments when it updates nothing


class _FP8Linear(torch.autograd.Function):
    """inp [..., K] (contiguous), weight [N, K], bias [N] or None, residual [..., N] or None, setup = (quantizers,
    tp, weight_cache, fuse_wgrad, training, is_first_microbatch, relay) -> [..., N] (the residual added in the GEMM's
    epilogue), cast by `quantizers` (the module's QuantizerSet: roles INPUT, WEIGHT, GRAD_OUTPUT). Saves only the
    FP8 xᵀ (+ scale_invs; Wᵀ only when cached: the backward casts it, see base.fp8_weight). tp: the module's
    distributed.TensorParallel or None. Row-parallel: bias and residual in rank 0's epilogue, the output summed over
    the TP ranks here (or reduce-scattered by the caller): see _row_parallel.py. weight_cache: the module's FP8 weight
    cache; fuse_wgrad: accumulate the wgrad into weight.main_grad."""

    @staticmethod
    def forward(ctx, inp, weight, bias, residual, setup):
        # (the non-tensor arguments come as one tuple: Function.apply handles each argument, host time per call)
        quantizers, tp, weight_cache, fuse_wgrad, training, is_first_microbatch, relay = setup
        need_dgrad = training and ctx.needs_input_grad[0]
        need_wgrad = training and ctx.needs_input_grad[1]
        x = inp if inp.dim() == 2 else inp.reshape(-1, inp.shape[-1])
        out_shape = inp.shape
        row_tp = tp if tp is not None and tp.mode == "row" else None
        bias_here, residual_here = epilogue_terms(row_tp, bias, residual)
        gathers = tp is not None and tp.gathers_input
        roles = quantizers.by_role  # (a dict read, not QuantizerSet.__getitem__'s call: host time)
        x_quantizer, w_quantizer = roles[Role.INPUT], roles[Role.WEIGHT]
        if not gathers and fused_forward_applies(quantizers, weight, bias_here, inp.dtype, is_first_microbatch):
            # (casts and GEMM in one op call: the common case, where a small layer's host time counts)
            out, x_op, w_op = fused_forward(
                x_quantizer, w_quantizer, x, weight, bias_here, inp.dtype, need_wgrad,
                need_dgrad and base.keeps_weight_transpose(weight, is_first_microbatch), residual_rows(residual_here))
        else:
            if gathers:  # sequence parallel: x is this rank's block, cast and all-gathered in FP8
                x_op = gather_cast(quantizers, x_quantizer, tp, x, need_wgrad)
                out_shape = gathered_shape(inp.shape, tp)
            else:
                x_op = x_quantizer.cast(x, transpose=need_wgrad)
            w_op = fp8_weight(weight_cache, "weight", weight, w_quantizer, need_dgrad, is_first_microbatch)
            out = fp8_gemm_bias(x_op, w_op, inp.dtype, bias_here, residual_rows(residual_here))
        out = sum_partials(row_tp, out)
        ctx.has_residual = residual is not None
        ctx.relay = relay if residual is not None and relay is not None and relay.armed else None
        if training:
            ctx.save_for_backward(x_op.data_t if need_wgrad else None, w_op.data_t)
            # scale_inv snapshots ride outside save_for_backward (their buffer's other slots get written: see
            # quantization/state.py); the weight is kept for main_grad, its dtype and the backward's Wᵀ cast
            # (the operands' scales as tuples, FP8Operand's arguments after data_t: the backward builds the two
            # operands it needs, and no operand object is made here for it, a small layer's host time)
            ctx.info = (quantizers, tp, fuse_wgrad, weight,
                        (x_op.scale_inv, x_op.fp8_dtype, x_op.layout, x_op.scale_inv_t),
                        (w_op.scale_inv, w_op.fp8_dtype, w_op.layout, w_op.scale_inv_t),
                        autocast.STATE.group, need_dgrad, need_wgrad, inp.dtype)
        return out if inp.dim() == 2 else out.view(*out_shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x_t, w_t = ctx.saved_tensors
        quantizers, tp, fuse_wgrad, weight, x_scales, w_scales, group, need_dgrad, need_wgrad, dx_dtype = ctx.info
        x_op, w_op = FP8Operand(None, x_t, *x_scales), FP8Operand(None, w_t, *w_scales)  # (the saved tensors)
        dy = grad if grad.dim() == 2 and grad.is_contiguous() else grad.reshape(-1, grad.shape[-1]).contiguous()
        roles = quantizers.by_role
        w_op = fp8_weight_transpose(weight, w_op, roles[Role.WEIGHT]) if need_dgrad else None
        main_grad = main_grad_of(weight) if need_wgrad and fuse_wgrad else None
        # (sequence parallel: dx reduce-scattered to this rank's block while the wgrad GEMM runs)
        dx, dw, dbias = output_grads(tp, dgrad_collective(tp, False), roles[Role.GRAD_OUTPUT], dy,
                                     ctx.needs_input_grad[2], w_op, x_op if need_wgrad else None, dx_dtype,
                                     weight.dtype, main_grad)
        quantizers.register_backward(group)
        if dx is not None and tp is not None and tp.gathers_input:
            dx = dx.view(-1, *grad.shape[1:-1], dx.shape[-1])
        elif dx is not None and grad.dim() != 2:
            dx = dx.view(*grad.shape[:-1], dx.shape[-1])
        residual_grad = grad if ctx.has_residual else None
        if ctx.relay is not None:  # (handed to the norm backward of the LayerNormLinear that added it: see
            ctx.relay.grad, residual_grad = grad, None  # _residual_relay.py)
        return dx, dw, dbias, residual_grad, None


class Linear(FP8ModuleBase):
    """Linear(in_features, out_features, bias=True, params_dtype=None, device="cuda", init_method=None,
    fuse_wgrad_accumulation=False, return_bias=False, fp8_min_gemm_size=None, tp_group=None, tp_size=1,
    parallel_mode=None, sequence_parallel=False).
    forward(inp [..., in], is_first_microbatch=None, residual=None). return_bias=True returns (out, bias) with the bias
    not added. residual: a tensor of the output's shape and dtype added to the output, inside fp8_autocast in the
    GEMM's epilogue (one rounding, no separate add); not with sequence parallelism. (residual_grad_relay:
    MultiheadAttention's, see _residual_relay.py.)

    Small-shape automatic path: inside fp8_autocast, a CUDA input with M*in*out < fp8_min_gemm_size (None: the
    default base.FP8_MIN_GEMM_SIZE = 2**35 ~ 3.4e10) runs the high-precision F.linear and leaves the FP8 state
    untouched; fp8_min_gemm_size=0 always runs FP8. Float8Tensor weights (fp8_model_init) always run FP8.

    Tensor parallelism (tp_group of size tp > 1; see distributed.TensorParallel for the amax reduction):
    parallel_mode="column": weight [out/tp, in] and bias [out/tp] (this rank's rows); input [..., in] (with
    sequence_parallel: this rank's dim-0 block, all-gathered: cast to FP8 on the block and gathered in FP8 inside
    fp8_autocast), output [..., out/tp]. parallel_mode="row": weight
    [out, in/tp], bias [out] (full); input [..., in/tp], output [..., out] summed over ranks (with
    sequence_parallel: reduce-scattered along dim 0), the bias (and residual) added once (inside fp8_autocast: in
    rank 0's GEMM epilogue, see _row_parallel.py; else after the sum). The weight is created by
    initialising the full [out, in] tensor and keeping this rank's part; load_state_dict takes full tensors (sliced
    by rank) or shards. parallel_mode=None: nothing is split."""

    forward_roles, backward_roles = GEMM_ROLES

    def __init__(self, in_features, out_features, bias=True, params_dtype=None, device="cuda", init_method=None,
                 fuse_wgrad_accumulation=False, return_bias=False, fp8_min_gemm_size=None, tp_group=None, tp_size=1,
                 parallel_mode=None, sequence_parallel=False):
        check_positive(in_features=in_features, out_features=out_features)
        tp = TensorParallel.create(tp_group, tp_size, parallel_mode, sequence_parallel)
        local_out = out_features
        if tp is not None and tp.mode == "column":
            local_out = tp.local("out_features", out_features)
        elif tp is not None:
            tp.local("in_features", in_features)  # (checks that tp divides it)
        super().__init__(params_dtype, device, fuse_wgrad_accumulation, local_out, fp8_min_gemm_size)
        self.in_features, self.out_features, self.return_bias = in_features, out_features, bool(return_bias)
        self.tp, self.parallel_mode, self.sequence_parallel = tp, parallel_mode, bool(sequence_parallel)
        shard_dim = 0 if tp is not None and tp.mode == "column" else 1  # rows (column) or columns (row)
        self.weight = self._weight_param((out_features, in_features), init_method, tp, shard_dim)
        self.bias = self._vector_param(local_out, 0.0) if bias else None
        if tp is not None:
            sharded = {"weight": (0, 1), "bias": (0, 1)} if tp.mode == "column" else {"weight": (1, 1)}
            self.register_load_state_dict_pre_hook(tp.load_full_checkpoint_hook(sharded))
        # forward's one-call path applies: no TP, bias added, no wgrad fusion, high-precision weight
        self._plain = tp is None and not self.return_bias and not self.fuse_wgrad_accumulation and \
            not self._fp8_params

    def forward(self, inp, is_first_microbatch=None, residual=None, residual_grad_relay=None):
        # A plain Linear on its high-precision path (outside fp8_autocast, or the small-shape path inside it): F.linear
        # at once, the input's checks only when it fails. (The inference of small layers is host-bound: every
        # call's Python counts.)
        if self._plain and residual is None and isinstance(inp, torch.Tensor) and (
                not autocast.STATE.enabled or inp.is_cuda and inp.numel() * self._gemm_n < (
                    base.FP8_MIN_GEMM_SIZE if self.fp8_min_gemm_size is None else self.fp8_min_gemm_size)):
            if self._last_forward_fp8:
                self._check_recompute_precision()
            if autocast.STATE.enabled:  # the small-shape path: counted, and warned about once per process
                self._note_small_shape(inp.numel() * self._gemm_n)
            if autocast.STATE.calibrating:
                self._calibrate(inp, self.weight)
            # (the parameters straight from _parameters: nn.Module.__getattr__ costs ~0.4 µs per name, as much as the
            # rest of this path; `self.weight` where a parametrization has moved it out)
            weight, bias = self._parameters.get("weight"), self._parameters.get("bias")
            try:
                return F.linear(inp, self.weight if weight is None else weight, bias if bias is not None else self.bias)
            except (RuntimeError, TypeError):
                check_input(inp, self.in_features)  # (raises the clear error when the input is the cause)
                raise
        if self._fp8_params and INFERENCE_PATH and residual is None and is_first_microbatch is None and \
                autocast.STATE.enabled:
            out = self._inference_forward(inp)
            if out is not None:
                return (out, self.bias) if self.return_bias else out
        if self.tp is not None:
            if residual is not None:
                check_residual(residual, inp, self.out_features, self.tp)
            return self._parallel_forward(inp, is_first_microbatch, residual, residual_grad_relay)
        check_input(inp, self.in_features)
        if residual is not None:
            check_residual(residual, inp, self.out_features, None)
        if self.return_bias:
            return self._local_linear(inp, None, is_first_microbatch, residual, residual_grad_relay), self.bias
        bias = self._parameters.get("bias")  # (as the weight in _local_linear; a bias=False Linear has none there)
        return self._local_linear(inp, self.bias if bias is None else bias, is_first_microbatch, residual,
                                  residual_grad_relay)

    def _inference_forward(self, inp: torch.Tensor) -> torch.Tensor | None:
        """Inside fp8_autocast, an FP8 (per-tensor) weight, no TP, no gradient needed: out = inp Wᵀ (+ bias unless
        return_bias) through fp8_linear_inference, with the training path's bookkeeping (the call counted, the
        forward state updated as at the autocast's exit, but inside the op's cast launch (see ScalingState.
        updated_inline), under delayed scaling; current scaling writes its slot's scale as its cast does; the recipe
        adopted as _fp8_begin does). Returns None where the Function's path must run: delayed scaling before its
        first update (the first call calibrates in Python), a checkpoint region, torch.compile, fp8_disabled, a
        block-scaled weight, a gradient needed.

        Args:
            inp: the input [..., in_features].
        Returns:
            The output [..., out_features], or None.
        """
        state = autocast.STATE
        params = self._parameters
        weight, bias = params.get("weight"), params.get("bias")
        if state.checkpoint is not None or self.tp is not None or self.fp8_disabled or \
                not isinstance(weight, Float8Tensor) or weight._scale_inv.dim() != 1:
            return None
        if torch.is_grad_enabled() and (weight.requires_grad or getattr(inp, "requires_grad", False) or
                                        (bias is not None and bias.requires_grad)):
            return None
        if torch.compiler.is_compiling():
            return None
        if state.recipe is not self._fp8_recipe:
            self._adopt_recipe(state.recipe)
        quantizers = self.quantizers
        if not quantizers.fused_per_tensor:
            return None
        quantizer = quantizers.by_role[_INPUT]
        fwd, slot = quantizer.state, quantizer.slot
        if quantizers.updates_by_history:
            # delayed: the cast with the slot's known scale writes the slot's snapshot (as cast_args gives it), and
            # the state's update runs in the same launch (see ScalingState.updated_inline) unless the state is
            # queued for the exit's update already, or its amaxes are to be all-reduced there first
            if not fwd.calibrated:
                return None
            current, scale_inv, inline = False, fwd.scale_invs[slot], _NO_UPDATE
            if not fwd.pending:
                recipe = quantizers.recipe
                if fwd.updated_inline or not INLINE_UPDATE or (recipe.reduce_amax and
                                                               update.distributed_initialized()):
                    update.register_forward(state.forward_states, fwd, recipe, state.group)
                else:
                    inline = fwd.inline_update_args(recipe)
        else:  # current scaling: amax, scale and cast in the op's one cast launch
            current, scale_inv, inline = True, fwd.scale_inv_slots[slot], _NO_UPDATE
        self._fp8_call_counts[0] += 1
        if not self._last_forward_fp8:
            self._last_forward_fp8 = True
        try:
            out = _C.linear_inference(inp if inp.is_contiguous() else inp.contiguous(), weight._data,
                                      weight._scale_inv, fwd.scales[slot], quantizer.fp8_dtype, fwd.amaxes[slot],
                                      scale_inv, None if self.return_bias else bias, current, quantizer.fp8_max,
                                      *inline)
        except (RuntimeError, TypeError, AttributeError):
            check_input(inp, self.in_features)  # (raises the clear error when the input is the cause)
            raise
        if inline is not _NO_UPDATE:
            fwd.updated_inline = True
            state.inline_updated.append(fwd)
        return out

    def _local_linear(self, inp, bias, is_first_microbatch, residual=None, relay=None):
        """inp [..., local in] @ this rank's weightᵀ (+ bias) (+ residual): FP8 inside fp8_autocast, else high
        precision."""
        state = autocast.STATE
        # (the parameter straight from _parameters: nn.Module.__getattr__ costs ~0.4 µs per read; `self.weight` where
        # a parametrization has moved it out)
        weight = self._parameters.get("weight")
        weight = self.weight if weight is None else weight
        if state.enabled and self._plain and state.recipe is not self._fp8_recipe and not self.fp8_disabled:
            self._adopt_recipe(state.recipe)  # (a plain Linear here runs FP8: adopt as _fp8_begin would, first)
        if state.enabled and self._native_node_applies(inp, weight, bias, is_first_microbatch, residual, state):
            # _runs_fp8's and _fp8_begin's bookkeeping for this case, inline (a small layer's host time counts):
            # the call counted, the forward state queued for the update at the autocast's exit
            self._fp8_call_counts[0] += 1
            if not self._last_forward_fp8:
                self._last_forward_fp8 = True
            quantizers = self.quantizers
            fwd = quantizers.fwd_state
            if not fwd.pending and quantizers.updates_by_history:
                update.register_forward(state.forward_states, fwd, quantizers.recipe, state.group)
            return _C.fp8_linear(inp if inp.is_contiguous() else inp.contiguous(), weight, bias,
                                 *quantizers.linear_node_args(state.group),
                                 weight.numel() < base.MIN_RECAST_WEIGHT_NUMEL)  # (base.keeps_weight_transpose)
        if state.enabled and self._runs_fp8(inp):
            self._fp8_begin(state)
            return _FP8Linear.apply(inp if inp.is_contiguous() else inp.contiguous(), weight, bias, residual,
                                    (self.quantizers, self.tp, self._weight_cache, self.fuse_wgrad_accumulation,
                                     torch.is_grad_enabled(), is_first_microbatch, relay))
        if self._last_forward_fp8:
            self._check_recompute_precision()
        if state.calibrating:
            self._calibrate(inp, self.weight)
        if self.fuse_wgrad_accumulation:
            out = high_precision_linear(self, inp, self.weight, bias)
        else:
            out = F.linear(inp, self.weight, bias)  # (the small-shape path's host time matters: F.linear directly)
        return out if residual is None else out + residual

    def _native_node_applies(self, inp, weight, bias, is_first_microbatch, residual, state):
        """Inside fp8_autocast: whether this call takes the C++ node (NATIVE_NODE): a plain Linear (no TP, no
        return_bias, no wgrad fusion, high-precision weight) with no residual and no weight cache, not fp8_disabled,
        the autocast's recipe already adopted, per-tensor quantizers whose scales are known before the casts (delayed
        scaling past the first update of both its states: the first step calibrates them in Python; the node casts
        with the slots' scales and registers the gradient state) or come from each tensor's amax (current scaling:
        the node computes them as the quantizers do), a bias in the input's 16-bit dtype, outside checkpoint regions
        and torch.compile (which trace the Function). (A plain Linear reaching here runs FP8: its forward took the
        small-shape path already where it applies.)"""
        quantizers = self.quantizers
        return (NATIVE_NODE and self._plain and residual is None and is_first_microbatch is None and
                state.recipe is self._fp8_recipe and not self.fp8_disabled and quantizers.fused_per_tensor and
                (not quantizers.updates_by_history or quantizers.scales_known_per_tensor()) and
                state.checkpoint is None and
                (bias is None or bias.dtype == inp.dtype != torch.float32) and not torch.compiler.is_compiling())

    def _parallel_forward(self, inp, is_first_microbatch, residual, relay):
        tp = self.tp
        if autocast.STATE.enabled:
            tp.check_amax_group(autocast.STATE.group)
        if tp.mode == "column":
            check_input(inp, self.in_features)
            bias = None if self.return_bias else self.bias
            if tp.gathers_input:
                out = self._gathering_linear(inp, bias, is_first_microbatch)
            else:
                out = self._local_linear(tp.column_input(inp), bias, is_first_microbatch)
            return (out, self.bias) if self.return_bias else out
        check_input(inp, self.weight.shape[1])
        bias = None if self.return_bias else self.bias
        state = autocast.STATE
        if state.enabled and self._runs_fp8(inp):  # (the Function adds bias and residual once and sums the ranks)
            self._fp8_begin(state)
            out = _FP8Linear.apply(inp if inp.is_contiguous() else inp.contiguous(), self.weight, bias, residual,
                                   (self.quantizers, tp, self._weight_cache, self.fuse_wgrad_accumulation,
                                    torch.is_grad_enabled(), is_first_microbatch, relay))
            out = tp.row_output(out) if tp.sequence_parallel else out
        else:
            out = tp.row_output(self._local_linear(inp, None, is_first_microbatch))
            out = out if bias is None else out + (tp.replicated(bias) if tp.sequence_parallel else bias)
            out = out if residual is None else out + residual
        if self.return_bias:
            return out, (tp.replicated(self.bias) if tp.sequence_parallel else self.bias)
        return out

    def _gathering_linear(self, inp, bias, is_first_microbatch):
        """Column-parallel with sequence_parallel: inp is this rank's dim-0 block, all-gathered in FP8 inside the FP8
        GEMM's Function, else in high precision before the local linear."""
        check_sequence_block(inp)
        state = autocast.STATE
        if state.enabled and self._runs_fp8(inp, self.tp.size):
            self._fp8_begin(state)
            return _FP8Linear.apply(inp if inp.is_contiguous() else inp.contiguous(), self.weight, bias, None,
                                    (self.quantizers, self.tp, self._weight_cache, self.fuse_wgrad_accumulation,
                                     torch.is_grad_enabled(), is_first_microbatch, None))
        return self._local_linear(self.tp.column_input(inp), bias, is_first_microbatch)

    def extra_repr(self):
        tp = "" if self.tp is None else f", parallel_mode={self.parallel_mode}, tp_size={self.tp.size}, " \
                                        f"sequence_parallel={self.sequence_parallel}"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{tp}"
