"""fused_attn_fwd / fused_attn_bwd: the CPU reference vs float64 math attention, opcheck, argument errors, the
autograd glue of DotProductAttention's cudnn backend (on the CPU reference); on the GPU (cuDNN) vs float64 for every
mask / GQA / layout / head dim, dropout statistics and replay, the fused dqkv buffer, the module vs its torch backend
and the fallback."""
import warnings

import pytest
import torch

import transformer_fp8  # noqa: F401  (registers the ops)
from tests.utils import assert_close_rel
from transformer_fp8 import DotProductAttention, MultiheadAttention
from transformer_fp8.module import attention_cudnn, qkv_split
from transformer_fp8.module.attention_cudnn import _grad_buffers, cudnn_attention

ops = torch.ops.transformer_fp8
LAYOUTS = ("bshd", "sbhd", "bhsd")
MASKS = ("no_mask", "causal", "padding", "padding_causal")
# CPU reference (float32 math) vs float64: one rounding of the result to the io dtype.
CPU_RTOL = {torch.bfloat16: 6e-3, torch.float16: 1e-3}
# cuDNN vs float64: flash attention rounds the probabilities (and dS in the backward) to the io dtype.
CUDA_OUT_RTOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
CUDA_GRAD_RTOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2}
cudnn_built = pytest.mark.skipif(not attention_cudnn.cudnn_attention_built(),
                                 reason="transformer_fp8 was built without the attention family")


def make_qkv(layout, b, hq, hkv, sq, skv, d, dtype, device="cpu", d_v=None):
    """q [b, hq, sq, d], k [b, hkv, skv, d], v [b, hkv, skv, d_v] as the [b, h, s, d] views DotProductAttention makes:
    of one fused QKV buffer [*lead, (hq + 2 hkv) d] in "bshd" / "sbhd" (when sq == skv and d_v == d), of separate
    tensors in that layout otherwise; "bhsd": contiguous tensors."""
    d_v = d_v or d

    def to_bhsd(t):
        return t.permute(1, 2, 0, 3) if layout == "sbhd" else t.transpose(1, 2)

    if layout == "bhsd":
        return (torch.randn(b, hq, sq, d, dtype=dtype, device=device), torch.randn(b, hkv, skv, d, dtype=dtype,
                device=device), torch.randn(b, hkv, skv, d_v, dtype=dtype, device=device))
    lead = (lambda s: (s, b)) if layout == "sbhd" else (lambda s: (b, s))
    if sq == skv and d_v == d:
        qkv = torch.randn(*lead(sq), (hq + 2 * hkv) * d, dtype=dtype, device=device)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        return tuple(to_bhsd(t.unflatten(-1, (-1, d))) for t in (q, k, v))
    return tuple(to_bhsd(torch.randn(*lead(s), h, dd, dtype=dtype, device=device))
                 for s, h, dd in ((sq, hq, d), (skv, hkv, d), (skv, hkv, d_v)))


def random_seqlens(b, sq, skv, device="cpu"):
    """int32 [b] lengths in [1, s], the last sequence full."""
    lq = torch.randint(1, sq + 1, (b,), dtype=torch.int32)
    lkv = torch.randint(1, skv + 1, (b,), dtype=torch.int32)
    lq[-1], lkv[-1] = sq, skv
    return lq.to(device), lkv.to(device)


def ref_attention(q, k, v, scale, causal=False, seqlens_q=None, seqlens_kv=None, keep=None):
    """float64 softmax(q kᵀ scale + mask) [* keep] v, query head i on kv head i // (hq / hkv); rows with no key, and
    query rows past seqlens_q, are zero. -> (out, logsumexp [b, hq, sq, 1])."""
    b, hq, sq, _ = q.shape
    groups, skv = hq // k.shape[1], k.shape[2]
    q, k, v = q.double(), k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    allowed = torch.ones(b, 1, sq, skv, dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed & torch.ones(sq, skv, dtype=torch.bool, device=q.device).tril()
    if seqlens_q is not None:
        i, j = torch.arange(sq, device=q.device), torch.arange(skv, device=q.device)
        allowed = allowed & (i.view(1, 1, sq, 1) < seqlens_q.view(b, 1, 1, 1).to(q.device))
        allowed = allowed & (j.view(1, 1, 1, skv) < seqlens_kv.view(b, 1, 1, 1).to(q.device))
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    lse = scores.logsumexp(-1, keepdim=True)
    probs = torch.nan_to_num((scores - lse).exp(), nan=0.0)
    if keep is not None:
        probs = probs * keep
    return probs @ v, lse


def ref_grads(grad_out, q, k, v, scale, **mask):
    """float64 (dq, dk, dv) of ref_attention by autograd."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, _ = ref_attention(*leaves, scale, **mask)
    return torch.autograd.grad(out, leaves, grad_out.double())


def run_op(q, k, v, scale, mask_type, seqlens=None, dropout_p=0.0, rng_state=None, grad_out=None):
    """fused_attn_fwd (+ fused_attn_bwd into zeroed buffers when grad_out is given) -> (out, stats, grads or None)."""
    causal = "causal" in mask_type
    seqlens_q, seqlens_kv = seqlens if "padding" in mask_type else (None, None)
    out, stats = ops.fused_attn_fwd(q, k, v, scale, causal, dropout_p, seqlens_q, seqlens_kv, rng_state)
    if grad_out is None:
        return out, stats, None
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    ops.fused_attn_bwd(grad_out, q, k, v, out, stats, *grads, scale, causal, dropout_p, seqlens_q, seqlens_kv,
                       rng_state)
    return out, stats, grads


def mask_kwargs(mask_type, seqlens):
    padding = "padding" in mask_type
    return dict(causal="causal" in mask_type, seqlens_q=seqlens[0] if padding else None,
                seqlens_kv=seqlens[1] if padding else None)


def check_against_float64(q, k, v, mask_type, out_rtol, grad_rtol, stats_rtol):
    b, hq, sq, _ = q.shape
    scale = q.shape[-1] ** -0.5
    seqlens = random_seqlens(b, sq, k.shape[2], q.device)
    grad_out = torch.randn(b, hq, sq, v.shape[-1], dtype=q.dtype, device=q.device)
    out, stats, grads = run_op(q, k, v, scale, mask_type, seqlens, grad_out=grad_out)
    kw = mask_kwargs(mask_type, seqlens)
    ref_out, ref_lse = ref_attention(q, k, v, scale, **kw)
    assert out.dtype == q.dtype and out.shape == ref_out.shape
    order = sorted(range(3), key=lambda i: -q.stride(i))
    assert out.permute(*order, 3).is_contiguous(), f"out strides {out.stride()} not in q's dim order {q.stride()}"
    assert_close_rel(out, ref_out, out_rtol)
    rows = ref_lse.isfinite()
    if kw["seqlens_q"] is not None:
        rows = rows & (torch.arange(sq, device=q.device).view(1, 1, sq, 1) < kw["seqlens_q"].view(b, 1, 1, 1))
        assert not out.masked_select(~rows).any(), "out rows past seqlens_q must be zero"
    assert stats.dtype == torch.float32 and stats.shape == (b, hq, sq, 1) and stats.is_contiguous()
    assert_close_rel(stats[rows], ref_lse[rows], stats_rtol, "stats")
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, ref_grads(grad_out, q, k, v, scale, **kw)):
        assert_close_rel(grad, ref, grad_rtol, name)


# ----------------------------------------------------------------------------------------------------- CPU reference
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mask_type", MASKS)
@pytest.mark.parametrize("hq,hkv", ((4, 4), (4, 2), (4, 1)))
@pytest.mark.parametrize("sq,skv", ((7, 7), (5, 9)))
def test_cpu_reference_matches_float64(dtype, layout, mask_type, hq, hkv, sq, skv):
    q, k, v = make_qkv(layout, 3, hq, hkv, sq, skv, 16, dtype)
    check_against_float64(q, k, v, mask_type, CPU_RTOL[dtype], 2 * CPU_RTOL[dtype], 1e-5)


def test_cpu_reference_value_head_dim_differs():
    q, k, v = make_qkv("bshd", 2, 4, 2, 6, 8, 16, torch.bfloat16, d_v=8)
    check_against_float64(q, k, v, "causal", CPU_RTOL[torch.bfloat16], 2 * CPU_RTOL[torch.bfloat16], 1e-5)


def dropout_keep_mask(q, k, rng_state, dropout_p):
    """The scaled keep mask the op applies under rng_state, read off a forward with v = identity (skv == d_v):
    out = P * keep."""
    b, hkv, skv, _ = k.shape
    eye = torch.eye(skv, dtype=q.dtype, device=q.device).expand(b, hkv, skv, skv).contiguous()
    probe, _ = ops.fused_attn_fwd(q, k, eye, q.shape[-1] ** -0.5, False, dropout_p, None, None, rng_state)
    return (probe != 0).double() / (1 - dropout_p)


def check_dropout(device, b, h, s, d, dtype, dropout_p, out_rtol, grad_rtol):
    """Statistics, replay and backward of dropout: the mask read off a v = identity probe is applied by the forward
    with any v and by the backward (both vs float64 with that mask); equal rng_state -> equal mask."""
    q, k, v = make_qkv("bshd", b, h, h, s, s, d, dtype, device)
    scale = d ** -0.5
    rng_state = torch.tensor([1234, 56], dtype=torch.int64, device=device)
    keep = dropout_keep_mask(q, k, rng_state, dropout_p)
    dropped = (keep == 0).double().mean().item()
    assert abs(dropped - dropout_p) < 0.02, f"dropped fraction {dropped:.4f}, expected {dropout_p}"
    assert torch.equal(keep, dropout_keep_mask(q, k, rng_state, dropout_p)), "same rng_state, another mask"
    other = torch.tensor([1235, 56], dtype=torch.int64, device=device)
    assert not torch.equal(keep, dropout_keep_mask(q, k, other, dropout_p)), "another seed, the same mask"
    grad_out = torch.randn(b, h, s, d, dtype=dtype, device=device)
    out, _, grads = run_op(q, k, v, scale, "no_mask", dropout_p=dropout_p, rng_state=rng_state, grad_out=grad_out)
    assert_close_rel(out, ref_attention(q, k, v, scale, keep=keep)[0], out_rtol)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = ref_attention(*leaves, scale, keep=keep)
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(ref_out, leaves, grad_out.double())):
        assert_close_rel(grad, ref, grad_rtol, name)


def test_cpu_dropout_mask_statistics_replay_and_backward():
    check_dropout("cpu", 2, 4, 64, 64, torch.bfloat16, 0.2, CPU_RTOL[torch.bfloat16], 2 * CPU_RTOL[torch.bfloat16])


def test_cpu_empty_queries():
    q, k, v = make_qkv("bhsd", 2, 4, 2, 0, 5, 16, torch.bfloat16)
    out, stats, grads = run_op(q, k, v, 0.25, "causal", grad_out=torch.zeros(2, 4, 0, 16, dtype=torch.bfloat16))
    assert out.shape == (2, 4, 0, 16) and stats.shape == (2, 4, 0, 1)
    assert not grads[1].any() and not grads[2].any()


def opcheck_args(device):
    q, k, v = make_qkv("sbhd", 2, 4, 2, 8, 8, 16, torch.bfloat16, device)
    seqlens_q, seqlens_kv = random_seqlens(2, 8, 8, device)
    rng_state = torch.tensor([7, 0], dtype=torch.int64, device=device)
    out, stats = ops.fused_attn_fwd(q, k, v, 0.25, True)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    return [
        ("fused_attn_fwd", (q, k, v, 0.25, True)),
        ("fused_attn_fwd", (q, k, v, 0.25, False, 0.1, seqlens_q, seqlens_kv, rng_state)),
        ("fused_attn_bwd", (torch.randn_like(out), q, k, v, out, stats, *grads, 0.25, True)),
    ]


def test_opcheck_cpu():
    for name, args in opcheck_args("cpu"):
        torch.library.opcheck(getattr(ops, name).default, args)


def _bad(device):
    q, k, v = make_qkv("bhsd", 2, 4, 2, 8, 8, 16, torch.bfloat16, device)
    lens = torch.full((2,), 8, dtype=torch.int32, device=device)
    out, stats = torch.zeros(2, 4, 8, 16, dtype=torch.bfloat16, device=device), torch.zeros(2, 4, 8, 1, device=device)
    g = [torch.zeros_like(t) for t in (q, k, v)]

    def bwd(grad_out=out, stats=stats, dq=g[0], dk=g[1]):
        ops.fused_attn_bwd(grad_out, q, k, v, out, stats, dq, dk, g[2], 0.25)

    return [
        (lambda: ops.fused_attn_fwd(q.float(), k, v, 0.25), "q: expected a float16 or bfloat16"),
        (lambda: ops.fused_attn_fwd(q[0], k, v, 0.25), r"q: expected a 4-D tensor \[b, hq, sq, d_qk\]"),
        (lambda: ops.fused_attn_fwd(q.transpose(2, 3), k, v, 0.25), "q: expected a contiguous last dim"),
        (lambda: ops.fused_attn_fwd(q, k.half(), v, 0.25), r"k: expected \S+ \(as q\), got"),
        (lambda: ops.fused_attn_fwd(q, k[:, :1].expand(2, 3, 8, 16), v, 0.25), "k: expected .*hkv dividing hq = 4"),
        (lambda: ops.fused_attn_fwd(q, k, v[:, :, :4], 0.25), r"v: expected \[2, 2, 8, d_v\]"),
        (lambda: ops.fused_attn_fwd(q, k[:, :, :0], v[:, :, :0], 0.25), "k/v: expected at least one key"),
        (lambda: ops.fused_attn_fwd(q, k, v, 0.25, False, 1.0), r"dropout_p: expected a value in \[0, 1\)"),
        (lambda: ops.fused_attn_fwd(q, k, v, 0.25, False, 0.1), "rng_state: required with dropout_p > 0"),
        (lambda: ops.fused_attn_fwd(q, k, v, 0.25, False, 0.1, None, None, lens[:1].long()), "rng_state: expected"),
        (lambda: ops.fused_attn_fwd(q, k, v, 0.25, False, 0.0, lens), "seqlens_q/seqlens_kv: expected both"),
        (lambda: ops.fused_attn_fwd(q, k, v, 0.25, False, 0.0, lens.long(), lens), "seqlens_q: expected an int32"),
        (lambda: ops.fused_attn_fwd(q, k, v, 0.25, False, 0.0, lens, lens[:1]), r"seqlens_kv: expected a contiguous"),
        (lambda: bwd(grad_out=out[:, :2]), r"grad_out: expected shape \(2, 4, 8, 16\)"),
        (lambda: bwd(stats=stats.double()), "stats: expected a float32"),
        (lambda: bwd(stats=stats[..., 0]), r"stats: expected .*shape \(2, 4, 8, 1\)"),
        (lambda: bwd(dq=g[1]), r"dq: expected .*shape \(2, 4, 8, 16\)"),
        (lambda: bwd(dk=g[1].half()), r"dk: expected \S+ \(as q\), got"),
    ]


@pytest.mark.parametrize("case", range(len(_bad("cpu"))))
def test_bad_inputs_raise(case):
    call, match = _bad("cpu")[case]
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        call()


# ------------------------------------------------------------------------- the cudnn backend's glue (on the CPU op)
def test_grad_buffers_share_one_buffer_for_fused_qkv_views():
    q, k, v = make_qkv("sbhd", 2, 4, 2, 6, 6, 8, torch.bfloat16)
    grads = _grad_buffers(q, k, v, zeroed=False)
    assert len({g.untyped_storage().data_ptr() for g in grads}) == 1
    for g, t in zip(grads, (q, k, v)):
        assert g.shape == t.shape and g.stride() == t.stride()
        assert g.storage_offset() == t.storage_offset() - q.storage_offset()
    # the same tensor three times (overlapping views) must not share one gradient buffer
    same = _grad_buffers(q, q, q, zeroed=True)
    assert len({g.untyped_storage().data_ptr() for g in same}) == 3 and not any(g.any() for g in same)


@cudnn_built
@pytest.mark.parametrize("interleaved,heads,groups,fold", ((False, 4, 2, False), (True, 4, 4, False),
                                                          (True, 4, 2, False), (True, 4, 2, True)))
def test_fused_qkv_gradient_without_copies(monkeypatch, interleaved, heads, groups, fold):
    """cudnn_attention (on the CPU op) on split_qkv's views: the qkv gradient is the buffer the attention backward
    wrote (no copies) where q is a view (interleaved GQA: with the groups folded into the batch), and equals the
    float64 gradient."""
    returned = []
    real = qkv_split._fused_gradient
    monkeypatch.setattr(qkv_split, "_fused_gradient", lambda *a: returned.append(real(*a)) or returned[-1])
    s, b, d = 6, 2, 8
    qkv = torch.randn(s, b, (heads + 2 * groups) * d, dtype=torch.bfloat16, requires_grad=True)
    q, k, v = (t.permute(1, 2, 0, 3) for t in qkv_split.split_qkv(qkv, heads, groups, d, interleaved, fold))
    out = cudnn_attention(q, k, v, None, "causal", 0.0, d ** -0.5)  # (folded: [b * g, h/g, s, d])
    grad_out = torch.randn(b, heads, s, d, dtype=torch.bfloat16)
    out.backward(grad_out.view(b * groups, heads // groups, s, d) if fold else grad_out)
    assert (returned[0] is not None) == (not interleaved or heads == groups or fold)
    leaf = qkv.detach().double().requires_grad_()
    ref_q, ref_k, ref_v = (t.permute(1, 2, 0, 3) for t in qkv_split.split_qkv(leaf, heads, groups, d, interleaved))
    ref_out, _ = ref_attention(ref_q, ref_k, ref_v, d ** -0.5, causal=True)
    ref_out.backward(grad_out.double())
    assert_close_rel(out.reshape(b, heads, s, d), ref_out, 2 * CPU_RTOL[torch.bfloat16], "out")
    assert_close_rel(qkv.grad, leaf.grad, 2 * CPU_RTOL[torch.bfloat16], "d(qkv)")


@cudnn_built
@pytest.mark.parametrize("fmt", ("sbhd", "bshd"))
def test_cudnn_attention_takes_the_module_format_without_layout_nodes(fmt):
    """cudnn_attention (on the CPU op) on sbhd / bshd tensors: output [s, b, h*d] / [b, s, h*d] whose autograd node
    is the attention's own node (the layout views are taken inside it), values and gradients as float64."""
    s, b, h, g, d = 5, 2, 4, 2, 8
    lead = (s, b) if fmt == "sbhd" else (b, s)
    q, k, v = (torch.randn(*lead, heads, d, dtype=torch.bfloat16, requires_grad=True) for heads in (h, g, g))
    out = cudnn_attention(q, k, v, None, "causal", 0.0, 0.3, qkv_format=fmt)
    assert out.shape == (*lead, h * d) and out.is_contiguous()
    assert out.grad_fn.name() == "FusedAttentionBackward"  # (the C++ node: see test_attention_native_node.py)
    assert all(type(fn).__name__ == "AccumulateGrad" for fn, _ in out.grad_fn.next_functions if fn is not None)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    to_bhsd = (lambda t: t.permute(1, 2, 0, 3)) if fmt == "sbhd" else (lambda t: t.transpose(1, 2))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = ref_attention(*map(to_bhsd, leaves), 0.3, causal=True)
    ref = (ref.permute(2, 0, 1, 3) if fmt == "sbhd" else ref.transpose(1, 2)).reshape(out.shape)
    ref.backward(grad_out.double())
    assert_close_rel(out, ref, CPU_RTOL[torch.bfloat16], "out")
    for name, t, r in zip("qkv", (q, k, v), leaves):
        assert t.grad.stride() == t.stride()
        assert_close_rel(t.grad, r.grad, 2 * CPU_RTOL[torch.bfloat16], f"d{name}")


@cudnn_built
def test_cudnn_attention_key_padding_mask_to_seqlens():
    b, h, s, d = 3, 2, 7, 8
    q, k, v = make_qkv("bshd", b, h, h, s, s, d, torch.bfloat16)
    lens = torch.tensor([3, 7, 1])
    mask = (torch.arange(s) >= lens.view(b, 1)).view(b, 1, 1, s)
    out = cudnn_attention(q, k, v, mask, "padding", 0.0, 0.3)
    ref, _ = ref_attention(q, k, v, 0.3, seqlens_q=torch.full((b,), s), seqlens_kv=lens)
    assert_close_rel(out, ref, CPU_RTOL[torch.bfloat16])


@cudnn_built
@pytest.mark.parametrize("mask,why", (
    ("scattered", "not a key-padding prefix mask"),
    ("per_query", "per-query masks have no cuDNN form"),
    ("empty_sequence", "at least one kept key per sequence"),
))
def test_cudnn_attention_refuses_masks_without_seqlens_form(monkeypatch, mask, why):
    monkeypatch.setattr(attention_cudnn, "_warned_reasons", set())
    b, h, s, d = 2, 2, 6, 8
    q, k, v = make_qkv("bshd", b, h, h, s, s, d, torch.bfloat16)
    attention_mask = {
        "scattered": torch.tensor([[0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1]], dtype=torch.bool).view(b, 1, 1, s),
        "per_query": torch.zeros(b, 1, s, s, dtype=torch.bool),
        "empty_sequence": torch.tensor([[1] * 6, [0] * 6], dtype=torch.bool).view(b, 1, 1, s),
    }[mask]
    with pytest.warns(UserWarning, match=why):
        assert cudnn_attention(q, k, v, attention_mask, "padding", 0.0, 0.3) is None


def test_attention_backend_choice(monkeypatch):
    monkeypatch.delenv("TFP8_ATTENTION_BACKEND", raising=False)
    default = "cudnn" if attention_cudnn.cudnn_attention_built() else "torch"
    assert DotProductAttention(2, 8).attention_backend == default
    monkeypatch.setenv("TFP8_ATTENTION_BACKEND", "torch")
    assert DotProductAttention(2, 8).attention_backend == "torch"
    assert DotProductAttention(2, 8, attention_backend="cudnn").attention_backend == "cudnn"
    monkeypatch.setenv("TFP8_ATTENTION_BACKEND", "cudnn")
    assert DotProductAttention(2, 8).attention_backend == "cudnn"
    with pytest.raises(ValueError, match="attention_backend: expected one of"):
        DotProductAttention(2, 8, attention_backend="flash")
    monkeypatch.setenv("TFP8_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match="TFP8_ATTENTION_BACKEND: expected one of"):
        DotProductAttention(2, 8)


# --------------------------------------------------------------------------------------------------- CUDA (cuDNN)
gpu = [pytest.mark.gpu, cudnn_built]


@pytest.mark.gpu
@cudnn_built
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mask_type", MASKS)
@pytest.mark.parametrize("hq,hkv", ((8, 8), (8, 2), (8, 1)))
def test_cuda_matches_float64(dtype, layout, mask_type, hq, hkv):
    q, k, v = make_qkv(layout, 2, hq, hkv, 128, 128, 128, dtype, "cuda")
    check_against_float64(q, k, v, mask_type, CUDA_OUT_RTOL[dtype], CUDA_GRAD_RTOL[dtype], 1e-3)


@pytest.mark.gpu
@cudnn_built
@pytest.mark.parametrize("d", (64, 128, 256))
@pytest.mark.parametrize("mask_type", ("causal", "padding_causal"))
@pytest.mark.parametrize("sq,skv", ((128, 128), (64, 192), (192, 64), (100, 77)))
def test_cuda_head_dims_and_cross_lengths(d, mask_type, sq, skv):
    q, k, v = make_qkv("sbhd", 2, 8, 2, sq, skv, d, torch.bfloat16, "cuda")
    check_against_float64(q, k, v, mask_type, CUDA_OUT_RTOL[torch.bfloat16], CUDA_GRAD_RTOL[torch.bfloat16], 1e-3)


@pytest.mark.gpu
@cudnn_built
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_cuda_dropout_mask_statistics_replay_and_backward(dtype):
    check_dropout("cuda", 2, 4, 128, 128, dtype, 0.2, CUDA_OUT_RTOL[dtype], CUDA_GRAD_RTOL[dtype])


@pytest.mark.gpu
@cudnn_built
def test_cuda_fused_dqkv_buffer_matches_float64():
    """dq, dk, dv written straight into one buffer laid out like the fused QKV (the strides cuDNN is given)."""
    q, k, v = make_qkv("sbhd", 2, 8, 2, 128, 128, 64, torch.bfloat16, "cuda")
    scale, grad_out = 0.125, torch.randn(2, 8, 128, 64, dtype=torch.bfloat16, device="cuda")
    out, stats = ops.fused_attn_fwd(q, k, v, scale, True)
    grads = _grad_buffers(q, k, v, zeroed=False)
    assert len({g.untyped_storage().data_ptr() for g in grads}) == 1
    ops.fused_attn_bwd(grad_out, q, k, v, out, stats, *grads, scale, True)
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, ref_grads(grad_out, q, k, v, scale, causal=True)):
        assert_close_rel(grad, ref, CUDA_GRAD_RTOL[torch.bfloat16], name)


@pytest.mark.gpu
@cudnn_built
def test_cuda_deterministic_backward_is_bitwise_repeatable():
    q, k, v = make_qkv("bshd", 2, 8, 2, 256, 256, 128, torch.bfloat16, "cuda")
    grad_out = torch.randn(2, 8, 256, 128, dtype=torch.bfloat16, device="cuda")
    torch.use_deterministic_algorithms(True)
    try:
        first = run_op(q, k, v, 0.1, "causal", grad_out=grad_out)[2]
        second = run_op(q, k, v, 0.1, "causal", grad_out=grad_out)[2]
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.gpu
@cudnn_built
def test_cuda_unsupported_head_dim_raises_not_implemented():
    q, k, v = make_qkv("bhsd", 2, 4, 4, 64, 64, 20, torch.bfloat16, "cuda")
    with pytest.raises(NotImplementedError, match="fused_attn_fwd: cuDNN cannot run this case"):
        ops.fused_attn_fwd(q, k, v, 0.2)


@pytest.mark.gpu
@cudnn_built
def test_opcheck_cuda():
    for name, args in opcheck_args("cuda"):
        torch.library.opcheck(getattr(ops, name).default, args)


@pytest.mark.gpu
@cudnn_built
@pytest.mark.parametrize("case", range(len(_bad("cpu"))))
def test_cuda_bad_inputs_raise(case):
    call, match = _bad("cuda")[case]
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        call()


# --------------------------------------------------------------------------------- modules: cudnn vs torch backend
def _module_run(module, inputs, attention_mask=None):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = module(*leaves, attention_mask=attention_mask)
    out.backward(torch.ones_like(out) / out.numel() ** 0.5)
    return out, [t.grad for t in leaves]


@pytest.mark.gpu
@cudnn_built
@pytest.mark.parametrize("fmt", ("sbhd", "bshd"))
@pytest.mark.parametrize("mask_type", MASKS)
@pytest.mark.parametrize("groups", (8, 2))
def test_cuda_dot_product_attention_cudnn_matches_torch_backend(fmt, mask_type, groups):
    s, b, h, d = 128, 2, 8, 64
    shape = lambda heads: (s, b, heads, d) if fmt == "sbhd" else (b, s, heads, d)  # noqa: E731
    inputs = [torch.randn(shape(n), dtype=torch.bfloat16, device="cuda") for n in (h, groups, groups)]
    mask = None
    if "padding" in mask_type:
        mask = (torch.arange(s, device="cuda") >= torch.tensor([s, 77], device="cuda").view(b, 1)).view(b, 1, 1, s)
    results = {}
    for backend in ("torch", "cudnn"):
        module = DotProductAttention(h, d, num_gqa_groups=groups, attn_mask_type=mask_type, qkv_format=fmt,
                                     attention_backend=backend)
        with warnings.catch_warnings():
            if backend == "cudnn":
                warnings.simplefilter("error")  # no fallback warning: cuDNN takes every case here
            results[backend] = _module_run(module, inputs, mask)
    (out_t, grads_t), (out_c, grads_c) = results["torch"], results["cudnn"]
    assert_close_rel(out_c, out_t, 1e-2)
    for grad_c, grad_t in zip(grads_c, grads_t):
        assert_close_rel(grad_c, grad_t, 2e-2, "grad")


@pytest.mark.gpu
@cudnn_built
@pytest.mark.parametrize("interleaved", [False, True])
def test_cuda_multihead_attention_cudnn_backend_writes_the_qkv_gradient_in_place(monkeypatch, interleaved):
    """Interleaved GQA too: its q, k, v go to the attention with the groups folded into the batch (views)."""
    returned = []
    real = qkv_split._fused_gradient
    monkeypatch.setattr(qkv_split, "_fused_gradient", lambda *a: returned.append(real(*a)) or returned[-1])
    results = {}
    x = torch.randn(128, 2, 512, dtype=torch.bfloat16, device="cuda")
    for backend in ("torch", "cudnn"):
        monkeypatch.setenv("TFP8_ATTENTION_BACKEND", backend)
        torch.manual_seed(0)
        mha = MultiheadAttention(512, 8, num_gqa_groups=2, attention_dropout=0.0,
                                 qkv_weight_interleaved=interleaved, params_dtype=torch.bfloat16)
        inp = x.clone().requires_grad_()
        out = mha(inp)
        out.float().square().mean().backward()
        results[backend] = (out, inp.grad, mha.qkv.weight.grad)
    assert returned and returned[-1] is not None, "the cudnn backward's dq/dk/dv were copied into a new dqkv"
    for a, b in zip(results["cudnn"], results["torch"]):
        assert_close_rel(a, b, 2e-2)


@pytest.mark.gpu
@cudnn_built
def test_cuda_dropout_repeats_under_manual_seed():
    module = DotProductAttention(8, 64, attention_dropout=0.3, attention_backend="cudnn").train()
    q, k, v = (torch.randn(128, 2, 8, 64, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    outs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        outs.append(module(q, k, v))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


@pytest.mark.gpu
@cudnn_built
def test_cuda_fallback_warns_once_with_the_reason(monkeypatch):
    monkeypatch.setattr(attention_cudnn, "_warned_reasons", set())
    monkeypatch.setattr(attention_cudnn, "_unsupported_cases", {})
    module = DotProductAttention(4, 20, attention_backend="cudnn")  # head dim 20: not a multiple of 8
    reference = DotProductAttention(4, 20, attention_backend="torch")
    q, k, v = (torch.randn(64, 2, 4, 20, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    with pytest.warns(UserWarning, match="cuDNN cannot run this case"):
        out = module(q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = module(q, k, v)
    assert torch.equal(out, again) and torch.equal(out, reference(q, k, v))
