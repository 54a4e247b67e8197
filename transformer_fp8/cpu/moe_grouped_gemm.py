"""CPU reference kernels of the grouped FP8 GEMMs: grouped_fp8_gemm, grouped_fp8_gemm_wgrad and our CUTLASS kernel's
ops grouped_fp8_gemm_sm90, grouped_fp8_gemm_wgrad_sm90 (contracts in csrc/ops.cpp), and the argument checks the CUDA
kernels (transformer_fp8/grouped_gemm.py) share.
Each group's product in float32 (the FP8 values are exact there), rounded to bfloat16 as the CUDA kernel's output,
then converted to out_dtype."""
import torch

from ._common import register

OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_fp8(t, arg):
    if t.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{arg}: expected a torch.float8_e4m3fn tensor (Hopper's grouped FP8 GEMM takes E4M3 only), "
                        f"got {t.dtype}")


def _check_scale(t, data, sizes, arg):
    if t.dtype != torch.float32:
        raise TypeError(f"{arg}: expected a float32 tensor, got {t.dtype}")
    if t.numel() not in sizes or t.dim() != 1:
        raise ValueError(f"{arg}: expected a 1-D tensor of {' or '.join(map(str, sizes))} elements, got shape "
                         f"{tuple(t.shape)}")
    if t.device != data.device:
        raise ValueError(f"{arg}: expected a tensor on {data.device}, got one on {t.device}")


def _check_offs(offs, data, arg="offs"):
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.numel() == 0:
        raise ValueError(f"offs: expected a non-empty 1-D int32 tensor (the groups' cumulative ends), got "
                         f"{offs.dtype} of shape {tuple(offs.shape)}")
    if offs.device != data.device:
        raise ValueError(f"{arg}: expected a tensor on {data.device}, got one on {offs.device}")


def _check_out_dtype(out_dtype):
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype: expected torch.float32, torch.float16 or torch.bfloat16, got {out_dtype}")


def check_grouped_gemm(a, a_scale_inv, b, b_scale_inv, offs, out_dtype):
    """The checks of grouped_fp8_gemm (both devices)."""
    _check_fp8(a, "a")
    _check_fp8(b, "b")
    if a.dim() != 2 or not a.is_contiguous():
        raise ValueError(f"a: expected a contiguous 2-D tensor [M, K], got shape {tuple(a.shape)}, strides "
                         f"{a.stride()}")
    if b.dim() != 3 or b.shape[2] != a.shape[1] or b.stride(2) != 1:
        raise ValueError(f"b: expected [G, N, {a.shape[1]}] with a contiguous last dim, got shape {tuple(b.shape)}, "
                         f"strides {b.stride()}")
    if b.device != a.device:
        raise ValueError(f"b: expected a tensor on {a.device}, got one on {b.device}")
    _check_offs(offs, a)
    if offs.numel() != b.shape[0]:
        raise ValueError(f"offs: expected {b.shape[0]} elements (b's groups), got {offs.numel()}")
    _check_scale(a_scale_inv, a, (1,), "a_scale_inv")
    _check_scale(b_scale_inv, a, (1, b.shape[0]), "b_scale_inv")
    _check_out_dtype(out_dtype)


def check_grouped_wgrad(a_t, a_scale_inv, b_t, b_scale_inv, offs, out_dtype):
    """The checks of grouped_fp8_gemm_wgrad (both devices)."""
    _check_fp8(a_t, "a_t")
    _check_fp8(b_t, "b_t")
    for t, arg in ((a_t, "a_t"), (b_t, "b_t")):
        if t.dim() != 2 or not t.is_contiguous():
            raise ValueError(f"{arg}: expected a contiguous 2-D tensor, got shape {tuple(t.shape)}, strides "
                             f"{t.stride()}")
    if b_t.shape[1] != a_t.shape[1] or b_t.device != a_t.device:
        raise ValueError(f"b_t: expected [K, {a_t.shape[1]}] on {a_t.device} (a_t's columns), got shape "
                         f"{tuple(b_t.shape)} on {b_t.device}")
    _check_offs(offs, a_t)
    _check_scale(a_scale_inv, a_t, (1,), "a_scale_inv")
    _check_scale(b_scale_inv, a_t, (1,), "b_scale_inv")
    _check_out_dtype(out_dtype)


def _groups(offs):
    ends = offs.tolist()  # (a CPU tensor: no device sync)
    return list(zip([0] + ends[:-1], ends))


@register("grouped_fp8_gemm")
def grouped_fp8_gemm(a, a_scale_inv, b, b_scale_inv, offs, out_dtype, use_split_accumulator=True):
    check_grouped_gemm(a, a_scale_inv, b, b_scale_inv, offs, out_dtype)
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32)
    b_scales = b_scale_inv.expand(b.shape[0])
    for g, (start, end) in enumerate(_groups(offs)):
        if end > start:
            out[start:end] = (a[start:end].float() @ b[g].float().T) * (a_scale_inv * b_scales[g])
    return out.to(torch.bfloat16).to(out_dtype)


@register("grouped_fp8_gemm_wgrad")
def grouped_fp8_gemm_wgrad(a_t, a_scale_inv, b_t, b_scale_inv, offs, out_dtype):
    check_grouped_wgrad(a_t, a_scale_inv, b_t, b_scale_inv, offs, out_dtype)
    groups = _groups(offs)
    out = torch.zeros(len(groups), a_t.shape[0], b_t.shape[0], dtype=torch.float32)
    for g, (start, end) in enumerate(groups):
        if end > start:
            out[g] = (a_t[:, start:end].float() @ b_t[:, start:end].float().T) * (a_scale_inv * b_scale_inv)
    return out.to(torch.bfloat16).to(out_dtype)


def _check_tile(tile):
    if tile not in (0, 1, 2, 3, 4, 5, 6, 7):
        raise ValueError(f"tile: expected 0 (auto), 1 (large), 2 (small), 3 (alt), 4 (wide), 5 (solo), 6 (ping) or "
                         f"7 (ours), got {tile}")


@register("grouped_fp8_gemm_sm90")
def grouped_fp8_gemm_sm90(a, a_scale_inv, b, b_scale_inv, offs, fast_accumulation=False, tile=0):
    _check_tile(tile)  # (the accumulation and the tiles are the CUDA kernel's: float32 sums here)
    return torch.ops.transformer_fp8.grouped_fp8_gemm(a, a_scale_inv, b, b_scale_inv, offs, torch.bfloat16)


@register("grouped_fp8_gemm_wgrad_sm90")
def grouped_fp8_gemm_wgrad_sm90(a_t, a_scale_inv, b_t, b_scale_inv, offs, fast_accumulation=False, tile=0):
    _check_tile(tile)
    return torch.ops.transformer_fp8.grouped_fp8_gemm_wgrad(a_t, a_scale_inv, b_t, b_scale_inv, offs, torch.bfloat16)


from . import moe_grouped_block_gemm  # noqa: E402,F401  (the block-scaled grouped ops register their CPU kernels)
