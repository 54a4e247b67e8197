"""DotProductAttention with qkv_format "thd" (packed variable-length sequences) against a float64 per-sequence
reference written out in plain PyTorch.

CPU: the per-sequence float32 math loop. GPU: FlashAttention varlen (torch's varlen_attn) in BF16, and the warned
per-sequence fallback for the cases it cannot take.
"""
import warnings

import pytest
import torch

from tests.utils import check_against_float64, rel_error
from transformer_fp8.module import MultiheadAttention, attention_varlen
from transformer_fp8.module.attention import DotProductAttention

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
VARLEN_FORWARD = "aten::_flash_attention_forward"
# (q lengths, kv lengths); None = the same as q (one cu_seqlens tensor)
LENGTHS = [([5], None), ([1, 7, 33, 64, 2], None), ([1, 1, 6, 1], None), ([3, 1, 20, 9], [5, 9, 20, 1]),
           ([16, 3], [2, 40])]


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(attention_varlen, "_warned_reasons", set())


def work_dtype(device):
    return torch.float32 if device == "cpu" else torch.bfloat16


def tolerance(device):
    return 1e-5 if device == "cpu" else 2e-2


def cu_seqlens(lengths, device):
    return torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)


def reference_attention(q, k, v, lengths_q, lengths_kv, causal, scale):
    """Float64, sequence by sequence: softmax(q kᵀ scale) v, k/v heads repeated, causal top-left; [total_q, h*d]."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    outs, q0, k0 = [], 0, 0
    for lq, lkv in zip(lengths_q, lengths_kv):
        qi = q[q0:q0 + lq].transpose(0, 1)
        ki, vi = (t[k0:k0 + lkv].transpose(0, 1).repeat_interleave(groups, 0) for t in (k, v))
        scores = qi @ ki.transpose(-1, -2) * scale
        if causal:
            scores = scores.masked_fill(~torch.ones(lq, lkv, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        outs.append((scores.softmax(-1) @ vi).transpose(0, 1))
        q0, k0 = q0 + lq, k0 + lkv
    out = torch.cat(outs)
    return out.reshape(out.shape[0], -1)


def make_packed(lengths_q, lengths_kv, heads, groups, d, dtype, device):
    def packed(tokens, h):
        return torch.randn(tokens, h, d, device=device).to(dtype).requires_grad_()
    return packed(sum(lengths_q), heads), packed(sum(lengths_kv), groups), packed(sum(lengths_kv), groups)


def check_against_reference(device, mask_type, heads, groups, d, lengths_q, lengths_kv, dtype, **forward_kw):
    same = lengths_kv is None
    lengths_kv = lengths_q if same else lengths_kv
    q, k, v = make_packed(lengths_q, lengths_kv, heads, groups, d, dtype, device)
    cu_q = cu_seqlens(lengths_q, device)
    cu_kv = cu_q if same else cu_seqlens(lengths_kv, device)
    dpa = DotProductAttention(heads, d, num_gqa_groups=groups, attn_mask_type=mask_type, qkv_format="thd")
    out = dpa(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, **forward_kw)
    assert out.dtype == dtype and out.shape == (q.shape[0], heads * d)
    tol = tolerance(device)
    check_against_float64(out, (q, k, v), lambda *qkv: reference_attention(*qkv, lengths_q, lengths_kv,
                                                                          "causal" in mask_type, dpa.softmax_scale),
                          tol, 2 * tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal"])
@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("lengths_q,lengths_kv", LENGTHS)
def test_matches_reference(device, mask_type, heads, groups, d, lengths_q, lengths_kv):
    check_against_reference(device, mask_type, heads, groups, d, lengths_q, lengths_kv, work_dtype(device))


@pytest.mark.parametrize("device", DEVICES)
def test_given_max_seqlen_and_float32_inputs(device):
    """max_seqlen given (no host sync on CUDA); float32 inputs give float32 outputs (bf16 kernel on the GPU)."""
    check_against_reference(device, "padding_causal", 8, 2, 64, [3, 30, 12], None, torch.float32,
                            max_seqlen_q=32, max_seqlen_kv=32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("thd_type,same_as", [("no_mask", "padding"), ("causal", "padding_causal")])
def test_mask_type_aliases(device, thd_type, same_as):
    """With thd, "no_mask" means "padding" and "causal" means "padding_causal": cu_seqlens always bound sequences."""
    q, k, v = make_packed([4, 9], [4, 9], 2, 2, 64, work_dtype(device), device)
    cu = cu_seqlens([4, 9], device)
    dpa = DotProductAttention(2, 64, qkv_format="thd")
    out = dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, attn_mask_type=thd_type)
    assert torch.equal(out, dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, attn_mask_type=same_as))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_type,bshd_mask_type", [("padding", "no_mask"), ("padding_causal", "causal")])
def test_equal_lengths_match_bshd(device, mask_type, bshd_mask_type):
    """b sequences of one length packed = the bshd path on [b, s, h, d] with no padding."""
    b, s, h, g, d = 3, 24, 4, 2, 64
    q, k, v = (torch.randn(b, s, heads, d, device=device).to(work_dtype(device)) for heads in (h, g, g))
    dpa = DotProductAttention(h, d, num_gqa_groups=g)
    bshd = dpa(q, k, v, qkv_format="bshd", attn_mask_type=bshd_mask_type)
    cu = cu_seqlens([s] * b, device)
    thd = dpa(*(t.flatten(0, 1) for t in (q, k, v)), qkv_format="thd", cu_seqlens_q=cu, attn_mask_type=mask_type)
    assert thd.shape == (b * s, h * d)
    assert rel_error(thd, bshd.flatten(0, 1)) <= (1e-6 if device == "cpu" else 1e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_statistics(device):
    """q = k = 0 gives uniform probabilities 1/s and v = one-hot rows, so every output element is one kept (1 / (s (1 -
    p))) or dropped (0) probability. On CUDA dropout takes the warned per-sequence path; eval mode has no dropout."""
    b, h, s, p = 3, 4, 64, 0.25
    dtype = work_dtype(device)
    q = torch.zeros(b * s, h, s, dtype=dtype, device=device)
    v = torch.eye(s, dtype=dtype, device=device).repeat(b, 1)[:, None, :].expand(b * s, h, s).contiguous()
    cu = cu_seqlens([s] * b, device)
    dpa = DotProductAttention(h, s, attention_dropout=p, attn_mask_type="padding", qkv_format="thd")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = dpa(q, q, v, cu_seqlens_q=cu).float()
    assert any("dropout" in str(w.message) for w in caught) == (device == "cuda")
    assert abs((out == 0).float().mean().item() - p) < 0.02
    kept = out[out != 0]
    assert torch.allclose(kept, torch.full_like(kept, 1 / (s * (1 - p))), rtol=1e-2)
    dpa.eval()
    assert torch.allclose(dpa(q, q, v, cu_seqlens_q=cu).float(), torch.full_like(out, 1 / s), rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal"])
@pytest.mark.parametrize("groups", [8, 2])
@pytest.mark.parametrize("max_given", [False, True])
def test_cuda_runs_flash_varlen(mask_type, groups, max_given):
    """Supported cases run FlashAttention varlen forward and backward, with no warning."""
    lengths = [100, 1, 37, 256]
    q, k, v = make_packed(lengths, lengths, 8, groups, 128, torch.bfloat16, "cuda")
    cu = cu_seqlens(lengths, "cuda")
    dpa = DotProductAttention(8, 128, num_gqa_groups=groups, attn_mask_type=mask_type, qkv_format="thd")
    max_kw = dict(max_seqlen_q=256, max_seqlen_kv=256) if max_given else {}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, **max_kw)
    names = {event.name for event in prof.events()}
    assert VARLEN_FORWARD in names, sorted(n for n in names if "attention" in n)
    assert not [w for w in caught if "thd" in str(w.message)]
    out.sum().backward()
    assert all(t.grad.isfinite().all() for t in (q, k, v))


@pytest.mark.gpu
def test_cuda_causal_cross_lengths_warn_once():
    """Causal with q length != kv length needs top-left alignment, which FlashAttention varlen does not give: one
    warning, then the per-sequence path (its correctness: test_matches_reference)."""
    q, k, v = make_packed([4, 8], [8, 8], 2, 2, 64, torch.bfloat16, "cuda")
    dpa = DotProductAttention(2, 64, attn_mask_type="padding_causal", qkv_format="thd")
    kw = dict(cu_seqlens_q=cu_seqlens([4, 8], "cuda"), cu_seqlens_kv=cu_seqlens([8, 8], "cuda"))
    with pytest.warns(UserWarning, match="bottom-right"):
        dpa(q, k, v, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dpa(q, k, v, **kw)


def test_bad_inputs():
    q, k, v = make_packed([3, 5], [3, 5], 4, 2, 16, torch.float32, "cpu")
    cu = cu_seqlens([3, 5], "cpu")
    dpa = DotProductAttention(4, 16, num_gqa_groups=2, qkv_format="thd")
    bad_calls = [
        ("cu_seqlens_q", dict(cu_seqlens_q=None)),
        ("cu_seqlens_q", dict(cu_seqlens_q=cu.long())),
        ("cu_seqlens_kv", dict(cu_seqlens_kv=cu.float())),
        ("cu_seqlens_q", dict(cu_seqlens_q=cu[None])),
        ("cu_seqlens_kv", dict(cu_seqlens_kv=torch.tensor([0, 6, 2, 8], dtype=torch.int32))),
        ("cu_seqlens_kv", dict(cu_seqlens_kv=torch.tensor([0, 3, 3, 8], dtype=torch.int32))),  # batch + 1 differs
        ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([0, 5, 3, 8], dtype=torch.int32))),   # not monotonic
        ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([1, 3, 8], dtype=torch.int32))),      # not from 0
        ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32))),      # last != tokens
        ("cu_seqlens_kv", dict(cu_seqlens_kv=torch.tensor([0, 3, 9], dtype=torch.int32))),
        ("max_seqlen_q", dict(max_seqlen_q=4)),
        ("attention_mask", dict(attention_mask=torch.zeros(2, 1, 1, 5, dtype=torch.bool))),
    ]
    for name, kw in bad_calls:
        with pytest.raises(ValueError, match=name):
            dpa(q, k, v, **{"cu_seqlens_q": cu, "cu_seqlens_kv": cu, **kw})
    with pytest.raises(ValueError, match="cu_seqlens_kv"):  # a query sequence with no keys
        dpa(q, k[:5], v[:5], cu_seqlens_q=cu, cu_seqlens_kv=torch.tensor([0, 0, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="query_layer"):
        dpa(q[None], k, v, cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="key_layer"):
        dpa(q, k[:, :1], v, cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="key_layer"):  # cu_seqlens_kv defaults to cu_seqlens_q: same token count
        dpa(q, k[:7], v[:7], cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="value_layer"):
        dpa(q, k, v[:7], cu_seqlens_q=cu, cu_seqlens_kv=cu)
    with pytest.raises(TypeError, match="value_layer"):
        dpa(q, k, v.double(), cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        DotProductAttention(4, 16, num_gqa_groups=2)(q[None], k[None], v[None], qkv_format="bshd", cu_seqlens_q=cu)
    for fmt in ("thd", "bhsd"):  # (DotProductAttention's formats only)
        with pytest.raises(NotImplementedError, match="qkv_format"):
            MultiheadAttention(64, 4, qkv_format=fmt, device="cpu")
