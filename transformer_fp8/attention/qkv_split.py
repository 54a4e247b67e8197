"""Split of a fused QKV projection output into q, k, v with a lean backward.

qkv [*lead, (h + 2g) * d] -> q [*lead, h, d], k [*lead, g, d], v [*lead, g, d]. Column order: interleaved per
group [h/g q heads, k, v] (TE's default), else [all q | all k | all v]. q, k and v are views of qkv, except for
interleaved GQA: there q cannot be a view (its heads are not evenly spaced) and is a copy, and k and v are copies too
(as views they would keep all of qkv alive for attention's backward, the q part included: for the gqa benchmark
layer 384 MiB instead of 128). Unless fold=True (interleaved GQA, sbhd): with the g groups folded into the batch,
q [s, b * g, h/g, d], k and v [s, b * g, 1, d] are all views (the b and g strides merge), nothing is copied, and
attention over them is the same as over b * g sequences of h/g query heads sharing one kv head each.
The backward writes dq, dk, dv into ONE new qkv-shaped gradient with three strided copies, where autograd's own
slicing backward would zero-fill a full-size gradient per output and sum them (for the guide layer: 3 fills,
3 copies and 2 adds of 192 MiB). When dq, dk, dv arrive as the q, k, v views of
one gradient laid out like qkv (the cuDNN attention backend writes them so), that gradient is returned: no copies.
split_qkv_rope does the split and RoPE on q and k in one node whose q, k, v are views of one new qkv-like buffer, so
that the same holds with RoPE (its backward rotates dq and dk back in place).
"""
import torch

from ..ops import tfp8


def _parts(qkv, heads, groups, head_dim, interleaved, fold=False):
    """Views of qkv: (q part, k, v); the q part is [*lead, g, h/g, d] when interleaved, else [*lead, h, d]. fold
    (interleaved, lead [s, b]): q [s, b * g, h/g, d], k and v [s, b * g, 1, d]."""
    lead = qkv.shape[:-1]
    if fold:
        per_group = qkv.view(lead[0], lead[1] * groups, heads // groups + 2, head_dim)
        return per_group[:, :, :-2], per_group[:, :, -2:-1], per_group[:, :, -1:]
    if interleaved:
        per_group = qkv.view(*lead, groups, heads // groups + 2, head_dim)
        return per_group[..., :-2, :], per_group[..., -2, :], per_group[..., -1, :]
    q, k, v = qkv.split([heads * head_dim, groups * head_dim, groups * head_dim], dim=-1)
    return q.view(*lead, heads, head_dim), k.view(*lead, groups, head_dim), v.view(*lead, groups, head_dim)


def _wide(t):
    """t [..., d] (d contiguous) viewed with 16-byte elements, or None where its layout does not allow it."""
    if t.stride(-1) != 1 or (t.shape[-1] * t.element_size()) % 16:
        return None
    try:
        return t.view(torch.complex128)
    except RuntimeError:  # a stride or offset that is not a multiple of 16 bytes
        return None


def _copy(dst, src):
    """dst.copy_(src) for same-dtype [..., d] tensors. PyTorch's strided copy moves one element per step; as 16-byte
    elements (8 BF16 values) it runs near memory bandwidth."""
    wide_dst, wide_src = _wide(dst), _wide(src)
    if wide_dst is None or wide_src is None or dst.dtype != src.dtype:
        dst.copy_(src)
    else:
        wide_dst.copy_(wide_src)


def _copied(t, shape):
    out = torch.empty(shape, dtype=t.dtype, device=t.device)
    _copy(out.view(t.shape), t)
    return out


def _outputs(qkv, heads, groups, head_dim, interleaved, fold):
    """(q [*lead, h, d], k, v): views of qkv, or all three copies for interleaved GQA unless folded (see the module
    docstring)."""
    q, k, v = _parts(qkv, heads, groups, head_dim, interleaved, fold)
    if fold:
        return q, k, v
    if interleaved and heads != groups:
        return _copied(q, (*qkv.shape[:-1], heads, head_dim)), _copied(k, k.shape), _copied(v, v.shape)
    return q.reshape(*qkv.shape[:-1], heads, head_dim), k, v


def _same_view(a, b):
    return a.shape == b.shape and a.stride() == b.stride() and a.data_ptr() == b.data_ptr()


def _fused_gradient(dq, dk, dv, qkv_shape, heads, groups, head_dim, interleaved, fold):
    """The qkv-shaped gradient itself when dq, dk, dv are already the q, k, v views of one buffer laid out like qkv
    (the cuDNN attention backward writes them so), else None."""
    if dq is None or dk is None or dv is None or dq._base is None or not dq._base is dk._base is dv._base:
        return None
    base = dq._base
    if not base.is_contiguous() or base.numel() != qkv_shape.numel():
        return None
    dqkv = base.view(qkv_shape)
    q_part, k_part, v_part = _parts(dqkv, heads, groups, head_dim, interleaved, fold)
    if interleaved and heads != groups and not fold:
        return None  # q is a copy there, never a view
    # (interleaved MHA: the q part [*lead, h, 1, d] -> [*lead, h, d])
    q_view = q_part.squeeze(-2) if interleaved and not fold else q_part
    if _same_view(q_view, dq) and _same_view(k_part, dk) and _same_view(v_part, dv):
        return dqkv
    return None


class _SplitQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, heads, groups, head_dim, interleaved, fold):
        ctx.set_materialize_grads(False)
        ctx.args = (qkv.shape, heads, groups, head_dim, interleaved, fold)
        return _outputs(qkv, heads, groups, head_dim, interleaved, fold)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        qkv_shape, heads, groups, head_dim, interleaved, fold = ctx.args
        fused = _fused_gradient(dq, dk, dv, qkv_shape, heads, groups, head_dim, interleaved, fold)
        if fused is not None:
            return fused, None, None, None, None, None
        some = next(g for g in (dq, dk, dv) if g is not None)
        dqkv = some.new_empty(qkv_shape)
        q_part, k_part, v_part = _parts(dqkv, heads, groups, head_dim, interleaved, fold)
        if dq is not None and interleaved and not fold:
            dq = dq.unflatten(-2, (groups, heads // groups))
        for part, grad in ((q_part, dq), (k_part, dk), (v_part, dv)):
            part.zero_() if grad is None else _copy(part, grad)
        return dqkv, None, None, None, None, None


def split_qkv(qkv, heads, groups, head_dim, interleaved, fold=False):
    """qkv [*lead, (heads + 2 * groups) * head_dim] -> (q [*lead, heads, d], k [*lead, groups, d], v likewise);
    fold=True (interleaved, qkv [s, b, ...]): q [s, b * groups, heads / groups, d], k and v [s, b * groups, 1, d],
    all views of qkv."""
    if fold and not (interleaved and qkv.dim() == 3):
        raise ValueError(f"fold: needs the interleaved layout and qkv [s, b, (h + 2g) * d], got interleaved="
                         f"{interleaved}, qkv {tuple(qkv.shape)}")
    if not qkv.requires_grad or not torch.is_grad_enabled():
        return _outputs(qkv, heads, groups, head_dim, interleaved, fold)
    return _SplitQKV.apply(qkv, heads, groups, head_dim, interleaved, fold)


def rope_split_fits(qkv, heads, groups, interleaved, fold, tensor_format):
    """Whether split_qkv_rope takes this case: a fused QKV output in training (grad enabled, qkv requires grad),
    q a strided view of it (the [q | k | v] layout, or interleaved without GQA), not folded, sbhd / bshd."""
    return (torch.is_grad_enabled() and qkv.requires_grad and not fold and qkv.dim() == 3 and qkv.is_contiguous()
            and not (interleaved and heads != groups) and tensor_format in ("sbhd", "bshd"))


def _q_view(part, interleaved):
    """The q part of _parts as [*lead, h, d] (interleaved MHA: [*lead, h, 1, d] -> [*lead, h, d])."""
    return part.squeeze(-2) if interleaved else part


class _SplitQKVRope(torch.autograd.Function):
    """split_qkv_rope: RoPE'd q and k, and v, written into ONE new buffer laid out like qkv; the backward rotates dq
    and dk back in place when they arrive as views of one qkv-like gradient (cuDNN's backward writes them so: then
    that gradient is dqkv, nothing is copied), else into a new dqkv."""

    @staticmethod
    def forward(ctx, qkv, heads, groups, head_dim, interleaved, q_freqs, k_freqs, tensor_format):
        ctx.set_materialize_grads(False)
        ctx.args = (qkv.shape, heads, groups, head_dim, interleaved, tensor_format)
        ctx.save_for_backward(q_freqs, k_freqs)
        out = torch.empty_like(qkv)
        q_in, k_in, v_in = _parts(qkv, heads, groups, head_dim, interleaved)
        q_out, k_out, v_out = _parts(out, heads, groups, head_dim, interleaved)
        q_in, q_out = _q_view(q_in, interleaved), _q_view(q_out, interleaved)
        tfp8.rope_fwd_into(q_in, q_freqs, tensor_format, False, q_out)
        tfp8.rope_fwd_into(k_in, k_freqs, tensor_format, False, k_out)
        _copy(v_out, v_in)
        return q_out, k_out, v_out

    @staticmethod
    def backward(ctx, dq, dk, dv):
        qkv_shape, heads, groups, head_dim, interleaved, tensor_format = ctx.args
        q_freqs, k_freqs = ctx.saved_tensors
        none = (None,) * 7
        fused = _fused_gradient(dq, dk, dv, qkv_shape, heads, groups, head_dim, interleaved, False)
        if fused is not None:  # (in place: this gradient buffer was made for this backward by the attention's)
            tfp8.rope_bwd_into(dq, q_freqs, tensor_format, False, dq)
            tfp8.rope_bwd_into(dk, k_freqs, tensor_format, False, dk)
            return (fused, *none)
        some = next(g for g in (dq, dk, dv) if g is not None)
        dqkv = some.new_empty(qkv_shape)
        q_part, k_part, v_part = _parts(dqkv, heads, groups, head_dim, interleaved)
        q_part = _q_view(q_part, interleaved)
        for part, grad, freqs in ((q_part, dq, q_freqs), (k_part, dk, k_freqs)):
            if grad is None:
                part.zero_()
            else:
                grad = grad if grad.stride(-1) == 1 else grad.contiguous()  # (e.g. expanded, from a sum)
                tfp8.rope_bwd_into(grad, freqs, tensor_format, False, part)
        v_part.zero_() if dv is None else _copy(v_part, dv)
        return (dqkv, *none)


def split_qkv_rope(qkv, heads, groups, head_dim, interleaved, q_freqs, k_freqs, tensor_format):
    """split_qkv then RoPE on q and k (apply_rotary_pos_emb's rotation, non-interleaved pairs) in one autograd node:
    q, k (rotated) and v come back as views of ONE new buffer laid out like qkv (so attention's backward can write one
    qkv-like gradient, rotated back in place: no copies), the memory of the three separate tensors the unfused path
    makes. Only where rope_split_fits(...) says so. q_freqs, k_freqs: float32 angles [>= s, 1 or b, 1, rot_dim]."""
    for name, freqs in (("q_freqs", q_freqs), ("k_freqs", k_freqs)):
        if freqs.requires_grad:
            raise ValueError(f"{name}: no gradient flows to the angles; pass {name}.detach()")
    q_freqs, k_freqs = (f.float() if f.stride(-1) == 1 else f.float().contiguous() for f in (q_freqs, k_freqs))
    return _SplitQKVRope.apply(qkv, heads, groups, head_dim, interleaved, q_freqs, k_freqs, tensor_format)
