"""split_qkv_rope (split + RoPE on q and k in one node, q, k, v views of one new buffer) equals the separate
split_qkv + apply_rotary_pos_emb, forward and backward, bit for bit; its in-place backward for a qkv-like gradient;
MultiheadAttention / TransformerLayer with and without it."""
import weakref

import pytest
import torch

import transformer_fp8 as te
from transformer_fp8.attention.cudnn import grad_views, shared_grad_layout
from transformer_fp8.attention.qkv_split import rope_split_fits, split_qkv, split_qkv_rope
from transformer_fp8.attention.rope import apply_rotary_pos_emb

LAYOUTS = [(False, 8, 2), (False, 4, 4), (True, 4, 4)]  # (interleaved, heads, groups)


def unfused(qkv, h, g, d, interleaved, q_freqs, k_freqs, fmt):
    q, k, v = split_qkv(qkv, h, g, d, interleaved)
    return apply_rotary_pos_emb(q, q_freqs, fmt), apply_rotary_pos_emb(k, k_freqs, fmt), v.contiguous()


def make(fmt, h, g, d=16, dtype=torch.bfloat16, rot_dim=16, seed=0, device="cpu"):
    torch.manual_seed(seed)
    qkv = torch.randn(5, 3, (h + 2 * g) * d, dtype=dtype, device=device)
    q_freqs = torch.rand(7, 1, 1, rot_dim, device=device) * 40
    return qkv, q_freqs, q_freqs * 0.7 + 1.0  # (k's angles differ from q's: each must use its own)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved,heads,groups", LAYOUTS)
@pytest.mark.parametrize("dtype,rot_dim", [(torch.bfloat16, 16), (torch.float32, 8)])
def test_matches_unfused_bitwise(fmt, interleaved, heads, groups, dtype, rot_dim):
    qkv, qf, kf = make(fmt, heads, groups, dtype=dtype, rot_dim=rot_dim)
    a, b = qkv.clone().requires_grad_(), qkv.clone().requires_grad_()
    ours = split_qkv_rope(a, heads, groups, 16, interleaved, qf, kf, fmt)
    ref = unfused(b, heads, groups, 16, interleaved, qf, kf, fmt)
    assert ours[0]._base is ours[1]._base is ours[2]._base
    weights = [torch.randn_like(t) for t in ref]
    for x, y in zip(ours, ref):
        assert torch.equal(x, y)
    sum((x * w).sum() for x, w in zip(ours, weights)).backward()
    sum((y * w).sum() for y, w in zip(ref, weights)).backward()
    assert torch.equal(a.grad, b.grad)


def _to_bhsd(t, fmt):
    return t.permute(1, 2, 0, 3) if fmt == "sbhd" else t.transpose(1, 2)


def _from_bhsd(t, fmt):
    return t.permute(2, 0, 1, 3) if fmt == "sbhd" else t.transpose(1, 2)


class _QKVLikeGrad(torch.autograd.Function):
    """Identity on (q, k, v) whose backward hands on the incoming gradients as views of ONE qkv-like buffer, made as
    the cuDNN attention backward makes its dq, dk, dv (cudnn.shared_grad_layout over the [b, h, s, d] views)."""

    @staticmethod
    def forward(ctx, q, k, v, fmt):
        ctx.layout, ctx.fmt = shared_grad_layout(*(_to_bhsd(t, fmt) for t in (q, k, v))), fmt
        assert ctx.layout is not None
        return q.clone(), k.clone(), v.clone()

    @staticmethod
    def backward(ctx, dq, dk, dv):
        views = [_from_bhsd(t, ctx.fmt) for t in grad_views(ctx.layout, dq.dtype, dq.device)]
        for view, grad in zip(views, (dq, dk, dv)):
            view.copy_(grad)
        _QKVLikeGrad.buffer = views[0]._base
        return (*views, None)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved,heads,groups", LAYOUTS)
def test_qkv_like_gradient_is_rotated_in_place_and_returned(fmt, interleaved, heads, groups):
    qkv, qf, kf = make(fmt, heads, groups)
    a, b = qkv.clone().requires_grad_(), qkv.clone().requires_grad_()
    ours = _QKVLikeGrad.apply(*split_qkv_rope(a, heads, groups, 16, interleaved, qf, kf, fmt), fmt)
    ref = unfused(b, heads, groups, 16, interleaved, qf, kf, fmt)
    weights = [torch.randn_like(t) for t in ref]
    sum((x * w).sum() for x, w in zip(ours, weights)).backward()
    sum((y * w).sum() for y, w in zip(ref, weights)).backward()
    assert torch.equal(a.grad, b.grad)
    assert a.grad.data_ptr() == _QKVLikeGrad.buffer.data_ptr()  # (that buffer became dqkv: no copy)


def test_missing_gradients_are_zeros():
    qkv, qf, kf = make("sbhd", 8, 2)
    a, b = qkv.clone().requires_grad_(), qkv.clone().requires_grad_()
    q, _, v = split_qkv_rope(a, 8, 2, 16, False, qf, kf, "sbhd")
    q2, _, v2 = unfused(b, 8, 2, 16, False, qf, kf, "sbhd")
    (q.float().sum() + v.float().square().sum()).backward()
    (q2.float().sum() + v2.float().square().sum()).backward()
    assert torch.equal(a.grad, b.grad)


def test_qkv_is_freed_and_the_fit_rules():
    qkv, qf, kf = make("sbhd", 8, 2)
    leaf = qkv.requires_grad_()
    out = leaf * 1.0
    alive = weakref.ref(out)
    q, k, v = split_qkv_rope(out, 8, 2, 16, False, qf, kf, "sbhd")
    del out
    assert alive() is None
    assert rope_split_fits(leaf * 1.0, 8, 2, False, False, "sbhd")
    assert not rope_split_fits(leaf * 1.0, 8, 2, True, False, "sbhd")  # interleaved GQA: q is no strided view
    assert not rope_split_fits(leaf * 1.0, 8, 2, False, True, "sbhd")  # folded
    assert not rope_split_fits(qkv.detach(), 8, 2, False, False, "sbhd")  # no gradient: inference keeps its path
    with torch.no_grad():
        assert not rope_split_fits(leaf * 1.0, 8, 2, False, False, "sbhd")
    with pytest.raises(ValueError, match="q_freqs: no gradient flows to the angles"):
        split_qkv_rope(leaf * 1.0, 8, 2, 16, False, qf.requires_grad_(), kf, "sbhd")


def _layer_pair(device, fmt, interleaved):
    torch.manual_seed(3)
    kwargs = dict(hidden_size=128, ffn_hidden_size=256, num_attention_heads=8, num_gqa_groups=2,
                  hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm", activation="swiglu",
                  bias=False, self_attn_mask_type="causal", attn_input_format=fmt, params_dtype=torch.bfloat16,
                  device=device)
    if interleaved is not None:
        kwargs["qkv_weight_interleaved"] = interleaved
    a = te.TransformerLayer(**kwargs)
    b = te.TransformerLayer(**kwargs)
    b.load_state_dict(a.state_dict())
    b.self_attention.fused_rope_split = False
    return a, b


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_transformer_layer_with_and_without(device, fmt):
    """The layer's output and every gradient equal with the fused split + RoPE and without (the non-interleaved
    [q | k | v] layout, GQA, as convert_llama makes it), in BF16 and under FP8 autocast (CUDA)."""
    a, b = _layer_pair(device, fmt, interleaved=False)
    x = torch.randn(32, 2, 128, dtype=torch.bfloat16, device=device)
    freqs = te.RotaryPositionEmbedding(16)(32).to(device)
    fp8 = device == "cuda"
    outs = []
    for layer in (a, b):
        xi = x.clone().requires_grad_()
        with te.fp8_autocast(enabled=fp8):
            out = layer(xi, rotary_pos_emb=freqs)
        out.float().square().mean().backward()
        outs.append((out, xi.grad, [p.grad for p in layer.parameters()]))
    (out_a, dx_a, grads_a), (out_b, dx_b, grads_b) = outs
    assert torch.equal(out_a, out_b)
    assert torch.equal(dx_a, dx_b)
    for ga, gb in zip(grads_a, grads_b):
        assert torch.equal(ga, gb)
