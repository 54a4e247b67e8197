"""FP8 recipes (Transformer Engine names): which FP8 formats to use and how scaling factors are chosen.

`Format.E4M3`: every FP8 tensor is E4M3. `Format.HYBRID`: forward tensors (inputs, weights) E4M3, gradients E5M2.
`DelayedScaling`: each tensor's scale comes from a history of amaxes of earlier steps,
    scale = fp8_max / amax / 2**margin, amax = max(history) ("max") or the newest entry ("most_recent").
`Float8CurrentScaling`: each tensor's scale comes from its own amax, computed right before the cast.
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
