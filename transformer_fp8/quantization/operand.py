"""FP8Operand: one tensor in FP8 as a GEMM (or a collective) takes it: data, its transposed copy, their scales."""
import torch

from ..ops import tfp8

LAYOUTS = ("tensor",)  # block scaling adds "block_1x128" (activations, gradients) and "block_128x128" (weights)


class FP8Operand:
    """A tensor x [M, K] quantized to FP8: q = sat(x * scale), read back as q * scale_inv.

    Attributes:
        data: q [M, K] (FP8), or None where only the transposed copy was made.
        data_t: qᵀ [K, M] (FP8, contiguous), or None where not made. Hopper's FP8 GEMMs take K-major operands only,
            so a GEMM that contracts over M (the wgrad: dyᵀ xᵀ) reads data_t.
        scale_inv: the dequantization scale of data; per-tensor layout: float32 [1].
        scale_inv_t: that of data_t; per-tensor layout: the same tensor as scale_inv.
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        layout: the scaling granularity, "tensor" (one scale for the whole tensor).
    """

    __slots__ = ("data", "data_t", "scale_inv", "scale_inv_t", "fp8_dtype", "layout")

    def __init__(self, data: torch.Tensor | None, data_t: torch.Tensor | None, scale_inv: torch.Tensor,
                 fp8_dtype: torch.dtype, layout: str = "tensor", scale_inv_t: torch.Tensor | None = None):
        """Args:
            data, data_t, scale_inv, fp8_dtype, layout: see the class attributes.
            scale_inv_t: the scale of data_t; None: scale_inv (per-tensor layout).
        """
        self.data, self.data_t, self.scale_inv = data, data_t, scale_inv
        self.scale_inv_t = scale_inv if scale_inv_t is None else scale_inv_t
        self.fp8_dtype, self.layout = fp8_dtype, layout

    def with_transpose(self) -> "FP8Operand":
        """Returns:
            self, with data_t made from data when it is missing (per-tensor layout: a plain FP8 transpose)."""
        if self.data_t is None:
            if self.layout != "tensor":
                raise NotImplementedError(f"FP8Operand.with_transpose: layout {self.layout!r} needs a recast")
            self.data_t = tfp8.fp8_transpose(self.data)
        return self

    def transposed_only(self, data_t: torch.Tensor | None = None) -> "FP8Operand":
        """A new operand with this one's scales, no data and `data_t` (what a backward rebuilds from the forward's
        scales and the transposed copy it kept; the scale_inv snapshots ride outside save_for_backward, see
        state.py).

        Args:
            data_t: the transposed data, or None.

        Returns:
            The new FP8Operand.
        """
        return FP8Operand(None, data_t, self.scale_inv, self.fp8_dtype, self.layout, self.scale_inv_t)

    def __repr__(self) -> str:
        shape = tuple(self.data.shape) if self.data is not None else None
        shape_t = tuple(self.data_t.shape) if self.data_t is not None else None
        return f"FP8Operand(data={shape}, data_t={shape_t}, fp8_dtype={self.fp8_dtype}, layout={self.layout!r})"
