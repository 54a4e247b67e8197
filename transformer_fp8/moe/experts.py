"""The experts of a mixture-of-experts layer: SwiGLU MLPs, routed (GroupedMLP, one GroupedLinear pair for all the
experts) and shared (SharedExpertMLP, a Linear pair every token goes through, with an optional sigmoid gate).

Megatron's names: `linear_fc1` holds each expert's gate and up projections stacked ([gate | up] rows, our SwiGLU's
order and transformers' gate_up_proj order), `linear_fc2` the down projection; the shared expert's gate is
`gate_weight` [1, H]. Inside fp8_autocast their GEMMs run in FP8; the SwiGLU runs in the input's precision.
"""
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import activation_high_precision, tfp8
from ..module.base import check_dtype, check_positive, default_init
from ..module.grouped_linear import GroupedLinear
from ..module.linear import Linear


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class _SwiGLU(torch.autograd.Function):
    """SwiGLU on our activation kernels: one pass forward, one backward (PyTorch's chunk / silu / mul take several),
    saving only the input."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return activation_high_precision(x, "swiglu")

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return tfp8.activation_bwd(grad.contiguous(), x, "swiglu")


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dim (our fused kernels; PyTorch's ops for other dtypes).

    Args:
        x: [..., 2F].
    Returns:
        [..., F].
    """
    if x.dtype in _KERNEL_DTYPES:
        return _SwiGLU.apply(x.contiguous())
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class GroupedMLP(nn.Module):
    """num_experts SwiGLU MLPs over the contiguous row groups of one input (the tokens permuted by expert).

    Args:
        num_experts: E.
        hidden_size: H, the input's and output's last dim.
        ffn_hidden_size: F, each expert's intermediate size.
        params_dtype, device: of the parameters.
        init_method: callable(weight) initialising each linear_fc1 weight (default: nn.Linear's).
        output_layer_init_method: the same for linear_fc2 (default: init_method).
        fuse_wgrad_accumulation: see GroupedLinear.

    Attributes:
        linear_fc1: GroupedLinear(E, H, 2F) without bias, weight{i} = expert i's [gate | up] rows.
        linear_fc2: GroupedLinear(E, F, H) without bias.
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int,
                 params_dtype: torch.dtype | None = None, device: str | torch.device = "cuda", init_method=None,
                 output_layer_init_method=None, fuse_wgrad_accumulation: bool = False) -> None:
        super().__init__()
        check_positive(num_experts=num_experts, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
        common = dict(bias=False, params_dtype=params_dtype, device=device,
                      fuse_wgrad_accumulation=fuse_wgrad_accumulation)
        self.linear_fc1 = GroupedLinear(num_experts, hidden_size, 2 * ffn_hidden_size, init_method=init_method,
                                        **common)
        self.linear_fc2 = GroupedLinear(num_experts, ffn_hidden_size, hidden_size,
                                        init_method=output_layer_init_method or init_method, **common)

    def forward(self, permuted: torch.Tensor, tokens_per_expert: torch.Tensor | Sequence[int],
                is_first_microbatch: bool | None = None, splits_aligned: bool = False) -> torch.Tensor:
        """Args:
            permuted: [N, H] rows grouped by expert (moe_permute's output).
            tokens_per_expert: rows of each expert: an integer tensor [E] on the rows' device, or a list of ints.
            is_first_microbatch: the FP8 weight cache switch (see GroupedLinear).
            splits_aligned: every count is a multiple of 16 (moe_permute(..., align_size=16); see GroupedLinear).
        Returns:
            [N, H], each row through its expert.
        """
        common = dict(is_first_microbatch=is_first_microbatch, splits_aligned=splits_aligned)
        # (fc1 applies the SwiGLU: in FP8 its backward then writes fc1's FP8 gradient in the d(SwiGLU) pass)
        hidden = self.linear_fc1(permuted, tokens_per_expert, output_activation="swiglu", **common)
        return self.linear_fc2(hidden, tokens_per_expert, **common)


class SharedExpertMLP(nn.Module):
    """A SwiGLU MLP that every token goes through, scaled by sigmoid(x · gate_weight) when gated (Qwen2-MoE).

    Args:
        hidden_size: H.
        ffn_hidden_size: its intermediate size.
        gate: whether the output is gated by a sigmoid of a learned projection of the input.
        params_dtype, device, init_method, output_layer_init_method, fuse_wgrad_accumulation: as GroupedMLP.

    Attributes:
        linear_fc1: Linear(H, 2 * ffn) without bias ([gate | up] rows). linear_fc2: Linear(ffn, H) without bias.
        gate_weight: [1, H] (high precision: a GEMM of one output column), or None.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, gate: bool = True,
                 params_dtype: torch.dtype | None = None, device: str | torch.device = "cuda", init_method=None,
                 output_layer_init_method=None, fuse_wgrad_accumulation: bool = False) -> None:
        super().__init__()
        check_positive(hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
        common = dict(bias=False, params_dtype=params_dtype, device=device,
                      fuse_wgrad_accumulation=fuse_wgrad_accumulation)
        self.linear_fc1 = Linear(hidden_size, 2 * ffn_hidden_size, init_method=init_method, **common)
        self.linear_fc2 = Linear(ffn_hidden_size, hidden_size, init_method=output_layer_init_method or init_method,
                                 **common)
        if gate:
            weight = torch.empty(1, hidden_size, dtype=check_dtype(params_dtype), device=device)
            (init_method or default_init)(weight)
            self.gate_weight = nn.Parameter(weight)
        else:
            self.register_parameter("gate_weight", None)

    def forward(self, hidden_states: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        """Args:
            hidden_states: [T, H].
            is_first_microbatch: the FP8 weight cache switch (see Linear).
        Returns:
            [T, H].
        """
        out = self.linear_fc2(swiglu(self.linear_fc1(hidden_states, is_first_microbatch=is_first_microbatch)),
                              is_first_microbatch=is_first_microbatch)
        if self.gate_weight is None:
            return out
        return out * torch.sigmoid(F.linear(hidden_states, self.gate_weight.to(hidden_states.dtype)))
