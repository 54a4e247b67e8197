"""CPU reference kernels of the FP8 attention ops: fused_attn_fp8_fwd, fused_attn_fp8_bwd (contract in csrc/ops.cpp).

Emulated FP8: every FP8 tensor is a torch float8 tensor, dequantized as x8.float() * descale; the math is float32.
The two tensors cuDNN quantizes inside its kernel are rounded here too: the probabilities P (with scale_s, to q's
dtype) before P v and P-transposed dO, and dS (with scale_dp, to grad_out's dtype) before the dq and dk products.
"""
from ._common import FP8_MAX, accumulate_amax, check_scalar_f32, register, saturating_cast
from .._layout import dense_in_order_of
from .attention import _allowed, _check_4d, _check_inputs, _check_like, _check_stats, _expand_heads, _probabilities

FP8_DTYPES = tuple(FP8_MAX)


def _scalars(data, **tensors):
    """Checks one-element float32 scale / amax tensors (none may be None); -> their values as 0-d float32 tensors."""
    for arg, t in tensors.items():
        if t is None:
            raise TypeError(f"{arg}: expected a float32 tensor of one element, got None")
        check_scalar_f32(t, data, arg)
    return [t.reshape(()) for t in tensors.values()]


def _dequantize(x8, descale):
    return x8.float() * descale


def _round_trip(x, scale, descale, fp8_dtype):
    """x (float32) cast to FP8 with scale, then dequantized: the value a kernel that rounds x reads back."""
    return saturating_cast(x * scale, fp8_dtype).float() * descale


def _cast_into(like, shape, x, scale, fp8_dtype):
    """saturate(x * scale) as fp8_dtype, dense in like's dim order (as the CUDA kernel allocates)."""
    out = dense_in_order_of(like, shape, dtype=fp8_dtype)
    out.copy_(saturating_cast(x * scale, fp8_dtype))
    return out


@register("fused_attn_fp8_fwd")
def fused_attn_fp8_fwd(q, k, v, descale_q, descale_k, descale_v, scale_s, descale_s, scale_o, amax_s, amax_o, scale,
                       causal=False):
    b, hq, hkv, sq, skv, d_v = _check_inputs(q, k, v, 0.0, None, None, None, dtypes=FP8_DTYPES)
    dq_, dk_, dv_, s_s, ds_s, s_o = _scalars(q, descale_q=descale_q, descale_k=descale_k, descale_v=descale_v,
                                             scale_s=scale_s, descale_s=descale_s, scale_o=scale_o)
    _scalars(q, amax_s=amax_s, amax_o=amax_o)
    qf, kf, vf = _dequantize(q, dq_), _dequantize(k, dk_), _dequantize(v, dv_)
    probs, stats = _probabilities(qf, kf, scale, _allowed(b, sq, skv, causal, None, None))
    accumulate_amax(amax_s, probs)
    o = _round_trip(probs, s_s, ds_s, q.dtype) @ _expand_heads(vf, hq // hkv)
    accumulate_amax(amax_o, o)
    return _cast_into(q, (b, hq, sq, d_v), o, s_o, q.dtype), stats.contiguous()


@register("fused_attn_fp8_bwd")
def fused_attn_fp8_bwd(grad_out, q, k, v, out, stats, descale_q, descale_k, descale_v, descale_o, descale_do, scale_s,
                       descale_s, scale_dp, descale_dp, scale_dq, scale_dk, scale_dv, amax_dp, amax_dq, amax_dk,
                       amax_dv, scale, causal=False):
    """P is recomputed from q and k (stats only checked); see csrc/ops.cpp for the formulas."""
    b, hq, hkv, sq, skv, d_v = _check_inputs(q, k, v, 0.0, None, None, None, dtypes=FP8_DTYPES)
    _check_4d(out, "out", "[b, hq, sq, d_v]")
    _check_like(out, q, "out")
    _check_4d(grad_out, "grad_out", "[b, hq, sq, d_v]")
    if grad_out.device != q.device:
        raise ValueError(f"grad_out: expected a tensor on {q.device}, got one on {grad_out.device}")
    if grad_out.dtype not in FP8_DTYPES:
        raise TypeError(f"grad_out: expected torch.float8_e4m3fn or torch.float8_e5m2, got {grad_out.dtype}")
    for t, arg in ((out, "out"), (grad_out, "grad_out")):
        if tuple(t.shape) != (b, hq, sq, d_v):
            raise ValueError(f"{arg}: expected shape {(b, hq, sq, d_v)}, got {tuple(t.shape)}")
    _check_stats(stats, q, (b, hq, sq, 1))
    dq_, dk_, dv_, do_, ddo, s_s, ds_s, s_dp, ds_dp, s_dq, s_dk, s_dv = _scalars(
        q, descale_q=descale_q, descale_k=descale_k, descale_v=descale_v, descale_o=descale_o, descale_do=descale_do,
        scale_s=scale_s, descale_s=descale_s, scale_dp=scale_dp, descale_dp=descale_dp, scale_dq=scale_dq,
        scale_dk=scale_dk, scale_dv=scale_dv)
    _scalars(q, amax_dp=amax_dp, amax_dq=amax_dq, amax_dk=amax_dk, amax_dv=amax_dv)
    groups, grad_dtype = hq // hkv, grad_out.dtype
    qf, kf, vf = _dequantize(q, dq_), _dequantize(k, dk_), _dequantize(v, dv_)
    g, o = _dequantize(grad_out, ddo), _dequantize(out, do_)
    probs, _ = _probabilities(qf, kf, scale, _allowed(b, sq, skv, causal, None, None))
    dv = (_round_trip(probs, s_s, ds_s, q.dtype).transpose(-1, -2) @ g).unflatten(1, (hkv, groups)).sum(2)
    d_scores = probs * (g @ _expand_heads(vf, groups).transpose(-1, -2) - (g * o).sum(-1, keepdim=True)) * scale
    accumulate_amax(amax_dp, d_scores)
    d_scores = _round_trip(d_scores, s_dp, ds_dp, grad_dtype)
    dq = d_scores @ _expand_heads(kf, groups)
    dk = (d_scores.transpose(-1, -2) @ qf).unflatten(1, (hkv, groups)).sum(2)
    grads = []
    for grad, like, amax, s in ((dq, q, amax_dq, s_dq), (dk, k, amax_dk, s_dk), (dv, v, amax_dv, s_dv)):
        accumulate_amax(amax, grad)
        grads.append(_cast_into(like, tuple(like.shape), grad, s, grad_dtype))
    return tuple(grads)
