"""GroupedLinear: num_gemms independent linears over contiguous row groups of one input (the experts of an MoE layer),
with Transformer Engine's arguments and parameter names (weight0..weight{n-1} [out, in], bias0..bias{n-1} [out]).

forward(inp [M, in], m_splits): rows m_splits[0] of inp go through expert 0, the next m_splits[1] through expert 1,
...; m_splits is a list of ints (TE) or an integer tensor on inp's device (no host sync in the step). Empty groups
are allowed. Inside fp8_autocast the GEMMs run in FP8 (one cast of the whole input, one grouped GEMM per direction);
outside it, in high precision.
"""
from collections.abc import Sequence

import torch

from .base import FP8ModuleBase, check_positive


class GroupedLinear(FP8ModuleBase):
    """num_gemms linears y_i = x_i W_iᵀ + b_i over the row groups x_i of one input.

    Args:
        num_gemms: number of groups (experts), >= 1.
        in_features: K, the input's last dim.
        out_features: N, the output's last dim.
        bias: whether each group has a bias (bias0..).
        params_dtype: dtype of the parameters (default: torch's default dtype).
        device: where the parameters live.
        init_method: callable(weight) initialising each weight in place (default: nn.Linear's).
        fuse_wgrad_accumulation: accumulate each weight gradient into weight{i}.main_grad (float32, the weight's
            shape) instead of returning it.
        return_bias: return (out, [bias0, ...]) without adding the biases.
        fp8_min_gemm_size: small-shape threshold on M*K*N (see Linear); None: the process default.
    """

    def __init__(self, num_gemms: int, in_features: int, out_features: int, bias: bool = True,
                 params_dtype: torch.dtype | None = None, device: str | torch.device = "cuda", init_method=None,
                 fuse_wgrad_accumulation: bool = False, return_bias: bool = False,
                 fp8_min_gemm_size: int | None = None) -> None:
        check_positive(num_gemms=num_gemms, in_features=in_features, out_features=out_features)
        super().__init__(num_gemms, params_dtype, device, fuse_wgrad_accumulation, out_features, fp8_min_gemm_size)
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.return_bias = bool(return_bias)
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", self._weight_param((out_features, in_features), init_method))
            self.register_parameter(f"bias{i}", self._vector_param(out_features, 0.0) if bias else None)
        self.use_bias = bool(bias)

    def forward(self, inp: torch.Tensor, m_splits: Sequence[int] | torch.Tensor,
                is_first_microbatch: bool | None = None) -> torch.Tensor | tuple:
        """Args:
            inp: [M, in_features] (or [..., in_features], flattened to rows), rows grouped by expert.
            m_splits: rows per group: a list of num_gemms ints summing to M, or an integer tensor [num_gemms] on
                inp's device (its sum must be M; not checked on the host: that would synchronise).
            is_first_microbatch: Transformer Engine's FP8 weight cache switch (None: no cache).

        Returns:
            [..., out_features] in inp's dtype; with return_bias, (out, [bias0, ...]).
        """
        raise NotImplementedError("GroupedLinear.forward: being written (moe-ops)")

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.use_bias}")
