"""The CUDA kernels of the block-scaled grouped FP8 GEMM ops (grouped_block_fp8_gemm, grouped_block_fp8_gemm_wgrad;
contracts in csrc/ops.cpp, layouts in transformer_fp8/quantization/block.py), recipe Float8BlockScaling.

Two kernels, chosen like the per-tensor grouped GEMMs' (transformer_fp8.grouped_gemm.BACKEND, read at each call):
- "cutlass": ours (csrc/grouped_block_*.cu, the ops grouped_block_fp8_gemm_sm90 / grouped_block_fp8_gemm_wgrad_sm90),
  CUTLASS 4.2's sm90 pointer-array grouped GEMM with blockwise scaling in the mainloop: every 128-deep K step's
  partial sums are multiplied by the scales of its A rows (1x128 tiles) and of its B block (128x128, forward and
  dgrad) or B columns (1x128 tiles, wgrad) and accumulated in float32. Group shapes, pointers and per-group packed
  scales are written on the device from the offsets: no host sync, empty groups allowed. Compute capability 9.0.
- "torch" (or where ours is not built / not a 9.0 GPU): both operands dequantized to bfloat16 (each FP8 value times
  its tile's scale, rounded to bfloat16: 2**-9 relative, far below the FP8 rounding) and torch._grouped_mm, also
  reading the offsets on the device. Slower (a pass over each operand and BF16 tensor cores), same contract.
The wgrad contracts over the grouped rows with 1x128 tiles along them: every non-empty group starts at a multiple of
128 rows so that no tile straddles two groups (GroupedLinear pads its groups to make that layout).
"""
import torch

from .cpu.block import BLOCK
from .cpu.moe_grouped_block_gemm import check_grouped_block_gemm, check_grouped_block_wgrad
from .grouped_gemm import ALIGN, use_cutlass


@torch.library.register_fake("transformer_fp8::grouped_block_fp8_gemm")
def _(a, a_scale_inv, b, b_scale_inv, offs, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@torch.library.register_fake("transformer_fp8::grouped_block_fp8_gemm_wgrad")
def _(a_t, a_scale_inv, b_t, b_scale_inv, offs, out_dtype):
    return a_t.new_empty((offs.shape[0], a_t.shape[0], b_t.shape[0]), dtype=out_dtype)


@torch.library.register_fake("transformer_fp8::grouped_block_fp8_gemm_sm90")
def _(a, a_scale_inv, b, b_scale_inv, offs):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16)


@torch.library.register_fake("transformer_fp8::grouped_block_fp8_gemm_wgrad_sm90")
def _(a_t, a_scale_inv, b_t, b_scale_inv, offs):
    return a_t.new_empty((offs.shape[0], a_t.shape[0], b_t.shape[0]), dtype=torch.bfloat16)


def _block_cutlass_runs(device: torch.device) -> bool:
    built = torch._C._dispatch_has_kernel_for_dispatch_key("transformer_fp8::grouped_block_fp8_gemm_sm90", "CUDA")
    return built and use_cutlass(device)


def _check_multiple_of_16(**sizes: int) -> None:
    for name, value in sizes.items():
        if value % ALIGN:
            raise ValueError(f"{name}: expected a multiple of {ALIGN} (the grouped FP8 kernel's 16-byte alignment), "
                             f"got {value}")


def _tile_values(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """FP8 data [R, C] with 1x128 tile scales [cdiv(C, 128), >= R] -> bfloat16 values."""
    rows, cols = data.shape
    scales = scale_inv[:, :rows].t().repeat_interleave(BLOCK, dim=1)[:, :cols]
    return (data.float() * scales).to(torch.bfloat16)


def _block_values(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """FP8 data [G, R, C] with 128x128 block scales [G, cdiv(R, 128), cdiv(C, 128)] -> bfloat16 values."""
    rows, cols = data.shape[1:]
    scales = scale_inv.repeat_interleave(BLOCK, dim=1).repeat_interleave(BLOCK, dim=2)[:, :rows, :cols]
    return (data.float() * scales).to(torch.bfloat16)


@torch.library.register_kernel("transformer_fp8::grouped_block_fp8_gemm", "cuda")
def _grouped_block_fp8_gemm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                            offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    check_grouped_block_gemm(a, a_scale_inv, b, b_scale_inv, offs, out_dtype)
    _check_multiple_of_16(N=b.shape[1], K=b.shape[2])
    if a.shape[0] == 0:
        return a.new_empty((0, b.shape[1]), dtype=out_dtype)
    if _block_cutlass_runs(a.device):
        out = torch.ops.transformer_fp8.grouped_block_fp8_gemm_sm90(a, a_scale_inv, b, b_scale_inv, offs)
    else:
        out = torch._grouped_mm(_tile_values(a, a_scale_inv), _block_values(b, b_scale_inv).transpose(-2, -1),
                                offs=offs)
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)


@torch.library.register_kernel("transformer_fp8::grouped_block_fp8_gemm_wgrad", "cuda")
def _grouped_block_fp8_gemm_wgrad(a_t: torch.Tensor, a_scale_inv: torch.Tensor, b_t: torch.Tensor,
                                  b_scale_inv: torch.Tensor, offs: torch.Tensor,
                                  out_dtype: torch.dtype) -> torch.Tensor:
    check_grouped_block_wgrad(a_t, a_scale_inv, b_t, b_scale_inv, offs, out_dtype)
    (n, m), k = a_t.shape, b_t.shape[0]
    _check_multiple_of_16(N=n, K=k, M=m)
    if m == 0:
        return a_t.new_zeros((offs.numel(), n, k), dtype=out_dtype)
    if _block_cutlass_runs(a_t.device):
        out = torch.ops.transformer_fp8.grouped_block_fp8_gemm_wgrad_sm90(a_t, a_scale_inv[:, :n].contiguous(), b_t,
                                                                          b_scale_inv[:, :k].contiguous(), offs)
    else:
        out = torch._grouped_mm(_tile_values(a_t, a_scale_inv), _tile_values(b_t, b_scale_inv).t(), offs=offs)
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)
