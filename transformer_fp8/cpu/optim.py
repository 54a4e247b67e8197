"""CPU reference kernel of the optim op adamw_step_ (contract in csrc/ops.cpp).

float32 math with every operation its own rounded torch op (float32 tensors times float32 scalars), the scalars
computed in double and rounded once, exactly as the CUDA kernel does, so that both give the same bits.
"""
import math

import torch

from ._common import register

HIGH_PRECISION = (torch.float32, torch.float16, torch.bfloat16)


def _check_entry(t, param, dtype, lst, i, why):
    if t.dtype != dtype:
        raise TypeError(f"{lst}[{i}]: expected {dtype} ({why}), got {t.dtype}")
    if t.shape != param.shape:
        raise ValueError(f"{lst}[{i}]: expected shape {tuple(param.shape)} (params[{i}]'s), got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{lst}[{i}]: expected a contiguous tensor (got strides {t.stride()})")
    if t.device != param.device:
        raise ValueError(f"{lst}[{i}]: expected a tensor on {param.device}, got one on {t.device}")


def _check(params, grads, exp_avgs, exp_avg_sqs, master_params, lr, beta1, beta2, eps, weight_decay, step):
    n = len(params)
    for name, lst in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
        if len(lst) != n:
            raise ValueError(f"{name}: expected {n} tensors (one per param), got {len(lst)}")
    if len(master_params) not in (0, n):
        raise ValueError(f"master_params: expected none or {n} tensors (one per param), got {len(master_params)}")
    for name, value, ok, expected in (("lr", lr, lr >= 0, ">= 0"),
                                      ("beta1", beta1, 0 <= beta1 < 1, "0 <= beta1 < 1"),
                                      ("beta2", beta2, 0 <= beta2 < 1, "0 <= beta2 < 1"),
                                      ("eps", eps, eps >= 0, ">= 0"),
                                      ("weight_decay", weight_decay, weight_decay >= 0, ">= 0")):
        if not ok:
            raise ValueError(f"{name}: expected {expected}, got {value}")
    if step < 1:
        raise ValueError(f"step: expected >= 1 (the step being taken, counted from 1), got {step}")
    if n == 0:
        return
    if params[0].dtype not in HIGH_PRECISION:
        raise TypeError(f"params[0]: expected a float32, float16 or bfloat16 tensor, got {params[0].dtype}")
    moment_dtype = exp_avgs[0].dtype
    if moment_dtype not in (params[0].dtype, torch.float32):
        raise TypeError(f"exp_avgs[0]: expected {params[0].dtype} (the parameters' dtype) or torch.float32, got "
                        f"{moment_dtype}")
    if master_params and params[0].dtype == torch.float32:
        raise ValueError("master_params: float32 parameters take no master weights")
    for i, param in enumerate(params):
        if param.dtype not in HIGH_PRECISION:
            raise TypeError(f"params[{i}]: expected a float32, float16 or bfloat16 tensor, got {param.dtype}")
        if not param.is_contiguous():
            raise ValueError(f"params[{i}]: expected a contiguous tensor (got strides {param.stride()})")
        if param.device != params[0].device:
            raise ValueError(f"params[{i}]: expected a tensor on {params[0].device}, got one on {param.device}")
        if param.dtype != params[0].dtype:
            raise TypeError(f"params[{i}]: expected {params[0].dtype} (params[0]'s dtype: one call takes one dtype), "
                            f"got {param.dtype}")
        _check_entry(grads[i], param, param.dtype, "grads", i, "params[i]'s dtype")
        _check_entry(exp_avgs[i], param, moment_dtype, "exp_avgs", i, "exp_avgs[0]'s dtype: one call takes one")
        _check_entry(exp_avg_sqs[i], param, moment_dtype, "exp_avg_sqs", i, "exp_avgs[0]'s dtype: one call takes one")
        if master_params:
            _check_entry(master_params[i], param, torch.float32, "master_params", i, "master weights")


def adamw_scalars(lr, beta1, beta2, eps, weight_decay, step, bias_correction=True, decoupled_weight_decay=True):
    """The step's float32 operands (lr * wd or 0, wd or 0 (L2), beta1, 1 - beta1, beta2, 1 - beta2, eps, step_size,
    1 / sqrt(bias correction 2)), each computed in double and rounded once, as the CUDA binding computes them."""
    step_size = lr / (1.0 - math.pow(beta1, step)) if bias_correction else lr
    inv_bc2 = 1.0 / math.sqrt(1.0 - math.pow(beta2, step)) if bias_correction else 1.0
    values = (lr * weight_decay if decoupled_weight_decay else 0.0, 0.0 if decoupled_weight_decay else weight_decay,
              beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps, step_size, inv_bc2)
    return [torch.tensor(v, dtype=torch.float32) for v in values]


@register("adamw_step_")
def adamw_step_(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step, maximize=False,
                master_params=None, bias_correction=True, decoupled_weight_decay=True):
    master_params = list(master_params or [])
    _check(params, grads, exp_avgs, exp_avg_sqs, master_params, lr, beta1, beta2, eps, weight_decay, step)
    lr_wd, l2_wd, b1, omb1, b2, omb2, eps32, step_size, inv_bc2 = adamw_scalars(
        lr, beta1, beta2, eps, weight_decay, step, bias_correction, decoupled_weight_decay)
    for i, (param, grad, exp_avg, exp_avg_sq) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        g = grad.float()
        if maximize:
            g = -g
        w = master_params[i].float() if master_params else param.float()
        g = g + l2_wd * w
        w = w - lr_wd * w
        m = b1 * exp_avg.float() + omb1 * g
        v = b2 * exp_avg_sq.float() + (omb2 * g) * g
        denom = v.double().sqrt().float() * inv_bc2 + eps32  # (sqrt correctly rounded, as CUDA's: torch's CPU
        # float32 sqrt is not)
        w = w - (step_size * m) / denom
        if master_params:
            master_params[i].copy_(w)
        param.copy_(w)
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
