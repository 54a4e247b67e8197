"""DotProductAttention with Transformer Engine's names and defaults.

DotProductAttention runs, on CUDA, this package's own cuDNN graph ops (attention_backend="cudnn", the default when
the build has them: cudnn.py, strided q/k/v views in, one fused dq/dk/dv buffer out), falling back, with
one warning per reason, to PyTorch's fused SDPA kernels for cases cuDNN cannot take; attention_backend="torch" runs
PyTorch's kernels directly, in the order cuDNN fused attention, FlashAttention, memory-efficient attention. It never
falls back to the unfused math path silently: when no fused kernel takes a case it warns once, with the reasons
PyTorch gives, and only then runs math attention. On CPU it is the float32 math reference.
MultiheadAttention = one fused QKV projection (Linear, or LayerNormLinear with input_layernorm), optional RoPE on q
and k, DotProductAttention, output projection.
"""

import math

import torch
from torch import nn

from ..module.base import _allow_missing_extra_state
from .cudnn import BACKENDS, cudnn_attention, default_backend
from .fp8 import AttentionScaling, fp8_attention, fp8_dpa_enabled, warn_not_fp8
from .varlen import check_packed_qkv, packed_attention
from .sdpa import scaled_dot_product_attention

QK_NORM_TYPES = (None, "RMSNorm")  # TE's "L2Normalization" and "LayerNorm" are not implemented
ATTN_MASK_TYPES = ("no_mask", "causal", "padding", "padding_causal")
QKV_FORMATS = ("sbhd", "bshd", "bhsd", "thd")  # "bhsd" (SDPA's layout) and "thd" (packed): DotProductAttention only
# 4-D qkv_format -> (its sequence, batch and heads dims)
SEQ_BATCH_HEAD_DIMS = {"sbhd": (0, 1, 2), "bshd": (1, 0, 2), "bhsd": (2, 0, 1)}
MAX_HEAD_DIM = 256


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


def check_no_tensor_parallel(tp_size, tp_group):
    size = tp_group.size() if tp_group is not None else tp_size
    if size != 1:
        raise NotImplementedError(f"tp_size/tp_group: DotProductAttention does not split heads itself (give it this "
                                  f"rank's heads, or use MultiheadAttention with set_parallel_mode=True), got size "
                                  f"{size}")


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
