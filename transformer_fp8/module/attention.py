"""Attention modules with Transformer Engine's names and defaults.

DotProductAttention runs, on CUDA, this package's own cuDNN graph ops (attention_backend="cudnn", the default when
the build has them: attention_cudnn.py, strided q/k/v views in, one fused dq/dk/dv buffer out), falling back, with
one warning per reason, to PyTorch's fused SDPA kernels for cases cuDNN cannot take; attention_backend="torch" runs
PyTorch's kernels directly, in the order cuDNN fused attention, FlashAttention, memory-efficient attention. It never
falls back to the unfused math path silently: when no fused kernel takes a case it warns once, with the reasons
PyTorch gives, and only then runs math attention. On CPU it is the float32 math reference.
MultiheadAttention = one fused QKV projection (Linear, or LayerNormLinear with input_layernorm), optional RoPE on q
and k, DotProductAttention, output projection.
"""
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..distributed import TensorParallel, model_parallel_rng
from .attention_cudnn import BACKENDS, cudnn_attention, default_backend
from .attention_fp8 import AttentionScaling, fp8_attention, fp8_dpa_enabled, warn_not_fp8
from .attention_varlen import check_packed_qkv, packed_attention
from .base import _allow_missing_extra_state
from .layernorm_linear import LayerNormLinear
from .linear import Linear
from .norm import RMSNorm
from ._residual_relay import ResidualGradRelay
from .qkv_split import split_qkv
from .rope import apply_rotary_pos_emb

QK_NORM_TYPES = (None, "RMSNorm")  # TE's "L2Normalization" and "LayerNorm" are not implemented
ATTN_MASK_TYPES = ("no_mask", "causal", "padding", "padding_causal")
QKV_FORMATS = ("sbhd", "bshd", "bhsd", "thd")  # "bhsd" (SDPA's layout) and "thd" (packed): DotProductAttention only
# 4-D qkv_format -> (its sequence, batch and heads dims)
SEQ_BATCH_HEAD_DIMS = {"sbhd": (0, 1, 2), "bshd": (1, 0, 2), "bhsd": (2, 0, 1)}
FUSED_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
MAX_HEAD_DIM = 256
NO_KERNEL_ERRORS = ("No available kernel", "No viable backend")  # what SDPA raises when no allowed backend fits
_warned_cases = set()


def _check_choice(value, choices, arg):
    if value not in choices:
        raise ValueError(f"{arg}: expected one of {choices}, got {value!r}")


def _sdpa_mask(attention_mask, attn_mask_type, sq, skv, device):
    """TE mask convention (bool, True = masked out) -> (SDPA attn_mask with True = attend, or None; is_causal)."""
    if attn_mask_type in ("no_mask", "causal"):
        if attention_mask is not None:
            raise ValueError(f"attention_mask: must be None with attn_mask_type={attn_mask_type!r}")
        return None, attn_mask_type == "causal"
    if attention_mask is None or attention_mask.dtype != torch.bool or attention_mask.dim() != 4:
        got = None if attention_mask is None else f"{attention_mask.dtype} {tuple(attention_mask.shape)}"
        raise ValueError(f"attention_mask: expected a bool [b, 1, 1 or s_q, s_kv] tensor (True = masked out) with "
                         f"attn_mask_type={attn_mask_type!r}, got {got}")
    if attention_mask.shape[-1] != skv or attention_mask.shape[-2] not in (1, sq):
        raise ValueError(f"attention_mask: expected [b, 1, 1 or {sq}, {skv}], got {tuple(attention_mask.shape)}")
    allowed = ~attention_mask.to(device)
    if attn_mask_type == "padding_causal":
        allowed = allowed & torch.ones(sq, skv, dtype=torch.bool, device=device).tril()
    return allowed, False


def _padding_mask_from_cu_seqlens(cu_seqlens_q, cu_seqlens_kv, attention_mask, mask_type, b, skv, device):
    """Padded sbhd/bshd/bhsd batches described by offsets (TE's cu_seqlens): bool [b, 1, 1, skv], True = the key
    position is padding (from cu_seqlens_kv, or cu_seqlens_q for self-attention). Query rows past a sequence's length
    are not masked (their outputs are finite, and padding). Device ops only: no host sync."""
    if "padding" not in mask_type:
        raise ValueError(f"cu_seqlens_q/cu_seqlens_kv: with qkv_format 'sbhd'/'bshd'/'bhsd' they describe padding "
                         f"and need attn_mask_type 'padding' or 'padding_causal', got {mask_type!r}")
    if attention_mask is not None:
        raise ValueError("attention_mask: give either attention_mask or cu_seqlens_q/cu_seqlens_kv, not both")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv)):
        if cu is not None and (not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.shape != (b + 1,)):
            got = f"{cu.dtype} {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
            raise ValueError(f"{name}: expected an int32 tensor of shape ({b + 1},) (batch + 1 offsets), got {got}")
    cu = (cu_seqlens_kv if cu_seqlens_kv is not None else cu_seqlens_q).to(device)
    lengths = cu[1:] - cu[:-1]
    return (torch.arange(skv, device=device) >= lengths[:, None]).view(b, 1, 1, skv)


def _expand_kv(t, groups):
    return t.repeat_interleave(groups, dim=1)


def _math_attention(q, k, v, reasons, **kw):
    """Unfused attention, after one warning per distinct case that says why no fused kernel took it."""
    case = (q.dtype, q.shape[-1], kw["attn_mask"] is not None, kw["is_causal"], kw["dropout_p"] > 0)
    if case not in _warned_cases:
        _warned_cases.add(case)
        why = "; ".join(dict.fromkeys(reasons)) or "no reason given"
        warnings.warn(f"DotProductAttention: no fused attention kernel (cuDNN, FlashAttention, memory-efficient) "
                      f"takes q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}: using unfused math attention. "
                      f"Reasons: {why}", stacklevel=4)
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **kw)


def _try_fused(q, k, v, enable_gqa, kw):
    """SDPA restricted to the fused backends (in FUSED_BACKENDS order), or None when none of them takes the case."""
    try:
        with sdpa_kernel(FUSED_BACKENDS, set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=enable_gqa, **kw)
    except RuntimeError as err:
        if not any(msg in str(err) for msg in NO_KERNEL_ERRORS):
            raise
        return None


def _fused_attention(q, k, v, **kw):
    """SDPA on q [b, hq, sq, d], k/v [b, hkv, skv, d] through the fused CUDA backends: GQA natively, else with k/v
    expanded to hq heads, else (warned) math."""
    groups = q.shape[1] // k.shape[1]
    out = _try_fused(q, k, v, groups > 1, kw)
    if out is None and groups > 1:
        out = _try_fused(q, _expand_kv(k, groups), _expand_kv(v, groups), False, kw)
    if out is not None:
        return out
    with warnings.catch_warnings(record=True) as caught:  # SDPA warns its reasons when no allowed backend fits
        warnings.simplefilter("always")
        _try_fused(q, k, v, groups > 1, kw)
    return _math_attention(q, k, v, [str(w.message).strip() for w in caught], **kw)


def scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False, dropout_p=0.0, scale=None):
    """q [b, hq, sq, d], k/v [b, hkv, skv, d] (hq % hkv == 0) -> [b, hq, sq, d_v] in q's dtype.

    CUDA: fused kernels in bf16/fp16 (float32 inputs are cast to bf16 around the kernel). CPU: float32 math.
    attn_mask: bool, True = attend, broadcastable to [b, hq, sq, skv].
    """
    kw = dict(attn_mask=attn_mask, is_causal=is_causal, dropout_p=dropout_p, scale=scale)
    dtype = q.dtype
    if q.device.type != "cuda":
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=q.shape[1] != k.shape[1],
                                             **kw)
        return out.to(dtype)
    if dtype not in (torch.float16, torch.bfloat16):
        q, k, v = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
    return _fused_attention(q, k, v, **kw).to(dtype)


class DotProductAttention(nn.Module):
    """softmax(q kᵀ * softmax_scale + mask) v over heads, q/k/v in qkv_format ("sbhd": [s, b, h, d], "bshd":
    [b, s, h, d], "bhsd": [b, h, s, d] as F.scaled_dot_product_attention takes them); k and v have num_gqa_groups
    heads (GQA/MQA). Output [s, b, h * d] (sbhd), [b, s, h * d] (bshd) or [b, h, s, d] (bhsd, as SDPA's).

    attn_mask_type: "no_mask", "causal" (top-left aligned), "padding", "padding_causal"; the padding types take
    attention_mask, bool [b, 1, 1, s_kv] (or [b, 1, s_q, s_kv]) with True = masked out (TE's convention).
    Dropout on the attention probabilities in training mode only.

    qkv_format "thd" (packed sequences, no padding tokens): q [total_q, h, d], k/v [total_kv, g, d], with forward's
    cu_seqlens_q / cu_seqlens_kv (int32 [batch + 1] offsets; cu_seqlens_kv=None: as q) and optional max_seqlen_q /
    max_seqlen_kv; output [total_q, h * d]. attention_mask must be None; "padding" and "no_mask" mean no causal
    mask, "padding_causal" and "causal" a causal mask top-left aligned within each sequence. Kernels, fallbacks and
    host syncs: attention_varlen.py.
    With "sbhd"/"bshd"/"bhsd" and a padding mask type, cu_seqlens_kv (or cu_seqlens_q for self-attention) may describe
    each sequence's length instead of attention_mask: key positions past the length are masked.
    gqa_groups_folded=True (sbhd, "no_mask" / "causal", no attention_mask): q [s, b * g, h/g, d], k and v
    [s, b * g, 1, d], the GQA groups folded into the batch (each group's h/g query heads over its one kv head), as
    MultiheadAttention passes views of an interleaved fused QKV without copying them (qkv_split.py); output
    [s, b, h * d], the same as for the unfolded q [s, b, h, d], k, v [s, b, g, d].

    attention_backend: "torch" (PyTorch's fused SDPA kernels) or "cudnn" (transformer_fp8's cuDNN graph ops, for
    sbhd / bshd / bhsd; a padding mask costs one host sync to check it is a key-padding prefix); None: the environment
    variable TFP8_ATTENTION_BACKEND, else "cudnn" when this build has the attention family, else "torch".

    FP8 attention: inside fp8_autocast with a DelayedScaling(fp8_dpa=True) recipe, "no_mask" / "causal" attention
    without dropout (sbhd / bshd / bhsd) runs in FP8 (attention_fp8.py: q, k, v, probabilities and output in FP8 with
    the module's own delayed-scaling state, gradients in the recipe's backward format), whatever attention_backend says;
    other cases run as above, after one warning per reason.
    """

    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                 attn_mask_type="causal", qkv_format="sbhd", softmax_scale=None, layer_number=None,
                 attention_type="self", tp_size=1, tp_group=None, sequence_parallel=False, attention_backend=None):
        super().__init__()
        _check_choice(attn_mask_type, ATTN_MASK_TYPES, "attn_mask_type")
        self.attention_backend = attention_backend or default_backend()
        _check_choice(self.attention_backend, BACKENDS, "attention_backend")
        _check_choice(qkv_format, QKV_FORMATS, "qkv_format")
        check_no_tensor_parallel(tp_size, tp_group)
        num_gqa_groups = num_gqa_groups or num_attention_heads
        if num_attention_heads % num_gqa_groups:
            raise ValueError(f"num_gqa_groups: must divide num_attention_heads={num_attention_heads}, "
                             f"got {num_gqa_groups}")
        if not 0 < kv_channels <= MAX_HEAD_DIM:
            raise ValueError(f"kv_channels: expected 1..{MAX_HEAD_DIM}, got {kv_channels}")
        self.num_attention_heads, self.num_gqa_groups, self.kv_channels = num_attention_heads, num_gqa_groups, \
            kv_channels
        self.attention_dropout, self.attn_mask_type, self.qkv_format = attention_dropout, attn_mask_type, qkv_format
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(kv_channels)
        self.layer_number, self.attention_type = layer_number, attention_type
        self.fp8_scaling = AttentionScaling()  # FP8 attention's scaling state (made on its first FP8 call)
        self.register_load_state_dict_pre_hook(_allow_missing_extra_state)

    def get_extra_state(self):
        return self.fp8_scaling.state_dict()

    def set_extra_state(self, state):
        self.fp8_scaling.load_state_dict(state)

    def _check_qkv(self, q, k, v, fmt):
        """q, k, v: 4-D fmt tensors with this module's heads and channels, one dtype and device, k and v of one batch
        and length, q of their batch. One expression on the good path (attention alone is timed step by step, where
        the host's time to the first kernel counts); _explain_bad_qkv names the argument and what was expected."""
        qs, ks, vs = q.shape, k.shape, v.shape
        seq_dim, batch_dim, head_dim = SEQ_BATCH_HEAD_DIMS[fmt]
        if not (len(qs) == len(ks) == len(vs) == 4 and qs[head_dim] == self.num_attention_heads and
                ks[head_dim] == vs[head_dim] == self.num_gqa_groups and qs[3] == ks[3] == vs[3] == self.kv_channels
                and ks[seq_dim] == vs[seq_dim] and ks[batch_dim] == vs[batch_dim] == qs[batch_dim] and
                q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
            self._explain_bad_qkv(q, k, v, fmt)

    def _explain_bad_qkv(self, q, k, v, fmt):
        seq_dim, batch_dim, head_dim = SEQ_BATCH_HEAD_DIMS[fmt]
        for name, t, heads in (("query_layer", q, self.num_attention_heads), ("key_layer", k, self.num_gqa_groups),
                               ("value_layer", v, self.num_gqa_groups)):
            if t.dim() != 4 or t.shape[head_dim] != heads or t.shape[3] != self.kv_channels:
                raise ValueError(f"{name}: expected a 4-D {fmt} tensor with {heads} heads of {self.kv_channels} "
                                 f"channels, got {tuple(t.shape)}")
            if t.dtype != q.dtype or t.device != q.device:
                raise TypeError(f"{name}: expected {q.dtype} on {q.device} (as query_layer), got {t.dtype} on "
                                f"{t.device}")
        if k.shape[:3] != v.shape[:3] or k.shape[batch_dim] != q.shape[batch_dim]:
            raise ValueError(f"key_layer/value_layer: batch and sequence dims must match ({fmt}), got q "
                             f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None, cu_seqlens_q=None,
                cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None, attn_mask_type=None,
                gqa_groups_folded=False):
        fmt = qkv_format or self.qkv_format
        mask_type = attn_mask_type or self.attn_mask_type
        _check_choice(fmt, QKV_FORMATS, "qkv_format")
        _check_choice(mask_type, ATTN_MASK_TYPES, "attn_mask_type")
        dropout_p = self.attention_dropout if self.training else 0.0
        if gqa_groups_folded:
            if fmt != "sbhd" or attention_mask is not None or mask_type not in ("no_mask", "causal") or \
                    cu_seqlens_q is not None or cu_seqlens_kv is not None:
                raise ValueError(f"gqa_groups_folded: takes sbhd q, k, v with a 'no_mask' or 'causal' mask type and "
                                 f"no attention_mask or cu_seqlens, got qkv_format {fmt!r}, attn_mask_type "
                                 f"{mask_type!r}")
            return self._folded_groups_attention(query_layer, key_layer, value_layer, mask_type, dropout_p)
        if fmt == "thd":
            if fp8_dpa_enabled() and not torch.compiler.is_compiling():
                warn_not_fp8("qkv_format 'thd'")
            check_packed_qkv(query_layer, key_layer, value_layer, self.num_attention_heads, self.num_gqa_groups,
                             self.kv_channels)
            if attention_mask is not None:
                raise ValueError("attention_mask: must be None with qkv_format='thd' (cu_seqlens give the sequences)")
            out = packed_attention(query_layer, key_layer, value_layer, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                                   max_seqlen_kv, causal="causal" in mask_type, dropout_p=dropout_p,
                                   scale=self.softmax_scale)
            return out.reshape(out.shape[0], -1)
        if max_seqlen_q is not None or max_seqlen_kv is not None:
            raise ValueError(f"max_seqlen_q/max_seqlen_kv: only taken with qkv_format='thd', got {fmt!r}")
        self._check_qkv(query_layer, key_layer, value_layer, fmt)
        if cu_seqlens_q is not None or cu_seqlens_kv is not None:
            seq_dim, batch_dim, _ = SEQ_BATCH_HEAD_DIMS[fmt]
            attention_mask = _padding_mask_from_cu_seqlens(cu_seqlens_q, cu_seqlens_kv, attention_mask, mask_type,
                                                           query_layer.shape[batch_dim], key_layer.shape[seq_dim],
                                                           query_layer.device)
        return self._attend(query_layer, key_layer, value_layer, attention_mask, mask_type, fmt, dropout_p)

    def _folded_groups_attention(self, query_layer, key_layer, value_layer, mask_type, dropout_p):
        """gqa_groups_folded: q [s, b * g, h/g, d], k and v [s, b * g, 1, d] -> [s, b, h * d] (see the class
        docstring)."""
        g, qs = self.num_gqa_groups, query_layer.shape
        expected_kv = (qs[0], qs[1], 1, self.kv_channels) if len(qs) == 4 else None
        if not (len(qs) == 4 and qs[1] % g == 0 and qs[2:] == (self.num_attention_heads // g, self.kv_channels) and
                key_layer.shape == value_layer.shape == expected_kv):
            raise ValueError(f"query_layer/key_layer/value_layer: with gqa_groups_folded expected q [s, b * {g}, "
                             f"{self.num_attention_heads // g}, {self.kv_channels}] and k, v [s, b * {g}, 1, "
                             f"{self.kv_channels}], got {tuple(qs)}, {tuple(key_layer.shape)}, "
                             f"{tuple(value_layer.shape)}")
        out = self._attend(query_layer, key_layer, value_layer, None, mask_type, "sbhd", dropout_p)
        return out.view(qs[0], qs[1] // g, -1)

    def _attend(self, query_layer, key_layer, value_layer, attention_mask, mask_type, fmt, dropout_p):
        """Checked sbhd / bshd / bhsd q, k, v -> [s, b, hq * d] / [b, s, hq * d] / [b, hq, s, d]: FP8, cuDNN or
        PyTorch's SDPA."""
        seq_dim = SEQ_BATCH_HEAD_DIMS[fmt][0]
        sq, skv, device = query_layer.shape[seq_dim], key_layer.shape[seq_dim], query_layer.device
        attn_mask, is_causal = _sdpa_mask(attention_mask, mask_type, sq, skv, device)
        to_bhsd = {"sbhd": lambda t: t.permute(1, 2, 0, 3), "bshd": lambda t: t.transpose(1, 2),
                   "bhsd": lambda t: t}[fmt]
        out = None
        if fp8_dpa_enabled():
            out = fp8_attention(self.fp8_scaling, *map(to_bhsd, (query_layer, key_layer, value_layer)),
                                attention_mask, mask_type, dropout_p, self.softmax_scale)
        if out is None and self.attention_backend == "cudnn" and device.type == "cuda":
            out = cudnn_attention(query_layer, key_layer, value_layer, attention_mask, mask_type, dropout_p,
                                  self.softmax_scale, fmt)  # (already [s, b, h * d] / [b, s, h * d] / [b, h, s, d])
            if out is not None:
                return out
        if out is None:
            out = scaled_dot_product_attention(*map(to_bhsd, (query_layer, key_layer, value_layer)),
                                               attn_mask=attn_mask, is_causal=is_causal, dropout_p=dropout_p,
                                               scale=self.softmax_scale)  # [b, h, sq, d]
        if fmt == "bhsd":
            return out
        out = out.permute(2, 0, 1, 3) if fmt == "sbhd" else out.transpose(1, 2)
        return out.reshape(*out.shape[:2], -1)


def check_no_tensor_parallel(tp_size, tp_group):
    size = tp_group.size() if tp_group is not None else tp_size
    if size != 1:
        raise NotImplementedError(f"tp_size/tp_group: DotProductAttention does not split heads itself (give it this "
                                  f"rank's heads, or use MultiheadAttention with set_parallel_mode=True), got size "
                                  f"{size}")


class MultiheadAttention(nn.Module):
    """Self-attention block: [LayerNorm/RMSNorm +] fused QKV GEMM, RoPE on q and k, attention, output GEMM.

    hidden_states [s, b, hidden] ("sbhd") or [b, s, hidden] ("bshd") -> same shape. The QKV weight has
    (h + 2 * g) * kv_channels rows (g = num_gqa_groups): with qkv_weight_interleaved they are ordered per group
    [q heads of the group, k, v] (TE's default), else [all q | all k | all v]. fuse_qkv_params is accepted: the QKV
    weight is always one parameter. Returns out, then bias (return_bias), then the norm output
    (return_layernorm_output), as TE does.

    Tensor parallelism (set_parallel_mode=True, a tp_group of size tp > 1; interleaved QKV weights): the QKV
    projection is column-parallel (this rank's num_gqa_groups/tp groups, i.e. num_attention_heads/tp query heads),
    attention runs on those heads, the output projection is row-parallel. With sequence_parallel ("sbhd" only) the
    input and output are this rank's sequence block: the input norm runs on it, and the QKV projection all-gathers
    its (normalised) input along the sequence, in FP8 inside fp8_autocast. Attention dropout then draws from the RNG
    tracker's "model-parallel-rng" state when it has one (distributed.get_rng_state_tracker(): seed it per rank for
    independent masks). return_layernorm_output is not supported with TP.

    qk_norm_type="RMSNorm" (TE's argument; as Qwen3): an RMSNorm over kv_channels on every q and k head (weights
    `q_norm.weight`, `k_norm.weight` [kv_channels], eps qk_norm_eps), after RoPE, or before it with
    qk_norm_before_rope=True. It runs in high precision (also inside fp8_autocast: the norms sit between the QKV
    GEMM and attention).
    """

    def __init__(self, hidden_size, num_attention_heads, kv_channels=None, attention_dropout=0.1,
                 layernorm_epsilon=1e-5, init_method=None, output_layer_init_method=None, layer_number=None,
                 attn_mask_type="causal", tp_group=None, tp_size=1, num_gqa_groups=None,
                 fuse_wgrad_accumulation=False, sequence_parallel=False, params_dtype=None, return_bias=False,
                 return_layernorm_output=False, input_layernorm=False, attention_type="self",
                 set_parallel_mode=False, fuse_qkv_params=False, zero_centered_gamma=False,
                 qkv_weight_interleaved=True, bias=True, normalization="LayerNorm", device="cuda",
                 attn_input_format=None, qkv_format="sbhd", qk_norm_type=None, qk_norm_eps=1e-6,
                 qk_norm_before_rope=False):
        super().__init__()
        if qk_norm_type not in QK_NORM_TYPES:
            raise NotImplementedError(f"qk_norm_type: supported {QK_NORM_TYPES}, got {qk_norm_type!r}")
        if attention_type != "self":
            raise NotImplementedError(f"attention_type: only 'self' is supported, got {attention_type!r}")
        if return_layernorm_output and not input_layernorm:
            raise ValueError("return_layernorm_output: needs input_layernorm=True")
        self.qkv_format = attn_input_format or qkv_format
        if self.qkv_format in ("thd", "bhsd"):
            raise NotImplementedError(f"qkv_format: MultiheadAttention and TransformerLayer take 'sbhd' or 'bshd'; "
                                      f"{self.qkv_format!r} is supported by DotProductAttention only")
        kv_channels = kv_channels or hidden_size // num_attention_heads
        num_gqa_groups = num_gqa_groups or num_attention_heads
        tp = TensorParallel.create(tp_group, tp_size, "column" if set_parallel_mode else None, sequence_parallel)
        local_heads, local_groups = num_attention_heads, num_gqa_groups
        if tp is not None:
            local_heads = tp.local("num_attention_heads", num_attention_heads)
            local_groups = tp.local("num_gqa_groups", num_gqa_groups)
            if not qkv_weight_interleaved:
                raise NotImplementedError("qkv_weight_interleaved: tensor parallelism needs the interleaved layout")
            if sequence_parallel and self.qkv_format != "sbhd":
                raise ValueError(f"qkv_format: sequence_parallel needs 'sbhd', got {self.qkv_format!r}")
        self.tp = tp
        self.heads, self.groups, self.head_dim = local_heads, local_groups, kv_channels
        self.qkv_weight_interleaved = qkv_weight_interleaved
        self.input_layernorm, self.return_layernorm_output = input_layernorm, return_layernorm_output
        self.return_bias = return_bias
        common = dict(bias=bias, params_dtype=params_dtype, device=device,
                      fuse_wgrad_accumulation=fuse_wgrad_accumulation)
        parallel = {} if tp is None else dict(tp_group=tp_group, tp_size=tp_size, sequence_parallel=sequence_parallel)
        column = dict(parallel, parallel_mode="column") if parallel else {}
        row = dict(parallel, parallel_mode="row") if parallel else {}
        qkv_features = (num_attention_heads + 2 * num_gqa_groups) * kv_channels
        if input_layernorm:
            self.layernorm_qkv = LayerNormLinear(
                hidden_size, qkv_features, eps=layernorm_epsilon, normalization=normalization,
                zero_centered_gamma=zero_centered_gamma, return_layernorm_output=return_layernorm_output,
                init_method=init_method, **column, **common)
        else:
            self.qkv = Linear(hidden_size, qkv_features, init_method=init_method, **column, **common)
        self.core_attention = DotProductAttention(
            local_heads, kv_channels, num_gqa_groups=local_groups, attention_dropout=attention_dropout,
            attn_mask_type=attn_mask_type, qkv_format=self.qkv_format, layer_number=layer_number)
        self.proj = Linear(num_attention_heads * kv_channels, hidden_size, init_method=output_layer_init_method,
                           return_bias=return_bias, **row, **common)
        self.qk_norm_before_rope = bool(qk_norm_before_rope)
        if qk_norm_type == "RMSNorm":  # one weight [kv_channels] shared by all heads, as TE's q_norm / k_norm
            norm_args = dict(eps=qk_norm_eps, params_dtype=params_dtype, device=device)
            self.q_norm, self.k_norm = RMSNorm(kv_channels, **norm_args), RMSNorm(kv_channels, **norm_args)
        else:
            self.q_norm = self.k_norm = None

    def _split_qkv(self, qkv, fold=False):
        """[*lead, (h + 2g) * d] -> q [*lead, h, d], k and v [*lead, g, d]; fold: the groups folded into the batch
        (see qkv_split.py)."""
        return split_qkv(qkv, self.heads, self.groups, self.head_dim, self.qkv_weight_interleaved, fold)

    @staticmethod
    def rotate_qk(q, k, v, rotary_pos_emb, tensor_format):
        """RoPE on q and k (rotary_pos_emb: freqs, or a (q_freqs, k_freqs) pair) -> (q, k, v), v made contiguous:
        q and k are new tensors now, and a view v alone would keep the whole QKV output alive."""
        q_freqs, k_freqs = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
        return (apply_rotary_pos_emb(q, q_freqs, tensor_format), apply_rotary_pos_emb(k, k_freqs, tensor_format),
                v.contiguous())

    def _folds_groups(self, attention_mask, attn_mask_type, rotary_pos_emb):
        """Whether q, k, v go to the attention as views of the QKV output with the GQA groups folded into the batch
        (DotProductAttention's gqa_groups_folded): interleaved GQA in sbhd without a mask tensor or RoPE (also under
        FP8 attention). Else interleaved GQA copies q, k and v (its q heads are not evenly spaced)."""
        return (self.qkv_weight_interleaved and self.groups != self.heads and self.qkv_format == "sbhd" and
                attention_mask is None and rotary_pos_emb is None and
                (attn_mask_type or self.core_attention.attn_mask_type) in ("no_mask", "causal"))

    def forward(self, hidden_states, attention_mask=None, attn_mask_type=None, is_first_microbatch=None,
                rotary_pos_emb=None, residual=None, checkpoint_core_attention=False):
        """rotary_pos_emb: freqs [s, 1, 1, rot_dim] from RotaryPositionEmbedding, or a (q_freqs, k_freqs) pair.
        residual: added to the output in the projection GEMM's epilogue (see Linear; not with sequence
        parallelism). checkpoint_core_attention: the attention core under transformer_fp8.checkpoint (recomputed in
        the backward; it then keeps q, k, v but not its output and softmax statistics)."""
        layernorm_output = None
        relay = None  # (the residual's gradient joins the QKV norm backward's dx: see _residual_relay.py)
        if residual is hidden_states and self.input_layernorm and torch.is_grad_enabled() and \
                not torch.compiler.is_compiling():
            relay = ResidualGradRelay()
        if self.input_layernorm:
            qkv = self.layernorm_qkv(hidden_states, is_first_microbatch=is_first_microbatch,
                                     residual_grad_relay=relay)
            if self.return_layernorm_output:
                qkv, layernorm_output = qkv
        else:
            qkv = self.qkv(hidden_states, is_first_microbatch=is_first_microbatch)
        fold = self._folds_groups(attention_mask, attn_mask_type, rotary_pos_emb)
        q, k, v = self._split_qkv(qkv, fold)
        if self.q_norm is not None and (self.qk_norm_before_rope or rotary_pos_emb is None):
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary_pos_emb is not None:
            q, k, v = self.rotate_qk(q, k, v, rotary_pos_emb, self.qkv_format)
            if self.q_norm is not None and not self.qk_norm_before_rope:
                q, k = self.q_norm(q), self.k_norm(k)
        with model_parallel_rng(self.tp is not None):  # dropout on this rank's heads
            if checkpoint_core_attention and torch.is_grad_enabled():
                from ..checkpoint import checkpoint  # (here: checkpoint.py imports the modules)
                context = checkpoint(self.core_attention, q, k, v, attention_mask=attention_mask,
                                     attn_mask_type=attn_mask_type, gqa_groups_folded=fold)
            else:
                context = self.core_attention(q, k, v, attention_mask=attention_mask, attn_mask_type=attn_mask_type,
                                              gqa_groups_folded=fold)
        out = self.proj(context, is_first_microbatch=is_first_microbatch, residual=residual,
                        residual_grad_relay=relay)
        outputs = (*out,) if self.return_bias else (out,)
        if self.return_layernorm_output:
            outputs += (layernorm_output,)
        return outputs if len(outputs) > 1 else outputs[0]
