"""CPU reference kernel of inference_cast: the input cast of an FP8-weight Linear's inference with its scaling
bookkeeping (contract: csrc/ops.cpp), written as the sequence of ops it stands for (the training path's)."""
import torch

from ._common import check_fp8_dtype, check_scalar_f32, register

_ALGOS = ("max", "most_recent")


def _check_state(x, current_scaling, history, state_scale, state_scale_inv, backup, amax_compute_algo):
    """Checks the delayed update's arguments (inference_cast's, named as in its schema).

    Returns:
        Whether the delayed update's state is given (all four tensors; none is the other valid choice)."""
    state = (history, state_scale, state_scale_inv, backup)
    given = sum(t is not None for t in state)
    if given not in (0, 4):
        raise ValueError(f"history, state_scale, state_scale_inv, backup: expected all four (a delayed update) or "
                         f"none, got {given}")
    if given == 0:
        return False
    if current_scaling:
        raise ValueError("history: the fused update is for delayed scaling (current_scaling=False)")
    if amax_compute_algo not in _ALGOS:
        raise ValueError(f"amax_compute_algo: expected one of {_ALGOS}, got {amax_compute_algo!r}")
    if history.dim() != 2 or min(history.shape) < 1:
        raise ValueError(f"history: expected shape [H, slots] with H, slots >= 1, got {tuple(history.shape)}")
    slots = history.shape[1]
    for t, arg, shape in ((history, "history", tuple(history.shape)), (state_scale, "state_scale", (slots,)),
                          (state_scale_inv, "state_scale_inv", (slots,)), (backup, "backup", (4, slots))):
        if t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{arg}: expected a contiguous float32 tensor of shape {list(shape)}, got {t.dtype} of "
                             f"shape {list(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"{arg}: expected a tensor on {x.device}, got one on {t.device}")
    return True


@register("inference_cast")
def inference_cast(x, scale, fp8_dtype, amax, scale_inv, current_scaling, fp8_max, history=None, state_scale=None,
                   state_scale_inv=None, backup=None, margin=0.0, amax_compute_algo="max"):
    """x -> q (fp8_dtype, x's shape) with the scaling bookkeeping of csrc/ops.cpp's contract."""
    ops = torch.ops.transformer_fp8
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"x: expected float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() == 0 or not x.is_contiguous():
        raise ValueError(f"x: expected a contiguous tensor with at least one dim, got shape {tuple(x.shape)} and "
                         f"strides {x.stride()}")
    check_fp8_dtype(fp8_dtype, "fp8_dtype")
    for t, arg in ((scale, "scale"), (amax, "amax"), (scale_inv, "scale_inv")):
        check_scalar_f32(t, x, arg)
    if not 0 < fp8_max < float("inf"):
        raise ValueError(f"fp8_max: expected a positive finite number, got {fp8_max}")
    update = _check_state(x, current_scaling, history, state_scale, state_scale_inv, backup, amax_compute_algo)
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if current_scaling:
        ops.compute_amax(x2, amax)
        ops.delayed_scaling_update([amax.view(1, 1)], [scale.view(1)], [scale_inv.view(1)], fp8_max, 0.0,
                                   "most_recent")
    q = ops.cast_transpose(x2, scale, fp8_dtype, True, False, None if current_scaling else amax, scale_inv)[0]
    if update:
        backup.copy_(torch.stack([history[0], history[-1], state_scale, state_scale_inv]))
        ops.delayed_scaling_update([history], [state_scale], [state_scale_inv], fp8_max, margin, amax_compute_algo)
    return q.view(x.shape)
