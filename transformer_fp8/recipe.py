"""FP8 recipes (Transformer Engine names): which FP8 formats to use and how scaling factors are chosen.

`Format.E4M3`: every FP8 tensor is E4M3. `Format.HYBRID`: forward tensors (inputs, weights) E4M3, gradients E5M2.
`DelayedScaling`: each tensor's scale comes from a history of amaxes of earlier steps,
    scale = fp8_max / amax / 2**margin, amax = max(history) ("max") or the newest entry ("most_recent").
`Float8CurrentScaling`: each tensor's scale comes from its own amax, computed right before the cast.
`Float8BlockScaling`: a float32 scale per 1x128 tile (activations, gradients) or 128x128 block (weights), from the
    tile's own amax at each cast; layouts and numerics in transformer_fp8/quantization/block.py.
`fp8_dpa=True` (DelayedScaling only): DotProductAttention runs cuDNN's FP8 attention (q, k, v, the softmax
    probabilities and the output in FP8, gradients in the backward format) with delayed scales like every other FP8
    tensor. Current scaling cannot take it: the probabilities and gradients are made inside the fused kernel, which
    needs their scales before it runs.
"""
import enum
from dataclasses import dataclass

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


class Format(enum.Enum):
    """FP8 dtypes of forward tensors and of gradients."""

    E4M3 = (torch.float8_e4m3fn, torch.float8_e4m3fn)
    HYBRID = (torch.float8_e4m3fn, torch.float8_e5m2)

    @property
    def fwd_dtype(self):
        return self.value[0]

    @property
    def bwd_dtype(self):
        return self.value[1]


def _check_format(fp8_format):
    if not isinstance(fp8_format, Format):
        raise TypeError(f"fp8_format: expected a recipe.Format (E4M3 or HYBRID), got {fp8_format!r}")


@dataclass(frozen=True)
class DelayedScaling:
    """Scales from an amax history, updated once per step (forward tensors after the forward, gradients after the
    backward) by one fused launch, without host synchronisation."""

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True
    fp8_dpa: bool = False

    def __post_init__(self):
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float)) or self.margin < 0:
            raise ValueError(f"margin: expected a number >= 0, got {self.margin!r}")
        _check_format(self.fp8_format)
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int):
            raise TypeError(f"amax_history_len: expected an int, got {self.amax_history_len!r}")
        if self.amax_history_len < 1:
            raise ValueError(f"amax_history_len: expected >= 1, got {self.amax_history_len}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo: expected 'max' or 'most_recent', got {self.amax_compute_algo!r}")
        if not isinstance(self.reduce_amax, bool):
            raise TypeError(f"reduce_amax: expected a bool, got {self.reduce_amax!r}")
        if not isinstance(self.fp8_dpa, bool):
            raise TypeError(f"fp8_dpa: expected a bool, got {self.fp8_dpa!r}")


@dataclass(frozen=True)
class Float8CurrentScaling:
    """Per-tensor scales from the tensor's own amax, computed right before each cast. fp8_dpa (FP8 attention) is not
    available with it (see the module docstring): only False is accepted."""

    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False

    def __post_init__(self):
        _check_format(self.fp8_format)
        if self.fp8_dpa is not False:
            raise ValueError(f"fp8_dpa: FP8 attention needs DelayedScaling (the fused kernel makes the probabilities "
                             f"and gradients it casts, so their scales must be known before it runs), got "
                             f"{self.fp8_dpa!r}")


@dataclass(frozen=True)
class QParams:
    """How one tensor role's block scales are chosen (TE's QParams).

    Args:
        power_2_scale: Round each scale down to a power of two (exact scale_inv, no rounding from the scale itself).
        amax_epsilon: Floor of a tile's amax before its scale is computed (>= 0; 0 keeps tiny tiles' full range).
    """

    power_2_scale: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self):
        if not isinstance(self.power_2_scale, bool):
            raise TypeError(f"power_2_scale: expected a bool, got {self.power_2_scale!r}")
        if isinstance(self.amax_epsilon, bool) or not isinstance(self.amax_epsilon, (int, float)):
            raise TypeError(f"amax_epsilon: expected a number, got {self.amax_epsilon!r}")
        if not 0.0 <= self.amax_epsilon < float("inf"):
            raise ValueError(f"amax_epsilon: expected a finite number >= 0, got {self.amax_epsilon!r}")


@dataclass(frozen=True)
class MMParams:
    """A GEMM's accumulation mode (TE's MMParams). Block scaling takes only the split accumulator."""

    use_split_accumulator: bool = True


def _check_block_dim(name, value):
    if isinstance(value, bool) or value not in (1, 2):
        raise ValueError(f"{name}: expected 1 (1x128 tiles) or 2 (128x128 blocks), got {value!r}")


@dataclass(frozen=True)
class Float8BlockScaling:
    """Block scaling (TE's Float8BlockScaling): every FP8 tensor carries a float32 scale per 1x128 tile or 128x128
    block, computed from that tile's amax at the cast (no history, no per-step update). The transposed copies the
    backward needs are cast from the high-precision tensor with their own tiles (no double rounding). GEMMs run through
    cuBLASLt's block-scaled FP8 kernels (Hopper, CUDA 12.9+) with the split accumulator.

    Args:
        fp8_format: Format.E4M3 (default: E4M3 everywhere) or Format.HYBRID (E5M2 gradients).
        fp8_quant_fwd_inp: Scale choice of the GEMM inputs (activations).
        fp8_quant_fwd_weight: Scale choice of the weights.
        fp8_quant_bwd_grad: Scale choice of the output gradients.
        x_block_scaling_dim: 1 (1x128 tiles, default) or 2 (128x128 blocks) for inputs.
        w_block_scaling_dim: 2 (default) or 1 for weights.
        grad_block_scaling_dim: 1 (default) or 2 for gradients. No GEMM may pair two 2's (cuBLASLt has no 128x128 x
            128x128 kernel): x with w (forward), grad with w (dgrad), grad with x (wgrad).
        fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: use_split_accumulator must stay True.
        fp8_dpa, fp8_mha: FP8 attention is not available with block scaling: only False is accepted.
    """

    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: QParams = QParams()
    fp8_quant_fwd_weight: QParams = QParams()
    fp8_quant_bwd_grad: QParams = QParams()
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = MMParams()
    fp8_gemm_dgrad: MMParams = MMParams()
    fp8_gemm_wgrad: MMParams = MMParams()
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        _check_format(self.fp8_format)
        for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
            if not isinstance(getattr(self, name), QParams):
                raise TypeError(f"{name}: expected a recipe.QParams, got {getattr(self, name)!r}")
        dims = {name: getattr(self, name) for name in ("x_block_scaling_dim", "w_block_scaling_dim",
                                                       "grad_block_scaling_dim")}
        for name, value in dims.items():
            _check_block_dim(name, value)
        for first, second, gemm in (("x", "w", "forward"), ("grad", "w", "dgrad"), ("grad", "x", "wgrad")):
            if dims[f"{first}_block_scaling_dim"] == 2 and dims[f"{second}_block_scaling_dim"] == 2:
                raise ValueError(f"{first}_block_scaling_dim, {second}_block_scaling_dim: both 2 would make the "
                                 f"{gemm} GEMM 128x128 x 128x128, which cuBLASLt does not run; make one of them 1")
        for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            params = getattr(self, name)
            if not isinstance(params, MMParams) or params.use_split_accumulator is not True:
                raise ValueError(f"{name}: block scaling needs MMParams(use_split_accumulator=True) (cuBLASLt's "
                                 f"block-scaled kernels have no fast accumulation), got {params!r}")
        for name in ("fp8_dpa", "fp8_mha"):
            if getattr(self, name) is not False:
                raise ValueError(f"{name}: FP8 attention is not available with Float8BlockScaling (cuDNN's FP8 "
                                 f"attention takes per-tensor scales), got {getattr(self, name)!r}")
