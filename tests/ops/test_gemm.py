"""fp8_gemm, fp8_gemm_accumulate: CPU reference vs float64; CUDA vs CPU reference, float64 and torch._scaled_mm."""
import pytest
import torch

import transformer_fp8  # noqa: F401  (registers the kernels)
from tests.utils import FP8_DTYPES, FP8_MAX, FP8_RTOL, rel_error, scalar

ops = torch.ops.transformer_fp8
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Operand pairs the FP8 tensor cores take (E5M2 x E5M2 is not one of them).
OPERAND_DTYPES = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)]
SHAPES = [(32, 64, 48), (33, 40, 24), (7, 16, 5), (1, 48, 17), (128, 256, 96)]  # (M, K, N)
HIGH_PRECISION_OUT = (torch.float32, torch.bfloat16, torch.float16)
# ||out - ref|| / ||ref|| of one rounding of the result to the output dtype (float32: summation order only).
OUT_RTOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3, torch.float16: 1e-3}
# Hopper's FP8 tensor cores keep only about 14 mantissa bits while accumulating; cuBLASLt's split accumulator promotes
# the partial sums to float32 every few K-steps, fast accumulation never does. Extra ||out - ref|| / ||ref|| allowed
# for K <= 1024, keyed by fast_accum:
TC_RTOL = {False: 3e-4, True: 3e-3}


def random_fp8(shape, dtype, device="cpu"):
    """Random FP8 values spread over a few binades (not zero, not saturated)."""
    return (torch.randn(shape, device=device) * 4).to(dtype)


def operands(m, k, n, dtypes=(E4M3, E4M3), scale_invs=(0.5, 0.03), device="cpu"):
    a, b = random_fp8((m, k), dtypes[0], device), random_fp8((n, k), dtypes[1], device)
    return a, scalar(scale_invs[0], device), b, scalar(scale_invs[1], device)


def bias_for(n, out_dtype, device="cpu"):
    dtype = torch.float16 if out_dtype == torch.float16 else torch.bfloat16
    return torch.randn(n, device=device).to(dtype)


def reference_f64(a, a_scale_inv, b, b_scale_inv, bias=None, gelu=False):
    """(result, pre-activation) in float64 from plain PyTorch."""
    result = (a.double() * a_scale_inv.double()) @ (b.double() * b_scale_inv.double()).t()
    if bias is not None:
        result = result + bias.double()
    pre = result
    if gelu:
        result = torch.nn.functional.gelu(result, approximate="tanh")
    return result, pre


def dequantized(out, out_scale):
    return out.double() / out_scale.double()


def fp8_out_scale(ref, out_dtype):
    """A scale that maps max|ref| to half the format's range (no saturation)."""
    return scalar(FP8_MAX[out_dtype] / 2 / ref.abs().max().item(), ref.device)


# ---------------------------------------------------------------------------------------------- CPU reference


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("dtypes", OPERAND_DTYPES)
@pytest.mark.parametrize("out_dtype", HIGH_PRECISION_OUT)
@pytest.mark.parametrize("scale_invs", [(1.0, 1.0), (0.5, 0.03), (7.5, 0.002)])
def test_reference_matches_float64(m, k, n, dtypes, out_dtype, scale_invs):
    a, sa, b, sb = operands(m, k, n, dtypes, scale_invs)
    out, pre_gelu = ops.fp8_gemm(a, sa, b, sb, out_dtype)
    ref, _ = reference_f64(a, sa, b, sb)
    assert out.dtype == out_dtype and out.shape == (m, n) and pre_gelu.numel() == 0
    assert rel_error(out, ref) <= OUT_RTOL[out_dtype]


@pytest.mark.parametrize("out_dtype", HIGH_PRECISION_OUT)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("gelu", [False, True])
def test_reference_bias_gelu(out_dtype, with_bias, gelu):
    a, sa, b, sb = operands(33, 64, 40)
    bias = bias_for(40, out_dtype) if with_bias else None
    out, pre_gelu = ops.fp8_gemm(a, sa, b, sb, out_dtype, bias=bias, gelu=gelu)
    ref, pre = reference_f64(a, sa, b, sb, bias, gelu)
    assert rel_error(out, ref) <= OUT_RTOL[out_dtype]
    if gelu:
        assert pre_gelu.dtype == (bias.dtype if with_bias else out_dtype)
        assert rel_error(pre_gelu, pre) <= OUT_RTOL[pre_gelu.dtype]
    else:
        assert pre_gelu.numel() == 0


@pytest.mark.parametrize("out_dtype", FP8_DTYPES)
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float16])
def test_reference_fp8_output_and_amax(out_dtype, gelu, bias_dtype):
    a, sa, b, sb = operands(17, 32, 48, (E4M3, E5M2))
    bias = None if bias_dtype is None else torch.randn(48).to(bias_dtype)
    ref, pre = reference_f64(a, sa, b, sb, bias, gelu)
    out_scale, amax = fp8_out_scale(ref, out_dtype), scalar(0.0)
    out, pre_gelu = ops.fp8_gemm(a, sa, b, sb, out_dtype, bias=bias, gelu=gelu, out_scale=out_scale, out_amax=amax)
    assert out.dtype == out_dtype
    assert rel_error(dequantized(out, out_scale), ref) <= FP8_RTOL[out_dtype]
    assert amax.item() == pytest.approx(ref.abs().max().item(), rel=1e-5)
    if gelu:
        assert pre_gelu.dtype == (bias_dtype or torch.bfloat16)
        assert rel_error(pre_gelu, pre) <= OUT_RTOL[pre_gelu.dtype]


def test_reference_fp8_output_saturates_and_amax_accumulates():
    a, sa, b, sb = operands(16, 32, 16)
    ref, _ = reference_f64(a, sa, b, sb)
    big = 10 * ref.abs().max().item()
    amax = scalar(big)
    out, _ = ops.fp8_gemm(a, sa, b, sb, E4M3, out_scale=scalar(1e6), out_amax=amax)
    assert amax.item() == scalar(big).item()  # max-accumulated: a larger amax stays
    expected = (ref * 1e6).clamp(-448, 448)
    assert torch.equal(out.float(), expected.float().to(E4M3).float())
    assert (out.float().abs() == 448).float().mean() > 0.9


@pytest.mark.parametrize("m,k,n", [(33, 40, 24), (8, 16, 16)])
def test_reference_accumulate(m, k, n):
    a, sa, b, sb = operands(m, k, n, (E5M2, E4M3))
    out = torch.randn(m, n)
    expected = out.double() + reference_f64(a, sa, b, sb)[0]
    ops.fp8_gemm_accumulate(a, sa, b, sb, out)
    assert rel_error(out, expected) <= 1e-5


def test_reference_empty_and_k_zero():
    a, sa, b, sb = operands(0, 32, 8)
    assert ops.fp8_gemm(a, sa, b, sb, torch.bfloat16)[0].shape == (0, 8)
    a, sa, b, sb = operands(5, 0, 8)
    bias = bias_for(8, torch.float32)
    out, _ = ops.fp8_gemm(a, sa, b, sb, torch.float32, bias=bias)
    assert torch.equal(out, bias.float().expand(5, 8))


def opcheck_cases(device):
    a, sa, b, sb = operands(33, 48, 40, device=device)
    bias = bias_for(40, torch.bfloat16, device)
    acc = torch.randn(33, 40, device=device)
    return [
        (ops.fp8_gemm.default, (a, sa, b, sb, torch.bfloat16), {}),
        (ops.fp8_gemm.default, (a, sa, b, sb, torch.float32), {"bias": bias, "gelu": True}),
        (ops.fp8_gemm.default, (a, sa, b, sb, E4M3),
         {"bias": bias, "out_scale": scalar(2.0, device), "out_amax": scalar(0.0, device),
          "use_split_accumulator": False}),
        (ops.fp8_gemm_accumulate.default, (a, sa, b, sb, acc), {}),
    ]


# opcheck's test_schema compares inputs before/after with torch.allclose, which has no float8 kernel: skip that one.
OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("case", range(4))
def test_opcheck_cpu(case):
    op, args, kwargs = opcheck_cases("cpu")[case]
    torch.library.opcheck(op, args, kwargs, test_utils=OPCHECK_UTILS)


def bad_calls(device):
    """(match, callable) pairs: each call must raise an error naming the argument."""
    a, sa, b, sb = operands(16, 32, 16, device=device)
    b5 = b.to(E5M2)
    return [
        ("a: expected torch.float8", lambda: ops.fp8_gemm(a.float(), sa, b, sb, torch.bfloat16)),
        ("b: expected a 2-D", lambda: ops.fp8_gemm(a, sa, b[0], sb, torch.bfloat16)),
        ("b: expected K = 32", lambda: ops.fp8_gemm(a, sa, b[:, :16].contiguous(), sb, torch.bfloat16)),
        ("a: expected a K-contiguous", lambda: ops.fp8_gemm(a.t(), sa, b, sb, torch.bfloat16)),
        ("E5M2 x E5M2", lambda: ops.fp8_gemm(a.to(E5M2), sa, b5, sb, torch.bfloat16)),
        ("a_scale_inv: expected a float32", lambda: ops.fp8_gemm(a, sa.double(), b, sb, torch.bfloat16)),
        ("b_scale_inv: expected one element", lambda: ops.fp8_gemm(a, sa, b, sb.expand(2), torch.bfloat16)),
        ("bias: expected shape", lambda: ops.fp8_gemm(a, sa, b, sb, torch.bfloat16,
                                                      bias=bias_for(15, torch.bfloat16, device))),
        ("bias: expected dtype", lambda: ops.fp8_gemm(a, sa, b, sb, torch.float32,
                                                      bias=torch.zeros(16, device=device))),
        ("out_scale: required", lambda: ops.fp8_gemm(a, sa, b, sb, E4M3)),
        ("out_dtype: expected", lambda: ops.fp8_gemm(a, sa, b, sb, torch.float64)),
        ("out: expected shape", lambda: ops.fp8_gemm_accumulate(a, sa, b, sb, torch.zeros(16, 8, device=device))),
        ("out: expected a float32", lambda: ops.fp8_gemm_accumulate(a, sa, b, sb,
                                                                   torch.zeros(16, 16, device=device).bfloat16())),
    ]


@pytest.mark.parametrize("case", range(13))
def test_bad_inputs_cpu(case):
    match, call = bad_calls("cpu")[case]
    with pytest.raises((TypeError, ValueError), match=match):
        call()


# ---------------------------------------------------------------------------------------------- CUDA kernels


def mismatch_fraction(x, y):
    """Fraction of elements whose bytes differ."""
    return (x.view(torch.uint8) != y.view(torch.uint8)).float().mean().item() if x.numel() else 0.0


def cpu_reference(*args, **kwargs):
    cpu = [t.cpu() if isinstance(t, torch.Tensor) else t for t in args]
    cpu_kwargs = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    return ops.fp8_gemm(*cpu, **cpu_kwargs), cpu_kwargs


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(256, 512, 384), (33, 40, 24), (1024, 1024, 2048), (17, 3, 5)])
@pytest.mark.parametrize("dtypes", OPERAND_DTYPES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fast_accum", [False, True])
def test_cuda_matches_scaled_mm(m, k, n, dtypes, out_dtype, fast_accum):
    a, sa, b, sb = operands(m, k, n, dtypes, device="cuda")
    out, _ = ops.fp8_gemm(a, sa, b, sb, out_dtype, use_split_accumulator=not fast_accum)
    ref, _ = reference_f64(a, sa, b, sb)
    assert rel_error(out, ref) <= OUT_RTOL[out_dtype] + TC_RTOL[fast_accum]
    if k % 16 or n % 16:
        return  # _scaled_mm takes no such shapes; the float64 comparison above covers them
    theirs = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=fast_accum)
    assert rel_error(out, theirs) <= (1e-6 if out_dtype == torch.float32 else 1e-3)
    assert mismatch_fraction(out, theirs) <= 0.02


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(33, 40, 24), (256, 512, 384)])
@pytest.mark.parametrize("out_dtype", HIGH_PRECISION_OUT)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("gelu", [False, True])
def test_cuda_bias_gelu(m, k, n, out_dtype, with_bias, gelu):
    a, sa, b, sb = operands(m, k, n, (E4M3, E5M2), device="cuda")
    bias = bias_for(n, out_dtype, "cuda") if with_bias else None
    out, pre_gelu = ops.fp8_gemm(a, sa, b, sb, out_dtype, bias=bias, gelu=gelu)
    (ref_out, ref_pre), _ = cpu_reference(a, sa, b, sb, out_dtype, bias=bias, gelu=gelu)
    f64, f64_pre = reference_f64(a, sa, b, sb, bias, gelu)
    assert out.dtype == ref_out.dtype and pre_gelu.dtype == ref_pre.dtype and pre_gelu.shape == ref_pre.shape
    tol = OUT_RTOL[out_dtype] + TC_RTOL[False] + 1e-3 * gelu  # GELU: cuBLASLt's own tanh approximation
    assert rel_error(out.cpu(), ref_out) <= 2 * tol
    assert rel_error(out, f64) <= tol
    if gelu:
        pre_tol = OUT_RTOL[pre_gelu.dtype] + TC_RTOL[False]
        assert rel_error(pre_gelu, f64_pre) <= pre_tol
        assert rel_error(pre_gelu.cpu(), ref_pre) <= 2 * pre_tol


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(33, 40, 24), (256, 512, 384)])
@pytest.mark.parametrize("dtypes", OPERAND_DTYPES)
@pytest.mark.parametrize("out_dtype", FP8_DTYPES)
@pytest.mark.parametrize("epilogue", ["none", "bias", "gelu", "bias_gelu"])
def test_cuda_fp8_output_and_amax(m, k, n, dtypes, out_dtype, epilogue):
    a, sa, b, sb = operands(m, k, n, dtypes, device="cuda")
    bias = bias_for(n, torch.bfloat16, "cuda") if "bias" in epilogue else None
    gelu = "gelu" in epilogue
    f64, _ = reference_f64(a, sa, b, sb, bias, gelu)
    out_scale, amax = fp8_out_scale(f64, out_dtype), scalar(0.0, "cuda")
    kwargs = dict(bias=bias, gelu=gelu, out_scale=out_scale, out_amax=amax)
    (ref_out, _), cpu_kwargs = cpu_reference(a, sa, b, sb, out_dtype, **kwargs)
    try:
        out, _ = ops.fp8_gemm(a, sa, b, sb, out_dtype, **kwargs)
    except RuntimeError as e:  # cuBLASLt does not take every combination: it must say so, naming the dtypes
        assert "not supported" in str(e) and str(out_dtype).split(".")[-1] in str(e)
        pytest.skip(f"cuBLASLt: {e}")
    # cuBLASLt's GELU differs from torch's in the far negative tail (values near 0, or -0 against 0), which the FP8
    # scale turns into byte mismatches; compare the bytes of the outputs above 1% of the largest.
    significant = ref_out.float().abs() >= 0.01 * ref_out.float().abs().max() if gelu else slice(None)
    out_bytes, ref_bytes = out.cpu().view(torch.uint8), ref_out.view(torch.uint8)
    assert mismatch_fraction(out_bytes[significant], ref_bytes[significant]) <= 0.02
    assert rel_error(dequantized(out, out_scale), f64) <= FP8_RTOL[out_dtype]
    assert amax.item() == pytest.approx(cpu_kwargs["out_amax"].item(), rel=1e-3)
    # amax is max-accumulated: a larger value stays
    ops.fp8_gemm(a, sa, b, sb, out_dtype, **{**kwargs, "out_amax": amax.fill_(1e30)})
    assert amax.item() == scalar(1e30).item()


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(33, 40, 24), (512, 1024, 256), (5, 16, 3)])
@pytest.mark.parametrize("fast_accum", [False, True])
def test_cuda_accumulate(m, k, n, fast_accum):
    a, sa, b, sb = operands(m, k, n, (E5M2, E4M3), device="cuda")
    out = torch.randn(m, n, device="cuda")
    expected = out.double() + reference_f64(a, sa, b, sb)[0]
    ops.fp8_gemm_accumulate(a, sa, b, sb, out, use_split_accumulator=not fast_accum)
    assert rel_error(out, expected) <= 1e-5 + TC_RTOL[fast_accum]


def misaligned(t, offset):
    """A contiguous copy of t whose data starts `offset` elements into its storage."""
    flat = torch.empty(t.numel() + offset, dtype=t.dtype, device=t.device)
    view = flat[offset:].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.gpu
def test_cuda_misaligned_pointers():
    """Operands and accumulate output whose data pointers are not 16-byte aligned still give the right result."""
    a, sa, b, sb = operands(64, 32, 48, device="cuda")
    a, b = misaligned(a, 8), misaligned(b, 4)
    out, _ = ops.fp8_gemm(a, sa, b, sb, torch.bfloat16)
    assert rel_error(out, reference_f64(a, sa, b, sb)[0]) <= OUT_RTOL[torch.bfloat16]
    acc = misaligned(torch.randn(64, 48, device="cuda"), 1)
    expected = acc.double() + reference_f64(a, sa, b, sb)[0]
    ops.fp8_gemm_accumulate(a, sa, b, sb, acc)
    assert rel_error(acc, expected) <= 1e-5 + TC_RTOL[False]


@pytest.mark.gpu
def test_cuda_empty_and_k_zero():
    a, sa, b, sb = operands(0, 32, 8, device="cuda")
    out, pre = ops.fp8_gemm(a, sa, b, sb, torch.bfloat16, gelu=True)
    assert out.shape == (0, 8) and pre.shape == (0, 8)
    a, sa, b, sb = operands(6, 32, 0, device="cuda")
    assert ops.fp8_gemm(a, sa, b, sb, torch.float32)[0].shape == (6, 0)
    a, sa, b, sb = operands(5, 0, 8, device="cuda")
    bias = bias_for(8, torch.float32, "cuda")
    out, pre = ops.fp8_gemm(a, sa, b, sb, torch.float32, bias=bias, gelu=True)
    assert torch.equal(pre, bias.expand(5, 8))
    assert rel_error(out, torch.nn.functional.gelu(bias.double(), approximate="tanh").expand(5, 8)) <= 1e-3
    acc = torch.randn(5, 8, device="cuda")
    expected = acc.clone()
    ops.fp8_gemm_accumulate(a, sa, b, sb, acc)
    assert torch.equal(acc, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(4))
def test_opcheck_cuda(case):
    op, args, kwargs = opcheck_cases("cuda")[case]
    torch.library.opcheck(op, args, kwargs, test_utils=OPCHECK_UTILS)


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(13))
def test_bad_inputs_cuda(case):
    match, call = bad_calls("cuda")[case]
    with pytest.raises(RuntimeError, match=match):
        call()
