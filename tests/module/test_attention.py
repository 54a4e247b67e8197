"""DotProductAttention and RoPE against float64 references written out in plain PyTorch.

CPU: the float32 math path. GPU: the fused cuDNN / FlashAttention / memory-efficient kernels in BF16, the warned
math fallback, and a profiler check that no case we support lands on the unfused path.
"""
import warnings

import pytest
import torch
from torch.nn.attention import SDPBackend

from tests.utils import check_against_float64, rel_error
from transformer_fp8.attention import sdpa as attention_module
from transformer_fp8.module import attention_cudnn
from transformer_fp8.module.attention import ATTN_MASK_TYPES, DotProductAttention
from transformer_fp8.module.rope import RotaryPositionEmbedding, apply_rotary_pos_emb

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
FUSED_OPS = ("aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_flash_attention",
             "aten::_scaled_dot_product_efficient_attention", "transformer_fp8::fused_attn_fwd")
MATH_OP = "aten::_scaled_dot_product_attention_math"


def work_dtype(device):
    return torch.float32 if device == "cpu" else torch.bfloat16


def tolerance(device):
    return 1e-5 if device == "cpu" else 2e-2


def to_bhsd(t, fmt):
    return {"sbhd": lambda: t.permute(1, 2, 0, 3), "bshd": lambda: t.transpose(1, 2), "bhsd": lambda: t}[fmt]()


def reference_attention(q, k, v, mask_type, pad_mask, scale, fmt):
    """Float64 softmax(q kᵀ scale + mask) v with k/v heads repeated for GQA; output [s, b, h*d], [b, s, h*d] or
    [b, h, s, d] (fmt sbhd, bshd, bhsd)."""
    q, k, v = (to_bhsd(t.double(), fmt) for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * scale
    allowed = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device)
    if "causal" in mask_type:
        allowed = allowed.tril()
    if "padding" in mask_type:
        allowed = allowed & ~pad_mask
    out = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
    if fmt == "bhsd":
        return out
    out = out.permute(2, 0, 1, 3) if fmt == "sbhd" else out.transpose(1, 2)
    return out.reshape(*out.shape[:2], -1)


def random_padding_mask(b, skv, device):
    """bool [b, 1, 1, skv], True = masked out; every row keeps 1 .. skv keys (one row keeps all)."""
    lengths = torch.randint(1, skv + 1, (b,), device=device)
    lengths[0] = skv
    return (torch.arange(skv, device=device) >= lengths[:, None]).view(b, 1, 1, skv)


def make_qkv(fmt, b, sq, skv, heads, groups, d, dtype, device):
    def shaped(s, h):
        shape = {"sbhd": (s, b, h, d), "bshd": (b, s, h, d), "bhsd": (b, h, s, d)}[fmt]
        return torch.randn(shape, device=device).to(dtype).requires_grad_()
    return shaped(sq, heads), shaped(skv, groups), shaped(skv, groups)


def check_against_reference(device, fmt, mask_type, heads, groups, b, s, d, dtype, scale=None):
    q, k, v = make_qkv(fmt, b, s, s, heads, groups, d, dtype, device)
    pad_mask = random_padding_mask(b, s, device) if "padding" in mask_type else None
    dpa = DotProductAttention(heads, d, num_gqa_groups=groups, attn_mask_type=mask_type, qkv_format=fmt,
                              softmax_scale=scale)
    out = dpa(q, k, v, attention_mask=pad_mask)
    assert out.dtype == dtype and out.shape == (q.shape if fmt == "bhsd" else (*q.shape[:2], heads * d))
    tol = tolerance(device)
    check_against_float64(out, (q, k, v), lambda *qkv: reference_attention(*qkv, mask_type, pad_mask,
                                                                          dpa.softmax_scale, fmt), tol, 2 * tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_type", ATTN_MASK_TYPES)
@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "bhsd"])
@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("b,s,d", [(2, 17, 32), (3, 64, 64)])
def test_matches_reference(device, mask_type, fmt, heads, groups, b, s, d):
    check_against_reference(device, fmt, mask_type, heads, groups, b, s, d, work_dtype(device))


@pytest.mark.parametrize("device", DEVICES)
def test_softmax_scale_and_float32_inputs(device):
    """A custom softmax_scale; float32 inputs give float32 outputs (computed in bf16 on the GPU)."""
    check_against_reference(device, "sbhd", "causal", 4, 2, 2, 33, 64, torch.float32, scale=0.3)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("mask_type", ATTN_MASK_TYPES)
def test_large_head_dims_cuda(d, mask_type):
    check_against_reference("cuda", "bshd", mask_type, 8, 2, 2, 128, d, torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("mask_type", ATTN_MASK_TYPES)
@pytest.mark.parametrize("groups", [8, 2])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_cuda_runs_a_fused_kernel(mask_type, groups, d, dropout):
    """Every supported case runs a fused kernel (our cuDNN ops, or PyTorch's cuDNN, FlashAttention or
    memory-efficient attention), never math, with no unfused-math warning."""
    q, k, v = make_qkv("sbhd", 2, 256, 256, 8, groups, d, torch.bfloat16, "cuda")
    pad_mask = random_padding_mask(2, 256, "cuda") if "padding" in mask_type else None
    dpa = DotProductAttention(8, d, num_gqa_groups=groups, attn_mask_type=mask_type, attention_dropout=dropout)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dpa(q, k, v, attention_mask=pad_mask).sum().backward()
    names = {event.name for event in prof.events()}
    assert any(op in names for op in FUSED_OPS), sorted(n for n in names if "attention" in n)
    assert MATH_OP not in names
    assert not [w for w in caught if "unfused math" in str(w.message)]


@pytest.mark.gpu
def test_cuda_fallback_warns_once_and_is_correct(monkeypatch):
    """The torch backend with FlashAttention as its only fused backend: a padding mask cannot be fused, one warning,
    then math."""
    monkeypatch.setattr(attention_module, "FUSED_BACKENDS", [SDPBackend.FLASH_ATTENTION])
    monkeypatch.setattr(attention_module, "_warned_cases", set())
    q, k, v = make_qkv("sbhd", 2, 64, 64, 4, 4, 64, torch.bfloat16, "cuda")
    pad_mask = random_padding_mask(2, 64, "cuda")
    dpa = DotProductAttention(4, 64, attn_mask_type="padding", attention_backend="torch")
    with pytest.warns(UserWarning, match="unfused math attention.*Reasons: .*[Ff]lash"):
        out = dpa(q, k, v, attention_mask=pad_mask)
    ref = reference_attention(q, k, v, "padding", pad_mask, dpa.softmax_scale, "sbhd")
    assert rel_error(out, ref) <= 2e-2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dpa(q, k, v, attention_mask=pad_mask)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_statistics(device, p):
    """q = k = 0 gives uniform probabilities 1/s and v = one-hot rows, so every output element is one kept or
    dropped probability: dropped ones are 0, kept ones 1 / (s (1 - p)), and the dropped fraction is about p."""
    b, h, s = 4, 4, 64
    dtype = work_dtype(device)
    q = torch.zeros(s, b, h, s, dtype=dtype, device=device)
    v = torch.eye(s, dtype=dtype, device=device)[:, None, None, :].expand(s, b, h, s).contiguous()
    dpa = DotProductAttention(h, s, attention_dropout=p, attn_mask_type="no_mask")
    torch.manual_seed(7)
    out = dpa(q, q, v).float()
    dropped = (out == 0).float().mean().item()
    assert abs(dropped - p) < 0.01
    kept = out[out != 0]
    assert torch.allclose(kept, torch.full_like(kept, 1 / (s * (1 - p))), rtol=1e-2)
    torch.manual_seed(7)
    assert torch.equal(dpa(q, q, v).float(), out), "same seed, same dropout mask"
    dpa.eval()
    assert torch.allclose(dpa(q, q, v).float(), torch.full_like(out, 1 / s), rtol=1e-2)


@pytest.mark.parametrize("zeroed", [False, True])
def test_cudnn_gradient_buffers_take_their_inputs_layout(zeroed):
    """The cuDNN backward's dq, dk, dv: views of one buffer laid out like a fused QKV's, else each laid out like its
    own input (sbhd views here): autograd then hands them to the sbhd tensors without a layout copy."""
    qkv = torch.randn(8, 2, 3 * 4 * 16).view(8, 2, 3, 4, 16).permute(1, 3, 0, 2, 4)  # [b, h, s, 3, d] views
    fused = attention_cudnn._grad_buffers(*(qkv[..., i, :] for i in range(3)), zeroed)
    assert fused[0].untyped_storage().data_ptr() == fused[2].untyped_storage().data_ptr()
    separate = [torch.randn(8, 2, h, 16).permute(1, 2, 0, 3) for h in (4, 2, 2)]  # sbhd tensors as [b, h, s, d]
    separate[2] = torch.randn(8, 2, 2, 32)[..., :16].permute(1, 2, 0, 3)  # not dense: dense in the same dim order
    for t, grad in zip(separate, attention_cudnn._grad_buffers(*separate, zeroed)):
        order = sorted(range(4), key=lambda i: -t.stride(i))
        assert grad.shape == t.shape and grad.is_contiguous() is False
        assert sorted(range(4), key=lambda i: -grad.stride(i)) == order
        assert grad.permute(order).is_contiguous()
        assert not zeroed or not grad.any()


def test_bad_inputs():
    q, k, v = make_qkv("sbhd", 2, 8, 8, 4, 2, 16, torch.float32, "cpu")
    dpa = DotProductAttention(4, 16, num_gqa_groups=2)
    with pytest.raises(ValueError, match="query_layer"):
        dpa(q[..., :8], k, v)
    with pytest.raises(ValueError, match="key_layer"):
        DotProductAttention(4, 16, num_gqa_groups=4)(q, k, v)
    with pytest.raises(TypeError, match="value_layer"):
        dpa(q, k, v.double())
    with pytest.raises(ValueError, match="attention_mask"):
        dpa(q, k, v, attention_mask=torch.zeros(2, 1, 1, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="attention_mask"):
        dpa(q, k, v, attn_mask_type="padding")
    with pytest.raises(ValueError, match="attention_mask"):
        dpa(q, k, v, attention_mask=torch.zeros(2, 1, 1, 7, dtype=torch.bool), attn_mask_type="padding")
    with pytest.raises(ValueError, match="attn_mask_type"):
        DotProductAttention(4, 16, attn_mask_type="arbitrary")
    with pytest.raises(ValueError, match="qkv_format"):
        DotProductAttention(4, 16, qkv_format="tbhd")
    with pytest.raises(ValueError, match="num_gqa_groups"):
        DotProductAttention(4, 16, num_gqa_groups=3)
    with pytest.raises(ValueError, match="kv_channels"):
        DotProductAttention(4, 512)
    with pytest.raises(NotImplementedError, match="tp_size"):
        DotProductAttention(4, 16, tp_size=2)
    bhsd = DotProductAttention(4, 16, num_gqa_groups=2, qkv_format="bhsd")
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    with pytest.raises(ValueError, match="query_layer: expected a 4-D bhsd tensor with 4 heads"):
        bhsd(q, kb, vb)  # (an sbhd q: 2 heads in bhsd's heads dim)
    with pytest.raises(ValueError, match="key_layer/value_layer"):
        bhsd(qb, kb, vb[:, :, :7])


@pytest.mark.parametrize("device", DEVICES)
def test_bhsd_equals_sbhd(device):
    """qkv_format "bhsd" (SDPA's layout) on the bhsd views of sbhd tensors: the sbhd result, as [b, h, s, d], and the
    same gradients; cuDNN on CUDA (its default backend) for both."""
    s, b, h, g, d = 64, 2, 8, 2, 64
    dtype = work_dtype(device)
    q, k, v = make_qkv("sbhd", b, s, s, h, g, d, dtype, device)
    dy = torch.randn(s, b, h * d, device=device, dtype=dtype)
    out = DotProductAttention(h, d, num_gqa_groups=g, attn_mask_type="causal")(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dy)
    bhsd = DotProductAttention(h, d, num_gqa_groups=g, attn_mask_type="causal", qkv_format="bhsd")
    out_bhsd = bhsd(*(to_bhsd(t, "sbhd") for t in (q, k, v)))
    assert out_bhsd.shape == (b, h, s, d)
    assert torch.equal(out_bhsd.permute(2, 0, 1, 3).reshape(s, b, h * d), out)
    grads_bhsd = torch.autograd.grad(out_bhsd, (q, k, v), to_bhsd(dy.view(s, b, h, d), "sbhd"))
    for got, want in zip(grads_bhsd, grads):
        assert rel_error(got, want) <= (1e-6 if device == "cpu" else 1e-2)


# --- RoPE ---

def rope_formula(t, positions, rot_dim, base, fmt):
    """Float64, pair by pair: channels (i, i + rot_dim/2) at position p rotate by p * base**(-2i/rot_dim)."""
    t = t.double()
    out = t.clone()
    half = rot_dim // 2
    for i in range(half):
        theta = positions.double() * base ** (-2 * i / rot_dim)
        theta = theta.view(-1, 1, 1) if fmt == "sbhd" else theta.view(1, -1, 1)
        cos, sin = theta.cos(), theta.sin()
        x1, x2 = t[..., i], t[..., i + half]
        out[..., i], out[..., i + half] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
@pytest.mark.parametrize("interpolation", [None, 4.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_formula(device, fmt, rotary_percent, interpolation, dtype):
    s, b, h, d = 13, 3, 2, 32
    t = torch.randn((s, b, h, d) if fmt == "sbhd" else (b, s, h, d), device=device).to(dtype)
    rope = RotaryPositionEmbedding(d, rotary_percent=rotary_percent, seq_len_interpolation_factor=interpolation,
                                   device=device)
    freqs = rope(s + 5)  # longer than needed: apply uses the first s positions
    assert freqs.shape == (s + 5, 1, 1, int(d * rotary_percent))
    out = apply_rotary_pos_emb(t, freqs, fmt)
    positions = torch.arange(s, device=device) / (interpolation or 1.0)
    ref = rope_formula(t, positions, int(d * rotary_percent), 10000.0, fmt)
    assert out.dtype == dtype
    assert rel_error(out, ref) <= (1e-6 if dtype == torch.float32 else 1e-2)


def test_rope_offset_and_bad_inputs():
    rope = RotaryPositionEmbedding(16)
    assert torch.allclose(rope(4, offset=3), rope(7)[3:])
    with pytest.raises(ValueError, match="dim"):
        RotaryPositionEmbedding(15)
    t = torch.randn(8, 1, 1, 16)
    with pytest.raises(ValueError, match="freqs"):
        apply_rotary_pos_emb(t, rope(4))
    with pytest.raises(ValueError, match="tensor_format"):
        apply_rotary_pos_emb(t, rope(8), "thd")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal"])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "bhsd"])
def test_padding_from_cu_seqlens_equals_the_mask(device, mask_type, fmt):
    """TE's cu_seqlens for padded sbhd/bshd/bhsd batches: the same result as the equivalent bool attention_mask."""
    b, s, heads, d = 3, 12, 4, 16
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = make_qkv(fmt, b, s, s, heads, heads, d, dtype, device)
    lengths = torch.tensor([12, 5, 1], dtype=torch.int32, device=device)
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0, dtype=torch.int32)])
    mask = (torch.arange(s, device=device) >= lengths[:, None]).view(b, 1, 1, s)
    dpa = DotProductAttention(heads, d, attn_mask_type=mask_type, qkv_format=fmt)
    with torch.no_grad():
        assert torch.equal(dpa(q, k, v, cu_seqlens_q=cu), dpa(q, k, v, attention_mask=mask))
        assert torch.equal(dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu), dpa(q, k, v, attention_mask=mask))
        with pytest.raises(ValueError, match="attention_mask"):
            dpa(q, k, v, attention_mask=mask, cu_seqlens_q=cu)
        with pytest.raises(ValueError, match="cu_seqlens_kv"):
            dpa(q, k, v, cu_seqlens_kv=cu.long())
        with pytest.raises(ValueError, match="cu_seqlens_q"):
            dpa(q, k, v, cu_seqlens_q=cu[:-1])
        with pytest.raises(ValueError, match="max_seqlen_q"):
            dpa(q, k, v, cu_seqlens_q=cu, max_seqlen_q=12)


@pytest.mark.parametrize("mask_type", ["causal", "no_mask"])
def test_gqa_groups_folded_equals_unfolded(mask_type):
    """gqa_groups_folded: q [s, b*g, h/g, d], k, v [s, b*g, 1, d] (the GQA groups folded into the batch) give the
    output of the unfolded tensors (the same float32 math per head); bad shapes and arguments are errors naming
    them."""
    s, b, h, g, d = 7, 3, 8, 2, 16
    q, k, v = make_qkv("sbhd", b, s, s, h, g, d, torch.float32, "cpu")
    folded = (q.reshape(s, b * g, h // g, d), k.reshape(s, b * g, 1, d), v.reshape(s, b * g, 1, d))
    dpa = DotProductAttention(h, d, num_gqa_groups=g, attn_mask_type=mask_type)
    out = dpa(*folded, gqa_groups_folded=True)
    assert out.shape == (s, b, h * d)
    assert rel_error(out, dpa(q, k, v)) <= 1e-6
    with pytest.raises(ValueError, match="query_layer/key_layer/value_layer"):
        dpa(q, k, v, gqa_groups_folded=True)
    for bad in (dict(attn_mask_type="padding"), dict(qkv_format="bshd"),
                dict(attention_mask=torch.zeros(b, 1, 1, s, dtype=torch.bool))):
        with pytest.raises(ValueError, match="gqa_groups_folded"):
            dpa(*folded, gqa_groups_folded=True, **bad)
