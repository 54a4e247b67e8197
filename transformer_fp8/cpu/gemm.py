"""CPU reference kernels of the gemm ops: FP8 "TN" GEMM with scale_inv per operand, bias/GELU epilogue, FP8 output.

out [M, N] = (a * a_scale_inv) @ (b * b_scale_inv)^T (+ bias, + residual), a [M, K] and b [N, K] row-major FP8. Math
in float32 (as the tensor cores accumulate); use_split_accumulator only selects the CUDA kernel's accumulation mode
and does not change the reference.
"""
import torch

from ._common import FP8_MAX, accumulate_amax, check_fp8_dtype, check_scalar_f32, register, saturating_cast

OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, *FP8_MAX)


def allowed_bias_dtypes(out_dtype):
    """Bias dtypes cuBLASLt's FP8 GEMM takes for an output dtype (FP8 outputs: the bias dtype is the C dtype)."""
    if out_dtype == torch.float16:
        return (torch.float16,)
    if out_dtype in FP8_MAX:
        return (torch.bfloat16, torch.float16)
    return (torch.bfloat16,)


def pre_gelu_dtype(out_dtype, bias):
    """dtype of the GELU input returned as pre_gelu: the bias dtype, else the output's (BF16 for an FP8 output)."""
    if bias is not None:
        return bias.dtype
    return torch.bfloat16 if out_dtype in FP8_MAX else out_dtype


def check_fp8_operand(t: torch.Tensor, arg: str) -> None:
    """An FP8 GEMM operand (or FP8 input): a 2-D row-major FP8 tensor; `arg` names it in the error."""
    check_fp8_dtype(t.dtype, arg)
    if t.dim() != 2:
        raise ValueError(f"{arg}: expected a 2-D tensor, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{arg}: expected a K-contiguous row-major tensor, got strides {t.stride()}")


def check_operand_pair(a: torch.Tensor, b: torch.Tensor) -> None:
    """What the two operands of a "TN" FP8 GEMM must agree on (per-tensor and block GEMMs alike): not both E5M2,
    the same K, one device."""
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        raise ValueError("a, b: E5M2 x E5M2 is not supported by the FP8 tensor cores; make one operand E4M3")
    if b.shape[1] != a.shape[1]:
        raise ValueError(f"b: expected K = {a.shape[1]} columns (a is {tuple(a.shape)}), got shape {tuple(b.shape)}")
    if b.device != a.device:
        raise ValueError(f"b: expected a tensor on {a.device}, got one on {b.device}")


def check_operands(a, a_scale_inv, b, b_scale_inv):
    """Checks shared by both GEMM ops (the CUDA bindings check the same things)."""
    check_fp8_operand(a, "a")
    check_fp8_operand(b, "b")
    check_operand_pair(a, b)
    check_scalar_f32(a_scale_inv, a, "a_scale_inv")
    check_scalar_f32(b_scale_inv, a, "b_scale_inv")


def check_epilogue(a, b, out_dtype, bias, out_scale, out_amax):
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype: expected float32, float16, bfloat16 or an FP8 dtype, got {out_dtype}")
    n = b.shape[0]
    if bias is not None:
        if bias.dtype not in allowed_bias_dtypes(out_dtype):
            raise ValueError(f"bias: expected dtype {' or '.join(map(str, allowed_bias_dtypes(out_dtype)))} for "
                             f"out_dtype {out_dtype}, got {bias.dtype}")
        if bias.shape != (n,):
            raise ValueError(f"bias: expected shape ({n},), got {tuple(bias.shape)}")
        if bias.device != a.device:
            raise ValueError(f"bias: expected a tensor on {a.device}, got one on {bias.device}")
    if out_dtype in FP8_MAX:
        if out_scale is None:
            raise ValueError(f"out_scale: required for an FP8 out_dtype ({out_dtype})")
        check_scalar_f32(out_scale, a, "out_scale")
        if out_amax is not None:
            check_scalar_f32(out_amax, a, "out_amax")
    elif out_scale is not None or out_amax is not None:
        raise ValueError(f"out_scale, out_amax: only for an FP8 out_dtype, got out_dtype {out_dtype}")


def check_residual(a, b, out_dtype, gelu, residual):
    m, n = a.shape[0], b.shape[0]
    if out_dtype in FP8_MAX or gelu:
        raise ValueError(f"residual: only for a float32, float16 or bfloat16 out_dtype without gelu, got out_dtype "
                         f"{out_dtype}{' with gelu' if gelu else ''}")
    if residual.dtype != out_dtype:
        raise ValueError(f"residual: expected dtype {out_dtype} (out_dtype), got {residual.dtype}")
    _check_output_matrix(residual, "residual", m, n, a.device)


def _check_output_matrix(t, arg, m, n, device):
    """An [m, n] tensor the GEMM reads as C: shape, contiguity, device."""
    if t.shape != (m, n):
        raise ValueError(f"{arg}: expected shape ({m}, {n}), got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{arg}: expected a contiguous tensor, got strides {t.stride()}")
    if t.device != device:
        raise ValueError(f"{arg}: expected a tensor on {device}, got one on {t.device}")


def dequantized_matmul(a, a_scale_inv, b, b_scale_inv):
    """(a * a_scale_inv) @ (b * b_scale_inv)^T in float32, [M, N]."""
    return (a.float() * a_scale_inv) @ (b.float() * b_scale_inv).t()


@register("fp8_gemm")
def fp8_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias=None, gelu=False, out_scale=None, out_amax=None,
             use_split_accumulator=True, residual=None):
    check_operands(a, a_scale_inv, b, b_scale_inv)
    check_epilogue(a, b, out_dtype, bias, out_scale, out_amax)
    if residual is not None:
        check_residual(a, b, out_dtype, gelu, residual)
    result = dequantized_matmul(a, a_scale_inv, b, b_scale_inv)
    if bias is not None:
        result = result + bias.float()
    if residual is not None:
        result = result + residual.float()
    pre_gelu = a.new_empty((0,), dtype=pre_gelu_dtype(out_dtype, bias))
    if gelu:
        pre_gelu = result.to(pre_gelu.dtype)
        result = torch.nn.functional.gelu(result, approximate="tanh")
    if out_dtype in FP8_MAX:
        accumulate_amax(out_amax, result)
        return saturating_cast(result * out_scale, out_dtype), pre_gelu
    return result.to(out_dtype), pre_gelu


@register("fp8_gemm_accumulate")
def fp8_gemm_accumulate(a, a_scale_inv, b, b_scale_inv, out, use_split_accumulator=True):
    check_operands(a, a_scale_inv, b, b_scale_inv)
    m, n = a.shape[0], b.shape[0]
    if out.dtype != torch.float32:
        raise ValueError(f"out: expected a float32 tensor, got {out.dtype}")
    _check_output_matrix(out, "out", m, n, a.device)
    out.add_(dequantized_matmul(a, a_scale_inv, b, b_scale_inv))
