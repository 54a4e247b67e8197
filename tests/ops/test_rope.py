"""rope_fwd / rope_bwd: CPU reference vs float64 PyTorch, CUDA vs float64 and vs the CPU reference, the autograd
Function of apply_rotary_pos_emb over them."""
import pytest
import torch

import transformer_fp8  # noqa: F401  (registers the ops)
from tests.utils import assert_close_rel, rel_error
from transformer_fp8.module.rope import RotaryPositionEmbedding, apply_rotary_pos_emb

ops = torch.ops.transformer_fp8
FORMATS = ("sbhd", "bshd")
# One rounding of the output to t's dtype (bf16: 2**-9 relative), float32: a few ulps of float32 sin / cos / products.
RTOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}
# CUDA vs the CPU reference: float32 ulps (sincosf, fused multiply-adds) that flip a rare rounding to bf16 / fp16.
CUDA_VS_CPU_RTOL = {torch.float32: 1e-6, torch.bfloat16: 2e-3, torch.float16: 2.5e-4}


def ref_rope(t, freqs, fmt, interleaved, inverse=False):
    """float64 rope_fwd, written as the formulas: rotate-half t * cos + rotate_half(t) * sin, or the pairs
    (2i, 2i + 1); inverse: d(t) by autograd through it, for grad_out = t."""
    if inverse:
        x = torch.zeros(t.shape, dtype=torch.float64, device=t.device, requires_grad=True)
        ref_rope(x, freqs, fmt, interleaved).backward(t.double())
        return x.grad
    s = t.shape[0] if fmt == "sbhd" else t.shape[1]
    f = freqs[:s].double()
    f = f if fmt == "sbhd" else f.transpose(0, 1)
    x = t.double()
    rot_dim = f.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    if interleaved:
        a, b = x_rot[..., 0::2], x_rot[..., 1::2]
        fa, fb = f[..., 0::2], f[..., 1::2]
        rotated = torch.stack((a * fa.cos() - b * fa.sin(), b * fb.cos() + a * fb.sin()), dim=-1).flatten(-2)
    else:
        x1, x2 = x_rot.chunk(2, dim=-1)
        rotated = x_rot * f.cos() + torch.cat((-x2, x1), dim=-1) * f.sin()
    return torch.cat((rotated, x_pass), dim=-1)


def shape_of(fmt, s, b, h, d):
    return (s, b, h, d) if fmt == "sbhd" else (b, s, h, d)


def random_freqs(s, b_f, rot_dim, device="cpu", extra_rows=3):
    """Angles [s + extra_rows, b_f, 1, rot_dim] up to a few hundred radians, the two halves unequal (so the backward
    must use each pair's own angles)."""
    return torch.rand(s + extra_rows, b_f, 1, rot_dim, device=device) * 300


def fused_qkv_views(fmt, s, b, h, g, d, dtype, device="cpu", interleaved_groups=False):
    """(q, k, v) strided views of one fused QKV tensor [*lead, (h + 2g) * d], as MultiheadAttention makes them."""
    lead = (s, b) if fmt == "sbhd" else (b, s)
    qkv = torch.randn(*lead, (h + 2 * g) * d, dtype=dtype, device=device)
    if interleaved_groups:
        per_group = qkv.view(*lead, g, h // g + 2, d)
        return per_group[..., 0, :], per_group[..., -2, :], per_group[..., -1, :]
    q, k, v = qkv.split([h * d, g * d, g * d], dim=-1)
    return q.view(*lead, h, d), k.view(*lead, g, d), v.view(*lead, g, d)


# ----------------------------------------------------------------------------------------------------- CPU reference
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("interleaved", (False, True))
@pytest.mark.parametrize("d,rot_dim", ((16, 16), (32, 12), (10, 6)))
@pytest.mark.parametrize("b_f", (1, 3))
def test_fwd_bwd_match_float64(fmt, dtype, interleaved, d, rot_dim, b_f):
    s, b, h = 7, 3, 2
    t = torch.randn(shape_of(fmt, s, b, h, d), dtype=dtype)
    grad = torch.randn(shape_of(fmt, s, b, h, d), dtype=dtype)
    freqs = random_freqs(s, b_f, rot_dim)
    out = ops.rope_fwd(t, freqs, fmt, interleaved)
    assert out.dtype == dtype and out.shape == t.shape and out.is_contiguous()
    assert_close_rel(out, ref_rope(t, freqs, fmt, interleaved), RTOL[dtype])
    assert torch.equal(out[..., rot_dim:], t[..., rot_dim:])
    dt = ops.rope_bwd(grad, freqs, fmt, interleaved)
    assert dt.dtype == dtype and dt.shape == t.shape
    assert_close_rel(dt, ref_rope(grad, freqs, fmt, interleaved, inverse=True), RTOL[dtype], "d(t)")


def test_bwd_inverts_fwd_for_rotary_embedding_angles():
    """With equal angles in both channels of a pair (RotaryPositionEmbedding's), rope_bwd is the inverse rotation."""
    t = torch.randn(9, 2, 3, 32, dtype=torch.float64).float()
    freqs = RotaryPositionEmbedding(32)(9)
    back = ops.rope_bwd(ops.rope_fwd(t, freqs, "sbhd"), freqs, "sbhd")
    assert_close_rel(back, t, 1e-6)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("interleaved_groups", (False, True))
def test_strided_views_of_fused_qkv(fmt, interleaved_groups):
    s, b, h, g, d = 5, 3, 4, 2, 16
    for t in fused_qkv_views(fmt, s, b, h, g, d, torch.bfloat16, interleaved_groups=interleaved_groups):
        assert not t.is_contiguous()
        # angles per sequence, a non-contiguous [s, b, 1, d] view (as the Llama integration makes them)
        freqs = (torch.rand(b, s, d) * 50).transpose(0, 1)[:, :, None, :]
        out = ops.rope_fwd(t, freqs, fmt)
        assert out.is_contiguous()
        assert torch.equal(out, ops.rope_fwd(t.contiguous(), freqs.contiguous(), fmt))
        assert_close_rel(out, ref_rope(t, freqs, fmt, False), RTOL[torch.bfloat16])
        assert torch.equal(ops.rope_bwd(t, freqs, fmt), ops.rope_bwd(t.contiguous(), freqs, fmt))


def test_empty_tensors():
    for shape in ((0, 2, 2, 8), (3, 0, 2, 8), (3, 2, 0, 8)):
        t = torch.randn(shape)
        assert ops.rope_fwd(t, torch.zeros(3, 1, 1, 8), "sbhd").shape == shape
        assert ops.rope_bwd(t, torch.zeros(3, 1, 1, 8), "sbhd").shape == shape


def opcheck_args(device):
    t = torch.randn(6, 2, 3, 16, dtype=torch.bfloat16, device=device)
    freqs = random_freqs(6, 1, 16, device)
    q, k, _ = fused_qkv_views("bshd", 6, 2, 4, 2, 16, torch.float32, device)
    freqs_b = random_freqs(6, 2, 8, device)
    return [
        ("rope_fwd", (t, freqs, "sbhd")),
        ("rope_fwd", (t, freqs, "sbhd", True)),
        ("rope_fwd", (k, freqs_b, "bshd")),
        ("rope_bwd", (t, freqs, "sbhd")),
        ("rope_bwd", (q, freqs_b, "bshd", True)),
    ]


def test_opcheck_cpu():
    for name, args in opcheck_args("cpu"):
        torch.library.opcheck(getattr(ops, name).default, args)


def _bad(t, f):
    return [
        (lambda: ops.rope_fwd(t, f, "thd"), "qkv_format: expected 'sbhd' or 'bshd'"),
        (lambda: ops.rope_fwd(t.int(), f, "sbhd"), "t: expected a float32, float16 or bfloat16"),
        (lambda: ops.rope_bwd(t.double(), f, "sbhd"), "grad_out: expected a float32, float16 or bfloat16"),
        (lambda: ops.rope_fwd(t[0], f, "sbhd"), r"t: expected a 4-D tensor \[s, b, h, d\]"),
        (lambda: ops.rope_bwd(t[0], f, "bshd"), r"grad_out: expected a 4-D tensor \[b, s, h, d\]"),
        (lambda: ops.rope_fwd(t.transpose(2, 3), f[..., :4], "sbhd"), "t: expected a contiguous last dim"),
        (lambda: ops.rope_fwd(t, f.double(), "sbhd"), "freqs: expected a float32"),
        (lambda: ops.rope_fwd(t, f[:3], "sbhd"), r"freqs: expected \[>= 4, 1 or 2, 1, rot_dim\]"),
        (lambda: ops.rope_fwd(t, f[:, :, :, :5], "sbhd"), "freqs: expected .* rot_dim even"),
        (lambda: ops.rope_fwd(t, torch.cat((f, f), -1), "sbhd"), "freqs: expected .*rot_dim <= d = 16"),
        (lambda: ops.rope_fwd(t, f.expand(4, 3, 1, 16), "sbhd"), "freqs: expected"),
        (lambda: ops.rope_fwd(t, f.expand(4, 1, 2, 16), "sbhd"), "freqs: expected"),
        (lambda: ops.rope_fwd(t, f[0], "sbhd"), "freqs: expected"),
        (lambda: ops.rope_fwd(t, torch.cat((f, f), -1)[..., ::2], "sbhd"), "freqs: expected a contiguous last dim"),
    ]


@pytest.mark.parametrize("case", range(len(_bad(None, None))))
def test_bad_inputs_raise(case):
    t, f = torch.randn(4, 2, 3, 16), torch.zeros(4, 1, 1, 16)
    call, match = _bad(t, f)[case]
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        call()


# ----------------------------------------------------------------------------------------------- apply_rotary_pos_emb
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("interleaved", (False, True))
def test_apply_rotary_pos_emb_autograd(device, fmt, interleaved):
    """q, k views of a fused QKV tensor that requires grad: outputs and d(qkv) against float64 autograd."""
    s, b, h, g, d = 6, 2, 4, 2, 32
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    lead = (s, b) if fmt == "sbhd" else (b, s)
    qkv = torch.randn(*lead, (h + 2 * g) * d, dtype=dtype, device=device, requires_grad=True)
    freqs = RotaryPositionEmbedding(d, rotary_percent=0.5, interleaved=interleaved, device=device)(s)
    qkv64 = qkv.detach().double().requires_grad_(True)
    outs = []
    for x in (qkv, qkv64):
        q, k, _ = x.split([h * d, g * d, g * d], dim=-1)
        q, k = q.unflatten(-1, (h, d)), k.unflatten(-1, (g, d))
        rope = apply_rotary_pos_emb if x is qkv else (lambda t, f, fmt, interleaved: ref_rope(t, f, fmt, interleaved))
        outs.append((rope(q, freqs, fmt, interleaved), rope(k, freqs, fmt, interleaved)))
    grads = [torch.randn_like(o) for o in outs[0]]
    torch.autograd.backward(outs[0], grads)
    torch.autograd.backward(outs[1], [gr.double() for gr in grads])
    for out, ref in zip(outs[0], outs[1]):
        assert out.dtype == dtype
        assert_close_rel(out, ref, RTOL[dtype])
    assert_close_rel(qkv.grad, qkv64.grad, RTOL[dtype], "d(qkv)")
    assert qkv.grad[..., (h + g) * d:].abs().max() == 0  # v took no part


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_apply_rotary_pos_emb_backward_of_a_sum(device):
    """The gradient of a sum arrives expanded (stride 0 in the last dim)."""
    t = torch.randn(5, 2, 3, 16, device=device, requires_grad=True)
    freqs = random_freqs(5, 1, 16, device)
    apply_rotary_pos_emb(t, freqs).sum().backward()
    assert_close_rel(t.grad, ref_rope(torch.ones_like(t), freqs, "sbhd", False, inverse=True), RTOL[torch.float32])


def test_apply_rotary_pos_emb_refuses_freqs_that_require_grad():
    freqs = RotaryPositionEmbedding(16)(4).requires_grad_(True)
    with pytest.raises(ValueError, match="freqs: no gradient"):
        apply_rotary_pos_emb(torch.randn(4, 1, 2, 16), freqs)


def test_interleaved_embedding_pairs_equal_angles():
    freqs = RotaryPositionEmbedding(8, interleaved=True)(5)
    assert torch.equal(freqs[..., 0::2], freqs[..., 1::2])
    assert torch.equal(freqs[..., 0::2], RotaryPositionEmbedding(8)(5)[..., :4])


# ----------------------------------------------------------------------------------------------------- CUDA kernel
# (s, b, h, d, rot_dim): 16-byte accesses, the element-wise fallback (rot_dim / 2 or d not a multiple of 8 elements),
# one token per block and several, a large head count, d = rot_dim and a pass-through tail.
GPU_CASES = ((17, 3, 4, 64, 64), (5, 2, 32, 128, 128), (9, 4, 3, 80, 48), (33, 1, 1, 16, 16), (4, 5, 7, 24, 20),
             (3, 2, 2, 10, 6), (130, 2, 8, 256, 128))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("interleaved", (False, True))
@pytest.mark.parametrize("case", GPU_CASES)
@pytest.mark.parametrize("b_f", ("1", "b"))
def test_cuda_matches_float64_and_cpu(fmt, dtype, interleaved, case, b_f):
    s, b, h, d, rot_dim = case
    t = torch.randn(shape_of(fmt, s, b, h, d), dtype=dtype, device="cuda")
    freqs = random_freqs(s, 1 if b_f == "1" else b, rot_dim, "cuda")
    for op, inverse in ((ops.rope_fwd, False), (ops.rope_bwd, True)):
        out = op(t, freqs, fmt, interleaved)
        assert out.dtype == dtype and out.shape == t.shape and out.is_contiguous()
        assert rel_error(out.cpu(), op(t.cpu(), freqs.cpu(), fmt, interleaved)) <= CUDA_VS_CPU_RTOL[dtype]
        assert_close_rel(out, ref_rope(t, freqs, fmt, interleaved, inverse), RTOL[dtype])
        assert torch.equal(out[..., rot_dim:], t[..., rot_dim:])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("interleaved_groups", (False, True))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_cuda_strided_views_of_fused_qkv(fmt, interleaved_groups, dtype):
    s, b, h, g, d = 37, 3, 8, 2, 128
    freqs = (torch.rand(b, s, d, device="cuda") * 500).transpose(0, 1)[:, :, None, :]
    for t in fused_qkv_views(fmt, s, b, h, g, d, dtype, "cuda", interleaved_groups):
        for op in (ops.rope_fwd, ops.rope_bwd):
            out = op(t, freqs, fmt)
            assert out.is_contiguous()
            assert torch.equal(out, op(t.contiguous(), freqs.contiguous(), fmt))
            assert rel_error(out.cpu(), op(t.cpu(), freqs.cpu(), fmt)) <= CUDA_VS_CPU_RTOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_cuda_unaligned_input_takes_the_elementwise_path(dtype):
    base = torch.randn(6, 2, 3, 65, dtype=dtype, device="cuda")
    t = base[..., 1:]  # last dim contiguous, data 1 element past a 16-byte boundary
    freqs = random_freqs(6, 1, 64, "cuda")
    out = ops.rope_fwd(t, freqs, "sbhd")
    assert torch.equal(out, ops.rope_fwd(t.contiguous(), freqs, "sbhd"))
    assert_close_rel(out, ref_rope(t, freqs, "sbhd", False), RTOL[dtype])


@pytest.mark.gpu
def test_cuda_long_sequence_angles_stay_accurate():
    """Angles up to 65536 rad (position 65536 of inv_freq 1): float32 output within float32 error of float64."""
    s = 4096
    rope = RotaryPositionEmbedding(128, device="cuda")
    freqs = rope(s, offset=65536 - s)
    t = torch.randn(s, 1, 2, 128, device="cuda")
    out = ops.rope_fwd(t, freqs, "sbhd")
    assert_close_rel(out, ref_rope(t, freqs, "sbhd", False), RTOL[torch.float32])


@pytest.mark.gpu
def test_cuda_large_token_count():
    t = torch.randn(2048, 40, 2, 64, dtype=torch.bfloat16, device="cuda")  # 81920 tokens: blocks loop over tokens
    freqs = random_freqs(2048, 1, 64, "cuda")
    out = ops.rope_fwd(t, freqs, "sbhd")
    assert rel_error(out.cpu(), ops.rope_fwd(t.cpu(), freqs.cpu(), "sbhd")) <= CUDA_VS_CPU_RTOL[torch.bfloat16]


@pytest.mark.gpu
def test_opcheck_cuda():
    for name, args in opcheck_args("cuda"):
        torch.library.opcheck(getattr(ops, name).default, args)


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(_bad(None, None))))
def test_cuda_bad_inputs_raise(case):
    t, f = torch.randn(4, 2, 3, 16, device="cuda"), torch.zeros(4, 1, 1, 16, device="cuda")
    call, match = _bad(t, f)[case]
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        call()


@pytest.mark.gpu
def test_cuda_rejects_freqs_on_another_device():
    with pytest.raises(RuntimeError, match="freqs: expected a tensor on cuda"):
        ops.rope_fwd(torch.randn(4, 2, 3, 16, device="cuda"), torch.zeros(4, 1, 1, 16), "sbhd")


# ------------------------------------------------------------------------------------- rope_fwd_into / rope_bwd_into
def _into_cases(device, dtype=torch.bfloat16):
    """(op name, input, out): into a strided view of a fused-QKV-shaped buffer, into a contiguous tensor, in place."""
    q, k, _ = fused_qkv_views("bshd", 6, 2, 4, 2, 16, dtype, device)
    q_out, k_out, _ = fused_qkv_views("bshd", 6, 2, 4, 2, 16, dtype, device)
    t = torch.randn(6, 2, 3, 16, dtype=dtype, device=device)
    return [("rope_fwd_into", q, q_out), ("rope_bwd_into", k, k_out), ("rope_fwd_into", t, torch.empty_like(t)),
            ("rope_bwd_into", t.clone(), None)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_into_equals_the_allocating_ops(device, dtype):
    """out = the allocating op's result, bit for bit, wherever out lies (strided, contiguous, the input itself);
    the input is left alone unless it is out."""
    freqs = random_freqs(6, 1, 16, device)
    for name, t, out in _into_cases(device, dtype):
        fmt = "bshd" if t.shape[1] == 6 else "sbhd"
        want = getattr(ops, name.replace("_into", ""))(t, freqs, fmt)
        before = t.clone()
        target = t if out is None else out
        getattr(ops, name)(t, freqs, fmt, False, target)
        assert torch.equal(target, want), name
        if out is not None:
            assert torch.equal(t, before)


def test_into_opcheck_cpu():
    freqs = random_freqs(6, 1, 16)
    for name, t, out in _into_cases("cpu"):
        fmt = "bshd" if t.shape[1] == 6 else "sbhd"
        torch.library.opcheck(getattr(ops, name).default, (t, freqs, fmt, False, t.clone() if out is None else out))


@pytest.mark.gpu
def test_into_opcheck_cuda():
    freqs = random_freqs(6, 1, 16, "cuda")
    for name, t, out in _into_cases("cuda"):
        fmt = "bshd" if t.shape[1] == 6 else "sbhd"
        torch.library.opcheck(getattr(ops, name).default, (t, freqs, fmt, False, t.clone() if out is None else out))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_into_rejects_bad_out(device):
    t = torch.randn(4, 2, 3, 16, device=device)
    f = torch.zeros(4, 1, 1, 16, device=device)
    errors = (ValueError, TypeError, RuntimeError)
    with pytest.raises(errors, match=r"out: expected (torch.float32|Float) \(t's dtype\)"):
        ops.rope_fwd_into(t, f, "sbhd", False, t.half())
    with pytest.raises(errors, match=r"out: expected shape \(4, 2, 3, 16\)|out: expected shape \[4, 2, 3, 16\]"):
        ops.rope_bwd_into(t, f, "sbhd", False, t[:2].clone())
    with pytest.raises(errors, match="out: expected a contiguous last dim"):
        ops.rope_fwd_into(t, f, "sbhd", False, torch.empty(4, 2, 16, 3, device=device).transpose(2, 3))
    wide = torch.randn(4, 2, 3, 32, device=device)
    with pytest.raises(errors, match="out: expected t itself .* or a tensor of another storage"):
        ops.rope_fwd_into(wide[..., :16], f, "sbhd", False, wide[..., 16:])
