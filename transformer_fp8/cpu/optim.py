"""CPU reference kernel of the optim op adamw_step_ (contract in csrc/ops.cpp).

float32 math with every operation its own rounded torch op (float32 tensors times float32 scalars), the scalars
computed in double and rounded once, exactly as the CUDA kernel does, so that both give the same bits.
"""
import math

import torch

from ._common import register

HIGH_PRECISION = (torch.float32, torch.float16, torch.bfloat16)


def _check_entry(t, param, lst, i):
    if t.dtype != param.dtype:
        raise TypeError(f"{lst}[{i}]: expected {param.dtype} (params[{i}]'s dtype), got {t.dtype}")
    if t.shape != param.shape:
        raise ValueError(f"{lst}[{i}]: expected shape {tuple(param.shape)} (params[{i}]'s), got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{lst}[{i}]: expected a contiguous tensor (got strides {t.stride()})")
    if t.device != param.device:
        raise ValueError(f"{lst}[{i}]: expected a tensor on {param.device}, got one on {t.device}")


def _check(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step):
    n = len(params)
    for name, lst in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
        if len(lst) != n:
            raise ValueError(f"{name}: expected {n} tensors (one per param), got {len(lst)}")
    for name, value, ok, expected in (("lr", lr, lr >= 0, ">= 0"),
                                      ("beta1", beta1, 0 <= beta1 < 1, "0 <= beta1 < 1"),
                                      ("beta2", beta2, 0 <= beta2 < 1, "0 <= beta2 < 1"),
                                      ("eps", eps, eps >= 0, ">= 0"),
                                      ("weight_decay", weight_decay, weight_decay >= 0, ">= 0")):
        if not ok:
            raise ValueError(f"{name}: expected {expected}, got {value}")
    if step < 1:
        raise ValueError(f"step: expected >= 1 (the step being taken, counted from 1), got {step}")
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
        _check_entry(grads[i], param, "grads", i)
        _check_entry(exp_avgs[i], param, "exp_avgs", i)
        _check_entry(exp_avg_sqs[i], param, "exp_avg_sqs", i)


def adamw_scalars(lr, beta1, beta2, eps, weight_decay, step):
    """The step's float32 operands (lr * wd, beta1, 1 - beta1, beta2, 1 - beta2, eps, step_size, 1 / sqrt(bias
    correction 2)), each computed in double and rounded once, as the CUDA binding computes them."""
    values = (lr * weight_decay, beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps, lr / (1.0 - math.pow(beta1, step)),
              1.0 / math.sqrt(1.0 - math.pow(beta2, step)))
    return [torch.tensor(v, dtype=torch.float32) for v in values]


@register("adamw_step_")
def adamw_step_(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step, maximize=False):
    _check(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step)
    lr_wd, b1, omb1, b2, omb2, eps32, step_size, inv_bc2 = adamw_scalars(lr, beta1, beta2, eps, weight_decay, step)
    for param, grad, exp_avg, exp_avg_sq in zip(params, grads, exp_avgs, exp_avg_sqs):
        g = grad.float()
        if maximize:
            g = -g
        p = param.float()
        p = p - lr_wd * p
        m = b1 * exp_avg.float() + omb1 * g
        v = b2 * exp_avg_sq.float() + (omb2 * g) * g
        denom = v.double().sqrt().float() * inv_bc2 + eps32  # (sqrt correctly rounded, as CUDA's: torch's CPU
        # float32 sqrt is not)
        param.copy_(p - (step_size * m) / denom)
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
