"""PyTorch's SDPA through its fused backends only (cuDNN, FlashAttention, memory-efficient), falling back to the math
path with one warning per case that says why: scaled_dot_product_attention, what DotProductAttention (its "torch"
backend, and the fallback of the "cudnn" one), packed (varlen) attention and the KV cache call.
"""
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

FUSED_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
NO_KERNEL_ERRORS = ("No available kernel", "No viable backend")  # what SDPA raises when no allowed backend fits
_warned_cases = set()


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
