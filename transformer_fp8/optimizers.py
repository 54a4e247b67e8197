"""Transformer Engine's optimizer API: `FusedAdam` with `transformer_engine.pytorch.optimizers.FusedAdam`'s arguments,
on our one-op Adam step (adamw_step_: float32 math, the CUDA kernel in csrc/optim_adamw.cu, a CPU reference with the
same bits).

Supported: AdamW (adam_w_mode=True, decoupled weight decay, the default) and Adam with L2 weight decay
(adam_w_mode=False), with or without bias correction; moments in float32 (the default, as TE's) or in the parameter's
dtype; float32 master weights of 16-bit parameters (master_weights=True: the step updates the master copy and writes
it, rounded, into the parameter). Refused with a ValueError naming the argument: amsgrad, capturable (CUDA-graph
capture of the step), master weights or moments in other dtypes (FP8 moments among them), use_decoupled_grad,
store_param_remainders. State per parameter: "step" (a Python int), "exp_avg", "exp_avg_sq" and, with master weights,
"master_param".
"""
from typing import Iterable, Optional, Tuple

import torch

from .optim import FusedAdamBase, FusedAdamW

__all__ = ["FusedAdam", "FusedAdamW"]


def _refuse_unless(ok: bool, argument: str, expected: str, value) -> None:
    if not ok:
        raise ValueError(f"{argument}: FusedAdam supports {expected}, got {value!r}")


class FusedAdam(FusedAdamBase):
    """Adam / AdamW in one fused op per parameter dtype, TE's `FusedAdam` arguments (see the module docstring).

    Args:
        params: parameters or parameter groups (float32, float16 or bfloat16; contiguous).
        lr: learning rate (>= 0).
        bias_correction: divide the moments by (1 - beta**step).
        betas: (beta1, beta2), each in [0, 1).
        eps: added to the denominator (>= 0).
        adam_w_mode: True: decoupled weight decay (AdamW); False: L2 decay added to the gradient (Adam).
        weight_decay: the decay coefficient (>= 0).
        amsgrad: only False.
        set_grad_none: zero_grad() sets gradients to None (else zeroes them).
        capturable: only False.
        master_weights: keep float32 master copies of 16-bit parameters and update those.
        master_weight_dtype: only torch.float32.
        exp_avg_dtype, exp_avg_sq_dtype: torch.float32 or the parameters' dtype (the same for both).
        use_decoupled_grad: only False.
        store_param_remainders: only False.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True,
                 capturable: bool = False, master_weights: bool = False,
                 master_weight_dtype: torch.dtype = torch.float32, exp_avg_dtype: torch.dtype = torch.float32,
                 exp_avg_sq_dtype: torch.dtype = torch.float32, use_decoupled_grad: bool = False,
                 store_param_remainders: bool = False):
        _refuse_unless(not amsgrad, "amsgrad", "False only", amsgrad)
        _refuse_unless(not capturable, "capturable", "False only (no CUDA-graph capture of the step)", capturable)
        _refuse_unless(master_weight_dtype == torch.float32, "master_weight_dtype", "torch.float32 only",
                       master_weight_dtype)
        _refuse_unless(exp_avg_dtype in (torch.float32, torch.float16, torch.bfloat16), "exp_avg_dtype",
                       "torch.float32 or the parameters' 16-bit dtype", exp_avg_dtype)
        _refuse_unless(exp_avg_sq_dtype == exp_avg_dtype, "exp_avg_sq_dtype", "the same dtype as exp_avg_dtype",
                       exp_avg_sq_dtype)
        _refuse_unless(not use_decoupled_grad, "use_decoupled_grad", "False only", use_decoupled_grad)
        _refuse_unless(not store_param_remainders, "store_param_remainders", "False only", store_param_remainders)
        _refuse_unless(lr >= 0, "lr", ">= 0", lr)
        _refuse_unless(0 <= betas[0] < 1 and 0 <= betas[1] < 1, "betas", "each in [0, 1)", betas)
        _refuse_unless(eps >= 0, "eps", ">= 0", eps)
        _refuse_unless(weight_decay >= 0, "weight_decay", ">= 0", weight_decay)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode, self.set_grad_none, self.master_weights = adam_w_mode, set_grad_none, master_weights
        self.moment_dtype = exp_avg_dtype

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Gradients to None (set_grad_none, the default) or to zero.

        Args:
            set_to_none: overrides set_grad_none for this call.
        """
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a state saved by FusedAdam. torch.optim.Optimizer.load_state_dict casts every state tensor to its
        parameter's dtype; float32 moments and master weights of 16-bit parameters are put back afterwards from the
        loaded tensors themselves (not from the cast), in the dtype they were saved in.

        Args:
            state_dict: what state_dict() returned.
        """
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        kept = {i: {key: value for key, value in state_dict["state"].get(i, {}).items()
                    if key in ("exp_avg", "exp_avg_sq", "master_param") and torch.is_tensor(value)} for i in saved_ids}
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(saved_ids, params):
            for key, value in kept[i].items():
                self.state[p][key] = value.detach().to(device=p.device).clone()

    def _state_of(self, p: torch.Tensor) -> dict:
        """p's state, created on its first step: zero moments, a float32 master copy when kept, step 0."""
        state = self.state[p]
        if "exp_avg" not in state:
            dtype = self.moment_dtype
            if dtype not in (torch.float32, p.dtype):
                raise ValueError(f"exp_avg_dtype: FusedAdam keeps moments in torch.float32 or the parameter's dtype; "
                                 f"got {dtype} for a {p.dtype} parameter of shape {tuple(p.shape)}")
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)
            if self.master_weights and p.dtype != torch.float32:
                state["master_param"] = p.detach().float().contiguous()
        return state

    def _options(self, group: dict) -> Tuple[bool, bool, bool]:
        return False, group["bias_correction"], self.adam_w_mode
