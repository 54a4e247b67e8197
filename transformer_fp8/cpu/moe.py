"""CPU reference kernels of the moe ops: moe_permute_rows, moe_unpermute_rows, moe_merging_probs_grad (contracts in
csrc/ops.cpp). Products and sums in float32, rounded one by one in slot order, as the CUDA kernels compute them."""
import torch

from ._common import FP8_MAX, register

HIGH_PRECISION = (torch.float32, torch.float16, torch.bfloat16)


def _check_rows(t, arg):
    if t.dim() != 2:
        raise ValueError(f"{arg}: expected a 2-D tensor [rows, hidden], got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{arg}: expected a contiguous tensor (got strides {t.stride()})")


def _check_high_precision(t, arg):
    if t.dtype not in HIGH_PRECISION:
        raise TypeError(f"{arg}: expected a float32, float16 or bfloat16 tensor, got {t.dtype}")


def _check_side_tensor(t, data, dtype, dtype_words, arg, shape_ok, expected_shape):
    """t (an index or weight tensor beside `data`): on data's device, of `dtype`, shape_ok, contiguous, in that
    order; dtype_words and expected_shape word the dtype and the shape in the errors."""
    if t.device != data.device:
        raise ValueError(f"{arg}: expected a tensor on {data.device}, got one on {t.device}")
    if t.dtype != dtype:
        raise TypeError(f"{arg}: expected {dtype_words} tensor, got {t.dtype}")
    if not shape_ok:
        raise ValueError(f"{arg}: expected {expected_shape}, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{arg}: expected a contiguous tensor (got strides {t.stride()})")


def _check_index(t, data, dim, arg):
    _check_side_tensor(t, data, torch.int32, "an int32", arg, t.dim() == dim, f"a {dim}-D tensor")


def _check_probs(probs, data, numel, arg):
    _check_side_tensor(probs, data, torch.float32, "a float32", arg, probs.numel() == numel,
                       f"{numel} elements (tokens x slots)")


def _gather(inp, rows, valid):
    """inp[rows] with zero rows where not valid (FP8 rows moved as bytes)."""
    data = inp.view(torch.uint8) if inp.dtype in FP8_MAX else inp
    out = data[torch.where(valid, rows, 0)]
    out[~valid] = 0
    return out.view(inp.dtype) if inp.dtype in FP8_MAX else out


@register("moe_permute_rows")
def moe_permute_rows(inp, slot_of_row, slots_per_token, probs=None):
    _check_rows(inp, "inp")
    if inp.dtype not in HIGH_PRECISION and inp.dtype not in FP8_MAX:
        raise TypeError(f"inp: unsupported dtype {inp.dtype}")
    _check_index(slot_of_row, inp, 1, "slot_of_row")
    if slots_per_token < 1:
        raise ValueError(f"slots_per_token: expected >= 1, got {slots_per_token}")
    tokens = inp.shape[0]
    if probs is not None:
        if inp.dtype in FP8_MAX:
            raise ValueError("probs: not supported with an FP8 inp (its rows are copied as bytes)")
        _check_probs(probs, inp, tokens * slots_per_token, "probs")
    slot = slot_of_row.long()
    valid = (slot >= 0) & (slot < tokens * slots_per_token)
    out = _gather(inp, torch.div(slot, slots_per_token, rounding_mode="floor"), valid)
    if probs is None:
        return out
    weight = torch.where(valid, probs.reshape(-1)[torch.where(valid, slot, 0)], 0.0)
    return (out.float() * weight[:, None]).to(inp.dtype)


@register("moe_unpermute_rows")
def moe_unpermute_rows(inp, row_id_map, probs=None):
    _check_rows(inp, "inp")
    _check_high_precision(inp, "inp")
    _check_index(row_id_map, inp, 2, "row_id_map")
    tokens, slots = row_id_map.shape
    if probs is not None:
        _check_probs(probs, inp, tokens * slots, "probs")
        probs = probs.reshape(tokens, slots)
    acc = torch.zeros(tokens, inp.shape[1], dtype=torch.float32, device=inp.device)
    for s in range(slots):
        rows = row_id_map[:, s].long()
        valid = (rows >= 0) & (rows < inp.shape[0])
        x = _gather(inp, rows, valid).float()
        acc = acc + (x if probs is None else x * torch.where(valid, probs[:, s], 0.0)[:, None])
    return acc.to(inp.dtype)


@register("moe_merging_probs_grad")
def moe_merging_probs_grad(grad_out, inp, row_id_map):
    _check_rows(grad_out, "grad_out")
    _check_high_precision(grad_out, "grad_out")
    _check_rows(inp, "inp")
    if inp.device != grad_out.device:
        raise ValueError(f"inp: expected a tensor on {grad_out.device}, got one on {inp.device}")
    if inp.dtype != grad_out.dtype or inp.shape[1] != grad_out.shape[1]:
        raise ValueError(f"inp: expected {grad_out.dtype} rows of {grad_out.shape[1]} (grad_out's), got {inp.dtype} "
                         f"of shape {tuple(inp.shape)}")
    _check_index(row_id_map, inp, 2, "row_id_map")
    if row_id_map.shape[0] != grad_out.shape[0]:
        raise ValueError(f"row_id_map: expected {grad_out.shape[0]} rows (grad_out's tokens), got shape "
                         f"{tuple(row_id_map.shape)}")
    rows = row_id_map.long()
    valid = (rows >= 0) & (rows < inp.shape[0])
    x = _gather(inp, rows.reshape(-1), valid.reshape(-1)).float().view(*rows.shape, inp.shape[1])
    return (x * grad_out.float()[:, None, :]).sum(-1)
