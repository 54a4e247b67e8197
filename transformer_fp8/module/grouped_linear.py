"""GroupedLinear: num_gemms independent linears over contiguous row groups of one input (the experts of an MoE layer),
with Transformer Engine's arguments and parameter names (weight0..weight{n-1} [out, in], bias0..bias{n-1} [out]).

forward(inp [M, in], m_splits): rows m_splits[0] of inp go through expert 0, the next m_splits[1] through expert 1,
...; m_splits is a list of ints (TE) or an integer tensor on inp's device (no host sync in the step). Empty groups
are allowed. Inside fp8_autocast the GEMMs run in FP8: one cast of the whole input, one of all the weights (stacked,
one scale: the WEIGHT role), one grouped GEMM per direction (transformer_fp8/grouped_gemm.py). Outside it, in high
precision.

FP8 details (from the grouped kernel, see grouped_gemm.py): the gradient is cast to E4M3 under every recipe format
(Hopper's grouped FP8 GEMM takes E4M3 only: HYBRID's E5M2 gradients are not available here); GEMM outputs are rounded
to bfloat16 before any other output dtype; in_features and out_features must be multiples of 16. The weight gradient
contracts over each group's rows, which the kernel needs in multiples of 16: groups given as a list of such sizes run
as they are, any other sizes (and every device tensor, whose sizes the host never reads, unless the caller passes
splits_aligned=True: moe_permute(..., align_size=16) makes such groups) through a padded copy of the FP8 input and
gradient (zeros between the groups; one gather each).

Under recipe.Float8BlockScaling (module/_grouped_linear_block.py): 1x128 tiles for the input and the gradient, 128x128
blocks for the weights (out_features a multiple of 128), the block-scaled grouped GEMMs (grouped_block_gemm.py) in
every direction; the weight gradient's groups are padded to start at multiples of 128 rows unless the host list's
sizes already are. fp8_model_init(recipe=Float8BlockScaling()) gives block-scaled Float8Tensor weights, which run only
under that recipe.
"""
import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .. import autocast
from ..float8_tensor import Float8Tensor
from ..grouped_gemm import ALIGN, group_offsets, padded_groups
from ..ops import activation_high_precision, activation_out_features, tfp8
from ..quantization import FP8Operand, Role
from ..recipe import Format
from ._amax_passes import activation_grad_amax
from ._gemm import high_precision_linear
from ._grouped_linear_block import GroupedLinearBlockFP8, cast_block_weights, check_block_recipe, is_block
from .base import FP8ModuleBase, check_choice, check_positive, main_grad_of

# activations a GroupedLinear can apply to its output (output_activation: our fused kernels; swiglu halves the dim)
OUTPUT_ACTIVATIONS = ("gelu", "relu", "swiglu")

def _e4m3_recipe(recipe):
    """The recipe with E4M3 gradients (the grouped kernel's only FP8 type): itself when already so."""
    if recipe.fp8_format == Format.E4M3:
        return recipe
    return dataclasses.replace(recipe, fp8_format=Format.E4M3)


def _group_of_rows(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """The group of each row, int64 [rows], from the groups' cumulative ends."""
    position = torch.arange(rows, dtype=torch.int32, device=offs.device)
    return torch.searchsorted(offs, position, right=True).clamp_(max=offs.numel() - 1)


class _Activation(torch.autograd.Function):
    """act(x) on our activation kernels: one pass forward, one backward, saving only the input."""

    @staticmethod
    def forward(ctx, x, activation):
        ctx.activation = activation
        ctx.save_for_backward(x)
        return activation_high_precision(x, activation)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return tfp8.activation_bwd(grad.contiguous(), x, ctx.activation), None


def _activate(x: torch.Tensor, activation: str) -> torch.Tensor:
    """act(x), differentiable: our kernels for the dtypes they take, PyTorch's ops (same formulas) for others."""
    if x.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return _Activation.apply(x.contiguous(), activation)
    if activation == "swiglu":
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.relu(x) if activation == "relu" else F.gelu(x, approximate="tanh")


class _GroupedLinearFP8(torch.autograd.Function):
    """x [M, K] (contiguous), m_splits (int tensor [G] on x's device), host_splits (the same sizes as a list when the
    caller gave one, else None), aligned (every group size a known multiple of 16), module, training (grad mode at the
    call), activation (applied to the output, or None), is_first_microbatch (the weight cache switch), then
    weight0..weight{G-1} and bias0..bias{G-1} (if any) ->
    [M, N] (activated: [M, N/2] for swiglu). With host sizes on CUDA and few groups (loops_over_groups) each GEMM is a
    dense one per group (see _dense_loop); else one grouped GEMM per direction. With an activation the backward's
    d(activation) writes the FP8 gradient itself when the GRAD_OUTPUT scale is known (delayed scaling, no biases):
    dact_cast_transpose, one pass instead of activation_bwd and a cast-transpose.
    """

    @staticmethod
    def forward(ctx, x, m_splits, host_splits, aligned, module, training, activation, is_first_microbatch, *params):
        g = module.num_gemms
        weights, biases = params[:g], params[g:]
        need_dgrad = training and ctx.needs_input_grad[0]
        need_wgrad = training and any(ctx.needs_input_grad[8:8 + g])
        loop = host_splits if loops_over_groups(host_splits, x) else None
        qset = module.quantizers
        offs = group_offsets(m_splits)
        x_op = qset[Role.INPUT].cast(x, rowwise=True, transpose=need_wgrad and aligned)
        w_data, w_scale_inv, w_t = module._fp8_weights(weights, need_dgrad, is_first_microbatch)
        if loop is None:
            out = tfp8.grouped_fp8_gemm(x_op.data, x_op.scale_inv, w_data, w_scale_inv, offs, x.dtype, False)
        else:
            out = _dense_loop(x_op.data, x_op.scale_inv, [w.t() for w in w_data.unbind(0)], w_scale_inv, loop,
                              (x.shape[0], module.out_features), x.dtype, fast_accumulation=True)
        group = _group_of_rows(offs, x.shape[0]) if biases else None
        if biases:
            out += torch.stack(biases).to(out.dtype)[group]
        ctx.activation = activation
        pre_activation = out if activation else None
        if activation:
            out = activation_high_precision(out, activation)
        ctx.module, ctx.aligned, ctx.dtype, ctx.loop = module, aligned, x.dtype, loop
        ctx.need = (need_dgrad, need_wgrad)
        ctx.group_ids = group
        ctx.group = autocast.STATE.group
        ctx.weights = weights if need_wgrad and module.fuse_wgrad_accumulation else None
        ctx.weight_dtype = weights[0].dtype
        ctx.bias_dtype = biases[0].dtype if biases else None
        ctx.x_op = (x_op.data_t if aligned else x_op.data, x_op.scale_inv) if need_wgrad else None
        ctx.w_op = (w_t, w_scale_inv) if need_dgrad else None
        ctx.save_for_backward(m_splits, offs, pre_activation)
        return out

    @staticmethod
    def backward(ctx, grad):
        m_splits, offs, pre_activation = ctx.saved_tensors
        module, g = ctx.module, ctx.module.num_gemms
        need_dgrad, need_wgrad = ctx.need
        dy, dy_op = _grad_output(ctx, grad.contiguous(), pre_activation, module.quantizers[Role.GRAD_OUTPUT])
        dx = None
        if need_dgrad:
            w_t, w_scale_inv = ctx.w_op
            if ctx.loop is None:
                dx = tfp8.grouped_fp8_gemm(dy_op.data, dy_op.scale_inv, w_t, w_scale_inv, offs, ctx.dtype, True)
            else:  # (w_t[g] [K, N], N contiguous: its transpose is column-major, as _scaled_mm's mat2 must be)
                dx = _dense_loop(dy_op.data, dy_op.scale_inv, [w.transpose(0, 1) for w in w_t.unbind(0)],
                                 w_scale_inv, ctx.loop, (grad.shape[0], module.in_features), ctx.dtype,
                                 fast_accumulation=False)
        dws = (None,) * g
        if need_wgrad:
            dws = _weight_grads(ctx, dy_op, m_splits, offs, grad.shape[0])
        dbiases = ()
        if ctx.group_ids is not None:  # (dy made: biases turn the fused d(activation) cast off)
            sums = torch.zeros(g, dy.shape[1], dtype=torch.float32, device=dy.device)
            dbiases = tuple(sums.index_add_(0, ctx.group_ids, dy.float()).to(ctx.bias_dtype).unbind(0))
        module.quantizers.register_backward(ctx.group)
        ctx.x_op = ctx.w_op = None
        return (dx, None, None, None, None, None, None, None, *dws, *dbiases)


def _grad_output(ctx, grad: torch.Tensor, pre_activation: torch.Tensor | None, quantizer) -> tuple:
    """The GEMMs' output gradient: (high precision [M, N] or None when not made, FP8Operand: rowwise data for the
    dgrad (and the unaligned wgrad's padded copy), data_t for the aligned wgrad). Through the output activation when
    there is one: fused with the cast (dact_cast_transpose) when the scale is known and no bias needs dy."""
    need_dgrad, need_wgrad = ctx.need
    transpose = need_wgrad and ctx.aligned
    if pre_activation is not None:
        fp8_args = None
        if quantizer.fused_per_tensor and ctx.group_ids is None:  # (delayed scaling's first step: from an amax pass)
            fp8_args = quantizer.output_args_for(activation_grad_amax(grad, pre_activation, None, ctx.activation),
                                                 grad.device)
        if fp8_args is not None:
            scale, fp8_dtype, amax, scale_inv = fp8_args
            q, qt, _ = tfp8.dact_cast_transpose(grad, pre_activation, ctx.activation, scale, fp8_dtype, amax,
                                                scale_inv, False, transpose)
            return None, FP8Operand(q, qt if transpose else None, scale_inv, fp8_dtype)
        grad = tfp8.activation_bwd(grad, pre_activation, ctx.activation)
    rowwise = need_dgrad or (need_wgrad and not ctx.aligned)
    return grad, quantizer.cast(grad, rowwise=rowwise, transpose=transpose)


def _weight_grads(ctx, dy_op: FP8Operand, m_splits: torch.Tensor, offs: torch.Tensor, rows: int) -> tuple:
    """dW_g = dy_gᵀ x_g for every group from one grouped wgrad GEMM: the transposed FP8 copies of the forward (aligned
    groups) or transposed copies of the padded FP8 input and gradient. With fuse_wgrad_accumulation the results go
    into each weight's main_grad (float32) and None is returned for them."""
    x_rows, x_scale_inv = ctx.x_op
    if ctx.aligned:
        dy_t, x_t, wgrad_offs = dy_op.data_t, x_rows, offs
    else:
        source, wgrad_offs = padded_groups(m_splits, rows)
        dy_t = tfp8.fp8_transpose(tfp8.moe_permute_rows(dy_op.data, source, 1, None))
        x_t = tfp8.fp8_transpose(tfp8.moe_permute_rows(x_rows, source, 1, None))
    fuse = ctx.weights is not None
    out_dtype = torch.float32 if fuse or ctx.weight_dtype == torch.float32 else ctx.weight_dtype
    if ctx.loop is not None:
        dw = _dense_wgrad_loop(dy_t, dy_op.scale_inv, x_t, x_scale_inv, ctx.loop, ctx.aligned, out_dtype)
    else:
        dw = tfp8.grouped_fp8_gemm_wgrad(dy_t, dy_op.scale_inv, x_t, x_scale_inv, wgrad_offs, out_dtype)
    if not fuse:
        return tuple(dw.to(ctx.weight_dtype).unbind(0))
    for weight, grad in zip(ctx.weights, dw.unbind(0)):
        main_grad_of(weight).add_(grad)
    return (None,) * len(ctx.weights)


# Groups given as a host list (the caller knows the sizes: Transformer Engine's m_splits) on CUDA, at most this many:
# one dense cuBLASLt FP8 GEMM per group (torch._scaled_mm, written into its rows of one output) instead of the grouped
# kernel. H100, torch 2.11 (benchmarks/bench_moe.py): 8 uneven groups of M=16384, K=4096, N=28672 run at 1353 TFLOP/s
# as a loop and 1009 as one grouped GEMM; 64 small groups at 47 (host-bound launches) against 566. Read at each call;
# 0 turns the loop off.
LOOP_MAX_GROUPS = 16


def loops_over_groups(host_splits: list[int] | None, x: torch.Tensor) -> bool:
    """Whether the GEMMs run as one dense GEMM per group (host sizes, CUDA, at most LOOP_MAX_GROUPS groups)."""
    return host_splits is not None and x.is_cuda and len(host_splits) <= LOOP_MAX_GROUPS


def _dense_loop(a: torch.Tensor, a_scale_inv: torch.Tensor, b_cols: list[torch.Tensor], b_scale_inv: torch.Tensor,
                splits: list[int], shape: tuple[int, int], out_dtype: torch.dtype,
                fast_accumulation: bool) -> torch.Tensor:
    """out [M, N], rows of group g = (a[rows] * a_scale_inv) (b_cols[g] * b_scale_inv[g]) from one torch._scaled_mm
    per non-empty group, each written into its rows. b_cols[g]: [K, N] column-major (the mat2 cuBLASLt takes)."""
    out = torch.empty(shape, dtype=out_dtype, device=a.device)
    scales = b_scale_inv.expand(len(splits)) if b_scale_inv.numel() == 1 else b_scale_inv
    start = 0
    for g, size in enumerate(splits):
        if size:
            torch._scaled_mm(a[start:start + size], b_cols[g], a_scale_inv, scales[g:g + 1], out_dtype=out_dtype,
                             use_fast_accum=fast_accumulation, out=out[start:start + size])
        start += size
    return out


def _dense_wgrad_loop(dy_t: torch.Tensor, dy_scale_inv: torch.Tensor, x_t: torch.Tensor, x_scale_inv: torch.Tensor,
                      splits: list[int], aligned: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """dW [G, N, K], dW_g = dy_gᵀ x_g from one torch._scaled_mm per group over the transposed copies dy_t [N, M'] and
    x_t [K, M'], whose groups start at multiples of ALIGN columns (padded unless aligned: cuBLASLt's 16-byte
    pointers); zeros for an empty group."""
    n, k = dy_t.shape[0], x_t.shape[0]
    dw = torch.empty(len(splits), n, k, dtype=out_dtype, device=dy_t.device)
    start = 0
    for g, size in enumerate(splits):
        cols = size if aligned else -(-size // ALIGN) * ALIGN  # (padding columns are zeros: they add nothing)
        if cols:
            torch._scaled_mm(dy_t[:, start:start + cols], x_t[:, start:start + cols].t(), dy_scale_inv, x_scale_inv,
                             out_dtype=out_dtype, use_fast_accum=False, out=dw[g])
        else:
            dw[g].zero_()
        start += cols
    return dw


def _stacked_view(weights: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """[G, N, K] over the weights' memory when they are consecutive contiguous blocks of one tensor (as
    GroupedLinear packs them), detached; else None."""
    w0 = weights[0]
    n, k = w0.shape
    storage, offset = w0.untyped_storage().data_ptr(), w0.storage_offset()
    for i, w in enumerate(weights):
        if (not w.is_contiguous() or w.dtype != w0.dtype or w.shape != w0.shape
                or w.untyped_storage().data_ptr() != storage or w.storage_offset() != offset + i * n * k):
            return None
    return w0.detach().as_strided((len(weights), n, k), (n * k, k, 1))


class GroupedLinear(FP8ModuleBase):
    """num_gemms linears y_i = x_i W_iᵀ + b_i over the row groups x_i of one input. FP8 roles: INPUT (the whole input),
    WEIGHT (all the weights: one scale; block scaling: a scale per 128x128 block), GRAD_OUTPUT (E4M3 under every
    format, see the module docstring).

    Args:
        num_gemms: number of groups (experts), >= 1.
        in_features: K, the input's last dim.
        out_features: N, the output's last dim.
        bias: whether each group has a bias (bias0..).
        params_dtype: dtype of the parameters (default: torch's default dtype).
        device: where the parameters live.
        init_method: callable(weight) initialising each weight in place (default: nn.Linear's).
        fuse_wgrad_accumulation: accumulate each weight gradient into weight{i}.main_grad (float32, the weight's
            shape) instead of returning it.
        return_bias: return (out, [bias0, ...]) without adding the biases.
        fp8_min_gemm_size: accepted for the other modules' API and ignored: GroupedLinear has no small-shape path,
            it runs FP8 at every size inside fp8_autocast (its FP8 path is one grouped GEMM per direction, whatever
            the size; only debug.disable_fp8 turns it off).
    """

    forward_roles = (Role.INPUT, Role.WEIGHT)
    backward_roles = (Role.GRAD_OUTPUT,)

    def __init__(self, num_gemms: int, in_features: int, out_features: int, bias: bool = True,
                 params_dtype: torch.dtype | None = None, device: str | torch.device = "cuda", init_method=None,
                 fuse_wgrad_accumulation: bool = False, return_bias: bool = False,
                 fp8_min_gemm_size: int | None = None) -> None:
        check_positive(num_gemms=num_gemms, in_features=in_features, out_features=out_features)
        super().__init__(params_dtype, device, fuse_wgrad_accumulation, out_features, fp8_min_gemm_size)
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.return_bias = bool(return_bias)
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", self._weight_param((out_features, in_features), init_method))
            self.register_parameter(f"bias{i}", self._vector_param(out_features, 0.0) if bias else None)
        self._pack_weights()
        self.use_bias = bool(bias)

    @property
    def weights(self) -> list[torch.Tensor]:
        """[weight0, ..., weight{num_gemms-1}]."""
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    @property
    def biases(self) -> list[torch.Tensor]:
        """[bias0, ...], or [] without biases."""
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.use_bias else []

    def forward(self, inp: torch.Tensor, m_splits: Sequence[int] | torch.Tensor,
                is_first_microbatch: bool | None = None, *, splits_aligned: bool = False,
                output_activation: str | None = None) -> torch.Tensor | tuple:
        """Args:
            inp: [M, in_features] (or [..., in_features], flattened to rows), rows grouped by expert.
            m_splits: rows per group: a list of num_gemms ints summing to M, or an integer tensor [num_gemms] on
                inp's device (its sum must be M; not checked on the host: that would synchronise).
            is_first_microbatch: Transformer Engine's FP8 weight cache switch (inside fp8_autocast): True casts the
                weights (with their transposes) and keeps the copy, False reuses the kept copy (cast and kept when
                there is none), None casts at every call and keeps nothing. Gradient accumulation over microbatches
                with weights that change only between steps: True on the first microbatch, False on the others.
            splits_aligned: the caller promises every m_splits entry is a multiple of 16 (the counts of
                moe_permute(..., align_size=16)): with a device m_splits the FP8 weight gradient then runs on the
                rows as they are, from the transposed copies the casts write, instead of padded copies. A host list
                is checked (ValueError); a device tensor is not (a sync): a wrong promise fails in the kernel.
            output_activation: "gelu", "relu" or "swiglu" (silu of the first half of the outputs times the second
                half), applied to the output (after the bias), or None. In FP8 its backward writes the GEMMs' FP8
                gradient in the same pass (delayed scaling after the first step, no biases): an MoE's fc1 + SwiGLU
                takes one pass fewer each step than GroupedLinear followed by a SwiGLU.

        Returns:
            [..., out_features] (out_features / 2 with swiglu) in inp's dtype; with return_bias, (out,
            [bias0, ...]).
        """
        x, splits, aligned = self._check_forward(inp, m_splits, splits_aligned)
        if output_activation is not None:
            check_choice("output_activation", output_activation, OUTPUT_ACTIVATIONS)
            if self.return_bias:
                raise ValueError("output_activation: not with return_bias (the bias goes inside the activation)")
            if output_activation == "swiglu" and self.out_features % 2:
                raise ValueError(f"output_activation: swiglu needs an even out_features, got {self.out_features}")
        biases = [] if self.return_bias else self.biases
        state = autocast.STATE
        if state.enabled and not self.fp8_disabled:
            host_splits = None if isinstance(m_splits, torch.Tensor) else list(m_splits)
            out = self._fp8_forward(x, splits, host_splits, aligned, biases, state, output_activation,
                                    is_first_microbatch)
        else:
            if state.calibrating:
                self._calibrate_grouped(x)
            out = self._high_precision_forward(x, m_splits, splits, biases)
            out = out if output_activation is None else _activate(out, output_activation)
        out = out.view(*inp.shape[:-1], activation_out_features(output_activation, self.out_features))
        return (out, self.biases) if self.return_bias else out

    def _check_forward(self, inp, m_splits, splits_aligned):
        """-> (inp as contiguous rows [M, K], m_splits as an int32 tensor on inp's device, aligned)."""
        if not isinstance(inp, torch.Tensor) or inp.dim() < 1 or inp.shape[-1] != self.in_features:
            shape = tuple(inp.shape) if isinstance(inp, torch.Tensor) else type(inp).__name__
            raise ValueError(f"inp: expected a tensor with last dim {self.in_features}, got {shape}")
        x = inp.reshape(-1, self.in_features)
        x = x if x.is_contiguous() else x.contiguous()
        if isinstance(m_splits, torch.Tensor):
            if m_splits.dim() != 1 or m_splits.numel() != self.num_gemms or m_splits.dtype.is_floating_point \
                    or m_splits.device != inp.device:
                raise ValueError(f"m_splits: expected an integer tensor of {self.num_gemms} elements on "
                                 f"{inp.device}, got {m_splits.dtype} of shape {tuple(m_splits.shape)} on "
                                 f"{m_splits.device}")
            return x, m_splits.to(torch.int32), bool(splits_aligned)
        splits = list(m_splits)
        if len(splits) != self.num_gemms or any(isinstance(s, bool) or not isinstance(s, int) or s < 0
                                                for s in splits) or sum(splits) != x.shape[0]:
            raise ValueError(f"m_splits: expected {self.num_gemms} non-negative ints summing to {x.shape[0]} (the "
                             f"input's rows), got {m_splits!r}")
        aligned = all(s % ALIGN == 0 for s in splits)
        if splits_aligned and not aligned:
            raise ValueError(f"m_splits: splits_aligned=True expects multiples of {ALIGN}, got {splits!r}")
        tensor = torch.tensor(splits, dtype=torch.int32).to(inp.device, non_blocking=True)
        return x, tensor, aligned

    # --- FP8 ---
    def _fp8_forward(self, x, splits, host_splits, aligned, biases, state, activation, is_first_microbatch):
        if self.in_features % ALIGN or self.out_features % ALIGN:
            raise ValueError(f"GroupedLinear: FP8 needs in_features and out_features multiples of {ALIGN} (the "
                             f"grouped FP8 kernel's alignment), got {self.in_features} and {self.out_features}")
        self._count_call(fp8=True)
        if is_block(state.recipe):
            check_block_recipe(state.recipe, self.out_features)
            self._fp8_begin(state)
            return GroupedLinearBlockFP8.apply(x, splits, host_splits, self, torch.is_grad_enabled(), activation,
                                               is_first_microbatch, *self.weights, *biases)
        self._fp8_begin(state)
        return _GroupedLinearFP8.apply(x, splits, host_splits, aligned, self, torch.is_grad_enabled(), activation,
                                       is_first_microbatch, *self.weights, *biases)

    def _calibrate_grouped(self, x: torch.Tensor) -> None:
        """fp8_autocast(calibrating=True) on the high-precision path: record the amaxes of what the FP8 path casts,
        the input rows (INPUT) and all the weights together (WEIGHT: one scale; Float8Tensor weights: none)."""
        weights = self.weights
        if any(isinstance(w, Float8Tensor) for w in weights):
            stacked = None
        else:
            stacked = _stacked_view(weights)
            stacked = torch.stack([w.detach() for w in weights]) if stacked is None else stacked
        self._calibrate(x.detach(), stacked)

    def _adopt_recipe(self, recipe):
        """The base's QuantizerSet, made for `recipe` with E4M3 gradients (the grouped kernel's only FP8 type); the
        module keeps `recipe` itself as the one it adopted (so that the next call with it adopts nothing)."""
        super()._adopt_recipe(_e4m3_recipe(recipe))
        self._fp8_recipe = recipe

    def _pack_weights(self) -> None:
        """Make the high-precision weights views of one [G, N, K] tensor (the same values), so that the FP8 path's
        cast reads them as one tensor without stacking them (a copy of every weight at every step). The parameters
        stay the same objects (their .data is replaced)."""
        weights = self.weights
        if any(isinstance(w, Float8Tensor) for w in weights) or _stacked_view(weights) is not None:
            return
        with torch.no_grad():
            packed = torch.stack([w.detach() for w in weights])
        for w, view in zip(weights, packed.unbind(0)):
            w.data = view

    def _fp8_weights(self, weights, need_t, is_first_microbatch=None):
        """The weights in FP8 for the grouped GEMMs: (data [G, N, K], scale_inv [1] or [G], Wᵀ [G, K, N] (a view
        with a contiguous last dim) or None). High-precision weights are stacked and cast once (the WEIGHT role, one
        scale for all); Float8Tensor weights (fp8_model_init) keep their own scales. is_first_microbatch: True
        casts (with Wᵀ) and keeps the result in the weight cache, False returns the kept one (or casts and keeps),
        None casts and keeps nothing."""
        cached = self._weight_cache.get("weights") if is_first_microbatch is False else None
        if cached is not None:
            return cached
        if is_first_microbatch is None:
            return self._cast_weights(weights, need_t)
        self._weight_cache["weights"] = operands = self._cast_weights(weights, True)
        return operands

    def _cast_weights(self, weights, need_t):
        """The FP8 weights of _fp8_weights, cast now."""
        g, n, k = self.num_gemms, self.out_features, self.in_features
        if all(isinstance(w, Float8Tensor) for w in weights):
            if any(w.layout != "tensor" for w in weights):
                raise TypeError("GroupedLinear: block-scaled FP8 weights (fp8_model_init with Float8BlockScaling) "
                                "need fp8_autocast(fp8_recipe=recipe.Float8BlockScaling()), got "
                                f"{type(self._fp8_recipe).__name__}")
            data = torch.stack([w._data for w in weights])
            scale_inv = torch.cat([w._scale_inv.reshape(1) for w in weights])
            return data, scale_inv, torch.stack([w.transpose_data() for w in weights]) if need_t else None
        if any(isinstance(w, Float8Tensor) for w in weights):
            raise TypeError("GroupedLinear: weights mix Float8Tensor and high-precision tensors")
        stacked = _stacked_view(weights)
        stacked = torch.stack(weights) if stacked is None else stacked
        op = self.quantizers[Role.WEIGHT].cast(stacked.view(g * n, k), rowwise=True, transpose=need_t)
        w_t = op.data_t.view(k, g, n).permute(1, 0, 2) if need_t else None
        return op.data.view(g, n, k), op.scale_inv, w_t

    def _fp8_block_weights(self, weights, need_t, is_first_microbatch=None):
        """The weights in 128x128 FP8 blocks for the block-scaled grouped GEMMs (_grouped_linear_block.BlockWeights),
        cast once over all the experts; is_first_microbatch as _fp8_weights (its own cache entry)."""
        cached = self._weight_cache.get("block_weights") if is_first_microbatch is False else None
        if cached is not None:
            return cached
        keep = is_first_microbatch is not None
        stacked = None
        if any(isinstance(w, Float8Tensor) for w in weights):
            if not all(isinstance(w, Float8Tensor) for w in weights):
                raise TypeError("GroupedLinear: weights mix Float8Tensor and high-precision tensors")
        else:
            stacked = _stacked_view(weights)
            stacked = torch.stack(weights) if stacked is None else stacked
        operands = cast_block_weights(self, weights, stacked, need_t or keep)
        if keep:
            self._weight_cache["block_weights"] = operands
        return operands

    # --- high precision ---
    def _high_precision_forward(self, x, m_splits, splits, biases):
        """y_g = x_g W_gᵀ + b_g per group (F.linear per group; a device m_splits is read on the host here)."""
        if self._last_forward_fp8:
            self._check_recompute_precision()
        sizes = splits.tolist() if isinstance(m_splits, torch.Tensor) else list(m_splits)
        if sum(sizes) != x.shape[0]:
            raise ValueError(f"m_splits: expected sizes summing to {x.shape[0]} (the input's rows), got {sizes}")
        outs = []
        for i, part in enumerate(x.split(sizes)):
            weight = getattr(self, f"weight{i}")
            if isinstance(weight, Float8Tensor):
                weight = weight.dequantize()
            bias = biases[i] if biases else None
            if self.fuse_wgrad_accumulation:
                outs.append(high_precision_linear(self, part, weight, bias))
            else:
                outs.append(F.linear(part, weight, bias))
        return torch.cat(outs) if outs else x.new_empty(0, self.out_features)

    # --- device moves ---
    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._pack_weights()  # (a move or cast makes each weight its own tensor again)
        return self

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.use_bias}")
