"""fp8_gemm's residual (cuBLASLt's C with beta = 1): out = a bᵀ + bias + residual, one rounding; CPU reference and
CUDA kernel vs float64, the padded/misaligned fallback, bad arguments."""
import pytest
import torch

import transformer_fp8  # noqa: F401  (registers the kernels)
from tests.ops.test_gemm import (HIGH_PRECISION_OUT, OPCHECK_UTILS, OUT_RTOL, TC_RTOL, bias_for, misaligned, operands,
                                 reference_f64)
from tests.utils import rel_error

ops = torch.ops.transformer_fp8
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def check(m, k, n, out_dtype, with_bias, device, extra_rtol, offset=0):
    a, sa, b, sb = operands(m, k, n, (E4M3, E4M3), device=device)
    bias = bias_for(n, out_dtype, device) if with_bias else None
    residual = (torch.randn(m, n, device=device) * 30).to(out_dtype)  # the GEMM's scale: the sum is not one term
    residual = misaligned(residual, offset) if offset else residual
    out, _ = ops.fp8_gemm(a, sa, b, sb, out_dtype, bias=bias, residual=residual)
    ref = reference_f64(a, sa, b, sb, bias)[0] + residual.double()
    assert out.dtype == out_dtype and out.shape == (m, n)
    assert rel_error(out, ref) <= OUT_RTOL[out_dtype] + extra_rtol


@pytest.mark.parametrize("m,k,n", [(32, 64, 48), (7, 16, 5)])
@pytest.mark.parametrize("out_dtype", HIGH_PRECISION_OUT)
@pytest.mark.parametrize("with_bias", [False, True])
def test_reference_matches_float64(m, k, n, out_dtype, with_bias):
    check(m, k, n, out_dtype, with_bias, "cpu", 0.0)


def bad_calls(device):
    a, sa, b, sb = operands(16, 32, 24, device=device)
    res = torch.randn(16, 24, device=device).bfloat16()
    return [
        ("residual: expected dtype", lambda: ops.fp8_gemm(a, sa, b, sb, torch.bfloat16, residual=res.float())),
        ("residual: expected shape", lambda: ops.fp8_gemm(a, sa, b, sb, torch.bfloat16, residual=res[:8])),
        ("residual: expected a contiguous",
         lambda: ops.fp8_gemm(a, sa, b, sb, torch.bfloat16, residual=res.t().contiguous().t())),
        ("residual: only for", lambda: ops.fp8_gemm(a, sa, b, sb, torch.bfloat16, gelu=True, residual=res)),
        ("residual: only for", lambda: ops.fp8_gemm(a, sa, b, sb, E4M3, out_scale=torch.ones(1, device=device),
                                                    residual=res)),
    ]


@pytest.mark.parametrize("index", range(5))
def test_bad_inputs_cpu(index):
    match, call = bad_calls("cpu")[index]
    with pytest.raises((TypeError, ValueError), match=match):
        call()


def test_opcheck_cpu():
    a, sa, b, sb = operands(33, 48, 40)
    residual = torch.randn(33, 40).bfloat16()
    torch.library.opcheck(ops.fp8_gemm.default, (a, sa, b, sb, torch.bfloat16),
                          {"bias": bias_for(40, torch.bfloat16), "residual": residual}, test_utils=OPCHECK_UTILS)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(33, 40, 24), (256, 512, 384), (1024, 2048, 4096), (7, 16, 5)])
@pytest.mark.parametrize("out_dtype", HIGH_PRECISION_OUT)
@pytest.mark.parametrize("with_bias", [False, True])
def test_cuda_matches_float64(m, k, n, out_dtype, with_bias):
    """(n = 5 and 24 are padded: the residual is added after the GEMM there.)"""
    check(m, k, n, out_dtype, with_bias, "cuda", TC_RTOL[False])


@pytest.mark.gpu
def test_cuda_misaligned_residual():
    check(64, 32, 48, torch.bfloat16, True, "cuda", TC_RTOL[False], offset=1)


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(5))
def test_bad_inputs_cuda(index):
    match, call = bad_calls("cuda")[index]
    with pytest.raises(RuntimeError, match=match):
        call()


@pytest.mark.gpu
def test_opcheck_cuda():
    a, sa, b, sb = operands(33, 48, 40, device="cuda")
    residual = torch.randn(33, 40, device="cuda").bfloat16()
    torch.library.opcheck(ops.fp8_gemm.default, (a, sa, b, sb, torch.bfloat16),
                          {"bias": bias_for(40, torch.bfloat16, "cuda"), "residual": residual},
                          test_utils=OPCHECK_UTILS)
