"""CPU reference kernel of the loss op: cross_entropy_chunk (contract in csrc/ops.cpp).

Float32 log-softmax per row, the target's log-probability gathered; the gradient exp(logprobs) in grad_dtype with the
target column written as exp(logprob) - 1, computed in float32 and rounded once (p rounded first would lose p - 1
when p is near 1); an ignored row's gradient is zeros.
"""
import torch

from ._common import register

GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(logits, targets, ignore_index, grad_dtype):
    if logits.dtype != torch.float32:
        raise TypeError(f"logits: expected a float32 tensor, got {logits.dtype}")
    if logits.dim() != 2:
        raise ValueError(f"logits: expected a 2-D tensor [rows, classes], got shape {tuple(logits.shape)}")
    if targets.device != logits.device:
        raise ValueError(f"targets: expected a tensor on {logits.device}, got one on {targets.device}")
    if targets.dtype != torch.int64:
        raise TypeError(f"targets: expected an int64 tensor, got {targets.dtype}")
    if targets.shape != (logits.shape[0],):
        raise ValueError(f"targets: expected shape ({logits.shape[0]},), got {tuple(targets.shape)}")
    if logits.shape[0] and not logits.shape[1]:
        raise ValueError(f"logits: expected at least one class, got shape {tuple(logits.shape)}")
    if grad_dtype is not None and grad_dtype not in GRAD_DTYPES:
        raise ValueError(f"grad_dtype: expected float32, float16, bfloat16 or None, got {grad_dtype}")
    counted = targets != ignore_index
    bad = counted & ((targets < 0) | (targets >= logits.shape[1]))
    if bool(bad.any()):
        raise ValueError(f"targets: expected values in [0, {logits.shape[1]}) or ignore_index ({ignore_index}), got "
                         f"{targets[bad][:4].tolist()}")
    return counted


@register("cross_entropy_chunk")
def cross_entropy_chunk(logits, targets, ignore_index, grad_dtype):
    _check(logits, targets, ignore_index, grad_dtype)
    return cross_entropy_math(logits, targets, ignore_index, grad_dtype)


def cross_entropy_math(logits, targets, ignore_index, grad_dtype):
    """The op's math in torch ops on any device, without the argument checks (which read the targets on the host):
    also the fallback on CUDA where the extension was built without the loss family."""
    counted = targets != ignore_index
    logprobs = torch.log_softmax(logits, dim=-1)
    index = torch.where(counted, targets, 0)[:, None]  # ignored rows read column 0, masked out below
    target_logprobs = logprobs.gather(1, index).squeeze(1)
    loss_rows = torch.where(counted, -target_logprobs, 0.0)
    if grad_dtype is None:
        return loss_rows, logits.new_empty(0)
    dlogits = torch.where(counted[:, None], logprobs.exp(), 0.0).to(grad_dtype)
    target_grad = torch.where(counted, target_logprobs.exp() - 1.0, 0.0).to(grad_dtype)
    dlogits.scatter_(1, index, target_grad[:, None])
    return loss_rows, dlogits
