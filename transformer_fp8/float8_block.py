"""The 128x128 block layout of FP8 weights (Float8Tensor with a block scale_inv) in plain torch math.

One float32 scale per 128x128 block of a weight w [N, K], stored as the block operand layout that
transformer_fp8/quantization/block.py documents (the layout cuBLASLt's block-scaled GEMM reads, so a weight goes to
the GEMM without a re-layout):

    data       [N, K] FP8
    scale_inv  [cdiv(N, 128), pad4(cdiv(K, 128))] float32      w[128*i : .., 128*j : ..] ~= data * scale_inv[i, j]
                                                                  (padding columns hold 1.0)

A Hugging Face block-FP8 checkpoint's `weight_scale_inv` [cdiv(N, 128), cdiv(K, 128)] is this scale_inv without
the padding columns (pad_block_scales adds them, unpadded_block_scales takes them off).

Scale of a block (as the block quantizer computes it): amax = max |block|, floored at amax_epsilon; scale =
fp8_max / amax in float32, the float32 max where that overflows, rounded down to a power of two with power_2_scale,
1 where amax is 0, Inf or NaN; q = saturate(x * scale) rounded to nearest even; scale_inv = 1 / scale. The
quantization is the block_cast op with 128x128 blocks (the activations' and gradients' cast kernel: one rule, one
implementation per device; its fake kernel serves the meta device); the rest are torch ops (any device).
"""
import torch
import torch.nn.functional as F

from .cpu.block import expand_scales
from .ops import tfp8

BLOCK = 128
LAYOUT_TENSOR = "tensor"  # (FP8Operand.layout names)
LAYOUT_BLOCK = "block_128x128"


def cdiv(a: int, b: int) -> int:
    """Returns: ceil(a / b) for ints a >= 0, b > 0."""
    return -(-a // b)


def pad4(n: int) -> int:
    """Returns: n rounded up to a multiple of 4 (cuBLASLt reads scale rows of 16 bytes)."""
    return cdiv(n, 4) * 4


def block_scale_shape(shape: tuple[int, ...] | torch.Size) -> tuple[int, int]:
    """The scale_inv shape of a 2-D weight in 128x128 blocks.

    Args:
        shape: the weight's shape (N, K).
    Returns:
        (cdiv(N, 128), pad4(cdiv(K, 128))).
    """
    rows, cols = shape
    return cdiv(rows, BLOCK), pad4(cdiv(cols, BLOCK))


def pad_block_scales(scale_inv: torch.Tensor, cols: int) -> torch.Tensor:
    """Checkpoint scales [cdiv(N, 128), cdiv(K, 128)] -> the operand layout [cdiv(N, 128), pad4(cdiv(K, 128))]
    (a float32 copy; padding columns 1.0). Already padded scales come back as a float32 contiguous tensor.

    Args:
        scale_inv: float32 [cdiv(N, 128), cdiv(K, 128)] (or already padded).
        cols: the weight's K.
    Returns:
        float32 [cdiv(N, 128), pad4(cdiv(K, 128))].
    """
    blocks, padded = cdiv(cols, BLOCK), pad4(cdiv(cols, BLOCK))
    if scale_inv.dim() != 2 or scale_inv.shape[1] not in (blocks, padded):
        raise ValueError(f"scale_inv: expected [row blocks, {blocks}] (or [row blocks, {padded}]) for {cols} "
                         f"columns, got shape {tuple(scale_inv.shape)}")
    scale_inv = scale_inv.to(torch.float32).contiguous()
    return F.pad(scale_inv, (0, padded - scale_inv.shape[1]), value=1.0) if scale_inv.shape[1] != padded \
        else scale_inv


def unpadded_block_scales(scale_inv: torch.Tensor, cols: int) -> torch.Tensor:
    """Returns: the block scales without the padding columns, [cdiv(N, 128), cdiv(K, 128)] (a view), as a
    block-FP8 checkpoint stores them.

    Args:
        scale_inv: [cdiv(N, 128), pad4(cdiv(K, 128))]. cols: the weight's K.
    """
    return scale_inv[:, :cdiv(cols, BLOCK)]


def transpose_block_scales(scale_inv: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The scale_inv of the transposed data [K, N] (same blocks, transposed): [cdiv(K, 128), pad4(cdiv(N, 128))].

    Args:
        scale_inv: the weight's [cdiv(N, 128), pad4(cdiv(K, 128))]. shape: the weight's (N, K).
    Returns:
        A new float32 tensor.
    """
    rows, cols = shape
    return pad_block_scales(unpadded_block_scales(scale_inv, cols).t(), rows)


def is_power_of_2(values: torch.Tensor) -> bool:
    """Returns: whether every element of float32 `values` is an exact power of two (mantissa bits all zero).

    Args:
        values: a float32 tensor.
    """
    return bool(((values.view(torch.int32) & _MANTISSA_BITS) == 0).all())


_MANTISSA_BITS = 0x007FFFFF


def quantize_blocks(x: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn, power_2_scale: bool = False,
                    amax_epsilon: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight in 128x128 blocks (see the module docstring for the scale rule) with the block_cast op
    (block_dim 2: its CUDA kernel, CPU reference or fake kernel, by x's device).

    Args:
        x: high precision [N, K] (float64 is cast to float32 first; any strides).
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        power_2_scale: round each block's scale down to a power of two (recipe QParams.power_2_scale).
        amax_epsilon: floor of each block's amax (recipe QParams.amax_epsilon), a finite number >= 0.
    Returns:
        (data FP8 [N, K] contiguous, scale_inv float32 [cdiv(N, 128), pad4(cdiv(K, 128))]).
    """
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D weight [N, K] for 128x128 blocks, got shape {tuple(x.shape)}")
    if x.numel() == 0:  # (no block to scale: nothing for a kernel to launch on)
        return (torch.empty(x.shape, dtype=fp8_dtype, device=x.device),
                torch.ones(block_scale_shape(x.shape), dtype=torch.float32, device=x.device))
    if x.dtype not in _CAST_INPUT_DTYPES:
        x = x.float()  # (the cast multiplies in float32 either way)
    data, scale_inv, _, _ = tfp8.block_cast(x.detach().contiguous(), fp8_dtype, 2, True, False, float(amax_epsilon),
                                            power_2_scale)
    return data, scale_inv


_CAST_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def dequantize_blocks(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Returns: data * scale_inv per 128x128 block, computed in float32, as `dtype` [N, K].

    Args:
        data: FP8 [N, K]. scale_inv: float32 [cdiv(N, 128), pad4(cdiv(K, 128))] (or unpadded). dtype: the output's.
    """
    rows, cols = data.shape
    return (data.float() * expand_scales(scale_inv.float(), rows, cols, 2)).to(dtype)


def row_block_range(rows: int, start: int, length: int, what: str) -> tuple[int, int]:
    """The scale_inv rows of data rows [start, start + length) of a weight with `rows` rows: a view of a block
    weight along dim 0 must start on a block boundary and end on one or at the last row.

    Args:
        rows: the weight's N. start, length: the rows of the view. what: the operation, for the error.
    Returns:
        (first scale row, number of scale rows).
    Raises:
        NotImplementedError: the view cuts through a 128-row block (its rows would need a scale of their own).
    """
    end = start + length
    if start % BLOCK or (end % BLOCK and end != rows):
        raise NotImplementedError(f"{what}: rows [{start}, {end}) of a weight in 128x128 blocks ({rows} rows) cut "
                                  f"through a block; views of block-scaled FP8 weights must start at a multiple of "
                                  f"128 rows and end at one or at the last row (dequantize() first for other views)")
    return start // BLOCK, cdiv(length, BLOCK)
