"""GEMMs on FP8Operands: out = a bᵀ with both operands K-major ("TN", what Hopper's FP8 GEMMs take).

Each operand gives its rowwise data [rows, K] or, with transpose_a / transpose_b, its transposed copy data_t (the
wgrad contracts over the tokens: dW = dyᵀ xᵀᵀ). The operands' layout picks the kernel: per-tensor ("tensor") goes to
tfp8.fp8_gemm / fp8_gemm_accumulate, block-scaled ("block_1x128", "block_128x128", see block.py) to
tfp8.block_fp8_gemm / block_fp8_gemm_accumulate (always the split accumulator; bias and residual in the epilogue
where the bias's dtype fits).
"""
import torch

from ..ops import tfp8
from .block import BLOCK_DIM_OF_LAYOUT
from .operand import FP8Operand


def _block_pair(a: FP8Operand, b: FP8Operand) -> bool:
    """Whether a and b are block-scaled (both), per-tensor (both: False), or an error naming the mix."""
    a_block, b_block = a.layout in BLOCK_DIM_OF_LAYOUT, b.layout in BLOCK_DIM_OF_LAYOUT
    for operand, name in ((a, "a"), (b, "b")):
        if operand.layout != "tensor" and operand.layout not in BLOCK_DIM_OF_LAYOUT:
            raise NotImplementedError(f"{name}: FP8 GEMM of layout {operand.layout!r} is not supported")
    if a_block != b_block:
        raise ValueError(f"a, b: layouts {a.layout!r} and {b.layout!r} do not mix in one GEMM (cast both with the "
                         f"same recipe)")
    return a_block


def _side(operand: FP8Operand, transposed: bool, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(data or data_t, its scale_inv) of an operand; a clear error for a missing side."""
    data, scale_inv = (operand.data_t, operand.scale_inv_t) if transposed else (operand.data, operand.scale_inv)
    if data is None:
        raise ValueError(f"{name}: the operand has no {'data_t' if transposed else 'data'} (cast it with "
                         f"{'transpose=True' if transposed else 'rowwise=True'})")
    return data, scale_inv


def gemm(a: FP8Operand, b: FP8Operand, out_dtype: torch.dtype, *, transpose_a: bool = False,
         transpose_b: bool = False, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
         use_split_accumulator: bool = True) -> torch.Tensor:
    """out [M, N] = A Bᵀ (+ bias [N]) (+ residual [M, N]) in out_dtype.

    Args:
        a: A [M, K] is a.data (a.data_t with transpose_a).
        b: B [N, K] is b.data (b.data_t with transpose_b).
        out_dtype: the output dtype (high precision).
        bias, residual: added in the GEMM epilogue (bias in out_dtype; not with a float32 output: see _gemm.py).
        use_split_accumulator: float32 promotion of the FP8 accumulation (False: fast accumulation, as forward
            GEMMs use).

    Returns:
        out [M, N].
    """
    a_data, a_scale_inv = _side(a, transpose_a, "a")
    b_data, b_scale_inv = _side(b, transpose_b, "b")
    if _block_pair(a, b):
        fits = bias is None or bias.dtype == (torch.float16 if out_dtype == torch.float16 else torch.bfloat16)
        out = tfp8.block_fp8_gemm(a_data, a_scale_inv, BLOCK_DIM_OF_LAYOUT[a.layout], b_data, b_scale_inv,
                                  BLOCK_DIM_OF_LAYOUT[b.layout], out_dtype, *((bias, residual) if fits else ()))
        if fits:
            return out
        out = out + bias.to(out_dtype)  # (a float32 bias of a float32 output: bias, then residual, after the GEMM)
        return out if residual is None else out + residual
    extra = {} if residual is None else {"residual": residual}
    return tfp8.fp8_gemm(a_data, a_scale_inv, b_data, b_scale_inv, out_dtype, bias,
                         use_split_accumulator=use_split_accumulator, **extra)[0]


def gemm_accumulate(a: FP8Operand, b: FP8Operand, out: torch.Tensor, *, transpose_a: bool = False,
                    transpose_b: bool = False) -> None:
    """out [M, N] (float32) += A Bᵀ, operands as gemm's (the wgrad into weight.main_grad)."""
    a_data, a_scale_inv = _side(a, transpose_a, "a")
    b_data, b_scale_inv = _side(b, transpose_b, "b")
    if _block_pair(a, b):
        tfp8.block_fp8_gemm_accumulate(a_data, a_scale_inv, BLOCK_DIM_OF_LAYOUT[a.layout], b_data, b_scale_inv,
                                       BLOCK_DIM_OF_LAYOUT[b.layout], out)
        return
    tfp8.fp8_gemm_accumulate(a_data, a_scale_inv, b_data, b_scale_inv, out)


def gemm_gelu_to_fp8(a: FP8Operand, b: FP8Operand, bias: torch.Tensor | None, out_quantizer) \
        -> tuple[FP8Operand, torch.Tensor]:
    """gelu(A Bᵀ + bias) written in FP8 by the GEMM epilogue with out_quantizer's known scale (cuBLASLt's GELU_AUX
    epilogue, fast accumulation as a forward GEMM).

    Args:
        a, b: the operands (rowwise data).
        bias: [N] in the pre-activation's dtype, or None.
        out_quantizer: a quantizer with known_scale (see Quantizer.output_args).

    Returns:
        (the FP8 activation as an FP8Operand (data only), the pre-activation [M, N] in BF16 (the GEMM's aux output)).
    """
    if _block_pair(a, b):
        raise NotImplementedError("gemm_gelu_to_fp8: block-scaled operands have no FP8-output GEMM (the output's "
                                  "block scales are not known before it runs)")
    a_data, a_scale_inv = _side(a, False, "a")
    b_data, b_scale_inv = _side(b, False, "b")
    scale, fp8_dtype, amax, scale_inv = out_quantizer.output_args()
    q, pre = tfp8.fp8_gemm(a_data, a_scale_inv, b_data, b_scale_inv, fp8_dtype, bias=bias, gelu=True,
                           out_scale=scale, out_amax=amax, use_split_accumulator=False)
    torch.reciprocal(scale, out=scale_inv)  # (the snapshot a cast would have written)
    return FP8Operand(q, None, scale_inv, fp8_dtype), pre
