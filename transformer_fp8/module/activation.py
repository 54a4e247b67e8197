"""act(x) in high precision through our fused activation kernels, with a lean backward: the MLPs' path outside FP8
(BF16 training, small shapes, calibration) and the LoRA layers'. Where plain PyTorch would run SwiGLU as silu, mul and
a chunk (three kernels forward, five backward, and saving gate, up and silu(gate)), one kernel each way saving x only.
"""
import torch

from ..ops import activation_high_precision, tfp8

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class _Activation(torch.autograd.Function):
    """act(x) with our activation kernels (gelu is the tanh approximation, swiglu's gate first); saves x only."""

    @staticmethod
    def forward(ctx, x, activation):
        x2d = x.reshape(-1, x.shape[-1])
        out = activation_high_precision(x2d, activation)
        ctx.save_for_backward(x2d)
        ctx.activation = activation
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        (x2d,) = ctx.saved_tensors
        dx = tfp8.activation_bwd(grad.reshape(-1, grad.shape[-1]).contiguous(), x2d, ctx.activation)
        return dx.view(*grad.shape[:-1], dx.shape[-1]), None


def fused_activation(x: torch.Tensor, activation: str) -> torch.Tensor:
    """act(x) through our kernels (autograd included).

    Args:
        x: [..., F_in], float32 / float16 / bfloat16, contiguous (F_in = 2F for swiglu: [gate | up]).
        activation: "gelu" (tanh approximation), "relu" or "swiglu".

    Returns:
        act(x), [..., F] in x's dtype (computed in float32, rounded once).
    """
    return _Activation.apply(x.contiguous(), activation)
