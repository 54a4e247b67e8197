"""CPU reference kernels of the rope ops: rope_fwd, rope_bwd (contract in csrc/ops.cpp).

t [s, b, h, d] ("sbhd") or [b, s, h, d] ("bshd"), last dim contiguous; freqs float32 [>= s, 1 or b, 1, rot_dim].
Channel pairs (a, b) = (i, i + rot_dim/2), or (2i, 2i + 1) when interleaved, with angles (fa, fb):
forward (a cos fa - b sin fa, b cos fb + a sin fb); backward (its transpose) (a cos fa + b sin fb, b cos fb - a sin fa).
Math in float32; the output is contiguous, in t's dtype.
"""
import torch

from ._common import register

HIGH_PRECISION = (torch.float32, torch.float16, torch.bfloat16)
FORMATS = ("sbhd", "bshd")


def _check(x, freqs, qkv_format, arg):
    """-> (s, b) after checking the arguments as the CUDA binding does."""
    if qkv_format not in FORMATS:
        raise ValueError(f"qkv_format: expected 'sbhd' or 'bshd', got {qkv_format!r}")
    if x.dtype not in HIGH_PRECISION:
        raise TypeError(f"{arg}: expected a float32, float16 or bfloat16 tensor, got {x.dtype}")
    layout = "s, b" if qkv_format == "sbhd" else "b, s"
    if x.dim() != 4:
        raise ValueError(f"{arg}: expected a 4-D tensor [{layout}, h, d] for qkv_format {qkv_format!r}, "
                         f"got shape {tuple(x.shape)}")
    if x.shape[3] > 1 and x.stride(3) != 1:
        raise ValueError(f"{arg}: expected a contiguous last dim, got strides {x.stride()}")
    if freqs.device != x.device:
        raise ValueError(f"freqs: expected a tensor on {x.device}, got one on {freqs.device}")
    if freqs.dtype != torch.float32:
        raise TypeError(f"freqs: expected a float32 tensor, got {freqs.dtype}")
    s, b = (x.shape[0], x.shape[1]) if qkv_format == "sbhd" else (x.shape[1], x.shape[0])
    d = x.shape[3]
    expected = f"[>= {s}, 1 or {b}, 1, rot_dim] with rot_dim even and 2 <= rot_dim <= d = {d}"
    rot_dim = freqs.shape[-1] if freqs.dim() == 4 else 0
    if (freqs.dim() != 4 or freqs.shape[0] < s or freqs.shape[1] not in (1, b) or freqs.shape[2] != 1
            or rot_dim % 2 or not 2 <= rot_dim <= d):
        raise ValueError(f"freqs: expected {expected}, got shape {tuple(freqs.shape)}")
    if freqs.stride(3) != 1:
        raise ValueError(f"freqs: expected a contiguous last dim, got strides {freqs.stride()}")
    return s, b


def _rope(x, freqs, qkv_format, interleaved, inverse, arg):
    s, _ = _check(x, freqs, qkv_format, arg)
    rot_dim = freqs.shape[-1]
    f = freqs[:s] if qkv_format == "sbhd" else freqs[:s].transpose(0, 1)  # broadcasts against x
    cos, sin = f.cos(), f.sin()
    if interleaved:
        pairs = (slice(0, rot_dim, 2), slice(1, rot_dim, 2))
    else:
        pairs = (slice(0, rot_dim // 2), slice(rot_dim // 2, rot_dim))
    a, b = (x[..., p].float() for p in pairs)
    ca, cb = (cos[..., p] for p in pairs)
    sa, sb = (sin[..., p] for p in pairs)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if inverse:
        out[..., pairs[0]], out[..., pairs[1]] = a * ca + b * sb, b * cb - a * sa
    else:
        out[..., pairs[0]], out[..., pairs[1]] = a * ca - b * sa, b * cb + a * sb
    out[..., rot_dim:] = x[..., rot_dim:]
    return out


@register("rope_fwd")
def rope_fwd(t, freqs, qkv_format, interleaved=False):
    return _rope(t, freqs, qkv_format, interleaved, inverse=False, arg="t")


@register("rope_bwd")
def rope_bwd(grad_out, freqs, qkv_format, interleaved=False):
    return _rope(grad_out, freqs, qkv_format, interleaved, inverse=True, arg="grad_out")


def _check_out(out, x, arg):
    if out.dtype != x.dtype:
        raise TypeError(f"out: expected {x.dtype} ({arg}'s dtype), got {out.dtype}")
    if out.shape != x.shape:
        raise ValueError(f"out: expected shape {tuple(x.shape)} ({arg}'s), got {tuple(out.shape)}")
    if out.device != x.device:
        raise ValueError(f"out: expected a tensor on {x.device}, got one on {out.device}")
    if out.shape[3] > 1 and out.stride(3) != 1:
        raise ValueError(f"out: expected a contiguous last dim, got strides {out.stride()}")
    same = out.data_ptr() == x.data_ptr() and out.stride() == x.stride()
    if not same and out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        raise ValueError(f"out: expected {arg} itself (the same view: in place) or a tensor of another storage")


@register("rope_fwd_into")
def rope_fwd_into(t, freqs, qkv_format, interleaved, out):
    result = _rope(t, freqs, qkv_format, interleaved, inverse=False, arg="t")
    _check_out(out, t, "t")
    out.copy_(result)


@register("rope_bwd_into")
def rope_bwd_into(grad_out, freqs, qkv_format, interleaved, out):
    result = _rope(grad_out, freqs, qkv_format, interleaved, inverse=True, arg="grad_out")
    _check_out(out, grad_out, "grad_out")
    out.copy_(result)
