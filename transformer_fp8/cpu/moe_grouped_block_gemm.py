"""CPU reference kernels of the block-scaled grouped FP8 GEMMs (recipe Float8BlockScaling): grouped_block_fp8_gemm,
grouped_block_fp8_gemm_wgrad and our CUTLASS kernel's ops grouped_block_fp8_gemm_sm90 /
grouped_block_fp8_gemm_wgrad_sm90 (contracts in csrc/ops.cpp), and the argument checks the CUDA kernels share.
Layouts: transformer_fp8/quantization/block.py. Both operands are dequantized (every FP8 value times the scale of
its tile, exact in float32), each group's product is summed in float32, rounded to bfloat16 as the CUDA kernel's
output, then converted to out_dtype."""
import torch

from ._common import register
from .block import BLOCK, expand_scales
from .moe_grouped_gemm import OUT_DTYPES

WGRAD_GROUP_ALIGN = BLOCK  # rows every wgrad group starts at a multiple of (its 1x128 tiles run along the rows)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_e4m3_2d(t: torch.Tensor, arg: str) -> None:
    if t.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{arg}: expected a torch.float8_e4m3fn tensor (the grouped kernel takes E4M3 only), got "
                        f"{t.dtype}")


def _check_float32(t: torch.Tensor, ref: torch.Tensor, arg: str) -> None:
    if t.dtype != torch.float32:
        raise TypeError(f"{arg}: expected a float32 tensor, got {t.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{arg}: expected a tensor on {ref.device}, got one on {t.device}")


def _check_tile_scales(scale_inv: torch.Tensor, ref: torch.Tensor, tiles: int, rows: int, arg: str) -> None:
    """scale_inv of 1x128 tiles: [tiles, >= rows] with contiguous rows (block_cast's layout, pad4 columns allowed)."""
    _check_float32(scale_inv, ref, arg)
    if scale_inv.dim() != 2 or scale_inv.shape[0] != tiles or scale_inv.shape[1] < rows or scale_inv.stride(1) != 1:
        raise ValueError(f"{arg}: expected 1x128 tile scales [{tiles}, >= {rows}] with a contiguous last dim "
                         f"(block_cast's layout), got shape {tuple(scale_inv.shape)}, strides {scale_inv.stride()}")


def _check_offs(offs: torch.Tensor, ref: torch.Tensor, groups: int | None = None) -> None:
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.numel() == 0:
        raise ValueError(f"offs: expected a non-empty 1-D int32 tensor (the groups' cumulative ends), got "
                         f"{offs.dtype} of shape {tuple(offs.shape)}")
    if offs.device != ref.device:
        raise ValueError(f"offs: expected a tensor on {ref.device}, got one on {offs.device}")
    if groups is not None and offs.numel() != groups:
        raise ValueError(f"offs: expected {groups} elements (b's groups), got {offs.numel()}")


def _check_out_dtype(out_dtype: torch.dtype) -> None:
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype: expected torch.float32, torch.float16 or torch.bfloat16, got {out_dtype}")


def check_grouped_block_gemm(a, a_scale_inv, b, b_scale_inv, offs, out_dtype=torch.bfloat16) -> None:
    """The checks of grouped_block_fp8_gemm (both devices): a [M, K] contiguous with 1x128 tile scales
    [cdiv(K, 128), >= M]; b [G, N, K] (contiguous last dim) with 128x128 block scales [G, cdiv(N, 128),
    cdiv(K, 128)] (any strides)."""
    _check_e4m3_2d(a, "a")
    _check_e4m3_2d(b, "b")
    if a.dim() != 2 or not a.is_contiguous():
        raise ValueError(f"a: expected a contiguous 2-D tensor [M, K], got shape {tuple(a.shape)}, strides "
                         f"{a.stride()}")
    m, k = a.shape
    if b.dim() != 3 or b.shape[2] != k or b.stride(2) != 1 or b.device != a.device:
        raise ValueError(f"b: expected [G, N, {k}] with a contiguous last dim on {a.device}, got shape "
                         f"{tuple(b.shape)}, strides {b.stride()} on {b.device}")
    g, n = b.shape[0], b.shape[1]
    _check_tile_scales(a_scale_inv, a, _cdiv(k, BLOCK), m, "a_scale_inv")
    _check_float32(b_scale_inv, a, "b_scale_inv")
    expected = (g, _cdiv(n, BLOCK), _cdiv(k, BLOCK))
    if tuple(b_scale_inv.shape) != expected:
        raise ValueError(f"b_scale_inv: expected 128x128 block scales of shape {expected} (b's groups, row blocks, "
                         f"column blocks; any strides), got {tuple(b_scale_inv.shape)}")
    _check_offs(offs, a, g)
    _check_out_dtype(out_dtype)


def check_grouped_block_wgrad(a_t, a_scale_inv, b_t, b_scale_inv, offs, out_dtype=torch.bfloat16) -> None:
    """The checks of grouped_block_fp8_gemm_wgrad (both devices): a_t [N, M], b_t [K, M] contiguous, each with the
    1x128 tile scales of its rows along M, [cdiv(M, 128), >= N] / [cdiv(M, 128), >= K]."""
    _check_e4m3_2d(a_t, "a_t")
    _check_e4m3_2d(b_t, "b_t")
    for t, arg in ((a_t, "a_t"), (b_t, "b_t")):
        if t.dim() != 2 or not t.is_contiguous():
            raise ValueError(f"{arg}: expected a contiguous 2-D tensor, got shape {tuple(t.shape)}, strides "
                             f"{t.stride()}")
    if b_t.shape[1] != a_t.shape[1] or b_t.device != a_t.device:
        raise ValueError(f"b_t: expected [K, {a_t.shape[1]}] on {a_t.device} (a_t's columns), got shape "
                         f"{tuple(b_t.shape)} on {b_t.device}")
    tiles = _cdiv(a_t.shape[1], BLOCK)
    _check_tile_scales(a_scale_inv, a_t, tiles, a_t.shape[0], "a_scale_inv")
    _check_tile_scales(b_scale_inv, a_t, tiles, b_t.shape[0], "b_scale_inv")
    _check_offs(offs, a_t)
    _check_out_dtype(out_dtype)


def _groups(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()  # (a CPU tensor: no device sync)
    return list(zip([0] + ends[:-1], ends))


def _check_wgrad_starts(groups: list[tuple[int, int]]) -> None:
    starts = [start for start, end in groups if end > start]
    if any(start % WGRAD_GROUP_ALIGN for start in starts):
        raise ValueError(f"offs: every non-empty group of the block-scaled wgrad must start at a multiple of "
                         f"{WGRAD_GROUP_ALIGN} rows (its 1x128 tiles run along the rows), got starts {starts}")


@register("grouped_block_fp8_gemm")
def grouped_block_fp8_gemm(a, a_scale_inv, b, b_scale_inv, offs, out_dtype):
    check_grouped_block_gemm(a, a_scale_inv, b, b_scale_inv, offs, out_dtype)
    m, k = a.shape
    n = b.shape[1]
    a_values = a.float() * expand_scales(a_scale_inv, m, k, 1)
    out = torch.zeros(m, n, dtype=torch.float32)
    for g, (start, end) in enumerate(_groups(offs)):
        if end > start:
            b_values = b[g].float() * expand_scales(b_scale_inv[g], n, k, 2)
            out[start:end] = a_values[start:end] @ b_values.T
    return out.to(torch.bfloat16).to(out_dtype)


@register("grouped_block_fp8_gemm_wgrad")
def grouped_block_fp8_gemm_wgrad(a_t, a_scale_inv, b_t, b_scale_inv, offs, out_dtype):
    check_grouped_block_wgrad(a_t, a_scale_inv, b_t, b_scale_inv, offs, out_dtype)
    groups = _groups(offs)
    _check_wgrad_starts(groups)
    (n, m), k = a_t.shape, b_t.shape[0]
    a_values = a_t.float() * expand_scales(a_scale_inv, n, m, 1)
    b_values = b_t.float() * expand_scales(b_scale_inv, k, m, 1)
    out = torch.zeros(len(groups), n, k, dtype=torch.float32)
    for g, (start, end) in enumerate(groups):
        if end > start:
            out[g] = a_values[:, start:end] @ b_values[:, start:end].T
    return out.to(torch.bfloat16).to(out_dtype)


@register("grouped_block_fp8_gemm_sm90")
def grouped_block_fp8_gemm_sm90(a, a_scale_inv, b, b_scale_inv, offs):
    return torch.ops.transformer_fp8.grouped_block_fp8_gemm(a, a_scale_inv, b, b_scale_inv, offs, torch.bfloat16)


@register("grouped_block_fp8_gemm_wgrad_sm90")
def grouped_block_fp8_gemm_wgrad_sm90(a_t, a_scale_inv, b_t, b_scale_inv, offs):
    return torch.ops.transformer_fp8.grouped_block_fp8_gemm_wgrad(a_t, a_scale_inv, b_t, b_scale_inv, offs,
                                                                  torch.bfloat16)
