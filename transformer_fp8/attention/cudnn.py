"""DotProductAttention's "cudnn" backend: the fused_attn_fwd / fused_attn_bwd ops (cuDNN's graph API, csrc/ops.cpp)
behind an autograd Function.

q/k/v go in as DotProductAttention gets them (sbhd / bshd tensors, or views of one fused QKV buffer), or as
[b, h, s, d] tensors of any strides: the autograd Function takes the [b, h, s, d] views itself, so no layout change
adds an autograd node or a copy. The output comes back in q's dim order, and the backward writes dq, dk, dv into
ONE buffer laid out like q, k, v's own (a fused QKV gradient) when q, k, v are disjoint views of one buffer.

A case the backend cannot take (an arbitrary attention mask, a mask that is not a key-padding prefix, a shape or
dtype cuDNN's support check refuses) returns None, after one warning per reason, and so does torch.compile tracing
(silently); the caller then runs PyTorch's SDPA. Dropout draws a philox (seed, offset) pair from torch's CUDA
generator per forward, so results repeat under torch.manual_seed and the backward replays the forward's mask.
"""
import functools
import os
import warnings

import torch

from .. import _C, ops

BACKENDS = ("torch", "cudnn")
BACKEND_ENV = "TFP8_ATTENTION_BACKEND"
_unsupported_cases = {}  # _case_key -> cuDNN's reason, so a refused case costs one dict lookup afterwards
_warned_reasons = set()
_shared_grad_layouts = {}  # (shape, stride, offset) of q, k, v -> whether one gradient buffer can hold them
# Calls without dropout and padding mask run through the C++ autograd node of csrc/autograd_attention.cpp (the host
# path of a Python autograd.Function made attention alone slower than PyTorch's SDPA, step by step); its results are
# _FusedAttention's bit for bit. Read at each call; False: always the Function.
NATIVE_NODE = True


def default_backend():
    """The backend TFP8_ATTENTION_BACKEND names; when unset "cudnn" if this build has the attention family (on the
    sbhd / bshd views our modules pass, as fast as PyTorch's cuDNN SDPA, and it writes a fused QKV's gradient in
    place), else "torch"."""
    backend = os.environ.get(BACKEND_ENV) or ("cudnn" if cudnn_attention_built() else "torch")
    if backend not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}: expected one of {BACKENDS}, got {backend!r}")
    return backend


@functools.cache
def cudnn_attention_built():
    return torch._C._dispatch_has_kernel_for_dispatch_key("transformer_fp8::fused_attn_fwd", "CUDA")


def _warn_once(reason):
    if reason not in _warned_reasons:
        _warned_reasons.add(reason)
        warnings.warn(f"DotProductAttention(attention_backend='cudnn'): using PyTorch's SDPA instead: {reason}",
                      stacklevel=4)


def _head_intervals(t, start):
    """[first, end) element offsets (from start) of each head's channels in one token of t [b, h, s, d]."""
    first = t.storage_offset() - start
    return [(first + i * t.stride(1), first + i * t.stride(1) + t.shape[3]) for i in range(t.shape[1])]


def _one_buffer_fits(q, k, v):
    """True when q, k, v are views of one storage that share their b and s strides and whose heads occupy disjoint
    channel ranges inside one token: then one buffer with the same layout holds dq, dk, dv without overlap."""
    key = tuple((t.shape, t.stride(), t.storage_offset()) for t in (q, k, v))
    if key not in _shared_grad_layouts:
        start = min(t.storage_offset() for t in (q, k, v))
        token_strides = {(t.stride(0) if t.shape[0] > 1 else None, t.stride(2) if t.shape[2] > 1 else None)
                         for t in (q, k, v)}
        strides = [s for pair in token_strides for s in pair if s is not None]
        intervals = sorted(iv for t in (q, k, v) for iv in _head_intervals(t, start))
        disjoint = all(a[1] <= b[0] for a, b in zip(intervals, intervals[1:]))
        fits = (len(token_strides) == 1 and disjoint and intervals[0][0] >= 0
                and all(intervals[-1][1] <= s for s in strides))
        _shared_grad_layouts[key] = fits
    return _shared_grad_layouts[key]


def shared_grad_layout(q, k, v):
    """For q, k, v ([b, h, s, d]) disjoint views of one buffer (a fused QKV): (numel, ((shape, stride, offset) of q,
    k, v)), one gradient buffer laid out like theirs; else None."""
    base = q._base
    if base is None or k._base is not base or v._base is not base or not q.numel() or not k.numel() or \
            not _one_buffer_fits(q, k, v):
        return None
    start = min(t.storage_offset() for t in (q, k, v))
    end = max(t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1 for t in (q, k, v))
    return end - start, tuple((t.shape, t.stride(), t.storage_offset() - start) for t in (q, k, v))


def grad_views(layout, dtype, device, zeroed=False):
    """(dq, dk, dv): views of one new buffer made as a shared_grad_layout says."""
    numel, views = layout
    buffer = (torch.zeros if zeroed else torch.empty)(numel, dtype=dtype, device=device)
    return tuple(buffer.as_strided(*view) for view in views)


def _grad_buffers(q, k, v, zeroed):
    """(dq, dk, dv) with q's, k's, v's shapes and strides: views of one new buffer when q, k, v are disjoint views
    of one (a fused QKV), else separate tensors each laid out like its input (so that autograd hands them on to
    the sbhd / bshd tensors q, k, v are views of without a layout copy). zeroed: rows the kernel leaves unwritten
    (padding) read zero."""
    layout = shared_grad_layout(q, k, v)
    if layout is not None:
        return grad_views(layout, q.dtype, q.device, zeroed)
    like = torch.zeros_like if zeroed else torch.empty_like
    return tuple(like(t) for t in (q, k, v))


def _torch_sdpa_grads(grad_out, q, k, v, scale, causal, seqlens_kv):
    """(dq, dk, dv) of PyTorch's SDPA (no dropout), for a case whose cuDNN forward ran but whose backward cuDNN
    refuses."""
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        mask = None
        if seqlens_kv is not None:
            mask = torch.arange(k.shape[2], device=q.device) < seqlens_kv.view(-1, 1, 1, 1)
            if causal:
                mask = mask & torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1])
        return torch.autograd.grad(out, (q, k, v), grad_out)


def _case_key(q, k, v, qkv_format, causal, padding, dropout_p, scale):
    """What decides whether cuDNN takes a call (q, k, v as cudnn_attention gets them)."""
    return (q.dtype, q.device, causal, padding, dropout_p > 0, scale, qkv_format,
            *((t.shape, t.stride(), t.data_ptr() % 16) for t in (q, k, v)))


# qkv_format -> (the permutation of its dims to [b, h, s, d], the inverse)
_TO_BHSD = {"bhsd": ((0, 1, 2, 3), (0, 1, 2, 3)), "sbhd": ((1, 2, 0, 3), (2, 0, 1, 3)),
            "bshd": ((0, 2, 1, 3), (0, 2, 1, 3))}


class _FusedAttention(torch.autograd.Function):
    """q, k, v in qkv_format -> out: [b, h, s, d] for "bhsd", else the format's [s, b, h * d] / [b, s, h * d]. The
    layout changes are views taken inside (no autograd nodes of their own: the host time of a step counts)."""

    @staticmethod
    def forward(ctx, q, k, v, qkv_format, scale, causal, dropout_p, seqlens_q, seqlens_kv):
        perm, inverse = _TO_BHSD[qkv_format]
        q, k, v = (t.permute(perm) for t in (q, k, v))
        rng_state = None
        if dropout_p > 0:  # a fresh philox (seed, offset) from torch's CUDA generator
            rng_state = torch.randint(0, 2**62, (2,), dtype=torch.int64, device=q.device)
        out, stats = ops.tfp8.fused_attn_fwd(q, k, v, scale, causal, dropout_p, seqlens_q, seqlens_kv, rng_state)
        ctx.save_for_backward(q, k, v, out, stats, seqlens_q, seqlens_kv, rng_state)
        ctx.args = (qkv_format, scale, causal, dropout_p)
        out = out.permute(inverse)  # (dense in q's dim order: for sbhd / bshd inputs a contiguous tensor)
        return out if qkv_format == "bhsd" else out.reshape(*out.shape[:2], -1)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, stats, seqlens_q, seqlens_kv, rng_state = ctx.saved_tensors
        qkv_format, scale, causal, dropout_p = ctx.args
        perm, inverse = _TO_BHSD[qkv_format]
        if qkv_format != "bhsd":
            grad_out = grad_out.view(*grad_out.shape[:2], -1, out.shape[3]).permute(perm)
        if grad_out.stride(-1) != 1:
            grad_out = grad_out.contiguous()
        dq, dk, dv = _grad_buffers(q, k, v, zeroed=seqlens_q is not None)
        try:
            ops.tfp8.fused_attn_bwd(grad_out, q, k, v, out, stats, dq, dk, dv, scale, causal, dropout_p, seqlens_q,
                                    seqlens_kv, rng_state)
        except NotImplementedError as err:
            dq, dk, dv = _refused_backward(str(err), grad_out, q, k, v, scale, causal, qkv_format, seqlens_q,
                                           seqlens_kv, dropout_p)
        return (*(t.permute(inverse) for t in (dq, dk, dv)), None, None, None, None, None, None)


def _refused_backward(message, grad_out, q, k, v, scale, causal, qkv_format, seqlens_q=None, seqlens_kv=None,
                      dropout_p=0.0):
    """A backward cuDNN refuses (q, k, v, grad_out as [b, h, s, d] views): the case runs PyTorch's SDPA from its next
    forward on (one warning), and this backward's (dq, dk, dv) come from PyTorch's SDPA; with dropout nothing can
    replay the forward's mask: an error. (Also the C++ node's fallback: see csrc/autograd_attention.cpp.)"""
    inverse = _TO_BHSD[qkv_format][1]
    _unsupported_cases[_case_key(*(t.permute(inverse) for t in (q, k, v)), qkv_format, causal, seqlens_q is not None,
                                 dropout_p, scale)] = message
    if dropout_p > 0:
        raise RuntimeError(f"DotProductAttention(attention_backend='cudnn'): the forward ran with dropout on cuDNN, "
                           f"whose backward refuses the case, and no other kernel replays its dropout mask: {message}")
    _warn_once(f"backward: {message}")
    return _torch_sdpa_grads(grad_out, q, k, v, scale, causal, seqlens_kv)


_C.set_attention_fallback(_refused_backward)


def _padding_seqlens(attention_mask, b, sq, skv, device):
    """Key-padding mask bool [b, 1, 1, skv] (True = masked out) -> (seqlens_q, seqlens_kv) int32 [b], or a reason
    when it is not one prefix of kept keys per sequence (checked on the GPU, one host sync)."""
    if attention_mask.shape[-2] != 1:
        return f"attention_mask of shape {tuple(attention_mask.shape)} (per-query masks have no cuDNN form; only " \
               f"key-padding masks [b, 1, 1, s_kv] do)"
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return "a padding mask under CUDA graph capture (its key-prefix check needs a host sync)"
    masked = attention_mask.reshape(b, skv).to(device)
    seqlens_kv = (~masked).sum(-1, dtype=torch.int32)
    prefix = torch.arange(skv, device=masked.device) >= seqlens_kv[:, None]
    if bool(((masked != prefix).any(-1) | (seqlens_kv == 0)).any()):
        return "attention_mask is not a key-padding prefix mask with at least one kept key per sequence"
    return torch.full((b,), sq, dtype=torch.int32, device=masked.device), seqlens_kv


def cudnn_attention(q, k, v, attention_mask, attn_mask_type, dropout_p, scale, qkv_format="bhsd"):
    """q [b, hq, sq, d], k/v [b, hkv, skv, d] CUDA tensors of any strides (DotProductAttention's masks and scale), or
    the same in qkv_format "sbhd" / "bshd" -> out [b, hq, sq, d] (memory in q's dim order), or for "sbhd" / "bshd"
    [sq, b, hq * d] / [b, sq, hq * d] (contiguous), in q's dtype; or None when the cuDNN backend cannot take the case
    (one warning per reason). Under torch.compile it returns None at once, without a warning (tracing a warning
    would break a fullgraph compile): compiled graphs run PyTorch's SDPA."""
    if torch.compiler.is_compiling():
        return None
    if not cudnn_attention_built():
        _warn_once("transformer_fp8 was built without the attention family (cudnn-frontend headers missing)")
        return None
    dtype = q.dtype
    if dtype not in (torch.float16, torch.bfloat16):
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    seqlens_q = seqlens_kv = None
    if attn_mask_type in ("padding", "padding_causal"):
        perm = _TO_BHSD[qkv_format][0]
        b, sq, skv = q.shape[perm[0]], q.shape[perm[2]], k.shape[perm[2]]
        seqlens = _padding_seqlens(attention_mask, b, sq, skv, q.device)
        if isinstance(seqlens, str):
            _warn_once(seqlens)
            return None
        seqlens_q, seqlens_kv = seqlens
    causal, scale, dropout_p = attn_mask_type in ("causal", "padding_causal"), float(scale), float(dropout_p)
    if _unsupported_cases and _case_key(q, k, v, qkv_format, causal, seqlens_q is not None, dropout_p,
                                        scale) in _unsupported_cases:
        return None
    try:
        if NATIVE_NODE and dropout_p == 0.0 and seqlens_q is None:
            out = _C.fused_attention(q, k, v, qkv_format, scale, causal)
        else:
            out = _FusedAttention.apply(q, k, v, qkv_format, scale, causal, dropout_p, seqlens_q, seqlens_kv)
    except NotImplementedError as err:
        _unsupported_cases[_case_key(q, k, v, qkv_format, causal, seqlens_q is not None, dropout_p, scale)] = str(err)
        _warn_once(str(err))
        return None
    return out if out.dtype == dtype else out.to(dtype)
