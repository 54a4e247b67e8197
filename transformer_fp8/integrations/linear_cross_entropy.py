"""Cross-entropy of a linear layer's logits without holding all the logits: a language model's head and its loss.

`linear_cross_entropy(hidden, weight, targets)` equals
`F.cross_entropy((hidden.float() @ weight.float().T).flatten(0, -2), targets.flatten())`: float32 logits (exact
products, float32 sums: what the GEMM accumulates; a Hugging Face lm_head rounds them to bfloat16 before its float32
loss, which is a little further from exact). The tokens go through in chunks of `chunk_size` rows. Per chunk: float32
logits [chunk, V], their log-softmax, the loss, and when a gradient is wanted dlogits = softmax - onehot in hidden's
dtype, from which the gradients of hidden (dlogits @ weight) and of weight (dlogitsᵀ @ hidden, summed over the chunks
in weight's dtype) are made at once. Only those two gradients wait for the backward, which scales them by grad_output
(/ the number of counted tokens for "mean"): no logits are kept, none are recomputed.

Memory, for M tokens and V classes: about chunk_size * V * 6 bytes while a chunk is computed (its float32 logits and
its dlogits in hidden's dtype), plus gradients the size of hidden and of weight until the backward; F.cross_entropy on
float32 logits holds about 3 * M * V * 4 bytes.
"""
import torch

from ..cpu.loss import cross_entropy_math
from ..ops import tfp8

REDUCTIONS = ("mean", "sum")
_CUDA_KERNEL = torch._C._dispatch_has_kernel_for_dispatch_key("transformer_fp8::cross_entropy_chunk", "CUDA")
DEFAULT_CHUNK_SIZE = 1024  # [1024, 32000] float32 logits: 125 MiB


def _float32_logits(hidden, weight):
    """hidden [C, H] @ weightᵀ [H, V] -> [C, V] float32 (16-bit inputs: float32 GEMM output on CUDA, upcast on CPU)."""
    if hidden.dtype == torch.float32:
        return torch.mm(hidden, weight.t())
    if hidden.is_cuda:
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    return torch.mm(hidden.float(), weight.float().t())


def _chunk_loss_and_dlogits(hidden, weight, targets, ignore_index, with_dlogits):
    """hidden [C, H], targets [C] -> (summed loss of the counted rows, float32 scalar; dlogits [C, V] = softmax -
    onehot in hidden's dtype, or None). Rows of ignored tokens have loss 0 and dlogits zeros, so they add nothing to
    either gradient without a mask. The loss and dlogits come from one op over the float32 logits
    (cross_entropy_chunk: two reads of the logits and one write of dlogits on CUDA)."""
    logits, grad_dtype = _float32_logits(hidden, weight), hidden.dtype if with_dlogits else None
    if logits.is_cuda and not _CUDA_KERNEL:  # (an extension built without the loss family)
        loss_rows, dlogits = cross_entropy_math(logits, targets, ignore_index, grad_dtype)
    else:
        loss_rows, dlogits = tfp8.cross_entropy_chunk(logits, targets, ignore_index, grad_dtype)
    return loss_rows.sum(), (dlogits if with_dlogits else None)


def _loss_and_grads(hidden, weight, targets, ignore_index, chunk_size, need_dhidden, need_dweight):
    """hidden [M, H], targets [M] -> (summed loss, number of counted tokens, dloss_sum/dhidden [M, H] or None,
    dloss_sum/dweight [V, H] or None)."""
    valid = targets != ignore_index
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    dhidden = torch.empty_like(hidden) if need_dhidden else None
    dweight = None
    for start in range(0, hidden.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        h = hidden[rows]
        chunk_loss, dlogits = _chunk_loss_and_dlogits(h, weight, targets[rows], ignore_index,
                                                      need_dhidden or need_dweight)
        loss += chunk_loss
        if need_dhidden:
            torch.mm(dlogits, weight, out=dhidden[rows])
        if need_dweight:
            dweight = torch.mm(dlogits.t(), h) if dweight is None else dweight.addmm_(dlogits.t(), h)
    return loss, valid.sum(), dhidden, dweight


class _LinearCrossEntropy(torch.autograd.Function):
    """The gradients are made in the forward and kept on ctx (not saved tensors: the backward scales them in place
    and hands them over, so they are not copied). One backward per forward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, reduction, chunk_size):
        loss, count, dhidden, dweight = _loss_and_grads(hidden, weight, targets, ignore_index, chunk_size,
                                                        *ctx.needs_input_grad[:2])
        ctx.grads, ctx.count, ctx.reduction = (dhidden, dweight), count, reduction
        return loss / count if reduction == "mean" else loss

    @staticmethod
    def backward(ctx, grad):
        if ctx.grads is None:
            raise RuntimeError("linear_cross_entropy: backward ran twice through the same forward (retain_graph); "
                               "its gradients are handed over by the first backward")
        (dhidden, dweight), ctx.grads = ctx.grads, None
        scale = grad / ctx.count.clamp(min=1) if ctx.reduction == "mean" else grad
        for g in (dhidden, dweight):
            if g is not None:
                g.mul_(scale)
        return dhidden, dweight, None, None, None, None


def _check(hidden, weight, targets, reduction, chunk_size):
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() < 1:
        raise TypeError(f"hidden: expected a floating-point tensor [..., H], got "
                        f"{getattr(hidden, 'dtype', type(hidden).__name__)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight: expected [V, {hidden.shape[-1]}], got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise TypeError(f"weight: expected {hidden.dtype} on {hidden.device} (as hidden), got {weight.dtype} on "
                        f"{weight.device}")
    if not isinstance(targets, torch.Tensor) or targets.dtype != torch.long or targets.device != hidden.device:
        raise TypeError(f"targets: expected an int64 tensor on {hidden.device}, got "
                        f"{getattr(targets, 'dtype', type(targets).__name__)}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets: expected shape {tuple(hidden.shape[:-1])} (hidden's without its last dim), got "
                         f"{tuple(targets.shape)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                         reduction: str = "mean", chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """Cross-entropy loss of logits = hidden @ weightᵀ against targets, chunk by chunk (see the module docstring).

    Gradients flow to hidden and weight (only to those that require them); dweight is summed over the chunks in
    weight's dtype (one rounding a chunk for bfloat16). Class indices out of range are not checked.

    Args:
        hidden: [..., H], a floating dtype (float32, bfloat16, float16).
        weight: [V, H], hidden's dtype and device.
        targets: [...] (hidden's leading shape), int64 class indices in [0, V) or ignore_index.
        ignore_index: targets equal to it count for nothing.
        reduction: "mean" over the counted tokens (NaN when there are none, as F.cross_entropy) or "sum".
        chunk_size: token rows per chunk (a positive int).

    Returns:
        The loss, a float32 scalar.
    """
    _check(hidden, weight, targets, reduction, chunk_size)
    hidden2d, targets1d = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden2d, weight, targets1d, ignore_index, reduction, chunk_size)
    loss, count, _, _ = _loss_and_grads(hidden2d, weight, targets1d, ignore_index, chunk_size, False, False)
    return loss / count if reduction == "mean" else loss
