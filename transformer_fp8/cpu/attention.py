"""CPU reference kernels of the attention ops: fused_attn_fwd, fused_attn_bwd (contract in csrc/ops.cpp).

float32 math attention on q [b, hq, sq, d_qk], k [b, hkv, skv, d_qk], v [b, hkv, skv, d_v] (float16 / bfloat16, last
dim contiguous, any other strides). The dropout mask comes from a CPU generator seeded with rng_state (seed, offset),
so the forward and the backward of one rng_state agree; it is not cuDNN's philox mask.
"""
import torch

from .._layout import dense_in_order_of
from ._common import register

DTYPES = (torch.float16, torch.bfloat16)


def _check_4d(t, arg, layout):
    if t.dim() != 4:
        raise ValueError(f"{arg}: expected a 4-D tensor {layout}, got shape {tuple(t.shape)}")
    if t.stride(3) != 1:
        raise ValueError(f"{arg}: expected a contiguous last dim, got strides {t.stride()}")


def _check_like(t, q, arg):
    if t.device != q.device:
        raise ValueError(f"{arg}: expected a tensor on {q.device}, got one on {t.device}")
    if t.dtype != q.dtype:
        raise TypeError(f"{arg}: expected {q.dtype} (as q), got {t.dtype}")


def _check_stats(stats, q, shape):
    """The forward's softmax statistics: float32, contiguous, of shape [b, hq, sq, 1], on q's device."""
    if stats.device != q.device:
        raise ValueError(f"stats: expected a tensor on {q.device}, got one on {stats.device}")
    if stats.dtype != torch.float32:
        raise TypeError(f"stats: expected a float32 tensor, got {stats.dtype}")
    if tuple(stats.shape) != shape or not stats.is_contiguous():
        raise ValueError(f"stats: expected a contiguous tensor of shape {shape}, got {tuple(stats.shape)} "
                         f"strides {stats.stride()}")


def _check_inputs(q, k, v, dropout_p, seqlens_q, seqlens_kv, rng_state, dtypes=DTYPES):
    """The CUDA binding's checks (q's dtype in dtypes); -> (b, hq, hkv, sq, skv, d_v)."""
    if q.dtype not in dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"q: expected a {names} tensor, got {q.dtype}")
    _check_4d(q, "q", "[b, hq, sq, d_qk]")
    _check_4d(k, "k", "[b, hkv, skv, d_qk]")
    _check_4d(v, "v", "[b, hkv, skv, d_v]")
    _check_like(k, q, "k")
    _check_like(v, q, "v")
    b, hq, sq, d_qk = q.shape
    hkv, skv, d_v = k.shape[1], k.shape[2], v.shape[3]
    if k.shape[0] != b or k.shape[3] != d_qk or hkv == 0 or hq % hkv:
        raise ValueError(f"k: expected [{b}, hkv, skv, {d_qk}] with hkv dividing hq = {hq}, got shape "
                         f"{tuple(k.shape)}")
    if tuple(v.shape[:3]) != (b, hkv, skv):
        raise ValueError(f"v: expected [{b}, {hkv}, {skv}, d_v] (as k), got shape {tuple(v.shape)}")
    if skv == 0 or d_qk == 0 or d_v == 0:
        raise ValueError(f"k/v: expected at least one key and non-empty head dims, got k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a value in [0, 1), got {dropout_p}")
    if (seqlens_q is None) != (seqlens_kv is None):
        raise ValueError("seqlens_q/seqlens_kv: expected both or neither (padding mask)")
    for t, arg in ((seqlens_q, "seqlens_q"), (seqlens_kv, "seqlens_kv")):
        if t is None:
            continue
        if t.device != q.device:
            raise ValueError(f"{arg}: expected a tensor on {q.device}, got one on {t.device}")
        if t.dtype != torch.int32:
            raise TypeError(f"{arg}: expected an int32 tensor, got {t.dtype}")
        if t.dim() != 1 or t.shape[0] != b or not t.is_contiguous():
            raise ValueError(f"{arg}: expected a contiguous [{b}] tensor, got shape {tuple(t.shape)} strides "
                             f"{t.stride()}")
    if dropout_p > 0:
        if rng_state is None:
            raise ValueError("rng_state: required with dropout_p > 0 (int64 [2]: philox seed, offset)")
        if rng_state.device != q.device:
            raise ValueError(f"rng_state: expected a tensor on {q.device}, got one on {rng_state.device}")
        if rng_state.dtype != torch.int64 or rng_state.numel() != 2 or not rng_state.is_contiguous():
            raise ValueError(f"rng_state: expected a contiguous int64 tensor of 2 elements (seed, offset), got "
                             f"{rng_state.dtype} of shape {tuple(rng_state.shape)}")
    return b, hq, hkv, sq, skv, d_v


def _allowed(b, sq, skv, causal, seqlens_q, seqlens_kv):
    """bool [b, 1, sq, skv]: True where query i may attend key j."""
    allowed = torch.ones(b, 1, sq, skv, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(sq, skv, dtype=torch.bool).tril()
    if seqlens_q is not None:
        rows = torch.arange(sq).view(1, 1, sq, 1) < seqlens_q.view(b, 1, 1, 1)
        cols = torch.arange(skv).view(1, 1, 1, skv) < seqlens_kv.view(b, 1, 1, 1)
        allowed &= rows & cols
    return allowed


def _dropout_keep(shape, dropout_p, rng_state):
    """Scaled keep mask (0 or 1 / (1 - p)) of the probabilities, float32, from rng_state's own CPU generator."""
    if dropout_p == 0:
        return None
    seed, offset = (int(x) for x in rng_state.tolist())
    generator = torch.Generator().manual_seed((seed * 1000003 + offset) % 2**63)
    keep = torch.rand(shape, generator=generator) >= dropout_p
    return keep.float() / (1.0 - dropout_p)


def _expand_heads(t, groups):
    """[b, hkv, s, d] -> [b, hkv * groups, s, d]: query head i reads kv head i // groups."""
    return t.repeat_interleave(groups, dim=1)


def _probabilities(q, k, scale, allowed):
    """(P float32 [b, hq, sq, skv] with rows of no allowed key zero, stats [b, hq, sq, 1] (0 on such rows))."""
    groups = q.shape[1] // k.shape[1]
    scores = (q.float() @ _expand_heads(k.float(), groups).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    any_allowed = allowed.any(-1, keepdim=True)
    stats = torch.where(any_allowed, scores.logsumexp(-1, keepdim=True), torch.zeros(()))
    probs = torch.where(allowed, (scores - stats).exp(), torch.zeros(()))
    return probs, stats


@register("fused_attn_fwd")
def fused_attn_fwd(q, k, v, scale, causal=False, dropout_p=0.0, seqlens_q=None, seqlens_kv=None, rng_state=None):
    b, hq, hkv, sq, skv, d_v = _check_inputs(q, k, v, dropout_p, seqlens_q, seqlens_kv, rng_state)
    allowed = _allowed(b, sq, skv, causal, seqlens_q, seqlens_kv)
    probs, stats = _probabilities(q, k, scale, allowed)
    keep = _dropout_keep(probs.shape, dropout_p, rng_state)
    if keep is not None:
        probs = probs * keep
    out = dense_in_order_of(q, (b, hq, sq, d_v))
    out.copy_(probs @ _expand_heads(v.float(), hq // hkv))
    return out, stats.contiguous()


@register("fused_attn_bwd")
def fused_attn_bwd(grad_out, q, k, v, out, stats, dq, dk, dv, scale, causal=False, dropout_p=0.0, seqlens_q=None,
                   seqlens_kv=None, rng_state=None):
    """dS = P * (dP - rowsum(dO * O)), dq = dS k * scale, dk = dSᵀ q * scale, dv = (P * keep)ᵀ dO, with P recomputed
    from q, k and the masks, and the kv-head gradients summed over their query heads."""
    b, hq, hkv, sq, skv, d_v = _check_inputs(q, k, v, dropout_p, seqlens_q, seqlens_kv, rng_state)
    for t, arg in ((grad_out, "grad_out"), (out, "out")):
        _check_4d(t, arg, "[b, hq, sq, d_v]")
        _check_like(t, q, arg)
        if tuple(t.shape) != (b, hq, sq, d_v):
            raise ValueError(f"{arg}: expected shape {(b, hq, sq, d_v)}, got {tuple(t.shape)}")
    _check_stats(stats, q, (b, hq, sq, 1))
    for grad, like, arg in ((dq, q, "dq"), (dk, k, "dk"), (dv, v, "dv")):
        _check_4d(grad, arg, "(the shape of its input)")
        _check_like(grad, q, arg)
        if grad.shape != like.shape:
            raise ValueError(f"{arg}: expected shape {tuple(like.shape)}, got {tuple(grad.shape)}")
    groups = hq // hkv
    allowed = _allowed(b, sq, skv, causal, seqlens_q, seqlens_kv)
    probs, _ = _probabilities(q, k, scale, allowed)
    keep = _dropout_keep(probs.shape, dropout_p, rng_state)
    dropped = probs if keep is None else probs * keep
    g, o = grad_out.float(), out.float()
    d_dropped = g @ _expand_heads(v.float(), groups).transpose(-1, -2)
    d_probs = d_dropped if keep is None else d_dropped * keep
    d_scores = probs * (d_probs - (g * o).sum(-1, keepdim=True)) * scale
    dq.copy_(d_scores @ _expand_heads(k.float(), groups))
    dk.copy_((d_scores.transpose(-1, -2) @ q.float()).unflatten(1, (hkv, groups)).sum(2))
    dv.copy_((dropped.transpose(-1, -2) @ g).unflatten(1, (hkv, groups)).sum(2))
