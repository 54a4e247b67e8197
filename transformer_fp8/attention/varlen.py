"""Packed variable-length attention (qkv_format "thd"), the engine of DotProductAttention for thd.

q [total_q, h, d], k/v [total_kv, g, d] (g divides h: GQA/MQA); cu_seqlens_q / cu_seqlens_kv int32 [batch + 1],
cumulative offsets from 0 to the token count: sequence i is rows cu[i]:cu[i + 1] of q, and of k/v. Sequences attend
only within themselves; causal masks are top-left aligned within each sequence (query j sees keys 0..j), as TE's
"padding_causal". Output [total_q, h, d] in q's dtype.

CUDA: torch.nn.attention.varlen.varlen_attn, FlashAttention-2's varlen kernel (forward and backward, GQA without
expanding k/v), in bf16/fp16; float32 inputs are cast to bf16 around it. Cases it cannot take run, after one warning
per reason, a loop over the sequences through the fused SDPA kernels (one host sync to read cu_seqlens):
attention dropout (varlen_attn has none), a head dim that is not a multiple of 8, and a causal mask with a sequence
whose q and kv lengths differ (FlashAttention aligns causal masks bottom-right).
CPU: that loop in float32 math: the reference.

Host syncs on CUDA: none when max_seqlen_q and max_seqlen_kv are given and, for causal masks, cu_seqlens_kv is
cu_seqlens_q (the same tensor, or None). Otherwise cu_seqlens are read on the host once (to compute the max lengths
or compare q and kv lengths); their values (0 first, non-decreasing, last = token count, max_seqlen large enough)
are checked whenever they are read, so always on CPU, and are trusted when not read.
"""
import itertools
import warnings

import torch
from torch.nn.attention.varlen import varlen_attn

from .sdpa import scaled_dot_product_attention

_warned_reasons = set()


def check_packed_qkv(q, k, v, heads, groups, channels):
    """q [total_q, heads, channels], k and v [total_kv, groups, channels], one dtype and device."""
    for name, t, h in (("query_layer", q, heads), ("key_layer", k, groups), ("value_layer", v, groups)):
        if t.dim() != 3 or t.shape[1] != h or t.shape[2] != channels:
            raise ValueError(f"{name}: expected a 3-D thd tensor [tokens, {h}, {channels}], got {tuple(t.shape)}")
        if t.dtype != q.dtype or t.device != q.device:
            raise TypeError(f"{name}: expected {q.dtype} on {q.device} (as query_layer), got {t.dtype} on "
                            f"{t.device}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"value_layer: expected {k.shape[0]} tokens (as key_layer), got {v.shape[0]}")


def _check_cu_seqlens(cu, name, device):
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
        got = f"{cu.dtype} {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else repr(cu)
        raise ValueError(f"{name}: expected an int32 tensor [batch + 1] of cumulative sequence offsets, got {got}")
    if cu.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (as query_layer), got {cu.device}")


def _check_offsets(offsets, name, tokens):
    if offsets[0] != 0 or any(b < a for a, b in itertools.pairwise(offsets)):
        raise ValueError(f"{name}: expected non-decreasing offsets starting at 0, got {offsets}")
    if offsets[-1] != tokens:
        raise ValueError(f"{name}: the last offset must be the token count {tokens}, got {offsets[-1]}")


def _lengths(offsets):
    return [b - a for a, b in itertools.pairwise(offsets)]


def _max_seqlen(given, lengths, name):
    longest = max(lengths)
    if given is not None and given < longest:
        raise ValueError(f"{name}: {given} is shorter than the longest sequence ({longest})")
    return longest if given is None else given


def _read_offsets(cu_q, cu_kv, tokens_q, tokens_kv):
    """Both offset lists on the host (one device-to-host copy), checked."""
    rows = torch.stack([cu_q, cu_kv]).tolist()
    _check_offsets(rows[0], "cu_seqlens_q", tokens_q)
    _check_offsets(rows[1], "cu_seqlens_kv", tokens_kv)
    for i, (lq, lkv) in enumerate(zip(_lengths(rows[0]), _lengths(rows[1]))):
        if lq and not lkv:
            raise ValueError(f"cu_seqlens_kv: sequence {i} has {lq} query tokens but no key/value tokens")
    return rows


def _per_sequence_attention(q, k, v, offsets_q, offsets_kv, causal, dropout_p, scale):
    """One SDPA call per sequence (top-left causal, as SDPA's is_causal), outputs concatenated."""
    outs = []
    for (q0, q1), (k0, k1) in zip(itertools.pairwise(offsets_q), itertools.pairwise(offsets_kv)):
        if q1 > q0:
            qi, ki, vi = (t[a:b].transpose(0, 1)[None] for t, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1)))
            out = scaled_dot_product_attention(qi, ki, vi, is_causal=causal, dropout_p=dropout_p, scale=scale)
            outs.append(out[0].transpose(0, 1))
    return torch.cat(outs) if outs else q[:0]


def _flash_varlen(q, k, v, cu_q, cu_kv, max_q, max_kv, causal, scale):
    dtype = q.dtype
    if dtype not in (torch.float16, torch.bfloat16):
        q, k, v = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
    out = varlen_attn(q, k, v, cu_q, cu_kv, max_q, max_kv, scale=scale, window_size=(-1, 0) if causal else (-1, -1))
    return out.to(dtype)


def _flash_refusal(q, dropout_p):
    """Why varlen_attn cannot take the case (None when it can), known before reading cu_seqlens."""
    if dropout_p > 0:
        return "attention dropout is not supported by varlen_attn"
    if q.shape[-1] % 8:
        return f"head dim {q.shape[-1]} is not a multiple of 8"
    return None


def _warn_once(reason, q):
    if reason not in _warned_reasons:
        _warned_reasons.add(reason)
        warnings.warn(f"DotProductAttention(qkv_format='thd'): FlashAttention varlen cannot take q {tuple(q.shape)} "
                      f"{q.dtype}: {reason}. Running one fused SDPA call per sequence instead (a host sync and a "
                      f"Python loop over the batch).", stacklevel=4)


def packed_attention(q, k, v, cu_seqlens_q, cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None,
                     causal=False, dropout_p=0.0, scale=None):
    """Attention over packed sequences (see the module docstring): q [total_q, h, d], k/v [total_kv, g, d] ->
    [total_q, h, d]. cu_seqlens_kv=None means cu_seqlens_q (self-attention; max_seqlen_kv then defaults to
    max_seqlen_q). max_seqlen_*: the longest sequence, or more; computed from cu_seqlens (a host sync) when None."""
    if cu_seqlens_kv is None:
        cu_seqlens_kv = cu_seqlens_q
        max_seqlen_kv = max_seqlen_q if max_seqlen_kv is None else max_seqlen_kv
    _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.device)
    _check_cu_seqlens(cu_seqlens_kv, "cu_seqlens_kv", q.device)
    if cu_seqlens_kv is cu_seqlens_q and k.shape[0] != q.shape[0]:
        raise ValueError(f"key_layer: expected {q.shape[0]} tokens (as query_layer, cu_seqlens_kv being cu_seqlens_q), "
                         f"got {k.shape[0]}")
    if cu_seqlens_kv.numel() != cu_seqlens_q.numel():
        raise ValueError(f"cu_seqlens_kv: expected {cu_seqlens_q.numel()} entries (batch + 1, as cu_seqlens_q), got "
                         f"{cu_seqlens_kv.numel()}")
    flash = q.device.type == "cuda"
    reason = _flash_refusal(q, dropout_p) if flash else None
    lengths_needed = max_seqlen_q is None or max_seqlen_kv is None or (causal and cu_seqlens_kv is not cu_seqlens_q)
    if flash and not reason and not lengths_needed:
        return _flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, causal, scale)
    offsets_q, offsets_kv = _read_offsets(cu_seqlens_q, cu_seqlens_kv, q.shape[0], k.shape[0])
    max_seqlen_q = _max_seqlen(max_seqlen_q, _lengths(offsets_q), "max_seqlen_q")
    max_seqlen_kv = _max_seqlen(max_seqlen_kv, _lengths(offsets_kv), "max_seqlen_kv")
    if flash and not reason and causal and _lengths(offsets_q) != _lengths(offsets_kv):
        reason = "a causal mask with q length != kv length in a sequence (FlashAttention aligns it bottom-right)"
    if flash and not reason:
        return _flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, causal, scale)
    if reason:
        _warn_once(reason, q)
    return _per_sequence_attention(q, k, v, offsets_q, offsets_kv, causal, dropout_p, scale)
