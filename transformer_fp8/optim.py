"""FusedAdamW: torch.optim.AdamW's update (decoupled weight decay) in one op, adamw_step_, per group, dtype and device.

The CUDA kernel updates up to 192 tensors per launch with 16-byte accesses, two vectors of each tensor in flight per
thread (the update reads four tensors and writes three: it is memory-bound; benchmarks/bench_optim.py times it
against torch's fused AdamW). Numerics: float32 math, every operation rounded on its own (the second moment's bias
correction a multiplication by 1 / sqrt(1 - beta2**step)), the moments stored in the parameter's dtype as
torch.optim.AdamW keeps them; the CPU reference kernel gives the same bits. Supported: dense gradients,
amsgrad=False; the state dict has torch.optim.AdamW's keys ("step", "exp_avg", "exp_avg_sq"; "step" a Python int),
and it loads torch.optim.AdamW's state dict.
"""
from collections import defaultdict
from typing import Iterable, Tuple

import torch

from . import ops  # noqa: F401  (registers the op's fake kernel)

tfp8 = torch.ops.transformer_fp8


class FusedAdamBase(torch.optim.Optimizer):
    """The step FusedAdamW and optimizers.FusedAdam share: the parameters with gradients bucketed by (device, dtype,
    moment dtype, master weights kept, step), one adamw_step_ per bucket. Subclasses create the state (_state_of: a
    dict with "step", "exp_avg", "exp_avg_sq" and optionally "master_param") and name the op's options (_options)."""

    def _state_of(self, p: torch.Tensor) -> dict:
        raise NotImplementedError

    def _options(self, group: dict) -> Tuple[bool, bool, bool]:
        """(maximize, bias_correction, decoupled_weight_decay) for the group's op calls."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        """One step over every parameter with a gradient.

        Args:
            closure: optional callable that re-evaluates the model and returns the loss.
        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        name = type(self).__name__
        for group in self.param_groups:
            buckets = defaultdict(lambda: ([], [], [], [], []))  # one op call per key: its five lists
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{name}: sparse gradients are not supported")
                if not p.is_contiguous():
                    raise ValueError(f"{name}: parameters must be contiguous (updated in place), got one of shape "
                                     f"{tuple(p.shape)} with strides {p.stride()}")
                state = self._state_of(p)
                state["step"] += 1
                master = state.get("master_param")
                key = (p.device, p.dtype, state["exp_avg"].dtype, master is not None, state["step"])
                grad = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
                for target, tensor in zip(buckets[key], (p, grad, state["exp_avg"], state["exp_avg_sq"], master)):
                    if tensor is not None:
                        target.append(tensor)
            beta1, beta2 = group["betas"]
            maximize, bias_correction, decoupled = self._options(group)
            for key, (params, grads, exp_avgs, exp_avg_sqs, masters) in buckets.items():
                tfp8.adamw_step_(params, grads, exp_avgs, exp_avg_sqs, float(group["lr"]), beta1, beta2, group["eps"],
                                 group["weight_decay"], key[-1], maximize, masters or None, bias_correction, decoupled)
        return loss


class FusedAdamW(FusedAdamBase):
    """AdamW with torch.optim.AdamW's arguments and update rule, one fused kernel per step (see the module docstring).

    Args:
        params: parameters or parameter groups (float32, float16 or bfloat16; contiguous).
        lr: learning rate (>= 0).
        betas: (beta1, beta2), each in [0, 1).
        eps: added to the denominator (>= 0).
        weight_decay: decoupled weight decay coefficient (>= 0): param -= lr * weight_decay * param.
        amsgrad: only False is supported (refused otherwise).
        maximize: ascend instead of descend.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, maximize: bool = False):
        if amsgrad:
            raise ValueError("amsgrad: FusedAdamW does not support amsgrad=True; use torch.optim.AdamW")
        if not lr >= 0:
            raise ValueError(f"lr: expected >= 0, got {lr}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas: expected each in [0, 1), got {betas}")
        if not eps >= 0:
            raise ValueError(f"eps: expected >= 0, got {eps}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay: expected >= 0, got {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=maximize)
        super().__init__(params, defaults)

    def _state_of(self, p: torch.Tensor) -> dict:
        """p's state, created on its first step (zero moments in p's dtype, step 0)."""
        state = self.state[p]
        if "exp_avg" not in state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        elif isinstance(state["step"], torch.Tensor):  # (a state loaded from torch.optim.AdamW)
            state["step"] = int(state["step"].item())
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = state[key].to(p.dtype).contiguous()
        return state

    def _options(self, group: dict) -> Tuple[bool, bool, bool]:
        return group["maximize"], True, True
