"""CPU reference kernels of the block-scaling ops (recipe Float8BlockScaling): block_cast, block_dequantize,
block_fp8_gemm, block_fp8_gemm_accumulate. Layouts: transformer_fp8/quantization/block.py. Math in float32; the
GEMM dequantizes both operands and multiplies in float32."""
import torch

from ._common import FP8_MAX, check_fp8_dtype, register, saturating_cast
from .activation import act_forward, check_activation
from .gemm import check_fp8_operand, check_operand_pair, check_residual

BLOCK = 128
HIGH_PRECISION = (torch.float32, torch.float16, torch.bfloat16)
_FLOAT32_MAX = torch.finfo(torch.float32).max
_EXPONENT_BITS = -8388608  # 0xFF800000 as int32: sign and exponent of a float32


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pad4(a: int) -> int:
    return _cdiv(a, 4) * 4


def block_scale_shape(rows: int, cols: int, block_dim: int) -> tuple[int, int]:
    """Shape of the float32 scale_inv of FP8 data [rows, cols] cast with block_dim (block.py's layout).

    Args:
        rows: Rows of the data (M, or K for a transposed copy).
        cols: Columns of the data (the contiguous dim the GEMM reduces over).
        block_dim: 1 for 1x128 tiles along cols, 2 for 128x128 blocks.

    Returns:
        (ceil(cols / 128), pad4(rows)) for block_dim 1, (ceil(rows / 128), pad4(ceil(cols / 128))) for block_dim 2.
    """
    if block_dim == 1:
        return _cdiv(cols, BLOCK), _pad4(rows)
    return _cdiv(rows, BLOCK), _pad4(_cdiv(cols, BLOCK))


def _check_block_dim(block_dim: int, arg: str = "block_dim") -> None:
    if block_dim not in (1, 2):
        raise ValueError(f"{arg}: expected 1 (1x128 tiles) or 2 (128x128 blocks), got {block_dim}")


def tile_scales(amax: torch.Tensor, fp8_max: float, amax_epsilon: float, power_2_scale: bool) -> torch.Tensor:
    """Scales of tiles from their amaxes (float32), as the CUDA kernel computes them (see csrc/ops.cpp block_cast)."""
    amax = torch.where(amax < amax_epsilon, torch.full_like(amax, amax_epsilon), amax)  # (NaN stays NaN)
    scale = torch.full_like(amax, fp8_max) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, _FLOAT32_MAX), scale)
    if power_2_scale:
        scale = (scale.view(torch.int32) & _EXPONENT_BITS).view(torch.float32)
    unusable = (amax == 0) | torch.isinf(amax) | torch.isnan(amax)
    return torch.where(unusable, torch.ones_like(scale), scale)


def _padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))


def _cast_1x128(x: torch.Tensor, fp8_dtype, amax_epsilon, power_2_scale):
    """x [M, K] float32 -> (q [M, K], scale_inv [ceil(K/128), pad4(M)]) with 1x128 tiles along K."""
    m, k = x.shape
    kb = _cdiv(k, BLOCK)
    tiles = _padded(x, m, kb * BLOCK).reshape(m, kb, BLOCK)
    scale = tile_scales(tiles.abs().amax(dim=2), FP8_MAX[fp8_dtype], amax_epsilon, power_2_scale)  # [M, Kb]
    q = saturating_cast((tiles * scale.unsqueeze(2)).reshape(m, kb * BLOCK)[:, :k], fp8_dtype).contiguous()
    scale_inv = torch.ones(block_scale_shape(m, k, 1), dtype=torch.float32, device=x.device)
    scale_inv[:, :m] = torch.reciprocal(scale).t()
    return q, scale_inv


def _cast_128x128(x: torch.Tensor, fp8_dtype, amax_epsilon, power_2_scale):
    """x [M, K] float32 -> (q [M, K], scale_inv [ceil(M/128), pad4(ceil(K/128))], scales [Mb, Kb])."""
    m, k = x.shape
    mb, kb = _cdiv(m, BLOCK), _cdiv(k, BLOCK)
    blocks = _padded(x, mb * BLOCK, kb * BLOCK).reshape(mb, BLOCK, kb, BLOCK)
    scale = tile_scales(blocks.abs().amax(dim=(1, 3)), FP8_MAX[fp8_dtype], amax_epsilon, power_2_scale)
    scaled = (blocks * scale[:, None, :, None]).reshape(mb * BLOCK, kb * BLOCK)[:m, :k]
    q = saturating_cast(scaled, fp8_dtype).contiguous()
    return q, torch.reciprocal(scale)


def _with_padding(values: torch.Tensor, shape) -> torch.Tensor:
    out = torch.ones(shape, dtype=torch.float32, device=values.device)
    out[:, :values.shape[1]] = values
    return out


@register("block_cast")
def block_cast(input, fp8_dtype, block_dim, rowwise=True, transpose=False, amax_epsilon=0.0, power_2_scale=True):
    """input [M, K] -> (q [M, K] or empty, scale_inv, qt [K, M] or empty, scale_inv_t); see csrc/ops.cpp."""
    _check_cast_input(input, fp8_dtype, amax_epsilon)
    _check_block_dim(block_dim)
    return _cast_blocks(input.float(), fp8_dtype, block_dim, rowwise, transpose, amax_epsilon, power_2_scale)


def _check_cast_input(input, fp8_dtype, amax_epsilon):
    """The checks both block casts share, in the CUDA binding's order (check_cast_input)."""
    if input.dtype not in HIGH_PRECISION:
        raise TypeError(f"input: expected a float32, float16 or bfloat16 tensor, got {input.dtype}")
    if input.dim() != 2:
        raise ValueError(f"input: expected a 2-D tensor [M, K], got shape {tuple(input.shape)}")
    if not input.is_contiguous():
        raise ValueError(f"input: expected a contiguous tensor (got strides {input.stride()})")
    check_fp8_dtype(fp8_dtype, "fp8_dtype")
    if not (amax_epsilon >= 0.0 and amax_epsilon != float("inf")):
        raise ValueError(f"amax_epsilon: expected a finite number >= 0, got {amax_epsilon}")


def _cast_blocks(x, fp8_dtype, block_dim, rowwise, transpose, amax_epsilon, power_2_scale):
    """block_cast's math on x [M, K] float32 (arguments checked)."""
    m, k = x.shape
    empty_q, empty_s = x.new_empty((0,), dtype=fp8_dtype), x.new_empty((0,), dtype=torch.float32)
    q, scale_inv, qt, scale_inv_t = empty_q, empty_s, empty_q, empty_s
    if block_dim == 1:
        if rowwise:
            q, scale_inv = _cast_1x128(x, fp8_dtype, amax_epsilon, power_2_scale)
        if transpose:
            qt, scale_inv_t = _cast_1x128(x.t().contiguous(), fp8_dtype, amax_epsilon, power_2_scale)
        return q, scale_inv, qt, scale_inv_t
    data, block_scale_inv = _cast_128x128(x, fp8_dtype, amax_epsilon, power_2_scale)
    if rowwise:
        q, scale_inv = data, _with_padding(block_scale_inv, block_scale_shape(m, k, 2))
    if transpose:
        qt, scale_inv_t = data.t().contiguous(), _with_padding(block_scale_inv.t(), block_scale_shape(k, m, 2))
    return q, scale_inv, qt, scale_inv_t


@register("block_activation_cast")
def block_activation_cast(input, activation, fp8_dtype, rowwise=True, transpose=False, amax_epsilon=0.0,
                          power_2_scale=True):
    """block_cast (1x128 tiles) of act(input) computed in float32: input [M, F] (gelu, relu) or [M, 2F] (swiglu)."""
    check_activation(activation)
    _check_cast_input(input, fp8_dtype, amax_epsilon)
    if activation == "swiglu" and input.shape[1] % 2 != 0:
        raise ValueError(f"input: swiglu expects an even last dimension [M, 2F], got shape {tuple(input.shape)}")
    return _cast_blocks(act_forward(input.float(), activation), fp8_dtype, 1, rowwise, transpose, amax_epsilon,
                        power_2_scale)


def _check_scale_inv(scale_inv, data, block_dim, arg, data_arg):
    if scale_inv.dtype != torch.float32:
        raise TypeError(f"{arg}: expected a float32 tensor, got {scale_inv.dtype}")
    if scale_inv.device != data.device:
        raise ValueError(f"{arg}: expected a tensor on {data.device}, got one on {scale_inv.device}")
    if not scale_inv.is_contiguous():
        raise ValueError(f"{arg}: expected a contiguous tensor (got strides {scale_inv.stride()})")
    expected = block_scale_shape(data.shape[0], data.shape[1], block_dim)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"{arg}: expected shape {expected} for {data_arg} {tuple(data.shape)} with block_dim "
                         f"{block_dim} (block_cast's layout), got {tuple(scale_inv.shape)}")


def expand_scales(scale_inv: torch.Tensor, rows: int, cols: int, block_dim: int) -> torch.Tensor:
    """The scale_inv of every element of data [rows, cols] (float32 [rows, cols]) from block_cast's layout.

    Args:
        scale_inv: The scales, block_scale_shape(rows, cols, block_dim).
        rows: Rows of the data.
        cols: Columns of the data.
        block_dim: 1 (1x128 tiles) or 2 (128x128 blocks).

    Returns:
        float32 [rows, cols].
    """
    if block_dim == 1:
        per_row = scale_inv[:, :rows].t()  # [rows, ceil(cols / 128)]
        return per_row.repeat_interleave(BLOCK, dim=1)[:, :cols]
    per_block = scale_inv[:, :_cdiv(cols, BLOCK)]
    return per_block.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)[:rows, :cols]


def _dequantized(q, scale_inv, block_dim):
    return q.float() * expand_scales(scale_inv, q.shape[0], q.shape[1], block_dim)


@register("block_dequantize")
def block_dequantize(input, scale_inv, block_dim, out_dtype):
    """FP8 [M, K] with block_cast's scale_inv -> out_dtype [M, K] = q * the scale_inv of its tile."""
    check_fp8_operand(input, "input")
    _check_block_dim(block_dim)
    if out_dtype not in HIGH_PRECISION:
        raise TypeError(f"out_dtype: expected torch.float32, torch.float16 or torch.bfloat16, got {out_dtype}")
    _check_scale_inv(scale_inv, input, block_dim, "scale_inv", "input")
    return _dequantized(input, scale_inv, block_dim).to(out_dtype)


def check_block_operands(a, a_scale_inv, a_block_dim, b, b_scale_inv, b_block_dim):
    """The checks both block GEMMs share (the CUDA binding checks the same)."""
    _check_block_dim(a_block_dim, "a_block_dim")
    _check_block_dim(b_block_dim, "b_block_dim")
    if a_block_dim == 2 and b_block_dim == 2:
        raise ValueError("a_block_dim, b_block_dim: 128x128 x 128x128 block scaling is not supported by cuBLASLt; "
                         "make one operand 1x128")
    check_fp8_operand(a, "a")
    _check_scale_inv(a_scale_inv, a, a_block_dim, "a_scale_inv", "a")
    check_fp8_operand(b, "b")
    _check_scale_inv(b_scale_inv, b, b_block_dim, "b_scale_inv", "b")
    check_operand_pair(a, b)


def _product(a, a_scale_inv, a_block_dim, b, b_scale_inv, b_block_dim):
    return _dequantized(a, a_scale_inv, a_block_dim) @ _dequantized(b, b_scale_inv, b_block_dim).t()


@register("block_fp8_gemm")
def block_fp8_gemm(a, a_scale_inv, a_block_dim, b, b_scale_inv, b_block_dim, out_dtype, bias=None, residual=None):
    """out [M, N] = dequantized a @ dequantized bᵀ (+ bias) (+ residual) in float32, returned in out_dtype."""
    check_block_operands(a, a_scale_inv, a_block_dim, b, b_scale_inv, b_block_dim)
    if out_dtype not in HIGH_PRECISION:
        raise ValueError(f"out_dtype: expected torch.float32, torch.float16 or torch.bfloat16, got {out_dtype}")
    if bias is not None:
        wanted = torch.float16 if out_dtype == torch.float16 else torch.bfloat16
        if bias.dtype != wanted:
            raise ValueError(f"bias: expected dtype {wanted} for out_dtype {out_dtype}, got {bias.dtype}")
        if tuple(bias.shape) != (b.shape[0],):
            raise ValueError(f"bias: expected shape ({b.shape[0]},), got {tuple(bias.shape)}")
        if bias.device != a.device:
            raise ValueError(f"bias: expected a tensor on {a.device}, got one on {bias.device}")
    if residual is not None:
        check_residual(a, b, out_dtype, False, residual)
    out = _product(a, a_scale_inv, a_block_dim, b, b_scale_inv, b_block_dim)
    if bias is not None:
        out = out + bias.float()
    if residual is not None:
        out = out + residual.float()
    return out.to(out_dtype)


@register("block_fp8_gemm_accumulate")
def block_fp8_gemm_accumulate(a, a_scale_inv, a_block_dim, b, b_scale_inv, b_block_dim, out):
    """out [M, N] float32 += dequantized a @ dequantized bᵀ."""
    check_block_operands(a, a_scale_inv, a_block_dim, b, b_scale_inv, b_block_dim)
    m, n = a.shape[0], b.shape[0]
    if out.dtype != torch.float32:
        raise ValueError(f"out: expected a float32 tensor, got {out.dtype}")
    if tuple(out.shape) != (m, n):
        raise ValueError(f"out: expected shape ({m}, {n}), got {tuple(out.shape)}")
    if not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous tensor, got strides {out.stride()}")
    if out.device != a.device:
        raise ValueError(f"out: expected a tensor on {a.device}, got one on {out.device}")
    out.add_(_product(a, a_scale_inv, a_block_dim, b, b_scale_inv, b_block_dim))
