"""The CUDA kernels of the grouped FP8 GEMM ops (grouped_fp8_gemm, grouped_fp8_gemm_wgrad; contracts in csrc/ops.cpp),
and the device-side group bookkeeping GroupedLinear uses with them.

Two kernels, chosen by BACKEND (read at each call):
- "cutlass": ours (csrc/grouped_gemm_*.cu, the ops grouped_fp8_gemm_sm90 / grouped_fp8_gemm_wgrad_sm90), a CUTLASS 3
  pointer-array grouped GEMM for Hopper with one FP32 alpha per group (per-tensor scales, no rowwise expansion) whose
  group shapes and pointers are written on the device from the offsets: no host sync, empty groups allowed; for the
  fast-accumulation forward of groups under 1024 rows on average, a kernel of our own built on the same headers
  (csrc/grouped_gemm_rows_kernel.cuh, which reads the offsets itself). Built when the CUTLASS headers are found
  (setup.py); runs on compute capability 9.0 only.
- "torch": torch._scaled_grouped_mm (torch >= 2.9), torch's own CUTLASS grouped kernel with rowwise scales (a
  per-tensor scale is expanded), also reading the offsets on the device.
"auto" (default) takes ours where it is built and the GPU is a 9.0 one, else torch's. cuBLASLt's grouped batch mode
(CUBLASLT_BATCH_MODE_GROUPED) is not in the cuBLAS 13.1 that torch 2.11 pins (its FP8 Hopper support came with
CUDA 13.2 update 1), and a loop of dense GEMMs needs the group sizes on the host.
Limits both kernels share, which the ops' contracts carry: E4M3 operands only (GroupedLinear casts gradients to E4M3
under every format), a bfloat16 output, and for the weight gradient (the contraction over the grouped rows) every
group starting at a multiple of 16 rows (padded_groups below makes such a layout from any group sizes).
"""
import functools

import torch

from .cpu.moe_grouped_gemm import check_grouped_gemm, check_grouped_wgrad

ALIGN = 16  # rows per group the wgrad kernel needs (16 bytes of FP8)

# Which kernel runs the grouped GEMMs on CUDA: "auto", "cutlass" (ours; an error where it is not built or the GPU is
# not a compute capability 9.0 one) or "torch" (torch._scaled_grouped_mm). Read at each call.
BACKEND = "auto"
# Our kernel's CTA tiles: 0 picks by kind, accumulation and the groups' average size; 1 large, 2 small, 3 alt, 4 wide,
# 5 solo, 6 ping (CUTLASS), 7 our own forward kernel (csrc/grouped_gemm.h); or a dict {(form, fast_accumulation): tile}
# with form "rows" (fprop, dgrad) or "contraction" (wgrad), 0 for the pairs it leaves out (to compare choices inside
# one model step). Read at each call.
CUTLASS_TILE: int | dict[tuple[str, bool], int] = 0
_BACKENDS = ("auto", "cutlass", "torch")


def cutlass_tile(form: str, fast_accumulation: bool) -> int:
    """The tile configuration CUTLASS_TILE asks for, for one GEMM.

    Args:
        form: "rows" (fprop, dgrad) or "contraction" (wgrad).
        fast_accumulation: the GEMM's accumulation.

    Returns:
        The ops' tile argument (0: the kernel's own choice).
    """
    if isinstance(CUTLASS_TILE, dict):
        return CUTLASS_TILE.get((form, fast_accumulation), 0)
    return CUTLASS_TILE


@functools.lru_cache(maxsize=None)
def _cutlass_runs_on(device: torch.device) -> bool:
    built = torch._C._dispatch_has_kernel_for_dispatch_key("transformer_fp8::grouped_fp8_gemm_sm90", "CUDA")
    return built and torch.cuda.get_device_capability(device) == (9, 0)


def use_cutlass(device: torch.device) -> bool:
    """Whether the grouped GEMMs on `device` run on our CUTLASS kernel (BACKEND and what was built decide).

    Args:
        device: a CUDA device.

    Returns:
        True for our kernel, False for torch._scaled_grouped_mm.
    """
    if BACKEND not in _BACKENDS:
        raise ValueError(f"transformer_fp8.grouped_gemm.BACKEND: expected one of {_BACKENDS}, got {BACKEND!r}")
    if BACKEND == "torch":
        return False
    runs = _cutlass_runs_on(torch.device(device))
    if BACKEND == "cutlass" and not runs:
        raise RuntimeError("transformer_fp8.grouped_gemm.BACKEND='cutlass': our grouped kernel needs a compute "
                           "capability 9.0 GPU and an extension built with the CUTLASS headers (pip install "
                           "nvidia-cutlass, then rebuild); set BACKEND='torch' for torch's kernel")
    return runs


def _check_multiple_of_16(**sizes: int) -> None:
    for name, value in sizes.items():
        if value % ALIGN:
            raise ValueError(f"{name}: expected a multiple of {ALIGN} (the grouped FP8 kernel's 16-byte alignment), "
                             f"got {value}")


@torch.library.register_kernel("transformer_fp8::grouped_fp8_gemm", "cuda")
def _grouped_fp8_gemm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                      offs: torch.Tensor, out_dtype: torch.dtype, use_split_accumulator: bool = True) -> torch.Tensor:
    check_grouped_gemm(a, a_scale_inv, b, b_scale_inv, offs, out_dtype)
    g, n, k = b.shape
    _check_multiple_of_16(N=n, K=k)
    m = a.shape[0]
    if m == 0:
        return a.new_empty((0, n), dtype=out_dtype)
    if use_cutlass(a.device):
        out = torch.ops.transformer_fp8.grouped_fp8_gemm_sm90(a, a_scale_inv, b, b_scale_inv, offs,
                                                              not use_split_accumulator,
                                                              cutlass_tile("rows", not use_split_accumulator))
        return out if out_dtype == torch.bfloat16 else out.to(out_dtype)
    scale_a = a_scale_inv.expand(m).contiguous()
    scale_b = b_scale_inv.reshape(-1, 1).expand(g, n).contiguous()
    out = torch._scaled_grouped_mm(a, b.transpose(-2, -1), scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16,
                                   use_fast_accum=not use_split_accumulator)
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)


# With torch's kernel (BACKEND "torch"), the weight gradient of groups averaging fewer rows than this runs torch's BF16
# grouped kernel on BF16 copies of the FP8 operands (b_t's exact; a_t's times both scales, rounded to BF16: 2**-9, far
# below the FP8 rounding; float32 sums): about the numbers of an FP8 GEMM with a split accumulator, and faster than
# torch's FP8 kernel for small groups. Our kernel's split wgrad is faster than both at every measured size, hence 0 for
# it below (benchmarks/RESULTS.md, MoE sections of 2026-11-26 sessions 2 and 3). Read at each call; 0 turns the BF16
# kernel off.
WGRAD_BF16_BELOW_ROWS_PER_GROUP = 1024
# The same threshold when our CUTLASS kernel runs the FP8 wgrad (BACKEND); 0: always the FP8 kernel.
CUTLASS_WGRAD_BF16_BELOW_ROWS_PER_GROUP = 0
# The FP8 wgrad kernel's accumulation: False (default, Transformer Engine's choice for wgrad) promotes the partial
# sums to float32 (split accumulator); True keeps Hopper's fast FP8 accumulation, less precise over long groups and
# faster (the measured trade in benchmarks/RESULTS.md, "wgrad precision: fast accumulation vs split"). Read at each
# call.
WGRAD_FAST_ACCUMULATION = False


@torch.library.register_kernel("transformer_fp8::grouped_fp8_gemm_wgrad", "cuda")
def _grouped_fp8_gemm_wgrad(a_t: torch.Tensor, a_scale_inv: torch.Tensor, b_t: torch.Tensor,
                            b_scale_inv: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    check_grouped_wgrad(a_t, a_scale_inv, b_t, b_scale_inv, offs, out_dtype)
    g, n, k, m = offs.numel(), a_t.shape[0], b_t.shape[0], a_t.shape[1]
    _check_multiple_of_16(N=n, K=k, M=m)
    if m == 0:
        return a_t.new_zeros((g, n, k), dtype=out_dtype)
    cutlass = use_cutlass(a_t.device)
    bf16_below = CUTLASS_WGRAD_BF16_BELOW_ROWS_PER_GROUP if cutlass else WGRAD_BF16_BELOW_ROWS_PER_GROUP
    if m < bf16_below * g:  # (the scales go into a's copy: no pass over the output)
        a = a_t.to(torch.bfloat16).mul_(a_scale_inv * b_scale_inv)
        out = torch._grouped_mm(a, b_t.to(torch.bfloat16).t(), offs=offs)
    elif cutlass:
        fast = WGRAD_FAST_ACCUMULATION
        out = torch.ops.transformer_fp8.grouped_fp8_gemm_wgrad_sm90(a_t, a_scale_inv, b_t, b_scale_inv, offs, fast,
                                                                    cutlass_tile("contraction", fast))
    else:
        out = torch._scaled_grouped_mm(a_t, b_t.t(), a_scale_inv.expand(g * n).contiguous(),
                                       b_scale_inv.expand(g * k).contiguous(), offs=offs, out_dtype=torch.bfloat16,
                                       use_fast_accum=WGRAD_FAST_ACCUMULATION)
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)


@torch.library.register_fake("transformer_fp8::grouped_fp8_gemm_sm90")
def _(a, a_scale_inv, b, b_scale_inv, offs, fast_accumulation=False, tile=0):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16)


@torch.library.register_fake("transformer_fp8::grouped_fp8_gemm_wgrad_sm90")
def _(a_t, a_scale_inv, b_t, b_scale_inv, offs, fast_accumulation=False, tile=0):
    return a_t.new_empty((offs.shape[0], a_t.shape[0], b_t.shape[0]), dtype=torch.bfloat16)


def group_offsets(m_splits: torch.Tensor) -> torch.Tensor:
    """Rows per group (integer tensor [G]) -> the groups' cumulative ends, int32 [G] (the ops' offs)."""
    return torch.cumsum(m_splits, 0, dtype=torch.int32)


def padded_rows_bound(rows: int, groups: int, align: int = ALIGN) -> int:
    """Rows of the padded layout for `rows` rows in `groups` groups: enough for every group rounded up to `align`
    rows, itself a multiple of `align` (known on the host without the group sizes)."""
    return -(-(rows + (align - 1) * groups) // align) * align


def padded_groups(m_splits: torch.Tensor, rows: int, align: int = ALIGN) -> tuple[torch.Tensor, torch.Tensor]:
    """A layout where every group starts at a multiple of `align` rows, made on the device (no sync).

    Args:
        m_splits: rows per group, an integer tensor [G] (summing to `rows`).
        rows: the number of rows of the unpadded tensor.
        align: the rows each group is rounded up to, a multiple of ALIGN (ALIGN: the per-tensor wgrad kernel's
            16-byte alignment; 128: the block-scaled wgrad's tiles).

    Returns:
        (source_rows int32 [padded_rows_bound(rows, G, align)]: the unpadded row each padded row copies, -1 for padding
        (moe_permute_rows with slots_per_token=1 makes the padded tensor, zeros in the padding),
        offs int32 [G]: the padded groups' cumulative ends, the last one extended to the padded size (the trailing
        padding joins the last group: zeros add nothing to its wgrad)).
    """
    if align <= 0 or align % ALIGN:
        raise ValueError(f"align: expected a positive multiple of {ALIGN}, got {align}")
    groups = m_splits.numel()
    total = padded_rows_bound(rows, groups, align)
    sizes = m_splits.to(torch.int32)
    starts = torch.cumsum(sizes, 0, dtype=torch.int32) - sizes
    padded = (sizes + (align - 1)) // align * align
    padded_ends = torch.cumsum(padded, 0, dtype=torch.int32)
    padded_starts = padded_ends - padded
    position = torch.arange(total, dtype=torch.int32, device=m_splits.device)
    group = torch.searchsorted(padded_ends, position, right=True).clamp_(max=groups - 1)
    local = position - padded_starts[group]
    source = torch.where(local < sizes[group], starts[group] + local, -1).to(torch.int32)
    # (the last end set to `total` by a device op: an indexed assignment of a host number would copy it over, a sync)
    offs = torch.cat((padded_ends[:-1], padded_ends.new_full((1,), total)))
    return source, offs


from . import grouped_block_gemm  # noqa: E402,F401  (the block-scaled grouped ops' CUDA and fake kernels)
