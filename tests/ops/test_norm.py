"""LayerNorm / RMSNorm ops: CPU reference kernels against float64 PyTorch, CUDA kernels against both."""
import pytest
import torch
import torch.nn.functional as F

import transformer_fp8  # noqa: F401  (registers the ops)
from tests.utils import FP8_DTYPES, FP8_MAX, FP8_RTOL, assert_close_rel, scalar

ops = torch.ops.transformer_fp8
EPS = 1e-5
# ||out - ref|| / ||ref|| of one rounding to the dtype (plus float32 math), and of a backward pass (a few more).
FWD_RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 6e-3}
BWD_RTOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}
SHAPES = [(1, 64), (7, 1000), (32, 768), (5, 4100), (3, 8192)]


def make_inputs(m, n, dtype, device="cpu", weight_dtype=None):
    """x with a nonzero mean and a spread of row scales; weight near 1 (or near 0 for zero-centered use), bias."""
    weight_dtype = weight_dtype or dtype
    x = (torch.randn(m, n, device=device) * torch.rand(m, 1, device=device) * 3 + 0.5).to(dtype)
    weight = (1 + 0.2 * torch.randn(n, device=device)).to(weight_dtype)
    bias = (0.1 * torch.randn(n, device=device)).to(weight_dtype)
    return x, weight, bias


def gamma64(weight, zero_centered_gamma):
    return weight.double() + (1.0 if zero_centered_gamma else 0.0)


def layernorm_ref(x, weight, bias, zero_centered_gamma):
    """float64 LayerNorm through torch.nn.functional."""
    b = None if bias is None else bias.double()
    return F.layer_norm(x.double(), (x.shape[1],), gamma64(weight, zero_centered_gamma), b, EPS)


def rmsnorm_ref(x, weight, zero_centered_gamma):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(dim=1, keepdim=True) + EPS) * gamma64(weight, zero_centered_gamma)


def fp8_ref(y64, scale, fp8_dtype):
    """What a dequantized FP8 output should approach: y saturated at fp8_max / scale."""
    limit = FP8_MAX[fp8_dtype] / scale
    return y64.clamp(-limit, limit)


def saturating_scale(y64, fp8_dtype):
    """A scale that maps half of max|y| to the format's max, so the largest values saturate."""
    return 2 * FP8_MAX[fp8_dtype] / y64.abs().max().item()


def check_fwd_against_float64(out, y64, dtype, fp8_dtype, scale):
    if fp8_dtype is None:
        assert out.dtype == dtype
        assert_close_rel(out, y64, FWD_RTOL[dtype])
    else:
        assert out.dtype == fp8_dtype
        assert_close_rel(out.double() / scale, fp8_ref(y64, scale, fp8_dtype), FP8_RTOL[fp8_dtype], "dequantized out")


def run_fwd(kind, x, weight, bias, zcg, fp8_dtype, scale, amax=None, scale_inv=None):
    """Calls layernorm_fwd / rmsnorm_fwd with the FP8 arguments; returns (out, mean or None, rstd)."""
    dev = x.device
    kwargs = dict(zero_centered_gamma=zcg, amax=amax, scale_inv=scale_inv)
    if fp8_dtype is not None:
        kwargs.update(scale=scalar(scale, dev), fp8_dtype=fp8_dtype)
    if kind == "layernorm":
        return ops.layernorm_fwd(x, weight, bias, EPS, **kwargs)
    out, rstd = ops.rmsnorm_fwd(x, weight, EPS, **kwargs)
    return out, None, rstd


def reference(kind, x, weight, bias, zcg):
    return layernorm_ref(x, weight, bias, zcg) if kind == "layernorm" else rmsnorm_ref(x, weight, zcg)


# ---------------------------------------------------------------- CPU reference kernels vs float64


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("zcg", [False, True])
def test_fwd_high_precision_matches_float64(kind, shape, dtype, zcg):
    x, weight, bias = make_inputs(*shape, dtype)
    if zcg:
        weight = weight - 1
    out, mean, rstd = run_fwd(kind, x, weight, bias, zcg, None, None)
    check_fwd_against_float64(out, reference(kind, x, weight, bias, zcg), dtype, None, None)
    x64 = x.double()
    if kind == "layernorm":
        assert_close_rel(mean, x64.mean(dim=1), 1e-6, "mean")
        assert_close_rel(rstd, torch.rsqrt(x64.var(dim=1, unbiased=False) + EPS), 1e-5, "rstd")
    else:
        assert_close_rel(rstd, torch.rsqrt(x64.pow(2).mean(dim=1) + EPS), 1e-5, "rstd")
    assert mean is None or mean.dtype == torch.float32
    assert rstd.dtype == torch.float32 and rstd.shape == (shape[0],)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("shape", [(7, 1000), (32, 768), (5, 4100)])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("scale_kind", ["small", "unit", "saturating"])
def test_fwd_fp8_matches_float64(kind, shape, fp8_dtype, scale_kind):
    x, weight, bias = make_inputs(*shape, torch.bfloat16)
    y64 = reference(kind, x, weight, bias, False)
    scale = {"small": 0.25, "unit": 1.0, "saturating": saturating_scale(y64, fp8_dtype)}[scale_kind]
    amax, scale_inv = scalar(0.0), scalar(-1.0)
    out, _, _ = run_fwd(kind, x, weight, bias, False, fp8_dtype, scale, amax, scale_inv)
    check_fwd_against_float64(out, y64, torch.bfloat16, fp8_dtype, scale)
    assert torch.isfinite(out.float()).all()
    if scale_kind == "saturating":
        assert out.float().abs().max().item() == FP8_MAX[fp8_dtype]
    assert amax.item() == pytest.approx(y64.abs().max().item(), rel=1e-5)
    assert scale_inv.item() == pytest.approx(1 / scale, rel=1e-7)


def test_fwd_amax_keeps_larger_value_and_works_without_fp8():
    x, weight, bias = make_inputs(4, 256, torch.bfloat16)
    amax = scalar(1e6)
    ops.layernorm_fwd(x, weight, bias, EPS, scale=scalar(1.0), fp8_dtype=torch.float8_e4m3fn, amax=amax)
    assert amax.item() == 1e6
    amax = scalar(0.0)
    out, _ = ops.rmsnorm_fwd(x, weight, EPS, amax=amax)
    assert amax.item() == pytest.approx(rmsnorm_ref(x, weight, False).abs().max().item(), rel=1e-5)
    assert out.dtype == torch.bfloat16


def test_fwd_float32_weight_with_bf16_input():
    x, weight, bias = make_inputs(9, 1000, torch.bfloat16, weight_dtype=torch.float32)
    out, _, _ = ops.layernorm_fwd(x, weight, bias, EPS)
    assert out.dtype == torch.bfloat16
    assert_close_rel(out, layernorm_ref(x, weight, bias, False), FWD_RTOL[torch.bfloat16])


def test_layernorm_without_bias():
    x, weight, _ = make_inputs(5, 300, torch.float32)
    out, _, _ = ops.layernorm_fwd(x, weight, None, EPS)
    assert_close_rel(out, layernorm_ref(x, weight, None, False), FWD_RTOL[torch.float32])


def autograd_ref(kind, x, weight, bias, zcg, dy):
    """float64 gradients (dx, dgamma[, dbeta]) through torch.autograd."""
    x64 = x.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    b64 = bias.double().requires_grad_()
    y = reference(kind, x64, w64, b64 if kind == "layernorm" else None, zcg)
    y.backward(dy.double())
    return (x64.grad, w64.grad, b64.grad) if kind == "layernorm" else (x64.grad, w64.grad)


def run_bwd(kind, dy, x, mean, rstd, weight, zcg, **kwargs):
    if kind == "layernorm":
        return ops.layernorm_bwd(dy, x, mean, rstd, weight, zcg, **kwargs)
    return ops.rmsnorm_bwd(dy, x, rstd, weight, zcg, **kwargs)


def check_dx_add(kind, m, n, dtype, device):
    """dx_add joins dx (one rounding): dx(dx_add) vs float64 autograd's dx + dx_add; dgamma/dbeta unchanged."""
    x, weight, bias = make_inputs(m, n, dtype, device)
    dy, dx_add = (torch.randn(m, n, device=device).to(dtype) for _ in range(2))
    _, mean, rstd = run_fwd(kind, x, weight, bias, False, None, None)
    grads = run_bwd(kind, dy, x, mean, rstd, weight, False, dx_add=dx_add)
    plain = run_bwd(kind, dy, x, mean, rstd, weight, False)
    refs = autograd_ref(kind, x, weight, bias, False, dy)
    assert_close_rel(grads[0], refs[0] + dx_add.double(), BWD_RTOL[dtype], "dx + dx_add")
    for got, want in zip(grads[1:], plain[1:]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("shape", [(1, 64), (7, 1000), (32, 768), (5, 4100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("zcg", [False, True])
def test_bwd_matches_autograd_float64(kind, shape, dtype, zcg):
    x, weight, bias = make_inputs(*shape, dtype)
    dy = torch.randn(shape).to(dtype)
    _, mean, rstd = run_fwd(kind, x, weight, bias, zcg, None, None)
    grads = run_bwd(kind, dy, x, mean, rstd, weight, zcg)
    refs = autograd_ref(kind, x, weight, bias, zcg, dy)
    for name, got, ref in zip(("dx", "dgamma", "dbeta"), grads, refs):
        assert got.dtype == dtype and got.shape == ref.shape
        assert_close_rel(got, ref, BWD_RTOL[dtype], name)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("shape", [(7, 1000), (32, 768)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bwd_dx_add(kind, shape, dtype):
    check_dx_add(kind, *shape, dtype, "cpu")


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_empty_rows(kind):
    x, weight, bias = make_inputs(0, 128, torch.bfloat16)
    amax = scalar(0.5)
    out, mean, rstd = run_fwd(kind, x, weight, bias, False, torch.float8_e4m3fn, 1.0, amax)
    assert out.shape == (0, 128) and out.dtype == torch.float8_e4m3fn and rstd.shape == (0,)
    assert amax.item() == 0.5
    grads = run_bwd(kind, x, x, mean, rstd, weight, False)
    assert grads[0].shape == (0, 128)
    for g in grads[1:]:
        assert g.shape == (128,) and (g == 0).all()


def opcheck_cases(device):
    x, weight, bias = make_inputs(5, 96, torch.bfloat16, device)
    dy = torch.randn_like(x)
    mean = x.float().mean(dim=1)
    rstd = torch.rand(5, device=device) + 0.5
    fp8 = dict(scale=scalar(2.0, device), fp8_dtype=torch.float8_e4m3fn, amax=scalar(0.0, device),
               scale_inv=scalar(0.0, device))
    return [
        (ops.layernorm_fwd, (x, weight, bias, EPS), {}),
        (ops.layernorm_fwd, (x, weight, None, EPS, True), fp8),
        (ops.rmsnorm_fwd, (x, weight, EPS), {}),
        (ops.rmsnorm_fwd, (x, weight, EPS, False), fp8),
        (ops.layernorm_bwd, (dy, x, mean, rstd, weight, True), {}),
        (ops.rmsnorm_bwd, (dy, x, rstd, weight), {}),
    ]


@pytest.mark.parametrize("case", range(6))
def test_opcheck_cpu(case):
    op, args, kwargs = opcheck_cases("cpu")[case]
    torch.library.opcheck(op, args, kwargs)


# ---------------------------------------------------------------- argument checks


def bad_calls():
    x, w, b = make_inputs(4, 64, torch.bfloat16)
    stat = torch.zeros(4)
    s = scalar(1.0)
    e4m3 = torch.float8_e4m3fn
    return [
        ("input", TypeError, lambda: ops.layernorm_fwd(x.int(), w, b, EPS)),
        ("input", ValueError, lambda: ops.rmsnorm_fwd(x[0], w, EPS)),
        ("input", ValueError, lambda: ops.rmsnorm_fwd(x.t(), w[:4], EPS)),
        ("weight", ValueError, lambda: ops.layernorm_fwd(x, w[:10], b, EPS)),
        ("weight", TypeError, lambda: ops.rmsnorm_fwd(x, w.half(), EPS)),
        ("bias", ValueError, lambda: ops.layernorm_fwd(x, w, b[:3], EPS)),
        ("bias", TypeError, lambda: ops.layernorm_fwd(x, w, b.float(), EPS)),
        ("weight", ValueError, lambda: ops.rmsnorm_fwd(x, torch.randn(64, 2, dtype=torch.bfloat16)[:, 0], EPS)),
        ("scale", ValueError, lambda: ops.layernorm_fwd(x, w, b, EPS, fp8_dtype=e4m3)),
        ("scale", TypeError, lambda: ops.rmsnorm_fwd(x, w, EPS, scale=s.double(), fp8_dtype=e4m3)),
        ("fp8_dtype", ValueError, lambda: ops.rmsnorm_fwd(x, w, EPS, scale=s, fp8_dtype=torch.bfloat16)),
        ("fp8_dtype", ValueError, lambda: ops.rmsnorm_fwd(x, w, EPS, scale=s)),
        ("amax", ValueError, lambda: ops.rmsnorm_fwd(x, w, EPS, scale=s, fp8_dtype=e4m3, amax=torch.zeros(2))),
        ("scale_inv", TypeError,
         lambda: ops.rmsnorm_fwd(x, w, EPS, scale=s, fp8_dtype=e4m3, scale_inv=torch.zeros(1, dtype=torch.half))),
        ("grad_out", ValueError, lambda: ops.rmsnorm_bwd(x[:2], x, stat, w)),
        ("grad_out", TypeError, lambda: ops.layernorm_bwd(x.float(), x, stat, stat, w)),
        ("mean", ValueError, lambda: ops.layernorm_bwd(x, x, stat[:3], stat, w)),
        ("rstd", TypeError, lambda: ops.rmsnorm_bwd(x, x, stat.double(), w)),
        ("weight", ValueError, lambda: ops.rmsnorm_bwd(x, x, stat, w[:5])),
        ("dx_add", ValueError, lambda: ops.rmsnorm_bwd(x, x, stat, w, dx_add=x[:2])),
        ("dx_add", TypeError, lambda: ops.layernorm_bwd(x, x, stat, stat, w, dx_add=x.double())),
    ]


@pytest.mark.parametrize("case", range(len(bad_calls())))
def test_bad_arguments_are_named(case):
    arg, exc, call = bad_calls()[case]
    with pytest.raises(exc, match=rf"^{arg}:"):
        call()


# ---------------------------------------------------------------- CUDA kernels


def count_fp8_mismatches(a, b):
    return (a.view(torch.uint8) != b.view(torch.uint8)).sum().item()


# bf16 kernel paths: rows in registers (N a multiple of 8: 768 ... 20000 forward, up to 16384 backward) and the
# general path (4100: not a multiple of 8; 40000: too long a row; 20000 backward).
GPU_NS = [768, 1024, 4096, 8192, 1000, 24, 16384, 20000, 4100, 40000]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("n", GPU_NS)
@pytest.mark.parametrize("fp8_dtype", [None, *FP8_DTYPES])
def test_cuda_fwd_bf16_matches_reference(kind, n, fp8_dtype):
    m = 37
    x, weight, bias = make_inputs(m, n, torch.bfloat16, "cuda")
    y64 = reference(kind, x, weight, bias, False)
    scale = 1.0 if fp8_dtype is None else saturating_scale(y64, fp8_dtype)
    results = {}
    for dev in ("cuda", "cpu"):
        amax, scale_inv = scalar(0.0, dev), None if fp8_dtype is None else scalar(0.0, dev)
        args = [t.to(dev) for t in (x, weight, bias)]
        results[dev] = (*run_fwd(kind, *args, False, fp8_dtype, scale, amax, scale_inv), amax, scale_inv)
    (out, mean, rstd, amax, scale_inv), (out_c, mean_c, rstd_c, amax_c, _) = results["cuda"], results["cpu"]
    check_fwd_against_float64(out.cpu(), y64.cpu(), torch.bfloat16, fp8_dtype, scale)
    if fp8_dtype is None:
        assert_close_rel(out.cpu(), out_c, 2e-3, "out vs CPU reference")
    else:
        mismatches = count_fp8_mismatches(out.cpu(), out_c)
        assert mismatches <= max(1, out.numel() // 1000), f"{mismatches} of {out.numel()} FP8 bytes differ"
        assert scale_inv.item() == pytest.approx(1 / scale, rel=1e-7)
    assert_close_rel(rstd.cpu(), rstd_c, 1e-5, "rstd")
    if mean is not None:
        assert_close_rel(mean.cpu(), mean_c, 1e-5, "mean")
    assert amax.item() == pytest.approx(amax_c.item(), rel=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, None), (torch.float16, None),
                                                (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("n", [1024, 1000])
def test_cuda_fwd_other_dtypes_zero_centered(kind, dtype, weight_dtype, n):
    x, weight, bias = make_inputs(19, n, dtype, "cuda", weight_dtype)
    weight = weight - 1
    out, _, _ = run_fwd(kind, x, weight, bias, True, None, None)
    out_c, _, _ = run_fwd(kind, x.cpu(), weight.cpu(), bias.cpu(), True, None, None)
    assert out.dtype == dtype
    check_fwd_against_float64(out.cpu(), reference(kind, x, weight, bias, True).cpu(), dtype, None, None)
    assert_close_rel(out.cpu(), out_c, FWD_RTOL[dtype] / 2, "out vs CPU reference")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("m,n", [(37, 1000), (1000, 4096), (300, 20000)])  # (20000 columns: the general kernel)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_bwd_dx_add(kind, m, n, dtype):
    check_dx_add(kind, m, n, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("m,n", [(37, n) for n in GPU_NS] + [(1000, 1024), (1000, 4096), (300, 8192), (300, 20000)])
@pytest.mark.parametrize("dtype,weight_dtype", [(torch.bfloat16, None), (torch.bfloat16, torch.float32),
                                                (torch.float32, None)])
def test_cuda_bwd_matches_reference(kind, m, n, dtype, weight_dtype):
    x, weight, bias = make_inputs(m, n, dtype, "cuda", weight_dtype)
    dy = torch.randn(m, n, device="cuda").to(dtype)
    _, mean, rstd = run_fwd(kind, x, weight, bias, True, None, None)
    grads = run_bwd(kind, dy, x, mean, rstd, weight, True)
    grads_c = run_bwd(kind, *[t.cpu() if t is not None else None for t in (dy, x, mean, rstd, weight)], True)
    refs = autograd_ref(kind, x, weight, bias, True, dy)
    for name, got, cpu, ref in zip(("dx", "dgamma", "dbeta"), grads, grads_c, refs):
        assert got.dtype == cpu.dtype and got.shape == cpu.shape
        assert_close_rel(got.cpu(), cpu, BWD_RTOL[dtype] / 2, f"{name} vs CPU reference")
        assert_close_rel(got.cpu(), ref.cpu(), BWD_RTOL[dtype], f"{name} vs float64")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_cuda_bwd_is_deterministic(kind):
    x, weight, bias = make_inputs(3000, 1024, torch.bfloat16, "cuda", torch.float32)
    dy = torch.randn_like(x)
    _, mean, rstd = run_fwd(kind, x, weight, bias, False, None, None)
    first = run_bwd(kind, dy, x, mean, rstd, weight, False)
    second = run_bwd(kind, dy, x, mean, rstd, weight, False)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_cuda_misaligned_pointers_take_the_general_path(kind):
    m, n = 33, 1024
    x, weight, bias = make_inputs(m, n, torch.bfloat16, "cuda")
    storage = torch.empty(m * n + 1, dtype=x.dtype, device="cuda")
    x_off = storage[1:].view(m, n).copy_(x)  # contiguous, data pointer 2 bytes past a 16-byte boundary
    dy = torch.randn(m, n, device="cuda").to(x.dtype)
    out, mean, rstd = run_fwd(kind, x_off, weight, bias, False, torch.float8_e4m3fn, 8.0)
    out_c, mean_c, rstd_c = run_fwd(kind, x.cpu(), weight.cpu(), bias.cpu(), False, torch.float8_e4m3fn, 8.0)
    assert count_fp8_mismatches(out.cpu(), out_c) <= 1
    grads = run_bwd(kind, dy, x_off, mean, rstd, weight, False)
    grads_c = run_bwd(kind, dy.cpu(), x.cpu(), mean_c, rstd_c, weight.cpu(), False)
    for got, cpu in zip(grads, grads_c):
        assert_close_rel(got.cpu(), cpu, BWD_RTOL[torch.bfloat16] / 2)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_cuda_empty_rows(kind):
    x, weight, bias = make_inputs(0, 1024, torch.bfloat16, "cuda")
    amax = scalar(0.5, "cuda")
    out, mean, rstd = run_fwd(kind, x, weight, bias, False, torch.float8_e5m2, 1.0, amax)
    assert out.shape == (0, 1024) and out.dtype == torch.float8_e5m2 and rstd.shape == (0,)
    assert amax.item() == 0.5
    grads = run_bwd(kind, x, x, mean, rstd, weight, False)
    assert grads[0].shape == (0, 1024)
    for g in grads[1:]:
        assert g.shape == (1024,) and (g == 0).all()


@pytest.mark.gpu
def test_cuda_nan_input_propagates_to_amax():
    x, weight, bias = make_inputs(4, 1024, torch.bfloat16, "cuda")
    x[2, 5] = float("nan")
    amax = scalar(0.0, "cuda")
    ops.layernorm_fwd(x, weight, bias, EPS, scale=scalar(1.0, "cuda"), fp8_dtype=torch.float8_e4m3fn, amax=amax)
    assert amax.isnan().item()


@pytest.mark.gpu
def test_cuda_rejects_cpu_weight():
    x, weight, bias = make_inputs(4, 1024, torch.bfloat16, "cuda")
    with pytest.raises(RuntimeError, match="weight"):
        ops.layernorm_fwd(x, weight.cpu(), bias, EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(6))
def test_opcheck_cuda(case):
    op, args, kwargs = opcheck_cases("cuda")[case]
    torch.library.opcheck(op, args, kwargs)

