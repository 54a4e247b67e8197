"""One LoRA adapter (A, B, dropout, scale) and the update that a set of adapters adds to one GEMM's output.

An adapter on output rows [row_start, row_end) of a GEMM y = x Wᵀ adds scale * B A dropout(x) to those rows, with
A [r, in] (PEFT's init: nn.Linear's Kaiming-uniform), B [rows, r] (zeros: the adapted model starts equal to the base
one) and scale = alpha / r (alpha / sqrt(r) with use_rslora), as PEFT's LoRA. The adapters of one GEMM run as two
small GEMMs whatever their number: h = x [A_1; A_2; ...]ᵀ (one GEMM over the stacked A's; with dropout, one per
adapter, each with its own mask as PEFT draws them) and y + h Uᵀ with U [out, sum r] holding scale_i * B_i in rows
[row_start_i, row_end_i) and columns of h_i, zeros elsewhere (one GEMM whose epilogue adds y: torch.addmm).
"""
import math
from collections.abc import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F


class LoraAdapter(nn.Module):
    """lora_A [r, in_features], lora_B [out_features, r] on output rows [row_start, row_start + out_features) of the
    GEMM `gemm` of the module that holds it; `hf_name` is the Hugging Face module it adapts (the name it is saved
    under in PEFT's format)."""

    def __init__(self, in_features: int, out_features: int, r: int, alpha: float, dropout: float, use_rslora: bool,
                 row_start: int, gemm: str, hf_name: str, dtype: torch.dtype, device: torch.device) -> None:
        """Args:
            in_features / out_features: the GEMM's input features / the rows this adapter writes.
            r: rank. alpha: scaling numerator. dropout: probability on the adapter's input (training only).
            use_rslora: scale alpha / sqrt(r) instead of alpha / r.
            row_start: first output row of the GEMM that this adapter adds to. gemm: the GEMM's weight name.
            hf_name: the adapted Hugging Face module's qualified name. dtype / device: of A and B.
        """
        super().__init__()
        self.lora_A = nn.Linear(in_features, r, bias=False, dtype=dtype, device=device)
        self.lora_B = nn.Linear(r, out_features, bias=False, dtype=dtype, device=device)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.r, self.alpha, self.dropout, self.use_rslora = r, alpha, dropout, use_rslora
        self.scale = alpha / math.sqrt(r) if use_rslora else alpha / r
        self.row_start, self.row_end = row_start, row_start + out_features
        self.gemm, self.hf_name = gemm, hf_name

    def delta_weight(self) -> torch.Tensor:
        """Returns:
            scale * B A [out_features, in_features] in float32: what merging adds to the base weight's rows."""
        return self.scale * (self.lora_B.weight.float() @ self.lora_A.weight.float())

    def extra_repr(self) -> str:
        """Returns:
            The adapted module, rows, GEMM, r, alpha and dropout, for the module's repr."""
        return (f"{self.hf_name}: rows [{self.row_start}, {self.row_end}) of {self.gemm}, r={self.r}, "
                f"alpha={self.alpha}, dropout={self.dropout}")


def _drops(adapter: LoraAdapter) -> bool:
    return adapter.dropout > 0 and adapter.lora_dropout.training


def any_dropout(adapters: list[LoraAdapter]) -> bool:
    """Whether some adapter drops out its input now (dropout > 0, in training).

    Args:
        adapters: the adapters of one GEMM.
    Returns:
        True if at least one of them applies dropout now.
    """
    return any(_drops(a) for a in adapters)


def stacked_a(adapters: list[LoraAdapter]) -> torch.Tensor:
    """The adapters' A stacked in their order (one GEMM for all).

    Args:
        adapters: the adapters of one GEMM, sorted by row_start.
    Returns:
        [A_1; A_2; ...] [sum r, in_features].
    """
    return adapters[0].lora_A.weight if len(adapters) == 1 else torch.cat([a.lora_A.weight for a in adapters])


def down_projection(adapters: list[LoraAdapter], x: torch.Tensor) -> torch.Tensor:
    """The adapters' A applied to (their dropout of) x, stacked in the adapters' order.

    Args:
        adapters: the adapters of one GEMM, sorted by row_start.
        x: the GEMM's input [..., in_features].
    Returns:
        h [..., sum r] in the adapters' dtype.
    """
    dtype = adapters[0].lora_A.weight.dtype
    x = x if x.dtype == dtype else x.to(dtype)
    if not any_dropout(adapters):
        return F.linear(x, stacked_a(adapters))
    return torch.cat([F.linear(a.lora_dropout(x), a.lora_A.weight) for a in adapters], dim=-1)


def placed_up(adapters: list[LoraAdapter], out_features: int) -> torch.Tensor:
    """U [out_features, sum r]: scale_i * B_i in the rows of adapter i and the columns of its h, zeros elsewhere.

    Args:
        adapters: the adapters of one GEMM, sorted by row_start, not overlapping.
        out_features: the GEMM's output features.
    Returns:
        U [out_features, sum r] in the adapters' dtype.
    """
    total_r = sum(a.r for a in adapters)
    blocks, row, col = [], 0, 0
    for a in adapters:
        b = a.lora_B.weight
        if a.row_start > row:
            blocks.append(b.new_zeros(a.row_start - row, total_r))
        blocks.append(F.pad(b * a.scale, (col, total_r - col - a.r)))
        row, col = a.row_end, col + a.r
    if row < out_features:
        blocks.append(adapters[0].lora_B.weight.new_zeros(out_features - row, total_r))
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks)


def sorted_adapters(adapters: Iterable[LoraAdapter]) -> list[LoraAdapter]:
    """The adapters in output-row order (the order down_projection and placed_up need).

    Args:
        adapters: adapters of one GEMM, in any order.
    Returns:
        A new list sorted by row_start.
    """
    return sorted(adapters, key=lambda a: a.row_start)


def lora_update(adapters: list[LoraAdapter], x: torch.Tensor, out_features: int,
                out_dtype: torch.dtype) -> torch.Tensor:
    """The adapters' sum over the whole output: [..., out_features] in out_dtype (zeros in rows none adapts).

    Args:
        adapters: the adapters of one GEMM, sorted by row_start (sorted_adapters).
        x: the GEMM's input [..., in_features].
        out_features: the GEMM's output features.
        out_dtype: the dtype of the result.
    Returns:
        The update to add to the GEMM's output.
    """
    return up_projection(adapters, down_projection(adapters, x), out_features, out_dtype)


def up_projection(adapters: list[LoraAdapter], h: torch.Tensor, out_features: int,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """h [..., sum r] (the stacked A's output) -> the adapters' update [..., out_features] in out_dtype.

    Args:
        adapters: the adapters of one GEMM, sorted by row_start.
        h: the stacked A's output [..., sum r] (down_projection).
        out_features: the GEMM's output features.
        out_dtype: the dtype of the result.
    Returns:
        The update [..., out_features] (zeros in rows no adapter writes).
    """
    out = F.linear(h, placed_up(adapters, out_features))
    return out if out.dtype == out_dtype else out.to(out_dtype)


def add_lora_update(out: torch.Tensor, x: torch.Tensor, adapters: list[LoraAdapter]) -> torch.Tensor:
    """out + the adapters' update, the add in the second GEMM's epilogue (torch.addmm).

    Args:
        out: the GEMM's output [..., out_features].
        x: the GEMM's input [..., in_features].
        adapters: the adapters of that GEMM, sorted by row_start.
    Returns:
        A new tensor of out's shape and dtype.
    """
    return add_up_projection(out, down_projection(adapters, x), adapters)


def add_up_projection(out: torch.Tensor, h: torch.Tensor, adapters: list[LoraAdapter]) -> torch.Tensor:
    """out + the update from h [..., sum r] (the stacked A's output), the add in the GEMM's epilogue (torch.addmm).

    Args:
        out: a tensor of the update's shape [..., out_features] (the GEMM's output, or a residual to add it to).
        h: the stacked A's output.
        adapters: the adapters, sorted by row_start.
    Returns:
        A new tensor of out's shape and dtype.
    """
    up = placed_up(adapters, out.shape[-1])
    h, up = (h if h.dtype == out.dtype else h.to(out.dtype)), (up if up.dtype == out.dtype else up.to(out.dtype))
    out2d = out.reshape(-1, out.shape[-1])
    return torch.addmm(out2d, h.reshape(-1, h.shape[-1]), up.t()).view(out.shape)
