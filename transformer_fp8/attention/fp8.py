"""DotProductAttention in FP8 (recipe fp8_dpa=True): the fused_attn_fp8_fwd / fused_attn_fp8_bwd ops (csrc/ops.cpp;
CUDA: cuDNN's FP8 SDPA, CPU: the emulated reference) behind an autograd Function, with delayed scaling.

Scaling (a quantization.QuantizerSet over ATTENTION_ROLES, its states registered for the fused update like the FP8
modules' states):
  forward roles  ATTENTION_Q, _K, _V (the casts of the BF16 q, k, v), _S (softmax probabilities), _O (the output),
  fwd format; backward roles ATTENTION_DO (the cast of the output gradient), _DP (dS, the gradient of q kᵀ), _DQ,
  _DK, _DV, bwd format.
Every slot's amax is max-accumulated into amax_history row 0 (by the casts or the ops), and autocast's fused update
turns the histories into scales after the forward / backward.

Dataflow. Forward: q, k, v (any dtype, [b, h, s, d] views) -> FP8 (one cast each) -> FP8 out (on Hopper cuDNN gives
no BF16 out) -> dequantized to q's dtype. The FP8 q, k, v, out are saved (half the bytes of BF16).
Backward: grad_out -> FP8 (bwd format) -> FP8 dq, dk, dv (bwd format) -> dequantized to q's dtype.
Every tensor keeps its memory's dim order (sbhd inputs give sbhd FP8 copies, an sbhd out and sbhd gradients): the casts
run over memory as it lies (q, k, v views of a fused QKV too: rows at a stride), and no copy is made; for such views
dq, dk, dv are dequantized into one gradient laid out like the fused QKV, which the split hands on as it is.
Causal or no mask, no dropout. Cases the ops refuse (cuDNN on Hopper: head dims 16..256 (multiples of 16) forward,
128 only backward) fall back, after one warning per reason: a refused forward runs the high-precision path; a refused
backward computes the gradients with PyTorch's SDPA from the dequantized FP8 q, k, v, and the case then skips FP8
while gradients are needed. Under torch.compile the high-precision path runs (no FP8 attention in compiled graphs).
"""
import warnings

import torch

from .. import autocast
from ..ops import tfp8
from .._layout import dim_order, row_layout
from .cudnn import _torch_sdpa_grads, grad_views, shared_grad_layout
from ..quantization import ATTENTION_ROLES, QuantizerSet, Role, ScalingState

FP8_MASK_TYPES = ("no_mask", "causal")
_refused = {}  # (case, "forward" / "backward") -> the op's reason
_warned = set()


def warn_not_fp8(reason):
    """One warning per reason that a case runs without FP8 attention."""
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"DotProductAttention(fp8_dpa=True): not in FP8: {reason}", stacklevel=4)


def fp8_dpa_enabled():
    """Inside fp8_autocast with a recipe that asks for FP8 attention."""
    return autocast.STATE.enabled and getattr(autocast.STATE.recipe, "fp8_dpa", False)


class AttentionScaling:
    """A DotProductAttention's FP8 quantizers (ATTENTION_ROLES): made for the first recipe it runs with (the states
    remade when the amax history length changes) on the input's device. `fwd` / `bwd`: the states (a checkpoint
    region swaps `fwd` for its recompute)."""

    def __init__(self):
        self.quantizers = None

    @property
    def fwd(self):
        return None if self.quantizers is None else self.quantizers.fwd_state

    @fwd.setter
    def fwd(self, state):
        self.quantizers.fwd_state = state

    @property
    def bwd(self):
        return None if self.quantizers is None else self.quantizers.bwd_state

    @bwd.setter
    def bwd(self, state):
        self.quantizers.bwd_state = state

    def begin(self, device):
        """Adopt the active recipe and queue the forward state for the update (inside a checkpoint region's forward:
        have the region record it, see checkpoint.py); -> (recipe, group)."""
        state = autocast.STATE
        recipe, group = state.recipe, state.group
        old = self.quantizers
        if old is None or old.recipe is not recipe:
            states = None if old is None else (old.fwd_state, old.bwd_state)
            self.quantizers = QuantizerSet(recipe, *ATTENTION_ROLES, device, None, states)
        self.quantizers.to(device)
        self.quantizers.begin_forward(state)
        region = state.checkpoint
        if region is not None and region.recording:
            region.record(self, "fwd")
        return recipe, group

    def state_dict(self):
        """For the module's checkpoint (extra state): None before the first FP8 call."""
        return None if self.quantizers is None else self.quantizers.extra_state()

    def load_state_dict(self, state):
        if state is None:
            return
        device = state["fwd"]["scale"].device  # (begin() moves the state to the input's device)
        self.quantizers = QuantizerSet.from_states(*ATTENTION_ROLES, ScalingState.from_state_dict(state["fwd"], device),
                                                   ScalingState.from_state_dict(state["bwd"], device))


def _cast(x, quantizer):
    """x -> FP8 dense in x's dim order, with the quantizer's slot scale (amax accumulated; 1/scale written into the
    slot's snapshot)."""
    order, inverse = dim_order(x)
    rows = x.permute(order)
    if row_layout(rows) is None:  # (say, an expanded gradient; q, k, v of a fused QKV are rows at a stride)
        rows = rows.contiguous()
    q = tfp8.quantize(rows, quantizer.scale, quantizer.fp8_dtype, quantizer.amax, quantizer.scale_inv)
    return q.permute(inverse)


def _dequantize(x8, scale_inv, dtype):
    """A dense FP8 tensor of any dim order -> dtype, the same dim order."""
    order, inverse = dim_order(x8)
    return tfp8.dequantize(x8.permute(order).contiguous(), scale_inv, dtype).permute(inverse)


class _FP8Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, quantizers, group, case):
        qq, qk, qv, qs, qo = (quantizers[role] for role in ATTENTION_ROLES[0])
        q8, k8, v8 = (_cast(t, quantizer) for t, quantizer in ((q, qq), (k, qk), (v, qv)))
        out8, stats = tfp8.fused_attn_fp8_fwd(
            q8, k8, v8, qq.scale_inv, qk.scale_inv, qv.scale_inv, qs.scale, qs.scale_inv_slot, qo.scale, qs.amax,
            qo.amax, scale, causal)
        descale_o = torch.reciprocal(qo.scale, out=qo.scale_inv)  # the snapshot of the scale out8 has
        ctx.save_for_backward(q8, k8, v8, out8, stats)
        ctx.grad_layout = shared_grad_layout(q, k, v)  # (None unless q, k, v are views of a fused QKV)
        # Snapshots as attributes, not saved tensors: they share one buffer (see quantization/state.py).
        ctx.descales = (qq.scale_inv, qk.scale_inv, qv.scale_inv, descale_o)
        ctx.args = (scale, causal, quantizers, group, case, q.dtype)
        return _dequantize(out8, descale_o, q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q8, k8, v8, out8, stats = ctx.saved_tensors
        scale, causal, quantizers, group, case, dtype = ctx.args
        qs = quantizers[Role.ATTENTION_S]
        qdo, qdp, qdq, qdk, qdv = (quantizers[role] for role in ATTENTION_ROLES[1])
        g8 = _cast(grad_out, qdo)
        quantizers.register_backward(group)
        try:
            grads8 = tfp8.fused_attn_fp8_bwd(
                g8, q8, k8, v8, out8, stats, *ctx.descales, qdo.scale_inv, qs.scale, qs.scale_inv_slot, qdp.scale,
                qdp.scale_inv_slot, qdq.scale, qdk.scale, qdv.scale, qdp.amax, qdq.amax, qdk.amax, qdv.amax, scale,
                causal)
        except NotImplementedError as err:
            _refused[(case, "backward")] = str(err)
            warn_not_fp8(f"backward: {err}")
            q, k, v = (_dequantize(t, d, dtype) for t, d in zip((q8, k8, v8), ctx.descales))
            return (*_torch_sdpa_grads(grad_out.to(dtype), q, k, v, scale, causal, None), *(None,) * 5)
        scale_invs = [quantizer.scale_inv_slot for quantizer in (qdq, qdk, qdv)]
        if ctx.grad_layout is None:
            grads = [_dequantize(g, scale_inv, dtype) for g, scale_inv in zip(grads8, scale_invs)]
        else:  # into one gradient laid out like the fused QKV
            grads = grad_views(ctx.grad_layout, dtype, grad_out.device)
            for g8, g, scale_inv in zip(grads8, grads, scale_invs):
                order = dim_order(g8)[0]
                tfp8.dequantize_into(g8.permute(order), scale_inv, g.permute(order))
        return (*grads, *(None,) * 5)


def fp8_attention(scaling, q, k, v, attention_mask, attn_mask_type, dropout_p, scale):
    """q [b, hq, sq, d], k/v [b, hkv, skv, d] views (DotProductAttention's masks and scale) -> out [b, hq, sq, d] in
    q's dtype through FP8 attention with `scaling` (an AttentionScaling), or None when the case is not taken (one
    warning per reason; silently under torch.compile)."""
    if torch.compiler.is_compiling():
        return None
    if attn_mask_type not in FP8_MASK_TYPES or attention_mask is not None:
        warn_not_fp8(f"attn_mask_type {attn_mask_type!r} (FP8 attention takes {FP8_MASK_TYPES})")
        return None
    if dropout_p > 0:
        warn_not_fp8("attention dropout (FP8 attention has none)")
        return None
    if q.is_cuda and not torch._C._dispatch_has_kernel_for_dispatch_key("transformer_fp8::fused_attn_fp8_fwd",
                                                                          "CUDA"):
        warn_not_fp8("transformer_fp8 was built without the attention family (cudnn-frontend headers missing)")
        return None
    case = (q.dtype, q.device, attn_mask_type, float(scale), *(tuple(t.shape) for t in (q, k, v)))
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if (case, "forward") in _refused or (needs_grad and (case, "backward") in _refused):
        return None
    _, group = scaling.begin(q.device)
    try:
        return _FP8Attention.apply(q, k, v, float(scale), attn_mask_type == "causal", scaling.quantizers, group,
                                   case)
    except NotImplementedError as err:
        _refused[(case, "forward")] = str(err)
        warn_not_fp8(str(err))
        return None
