"""FP8 attention: fused_attn_fp8_fwd / fused_attn_fp8_bwd (CPU reference; GPU: cuDNN's FP8 SDPA) vs float64 attention,
amax accumulation, opcheck, argument errors; DotProductAttention under DelayedScaling(fp8_dpa=True): accuracy, its
scales and amaxes over steps, fallbacks; the recipe flag. GPU-marked variants run the same checks on cuDNN."""
import warnings

import pytest
import torch

from tests.ops.test_attention_op import make_qkv, ref_attention, ref_grads
from tests.utils import assert_close_rel, rel_error
from transformer_fp8 import DotProductAttention, MultiheadAttention, fp8_autocast
from transformer_fp8.recipe import DelayedScaling, Float8CurrentScaling
from transformer_fp8.module import attention_cudnn, attention_fp8
from transformer_fp8.module.qkv_split import split_qkv

ops = torch.ops.transformer_fp8
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
# vs float64 attention of the unquantized inputs: the output carries five E4M3 roundings (q, k, v, P, out; measured
# ~0.055 on the CPU reference), the gradients those plus three in the gradient format (dO, dS, the gradient itself;
# measured ~0.11 with E5M2, ~0.06 with E4M3).
OUT_RTOL = 0.1
GRAD_RTOL = {E5M2: 0.2, E4M3: 0.12}
gpu = [pytest.mark.gpu, pytest.mark.skipif(not attention_cudnn.cudnn_attention_built(),
                                           reason="transformer_fp8 was built without the attention family")]


def one(value, device):
    return torch.tensor([value], dtype=torch.float32, device=device)


def in_dim_order(t, fn):
    """fn applied to t's data laid out densely in t's dim order (dims by decreasing stride), viewed back in t's dims:
    an FP8 copy of a [b, h, s, d] view of an sbhd tensor is an sbhd-strided view too."""
    order = sorted(range(t.dim()), key=lambda i: -t.stride(i))
    return fn(t.permute(order).contiguous()).permute([order.index(i) for i in range(t.dim())])


def cast(t, fp8_dtype, margin=1.0):
    """t -> (FP8 copy in t's dim order with scale = fp8_max / (amax * margin), its scale_inv [1])."""
    scale = FP8_MAX[fp8_dtype] / (t.abs().amax().float().item() * margin)
    q = in_dim_order(t.float(), lambda x: ops.quantize(x, one(scale, t.device), fp8_dtype))
    return q, one(1 / scale, t.device)


def run_forward(q, k, v, scale, causal, o_amax):
    """fused_attn_fp8_fwd on FP8 casts of q, k, v; scale_s = 448 (P <= 1), scale_o from o_amax (x1.25 headroom)
    -> (dict of the FP8 tensors and scales, out dequantized, amax_s, amax_o)."""
    dev = q.device
    (q8, dq), (k8, dk), (v8, dv) = (cast(t, E4M3) for t in (q, k, v))
    scale_o = 448.0 / (1.25 * o_amax)
    amax_s, amax_o = one(0.0, dev), one(0.0, dev)
    out8, stats = ops.fused_attn_fp8_fwd(q8, k8, v8, dq, dk, dv, one(448.0, dev), one(1 / 448.0, dev),
                                         one(scale_o, dev), amax_s, amax_o, scale, causal)
    fwd = dict(q8=q8, k8=k8, v8=v8, descales=(dq, dk, dv, one(1 / scale_o, dev)), out8=out8, stats=stats)
    return fwd, out8.float() / scale_o, amax_s, amax_o


def run_backward(fwd, grad_out, grad_dtype, scale, causal, amaxes_ref):
    """fused_attn_fp8_bwd with scales from reference amaxes (dp, dq, dk, dv; x1.25 headroom) -> (dq, dk, dv
    dequantized, [amax_dp, amax_dq, amax_dk, amax_dv])."""
    dev = grad_out.device
    g8, g_descale = cast(grad_out, grad_dtype)
    scales = [FP8_MAX[grad_dtype] / (1.25 * a) for a in amaxes_ref]
    amaxes = [one(0.0, dev) for _ in range(4)]
    grads8 = ops.fused_attn_fp8_bwd(
        g8, fwd["q8"], fwd["k8"], fwd["v8"], fwd["out8"], fwd["stats"], *fwd["descales"], g_descale,
        one(448.0, dev), one(1 / 448.0, dev), one(scales[0], dev), one(1 / scales[0], dev),
        *(one(s, dev) for s in scales[1:]), *amaxes, scale, causal)
    for g in grads8:
        assert g.dtype == grad_dtype
    return [g.float() / s for g, s in zip(grads8, scales[1:])], amaxes


def ref_probs(q, k, scale, causal):
    """float64 softmax probabilities P [b, hq, sq, skv]."""
    sq, skv = q.shape[2], k.shape[2]
    kx = k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores = q.double() @ kx.transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(~torch.ones(sq, skv, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return scores.softmax(-1)


def ref_amax_dp(grad_out, q, k, v, scale, causal):
    """max |dS| of float64 attention: dS = P * (dO vᵀ - rowsum(dO * O)) * scale."""
    out, _ = ref_attention(q, k, v, scale, causal)
    probs, vx = ref_probs(q, k, scale, causal), v.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    g = grad_out.double()
    return (probs * (g @ vx.transpose(-1, -2) - (g * out).sum(-1, keepdim=True)) * scale).abs().max().item()


def check_op_against_float64(device, layout, causal, hq, hkv, d, grad_dtype=E5M2, backward=True):
    q, k, v = make_qkv(layout, 2, hq, hkv, 64, 64, d, torch.float32, device)
    scale = d ** -0.5
    ref, lse = ref_attention(q, k, v, scale, causal)
    fwd, out, amax_s, amax_o = run_forward(q, k, v, scale, causal, ref.abs().max().item())
    assert fwd["out8"].dtype == E4M3 and fwd["out8"].shape == ref.shape
    assert fwd["out8"].stride() == in_dim_order(q, lambda x: x.contiguous()).stride()  # out in q's dim order
    assert_close_rel(out, ref, OUT_RTOL)
    assert_close_rel(fwd["stats"], lse, 0.01, "stats")
    assert abs(amax_s.item() / ref_probs(q, k, scale, causal).max().item() - 1) < 0.1
    assert abs(amax_o.item() / ref.abs().max().item() - 1) < 0.1
    if not backward:
        return
    grad_out = torch.randn_like(ref).float()
    refs = ref_grads(grad_out, q, k, v, scale, causal=causal)
    amaxes_ref = [ref_amax_dp(grad_out, q, k, v, scale, causal)] + [r.abs().max().item() for r in refs]
    grads, amaxes = run_backward(fwd, grad_out, grad_dtype, scale, causal, amaxes_ref)
    for name, ours, want in zip("qkv", grads, refs):
        assert_close_rel(ours, want, GRAD_RTOL[grad_dtype], f"d{name}")
    for name, ours, want in zip(("dp", "dq", "dk", "dv"), amaxes, amaxes_ref):
        assert abs(ours.item() / want - 1) < 0.15, f"amax_{name}: {ours.item()} vs float64 {want}"


# ----------------------------------------------------------------------------------------------- the ops on CPU
@pytest.mark.parametrize("layout", ("bshd", "sbhd", "bhsd"))
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("hq,hkv,d", ((4, 4, 64), (4, 2, 128)))
def test_cpu_reference_matches_float64(layout, causal, hq, hkv, d):
    check_op_against_float64("cpu", layout, causal, hq, hkv, d)


def test_cpu_reference_e4m3_gradients():
    check_op_against_float64("cpu", "bshd", True, 4, 2, 64, grad_dtype=E4M3)


def test_amaxes_are_max_accumulated():
    q, k, v = make_qkv("bhsd", 1, 2, 2, 16, 16, 16, torch.float32)
    (q8, dq), (k8, dk), (v8, dv) = (cast(t, E4M3) for t in (q, k, v))
    big, small = one(5.0, "cpu"), one(1e-6, "cpu")
    out8, stats = ops.fused_attn_fp8_fwd(q8, k8, v8, dq, dk, dv, one(448.0, "cpu"), one(1 / 448, "cpu"),
                                         one(1.0, "cpu"), big, small, 0.25)
    assert big.item() == 5.0  # kept: larger than max P
    assert 1e-6 < small.item() == pytest.approx((out8.float()).abs().max().item(), rel=0.07)


def test_bwd_outputs_follow_input_dim_order():
    q, k, v = make_qkv("sbhd", 2, 4, 2, 16, 16, 16, torch.float32)
    q8, k8, v8 = (in_dim_order(t, lambda x: ops.quantize(x, one(1.0, "cpu"), E4M3)) for t in (q, k, v))
    s = [one(1.0, "cpu") for _ in range(3)]
    out8, stats = ops.fused_attn_fp8_fwd(q8, k8, v8, *s, one(448.0, "cpu"), one(1 / 448, "cpu"), one(1.0, "cpu"),
                                         one(0, "cpu"), one(0, "cpu"), 0.25, True)
    assert q8.stride() == torch.empty(16, 2, 4, 16).permute(1, 2, 0, 3).stride()
    assert out8.stride() == q8.stride()
    g8 = ops.quantize(torch.randn(2, 4, 16, 16), one(1.0, "cpu"), E5M2)
    grads = ops.fused_attn_fp8_bwd(g8, q8, k8, v8, out8, stats, *(one(1.0, "cpu") for _ in range(12)),
                                   *(one(0.0, "cpu") for _ in range(4)), 0.25, True)
    for g, t in zip(grads, (q8, k8, v8)):
        assert g.dtype == E5M2 and g.shape == t.shape and g.stride() == t.stride()


def small_sizes(device):
    """Sequence length and head dim of the small op tests: on Hopper cuDNN's FP8 backward takes head dim 128 only."""
    return (8, 16) if device == "cpu" else (128, 128)


def opcheck_args(device):
    s, d = small_sizes(device)
    q, k, v = make_qkv("sbhd", 2, 4, 2, s, s, d, torch.float32, device)
    q8, k8, v8 = (cast(t, E4M3)[0] for t in (q, k, v))
    ones = [one(1.0, device) for _ in range(12)]
    fwd_args = (q8, k8, v8, *ones[:6], one(0.0, device), one(0.0, device), 0.25, True)
    out8, stats = ops.fused_attn_fp8_fwd(*fwd_args)
    g8 = cast(torch.randn(2, 4, s, d, device=device), E5M2)[0]
    bwd_args = (g8, q8, k8, v8, out8, stats, *ones, *(one(0.0, device) for _ in range(4)), 0.25, True)
    return [("fused_attn_fp8_fwd", fwd_args), ("fused_attn_fp8_bwd", bwd_args)]


# opcheck's test_schema compares inputs with torch.allclose, which has no FP8 kernel (as in test_quantize.py).
NO_SCHEMA_CHECK = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def test_opcheck_cpu():
    for name, args in opcheck_args("cpu"):
        torch.library.opcheck(getattr(ops, name).default, args, test_utils=NO_SCHEMA_CHECK)


def _bad(device):
    seq, d = small_sizes(device)
    q, k, v = make_qkv("bhsd", 2, 4, 2, seq, seq, d, torch.float32, device)
    q8, k8, v8 = (cast(t, E4M3)[0] for t in (q, k, v))
    s = [one(1.0, device) for _ in range(12)]
    z = [one(0.0, device) for _ in range(4)]

    def fwd(q=q8, k=k8, descale_q=s[0], amax_o=z[1]):
        return ops.fused_attn_fp8_fwd(q, k, v8, descale_q, *s[1:6], z[0], amax_o, 0.25)

    out8, stats = fwd()
    g8 = cast(torch.randn(2, 4, seq, d, device=device), E5M2)[0]

    def bwd(grad_out=g8, out=out8, stats=stats, scale_dv=s[11], amax_dk=z[2]):
        return ops.fused_attn_fp8_bwd(grad_out, q8, k8, v8, out, stats, *s[:11], scale_dv, z[0], z[1], amax_dk,
                                      z[3], 0.25)

    return [
        (lambda: fwd(q=q), r"q: expected (a )?(torch\.)?float8_e4m3fn or (torch\.)?float8_e5m2"),
        (lambda: fwd(k=k8.view(torch.uint8).view(E5M2)), r"k: expected \S+ \(as q\), got"),
        (lambda: fwd(q=q8[0]), r"q: expected a 4-D tensor \[b, hq, sq, d_qk\]"),
        (lambda: fwd(descale_q=s[0].double()), "descale_q: expected a float32 tensor"),
        (lambda: fwd(amax_o=torch.zeros(2, device=device)), "amax_o: expected one element"),
        (lambda: bwd(grad_out=g8.float()), "grad_out: expected torch.float8_e4m3fn or torch.float8_e5m2"),
        (lambda: bwd(grad_out=g8[:, :2]), rf"grad_out: expected shape \(2, 4, {seq}, {d}\)"),
        (lambda: bwd(out=out8.view(torch.uint8).view(E5M2)), r"out: expected \S+ \(as q\), got"),
        (lambda: bwd(stats=stats.double()), "stats: expected a float32"),
        (lambda: bwd(scale_dv=torch.ones(1, 1, 2, device=device)), "scale_dv: expected one element"),
        (lambda: bwd(amax_dk=torch.zeros(1, dtype=torch.float16, device=device)), "amax_dk: expected a float32"),
    ]


@pytest.mark.parametrize("case", range(len(_bad("cpu"))))
def test_bad_inputs_raise(case):
    call, match = _bad("cpu")[case]
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        call()


# ------------------------------------------------------------------------------------------- recipe and module
def test_recipe_flag():
    assert DelayedScaling().fp8_dpa is False and DelayedScaling(fp8_dpa=True).fp8_dpa is True
    with pytest.raises(TypeError, match="fp8_dpa: expected a bool"):
        DelayedScaling(fp8_dpa=1)
    with pytest.raises(ValueError, match="fp8_dpa: FP8 attention needs DelayedScaling"):
        Float8CurrentScaling(fp8_dpa=True)


def _module_inputs(device, d, scale_by=1.0, layout="sbhd", s=32):
    q, k, v = make_qkv(layout, 2, 4, 2, s, s, d, torch.bfloat16, device)
    # (the [b, h, s, d] views back in DotProductAttention's sbhd layout, as leaves)
    to_fmt = (lambda t: t.permute(2, 0, 1, 3)) if layout == "sbhd" else (lambda t: t.transpose(1, 2))
    return [(to_fmt(t) * scale_by).detach().requires_grad_() for t in (q, k, v)]


def check_module_scaling_over_steps(device, d=64, s=32):
    """Three steps with shrinking inputs and output gradients: each step's amaxes land in history row 1 after the
    update (q, k, v and dO exactly; from the second step on, with scales from the first, S, O, dS, dq, dk, dv as
    float64 says), scales = fp8_max / max(history); the third step, whose scales come from two larger steps (no
    saturation), matches float64."""
    recipe = DelayedScaling(amax_history_len=4, fp8_dpa=True)
    attn = DotProductAttention(4, d, num_gqa_groups=2, attn_mask_type="causal")
    scale, previous = d ** -0.5, None
    for step, magnitude in enumerate((2.0, 1.5, 1.0)):
        q, k, v = _module_inputs(device, d, magnitude, s=s)
        with fp8_autocast(fp8_recipe=recipe):
            out = attn(q, k, v)
        grad = torch.randn_like(out) * magnitude
        out.backward(grad)
        fwd, bwd = attn.fp8_scaling.fwd, attn.fp8_scaling.bwd
        bhsd = [t.detach().permute(1, 2, 0, 3) for t in (q, k, v)]
        ref, _ = ref_attention(*bhsd, scale, causal=True)
        g_bhsd = grad.view(s, 2, 4, d).permute(1, 2, 0, 3)
        refs = ref_grads(g_bhsd, *bhsd, scale, causal=True)
        exact = [t.abs().max().float().item() for t in bhsd]
        assert fwd.amax_history[1, :3].tolist() == exact, "q, k, v amaxes"
        assert bwd.amax_history[1, 0].item() == grad.abs().max().float().item(), "amax_do"
        assert (fwd.amax_history[0] == 0).all() and (bwd.amax_history[0] == 0).all()
        assert step == 0 or (fwd.amax_history[2] == previous).all(), "history rolled by one"
        previous = fwd.amax_history[1].clone()
        for state, fmax in ((fwd, 448.0), (bwd, 57344.0)):
            torch.testing.assert_close(state.scale, fmax / state.amax_history.amax(0), rtol=1e-6, atol=0)
            torch.testing.assert_close(state.scale_inv, 1 / state.scale, rtol=1e-6, atol=0)
        if step > 0:  # (the first step ran with scales 1: P's small values underflow E4M3)
            want_s = ref_probs(*bhsd[:2], scale, True).max().item()
            assert abs(fwd.amax_history[1, 3].item() / want_s - 1) < 0.1, "amax_s"
            assert abs(fwd.amax_history[1, 4].item() / ref.abs().max().item() - 1) < 0.15, "amax_o"
            want_dp = ref_amax_dp(g_bhsd.float(), *bhsd, scale, True)
            for i, want in enumerate([want_dp] + [r.abs().max().item() for r in refs], start=1):
                assert abs(bwd.amax_history[1, i].item() / want - 1) < 0.25, f"bwd amax slot {i}"
        if step == 2:
            out_bhsd = out.detach().view(s, 2, 4, d).permute(1, 2, 0, 3)
            assert_close_rel(out_bhsd, ref, OUT_RTOL)
            for name, t, want in zip("qkv", (q, k, v), refs):
                assert_close_rel(t.grad.permute(1, 2, 0, 3), want, GRAD_RTOL[E5M2], f"d{name}")


def test_module_scaling_over_steps_cpu():
    check_module_scaling_over_steps("cpu")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_module_fp8_attention_on_folded_gqa_groups_matches_float64(device):
    """gqa_groups_folded=True under fp8_dpa: q [s, b*g, h/g, d], k, v [s, b*g, 1, d], views of one interleaved fused
    QKV (MultiheadAttention folds them so outside FP8 attention), run in FP8 and give float64's output and QKV
    gradient within FP8 tolerance. The second of two identical steps is checked: its scales come from the first's
    amaxes."""
    s, b, h, g, d = 128, 2, 8, 2, 128
    qkv = torch.randn(s, b, (h + 2 * g) * d, dtype=torch.bfloat16, device=device, requires_grad=True)
    grad = torch.randn(s, b, h * d, dtype=torch.bfloat16, device=device)
    attn = DotProductAttention(h, d, num_gqa_groups=g, attn_mask_type="causal")
    for _ in range(2):
        qkv.grad = None
        with fp8_autocast(fp8_recipe=DelayedScaling(fp8_dpa=True)):
            out = attn(*split_qkv(qkv, h, g, d, True, fold=True), gqa_groups_folded=True)
        out.backward(grad)
    assert attn.fp8_scaling.fwd is not None and attn.fp8_scaling.fwd.amax_history[1, 0] > 0  # (it ran in FP8)
    leaf = qkv.detach().double().requires_grad_()
    ref, _ = ref_attention(*(t.permute(1, 2, 0, 3) for t in split_qkv(leaf, h, g, d, True)), d ** -0.5, causal=True)
    ref = ref.permute(2, 0, 1, 3).reshape(s, b, h * d)
    ref.backward(grad.double())
    assert_close_rel(out, ref, OUT_RTOL)
    assert_close_rel(qkv.grad, leaf.grad, GRAD_RTOL[E5M2], "d(qkv)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_module_fp8_attention_in_bhsd_matches_float64(device):
    """qkv_format="bhsd" (SDPA's layout) under fp8_dpa, GQA: output [b, h, s, d] and gradients as float64's within
    FP8 tolerance; the second of two identical steps is checked (its scales come from the first's amaxes)."""
    b, h, g, s, d = 2, 8, 2, 128, 128
    q, k, v = (torch.randn(b, n, s, d, dtype=torch.bfloat16, device=device, requires_grad=True) for n in (h, g, g))
    grad = torch.randn(b, h, s, d, dtype=torch.bfloat16, device=device)
    attn = DotProductAttention(h, d, num_gqa_groups=g, attn_mask_type="causal", qkv_format="bhsd")
    for _ in range(2):
        q.grad = k.grad = v.grad = None
        with fp8_autocast(fp8_recipe=DelayedScaling(fp8_dpa=True)):
            out = attn(q, k, v)
        out.backward(grad)
    assert attn.fp8_scaling.fwd is not None and attn.fp8_scaling.fwd.amax_history[1, 0] > 0  # (it ran in FP8)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = ref_attention(*leaves, d ** -0.5, causal=True)
    ref.backward(grad.double())
    assert out.shape == (b, h, s, d)
    assert_close_rel(out, ref, OUT_RTOL)
    for name, t, leaf in zip("qkv", (q, k, v), leaves):
        assert_close_rel(t.grad, leaf.grad, GRAD_RTOL[E5M2], f"d{name}")


class _RecordingCasts:
    """Stands in for the ops namespace in attention_fp8: records the data pointer of every quantize input."""

    def __init__(self, real):
        self.real, self.quantized = real, []

    def __getattr__(self, name):
        op = getattr(self.real, name)
        if name != "quantize":
            return op

        def quantize(x, *args, **kwargs):
            self.quantized.append(x.data_ptr())
            return op(x, *args, **kwargs)
        return quantize


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_module_fp8_attention_casts_memory_as_it_lies(monkeypatch, device):
    """Separate sbhd q, k, v and the output gradient reach their FP8 casts without a copy (each cast reads the tensor's
    own memory), and the output and the input gradients come back sbhd-dense: no transposing copy on the way; the
    result is float64's within FP8 tolerance."""
    s, b, h, g, d = 64, 2, 4, 2, 128
    recording = _RecordingCasts(attention_fp8.tfp8)
    monkeypatch.setattr(attention_fp8, "tfp8", recording)
    q, k, v = (torch.randn(s, b, n, d, dtype=torch.bfloat16, device=device, requires_grad=True) for n in (h, g, g))
    attn = DotProductAttention(h, d, num_gqa_groups=g, attn_mask_type="causal")
    with fp8_autocast(fp8_recipe=DelayedScaling(fp8_dpa=True)):
        out = attn(q, k, v)
    grad = torch.randn_like(out)
    out.backward(grad)
    assert recording.quantized == [q.data_ptr(), k.data_ptr(), v.data_ptr(), grad.data_ptr()]
    assert out.shape == (s, b, h * d) and out.is_contiguous()
    assert all(t.grad.is_contiguous() for t in (q, k, v))
    leaves = [t.detach().double().permute(1, 2, 0, 3).requires_grad_() for t in (q, k, v)]
    ref, _ = ref_attention(*leaves, d ** -0.5, causal=True)
    ref.backward(grad.double().view(s, b, h, d).permute(1, 2, 0, 3))
    # (the first call's scales are 1: no tighter bound than FP8's range allows)
    assert rel_error(out.view(s, b, h, d).permute(1, 2, 0, 3), ref) <= 2 * OUT_RTOL


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("groups,interleaved", ((4, False), (2, True)))
def test_module_fp8_attention_on_a_fused_qkv_makes_no_copies(monkeypatch, device, groups, interleaved):
    """q, k, v views of one fused QKV output (as MultiheadAttention passes them; GQA interleaved: folded): their casts
    read the QKV's own memory, and dq, dk, dv are written into one QKV-shaped gradient that the split returns as it
    is (no copies); output and QKV gradient as float64's within FP8 tolerance (second of two steps)."""
    from transformer_fp8.module import qkv_split
    s, b, h, d = 64, 2, 4, 128
    recording = _RecordingCasts(attention_fp8.tfp8)
    monkeypatch.setattr(attention_fp8, "tfp8", recording)
    copies = []
    monkeypatch.setattr(qkv_split, "_copy", lambda dst, src: copies.append(dst.shape))
    qkv = torch.randn(s, b, (h + 2 * groups) * d, dtype=torch.bfloat16, device=device, requires_grad=True)
    grad = torch.randn(s, b, h * d, dtype=torch.bfloat16, device=device)
    attn = DotProductAttention(h, d, num_gqa_groups=groups, attn_mask_type="causal")
    for _ in range(2):
        qkv.grad, recording.quantized = None, []
        with fp8_autocast(fp8_recipe=DelayedScaling(fp8_dpa=True)):
            q, k, v = split_qkv(qkv, h, groups, d, interleaved, fold=interleaved)
            out = attn(q, k, v, gqa_groups_folded=interleaved)
        out.backward(grad)
    assert recording.quantized[:3] == [q.data_ptr(), k.data_ptr(), v.data_ptr()] and not copies
    monkeypatch.undo()  # (the reference's split copies its gradients)
    leaf = qkv.detach().double().requires_grad_()
    ref, _ = ref_attention(*(t.permute(1, 2, 0, 3) for t in split_qkv(leaf, h, groups, d, interleaved)), d ** -0.5,
                           causal=True)
    ref = ref.permute(2, 0, 1, 3).reshape(s, b, h * d)
    ref.backward(grad.double())
    assert_close_rel(out, ref, OUT_RTOL)
    assert_close_rel(qkv.grad, leaf.grad, GRAD_RTOL[E5M2], "d(qkv)")


def test_module_without_fp8_dpa_makes_no_fp8_state():
    attn = DotProductAttention(4, 16, num_gqa_groups=2, attn_mask_type="causal")
    q, k, v = _module_inputs("cpu", 16)
    with fp8_autocast(fp8_recipe=DelayedScaling()):
        attn(q, k, v)
    assert attn.fp8_scaling.fwd is None


@pytest.mark.parametrize("mask_type,dropout", (("padding", 0.0), ("causal", 0.1)))
def test_module_unsupported_cases_fall_back_with_a_warning(mask_type, dropout):
    attention_fp8._warned.clear()
    attn = DotProductAttention(4, 16, num_gqa_groups=2, attn_mask_type=mask_type, attention_dropout=dropout).eval()
    q, k, v = _module_inputs("cpu", 16)
    mask = torch.zeros(2, 1, 1, 32, dtype=torch.bool) if mask_type == "padding" else None
    with pytest.warns(UserWarning, match=r"fp8_dpa=True\): not in FP8"):
        with fp8_autocast(fp8_recipe=DelayedScaling(fp8_dpa=True)):
            attn.train(dropout > 0)(q, k, v, attention_mask=mask)
    assert attn.fp8_scaling.fwd is None


def test_refused_backward_falls_back_to_dequantized_sdpa(monkeypatch):
    """A backward the op refuses (as cuDNN on Hopper refuses head dims != 128): gradients from PyTorch's SDPA on the
    dequantized FP8 inputs, one warning, and the case skips FP8 while gradients are needed."""
    attention_fp8._warned.clear()
    attention_fp8._refused.clear()
    real = ops.fused_attn_fp8_bwd

    def refuse(*args):
        raise NotImplementedError("fused_attn_fp8_bwd: cuDNN cannot run this case (test)")

    monkeypatch.setattr(attention_fp8.tfp8, "fused_attn_fp8_bwd", refuse)
    attn = DotProductAttention(4, 16, num_gqa_groups=2, attn_mask_type="causal")
    recipe = DelayedScaling(fp8_dpa=True)
    q, k, v = _module_inputs("cpu", 16)
    with fp8_autocast(fp8_recipe=recipe):
        out = attn(q, k, v)
    with pytest.warns(UserWarning, match="backward: fused_attn_fp8_bwd: cuDNN cannot run"):
        out.backward(torch.ones_like(out))
    bhsd = [t.detach().permute(1, 2, 0, 3) for t in (q, k, v)]
    refs = ref_grads(torch.ones(2, 4, 32, 16), *bhsd, 0.25, causal=True)
    for t, want in zip((q, k, v), refs):
        assert_close_rel(t.grad.permute(1, 2, 0, 3), want, 0.1)
    history = attn.fp8_scaling.fwd.amax_history.clone()
    with fp8_autocast(fp8_recipe=recipe):
        attn(*_module_inputs("cpu", 16))
    assert torch.equal(attn.fp8_scaling.fwd.amax_history, history), "the refused case ran FP8 again"
    monkeypatch.setattr(attention_fp8.tfp8, "fused_attn_fp8_bwd", real)
    attention_fp8._refused.clear()


# ---------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ("bshd", "sbhd"))
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("hq,hkv", ((4, 4), (8, 2)))
def test_cuda_fp8_fwd_bwd_head_dim_128_matches_float64(layout, causal, hq, hkv):
    check_op_against_float64("cuda", layout, causal, hq, hkv, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", (False, True))
def test_cuda_fp8_fwd_head_dim_64_matches_float64(causal):
    check_op_against_float64("cuda", "bshd", causal, 8, 2, 64, backward=False)


@pytest.mark.gpu
def test_cuda_fp8_matches_cpu_reference():
    """cuDNN vs the CPU reference on the same FP8 inputs and scales (both emulate the same roundings)."""
    q, k, v = make_qkv("bshd", 2, 8, 2, 128, 128, 128, torch.float32, "cuda")
    ref, _ = ref_attention(q, k, v, 128 ** -0.5, True)
    fwd, out, amax_s, amax_o = run_forward(q, k, v, 128 ** -0.5, True, ref.abs().max().item())
    cpu_args = [t.cpu() if isinstance(t, torch.Tensor) else t for t in (
        fwd["q8"], fwd["k8"], fwd["v8"], *fwd["descales"][:3], one(448.0, "cpu"), one(1 / 448, "cpu"),
        1 / fwd["descales"][3], one(0.0, "cpu"), one(0.0, "cpu"), 128 ** -0.5, True)]
    out8_cpu, stats_cpu = ops.fused_attn_fp8_fwd(*cpu_args)
    assert rel_error(fwd["out8"].float().cpu(), out8_cpu.float()) < 0.05
    assert_close_rel(fwd["stats"].cpu(), stats_cpu, 1e-3, "stats")
    assert abs(amax_o.item() / cpu_args[-3].item() - 1) < 0.05


@pytest.mark.gpu
def test_cuda_fp8_bwd_head_dim_64_is_refused_on_hopper():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the head-dim-128-only FP8 backward is Hopper's limit")
    with pytest.raises(NotImplementedError, match="cuDNN cannot run this case"):
        check_op_against_float64("cuda", "bshd", True, 4, 4, 64)


@pytest.mark.gpu
def test_cuda_module_scaling_over_steps():
    check_module_scaling_over_steps("cuda", d=128, s=128)


@pytest.mark.gpu
def test_cuda_opcheck_and_bad_inputs():
    for name, args in opcheck_args("cuda"):
        torch.library.opcheck(getattr(ops, name).default, args, test_utils=NO_SCHEMA_CHECK)
    for call, match in _bad("cuda"):
        with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
            call()


@pytest.mark.gpu
def test_cuda_multihead_attention_fp8_dpa_trains_like_bf16():
    """MultiheadAttention steps (head dim 128; its GEMMs in FP8 either way) with and without fp8_dpa: the second step
    of each (scales from the first) gives close outputs and input gradients, and FP8 attention does not fall back."""
    torch.manual_seed(0)
    mha = MultiheadAttention(512, 4, attention_dropout=0.0, params_dtype=torch.bfloat16)
    x = torch.randn(128, 2, 512, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    results = []
    for fp8_dpa in (False, False, True, True):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*not in FP8")
            with fp8_autocast(fp8_recipe=DelayedScaling(fp8_dpa=fp8_dpa)):
                out = mha(x)
            out.float().square().mean().backward()
        results.append((out.detach().float(), x.grad.float().clone()))
        x.grad = None
    assert mha.core_attention.fp8_scaling.fwd is not None
    assert_close_rel(results[3][0], results[1][0], OUT_RTOL)
    assert_close_rel(results[3][1], results[1][1], GRAD_RTOL[E5M2], "dx")


def test_fp8_scaling_state_checkpoint_round_trip():
    """The scaling state travels in the module's state dict; a state dict without it (or from before the first FP8
    call) loads with strict=True."""
    attn = DotProductAttention(4, 16, num_gqa_groups=2, attn_mask_type="causal")
    fresh = DotProductAttention(4, 16, num_gqa_groups=2, attn_mask_type="causal")
    fresh.load_state_dict(attn.state_dict(), strict=True)  # no FP8 state yet
    assert fresh.fp8_scaling.fwd is None
    with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=3, fp8_dpa=True)):
        attn(*_module_inputs("cpu", 16))
    fresh.load_state_dict(attn.state_dict(), strict=True)
    for ours, theirs in ((fresh.fp8_scaling.fwd, attn.fp8_scaling.fwd), (fresh.fp8_scaling.bwd, attn.fp8_scaling.bwd)):
        for name in ("amax_history", "scale", "scale_inv"):
            assert torch.equal(getattr(ours, name), getattr(theirs, name))
    assert fresh.fp8_scaling.fwd.scale.data_ptr() != attn.fp8_scaling.fwd.scale.data_ptr()
    fresh.load_state_dict({}, strict=True)  # (e.g. a checkpoint from before FP8 attention): the state is kept
    assert fresh.fp8_scaling.fwd is not None
