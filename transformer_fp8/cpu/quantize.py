"""CPU reference kernels of the quantize ops: FP8 cast with scale (+amax, +scale_inv), dequantize, amax,
cast-transpose (+dbias) and FP8 transpose. Math in float32; q = saturate(x * scale), round to nearest even."""
import torch

from .._layout import row_layout
from ._common import accumulate_amax, check_fp8_dtype, check_scalar_f32, register, saturating_cast

HIGH_PRECISION = (torch.float32, torch.float16, torch.bfloat16)


def _check_high_precision(t, arg, rows=False):
    """t: float32 / float16 / bfloat16, contiguous (rows: or rows of contiguous elements at one stride)."""
    if t.dtype not in HIGH_PRECISION:
        raise TypeError(f"{arg}: expected a float32, float16 or bfloat16 tensor, got {t.dtype}")
    _check_layout(t, arg, rows)


def _check_layout(t, arg, rows):
    if rows and row_layout(t) is None:
        raise ValueError(f"{arg}: expected a contiguous tensor or rows of contiguous elements at one stride (such as "
                         f"a slice of a wider tensor's last dim), got shape {tuple(t.shape)} and strides {t.stride()}")
    if not rows and not t.is_contiguous():
        raise ValueError(f"{arg}: expected a contiguous tensor (got strides {t.stride()})")


def _check_2d(t, arg):
    if t.dim() != 2:
        raise ValueError(f"{arg}: expected a 2-D tensor [M, N], got shape {tuple(t.shape)}")


def _check_cast_args(input, scale, fp8_dtype, amax, scale_inv, arg="input", rows=False):
    _check_high_precision(input, arg, rows)
    check_fp8_dtype(fp8_dtype, "fp8_dtype")
    check_scalar_f32(scale, input, "scale")
    check_scalar_f32(amax, input, "amax")
    check_scalar_f32(scale_inv, input, "scale_inv")


def _cast(input, scale, fp8_dtype, amax, scale_inv):
    """The shared body of every cast: q = saturate(float(x) * scale); amax, scale_inv updated in place."""
    accumulate_amax(amax, input)
    if scale_inv is not None:
        scale_inv.copy_(torch.reciprocal(scale).reshape(scale_inv.shape))
    return saturating_cast(input.float() * scale.reshape(()), fp8_dtype)


def _empty_fp8(input, fp8_dtype):
    return input.new_empty((0,), dtype=fp8_dtype)


@register("quantize")
def quantize(input, scale, fp8_dtype, amax=None, scale_inv=None):
    """input (any shape, f32/f16/bf16; contiguous or rows at one stride) -> FP8 of the same shape, contiguous."""
    _check_cast_args(input, scale, fp8_dtype, amax, scale_inv, rows=True)
    return _cast(input, scale, fp8_dtype, amax, scale_inv).contiguous()


@register("dequantize")
def dequantize(input, scale_inv, out_dtype):
    """FP8 (any shape) -> out_dtype, float(q) * scale_inv computed in float32."""
    check_fp8_dtype(input.dtype, "input")
    if out_dtype not in HIGH_PRECISION:
        raise TypeError(f"out_dtype: expected torch.float32, torch.float16 or torch.bfloat16, got {out_dtype}")
    if not input.is_contiguous():
        raise ValueError(f"input: expected a contiguous tensor (got strides {input.stride()})")
    check_scalar_f32(scale_inv, input, "scale_inv")
    return (input.float() * scale_inv.reshape(())).to(out_dtype)


@register("dequantize_into")
def dequantize_into(input, scale_inv, out):
    """FP8 input (contiguous) -> out (input's shape, f32/f16/bf16; contiguous or rows at one stride) in place."""
    check_fp8_dtype(input.dtype, "input")
    _check_layout(input, "input", rows=False)
    if out.device != input.device:
        raise ValueError(f"out: expected a tensor on {input.device}, got one on {out.device}")
    _check_high_precision(out, "out", rows=True)
    if out.shape != input.shape:
        raise ValueError(f"out: expected input's shape {tuple(input.shape)}, got {tuple(out.shape)}")
    check_scalar_f32(scale_inv, input, "scale_inv")
    out.copy_(input.float() * scale_inv.reshape(()))


@register("compute_amax")
def compute_amax(input, amax):
    """amax = max(amax, max|input|) in place."""
    _check_high_precision(input, "input")
    check_scalar_f32(amax, input, "amax")
    accumulate_amax(amax, input)


@register("cast_transpose")
def cast_transpose(input, scale, fp8_dtype, rowwise=True, transpose=True, amax=None, scale_inv=None):
    """input [M, N] -> (q [M, N] or empty, qT [N, M] or empty), both FP8 with the same scale."""
    _check_cast_args(input, scale, fp8_dtype, amax, scale_inv)
    _check_2d(input, "input")
    q = _cast(input, scale, fp8_dtype, amax, scale_inv)
    q_rowwise = q if rowwise else _empty_fp8(input, fp8_dtype)
    q_transposed = q.t().contiguous() if transpose else _empty_fp8(input, fp8_dtype)
    return q_rowwise, q_transposed


@register("cast_transpose_dbias")
def cast_transpose_dbias(grad, scale, fp8_dtype, amax=None, scale_inv=None):
    """grad [M, N] -> (q [M, N], qT [N, M], dbias [N] = column sums in float32, returned in grad's dtype)."""
    _check_cast_args(grad, scale, fp8_dtype, amax, scale_inv, arg="grad")
    _check_2d(grad, "grad")
    q = _cast(grad, scale, fp8_dtype, amax, scale_inv)
    dbias = grad.float().sum(dim=0).to(grad.dtype)
    return q, q.t().contiguous(), dbias


@register("fp8_transpose")
def fp8_transpose(input):
    """FP8 [M, N] -> FP8 [N, M] (a byte transpose)."""
    check_fp8_dtype(input.dtype, "input")
    _check_2d(input, "input")
    if not input.is_contiguous():
        raise ValueError(f"input: expected a contiguous tensor (got strides {input.stride()})")
    return input.t().contiguous()
