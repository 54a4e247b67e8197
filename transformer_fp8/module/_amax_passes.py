"""Amaxes of tensors that are never made whole in high precision: an activation's output and its input's gradient,
computed a block of rows at a time (in float32, the fused kernels' own math) and max-accumulated.

Delayed scaling's first step has no scale before its casts, so the activation and its gradient used to be computed in
16 bits and then cast (a whole [tokens, ffn] temporary each, and the step's peak). With these passes the quantizer
calibrates its scale first (Quantizer.output_args_for) and the fused kernels then write FP8 directly, as in the later
steps: the first step holds the same tensors as the later ones.
"""
from collections.abc import Callable

import torch

from ..cpu.activation import dequantize_kept_input
from ..ops import activation_high_precision, tfp8

# Elements per block of rows: its float32 temporaries (input, output) stay a few tens of MiB whatever the layer.
CHUNK_ELEMENTS = 1 << 22


def _block_rows(width: int) -> int:
    """Rows per block of a tensor `width` elements wide."""
    return max(1, CHUNK_ELEMENTS // max(1, width))


def activation_amax(fc1_out: torch.Tensor, activation: str) -> Callable[[torch.Tensor], None]:
    """The amax of act(fc1_out), as Quantizer.output_args_for takes it.

    Args:
        fc1_out: the activation's input [M, F_in], contiguous.
        activation: "gelu", "relu" or "swiglu".

    Returns:
        A function max-accumulating amax(act(fc1_out)) into the float32 [1] tensor it is given.
    """
    def accumulate(amax: torch.Tensor) -> None:
        for block in fc1_out.split(_block_rows(fc1_out.shape[-1])):
            tfp8.compute_amax(activation_high_precision(block.float(), activation), amax)
    return accumulate


def activation_grad_amax(d_act: torch.Tensor, fc1_out: torch.Tensor | None,
                         kept: tuple[torch.Tensor, torch.Tensor] | None,
                         activation: str) -> Callable[[torch.Tensor], None]:
    """The amax of act'(x) * d_act, x the activation's input: fc1_out, or its kept E4M3 copy.

    Args:
        d_act: the gradient of the activation's output [M, F], contiguous.
        fc1_out: the activation's input [M, F_in], or None when `kept` holds it.
        kept: (E4M3 data [M, F_in], tile scale_inv [M, F_in / 128]) of activation_fwd_keep_input, or None.
        activation: "gelu", "relu" or "swiglu".

    Returns:
        A function max-accumulating the amax into the float32 [1] tensor it is given.
    """
    def accumulate(amax: torch.Tensor) -> None:
        step = _block_rows(kept[0].shape[-1] if fc1_out is None else fc1_out.shape[-1])
        inputs = fc1_out.split(step) if fc1_out is not None else (
            dequantize_kept_input(data, scale_inv, torch.float32)
            for data, scale_inv in zip(kept[0].split(step), kept[1].split(step)))
        for grad, x in zip(d_act.split(step), inputs):
            tfp8.compute_amax(tfp8.activation_bwd(grad.float(), x.float(), activation), amax)
    return accumulate
