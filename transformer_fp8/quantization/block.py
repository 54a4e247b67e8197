"""Block scaling (recipe.Float8BlockScaling): the operand layout, and the quantizer that casts to it.

Operand layout (what the block ops produce and block_fp8_gemm takes; the layout cuBLASLt's block-scaled FP8 GEMM on
Hopper reads, so nothing is re-laid out before a GEMM). All scales are float32 `scale_inv` (x ~= q * scale_inv),
`cdiv(a, b) = ceil(a / b)`, `pad4(a) = a rounded up to a multiple of 4` (cuBLASLt wants 16-byte scale rows). Padding
entries of a scale tensor hold 1.0.

1x128 tiles (block_dim 1: activations and gradients), x [M, K] high precision:
  data        [M, K] FP8                      row m, columns 128*j .. 128*j+127 share one scale
  scale_inv   [cdiv(K, 128), pad4(M)] f32     scale_inv[j, m] belongs to x[m, 128*j : 128*j+128]   (M contiguous)
  data_t      [K, M] FP8                      the transposed copy, quantized with its OWN 1x128 tiles along M
                                              (cast from x, not from data: no double rounding)
  scale_inv_t [cdiv(M, 128), pad4(K)] f32     scale_inv_t[i, k] belongs to x[128*i : 128*i+128, k]
  (data_t / scale_inv_t are exactly the 1x128 layout of xᵀ [K, M].)

128x128 blocks (block_dim 2: weights), w [N, K] high precision:
  data        [N, K] FP8                      one scale per 128x128 block
  scale_inv   [cdiv(N, 128), pad4(cdiv(K, 128))] f32   scale_inv[i, j] belongs to w[128*i : .., 128*j : ..]
  data_t      [K, N] FP8                      the same values transposed (same block scales: one rounding)
  scale_inv_t [cdiv(K, 128), pad4(cdiv(N, 128))] f32   scale_inv transposed: scale_inv_t[j, i] = scale_inv[i, j]
  (A Hugging Face block-FP8 checkpoint's `weight_scale_inv` [cdiv(N, 128), cdiv(K, 128)] is scale_inv without the
  padding columns.)

Scale of a tile (as TE computes it): amax = max|tile| floored at amax_epsilon; scale = fp8_max / amax (float32
division), float32 max when that overflows, 1 when amax is 0, Inf or NaN; with power_2_scale the scale is rounded
down to a power of two (its mantissa bits cleared). q = saturate(x * scale) rounded to nearest even,
scale_inv = 1 / scale.

GEMM ("TN", out [M, N] = a [M, K] · b [N, K]ᵀ): each operand is 1x128 or 128x128 along its K-contiguous rows;
fprop a = x (1x128) and b = w (128x128); dgrad a = dy (1x128) and b = w's data_t (128x128); wgrad a = dy's data_t
(1x128) and b = x's data_t (1x128). 128x128 x 128x128 is refused (cuBLASLt has no such kernel).
"""
import os
from typing import Any

import torch

from ..ops import tfp8
from ..recipe import Float8BlockScaling, QParams
from .operand import FP8Operand
from .quantizer import Quantizer
from .roles import Role
from .state import ScalingState

LAYOUT_1X128 = "block_1x128"
LAYOUT_128X128 = "block_128x128"
BLOCK_DIM_OF_LAYOUT = {LAYOUT_1X128: 1, LAYOUT_128X128: 2}
LAYOUT_OF_BLOCK_DIM = {1: LAYOUT_1X128, 2: LAYOUT_128X128}

_WEIGHT_ROLES = (Role.WEIGHT, Role.FC1_WEIGHT, Role.FC2_WEIGHT)
# The norm and the activation gradient cast with the fused kernels (norm_block_cast, dact_block_cast) unless this is
# "0" (then norm_fwd / activation_bwd, then block_cast). On by default since their loaders issue every load of a tile
# before the first use: on the H100's Llama-1.1B-shaped stack the fused path is the faster one, at the same peak
# memory (benchmarks/RESULTS.md, session 5); before that change the unfused one was.
FUSED_CASTS_ENV = "TFP8_BLOCK_FUSED"


def fused_casts_enabled() -> bool:
    """Returns:
        Whether the fused norm -> block-FP8 and activation-gradient -> block-FP8 kernels are used: yes unless the
        environment variable TFP8_BLOCK_FUSED is "0" (read at each call, so a benchmark can switch it between
        steps)."""
    return os.environ.get(FUSED_CASTS_ENV, "1") != "0"
_GRAD_ROLES = (Role.GRAD_OUTPUT, Role.FC1_GRAD_OUTPUT, Role.FC2_GRAD_OUTPUT)


def role_settings(recipe: Float8BlockScaling, role: Role) -> tuple[int, QParams]:
    """The block dim and QParams a Float8BlockScaling recipe gives a role.

    Args:
        recipe: the recipe.
        role: a GEMM role (weights, gradients, or else an input).

    Returns:
        (block_dim, qparams): the recipe's w_ / grad_ / x_block_scaling_dim and fp8_quant_fwd_weight /
        fp8_quant_bwd_grad / fp8_quant_fwd_inp.
    """
    if role in _WEIGHT_ROLES:
        return recipe.w_block_scaling_dim, recipe.fp8_quant_fwd_weight
    if role in _GRAD_ROLES:
        return recipe.grad_block_scaling_dim, recipe.fp8_quant_bwd_grad
    return recipe.x_block_scaling_dim, recipe.fp8_quant_fwd_inp


class BlockScalingQuantizer(Quantizer):
    """Float8BlockScaling: a float32 scale per 1x128 tile or 128x128 block from the tile's own amax at each cast
    (block_cast; the layout above). No amax history, no update, nothing shared between ranks; the transposed copy is
    cast from the high-precision tensor with its own tiles. The fused per-tensor ops cannot take it
    (fused_per_tensor False, known_scale False): modules cast separately and run the operand GEMM helpers, which send
    block layouts to block_fp8_gemm.

    Attributes:
        block_dim: 1 (1x128 tiles) or 2 (128x128 blocks), from the recipe for this role.
        qparams: the role's QParams (power_2_scale, amax_epsilon).
        layout: "block_1x128" or "block_128x128".
    """

    __slots__ = ("block_dim", "qparams", "layout")
    fused_per_tensor = False
    updates_by_history = False

    def __init__(self, role: Role, fp8_dtype: torch.dtype, state: ScalingState, slot: int, tp_group: Any = None,
                 recipe: Float8BlockScaling | None = None):
        """Args:
            role, fp8_dtype, state, slot, tp_group: as Quantizer's (the state's slot is not used: no history).
            recipe: the Float8BlockScaling recipe (None: its defaults).
        """
        super().__init__(role, fp8_dtype, state, slot, tp_group)
        self.block_dim, self.qparams = role_settings(recipe or Float8BlockScaling(), role)
        self.layout = LAYOUT_OF_BLOCK_DIM[self.block_dim]

    @classmethod
    def history_len(cls, recipe: Any) -> int:
        return 1

    @classmethod
    def same_scale_on_every_rank(cls, recipe: Any) -> bool:
        return False  # (each rank's tiles have their own scales: FP8 data of several ranks is no one tensor)

    def cast_args(self, x: torch.Tensor):
        raise NotImplementedError(f"{self!r}: block scaling has no per-tensor scale for a fused per-tensor op "
                                  f"(check fused_per_tensor before calling cast_args)")

    def output_args(self):
        raise NotImplementedError(f"{self!r}: block scaling has no scale known before a cast (known_scale is False)")

    def cast(self, x: torch.Tensor, *, rowwise: bool = True, transpose: bool = False) -> FP8Operand:
        """x [M, N] (contiguous, high precision) -> FP8Operand (this quantizer's layout) with data [M, N] and its
        scales (rowwise) and data_t [N, M] with its own (transpose), from one block_cast kernel."""
        q, scale_inv, qt, scale_inv_t = tfp8.block_cast(x, self.fp8_dtype, self.block_dim, rowwise, transpose,
                                                        float(self.qparams.amax_epsilon), self.qparams.power_2_scale)
        return FP8Operand(q if rowwise else None, qt if transpose else None, scale_inv, self.fp8_dtype, self.layout,
                          scale_inv_t)

    def cast_activation(self, x: torch.Tensor, activation: str, *, transpose: bool = False) -> FP8Operand:
        """act(x) cast in one kernel (block_activation_cast: the activation in float32, no high-precision output) for
        1x128 tiles; 128x128 blocks take the activation, then the cast."""
        if self.block_dim != 1:
            return super().cast_activation(x, activation, transpose=transpose)
        q, scale_inv, qt, scale_inv_t = tfp8.block_activation_cast(
            x, activation, self.fp8_dtype, True, transpose, float(self.qparams.amax_epsilon),
            self.qparams.power_2_scale)
        return FP8Operand(q, qt if transpose else None, scale_inv, self.fp8_dtype, self.layout, scale_inv_t)

    @property
    def fused_norm_cast(self) -> bool:
        """1x128 tiles, unless TFP8_BLOCK_FUSED=0: norm_block_cast."""
        return self.block_dim == 1 and fused_casts_enabled()

    @property
    def fused_dact_cast(self) -> bool:
        """1x128 tiles, unless TFP8_BLOCK_FUSED=0: dact_block_cast."""
        return self.block_dim == 1 and fused_casts_enabled()

    def cast_normalized(self, spec, x, weight, bias, *, transpose=False):
        """norm(x) -> (FP8Operand with 1x128 tiles (data_t with its own when transpose), mean or None, rstd) from
        norm_block_cast: the statistics kernel, then the cast normalising as it loads."""
        q, scale_inv, qt, scale_inv_t, mean, rstd = tfp8.norm_block_cast(
            x, weight, bias, spec.normalization, spec.eps, spec.zero_centered_gamma, self.fp8_dtype, True, transpose,
            float(self.qparams.amax_epsilon), self.qparams.power_2_scale)
        operand = FP8Operand(q, qt if transpose else None, scale_inv, self.fp8_dtype, self.layout, scale_inv_t)
        return operand, (mean if spec.normalization == "LayerNorm" else None), rstd

    def cast_activation_grad(self, grad, x, activation, *, transpose=False, with_dbias=False):
        """act'(x) * grad -> (FP8Operand with 1x128 tiles (data_t with its own when transpose), its column sums or
        None), from dact_block_cast."""
        q, scale_inv, qt, scale_inv_t, dbias = tfp8.dact_block_cast(
            grad, x, activation, self.fp8_dtype, True, transpose, float(self.qparams.amax_epsilon),
            self.qparams.power_2_scale, with_dbias)
        operand = FP8Operand(q, qt if transpose else None, scale_inv, self.fp8_dtype, self.layout, scale_inv_t)
        return operand, (dbias if with_dbias else None)

    def cast_with_dbias(self, x: torch.Tensor) -> tuple[FP8Operand, torch.Tensor]:
        """A gradient x [M, N] -> (FP8Operand with data and data_t, x summed over rows [N] in float32, returned in
        x's dtype: the bias gradient)."""
        return self.cast(x, rowwise=True, transpose=True), x.float().sum(dim=0).to(x.dtype)

    def add_transpose(self, operand: FP8Operand, x: torch.Tensor) -> FP8Operand:
        """operand with data_t: 128x128 blocks by byte transpose (the same block scales, transposed), 1x128 tiles
        recast from x (the transposed copy has its own tiles)."""
        if operand.data_t is not None or self.layout == LAYOUT_128X128:
            return operand.with_transpose()
        operand.data_t = self.transpose_like(x, operand)
        return operand

    def transpose_like(self, x: torch.Tensor, operand: FP8Operand) -> torch.Tensor:
        """x [N, K] (the tensor `operand` was cast from) -> its FP8 transpose [K, N], recast from x with this
        quantizer's tiles (the same scales as the forward for 128x128 blocks: the same values give the same block
        amaxes); the scales go to operand.scale_inv_t, where the GEMM helpers read them."""
        operand_t = self.cast(x, rowwise=False, transpose=True)
        operand.scale_inv_t = operand_t.scale_inv_t
        return operand_t.data_t
