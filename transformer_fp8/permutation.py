"""Token permutation for mixture-of-experts layers: moe_permute / moe_unpermute with Transformer Engine's names.

moe_permute copies each token's row once per expert it is routed to, grouped by expert (expert 0's tokens first, in
token order, then expert 1's, ...), so that a GroupedLinear runs one GEMM per contiguous group; moe_unpermute sums the
copies back into token order, weighted by the router's probabilities. Both are differentiable and never synchronise
with the device (except mask routing without num_out_tokens, which must count the routed rows on the host).

The row map (`row_id_map`, returned by moe_permute, passed to moe_unpermute) is int32 [T, S] on the tokens' device:
the permuted row of slot s of token t, or -1 where the slot is not routed or its row was dropped. Its slots are the
experts (S = E) for map_type="mask" and the top-k choices (S = topk) for map_type="index"; merging_probs is laid out
the same way ([T, E] or [T, topk]).

With align_size > 1 (FP8 training: 16, what the grouped FP8 weight-gradient GEMM needs) every expert's rows start at a
multiple of align_size: the rows between experts (and after the last) are zeros that no slot maps to, so that the
expert GEMMs run on the permuted tensor as it is, without padded copies; moe_unpermute skips them.
"""
import torch

from .grouped_gemm import padded_rows_bound
from .ops import tfp8
from .quantization import FP8Operand

MAP_TYPES = ("mask", "index")


def _check_map_type(map_type: str) -> None:
    if map_type not in MAP_TYPES:
        raise ValueError(f"map_type: expected 'mask' or 'index', got {map_type!r}")


def _routing_rows(routing_map: torch.Tensor, num_out_tokens: int, map_type: str) -> tuple[torch.Tensor, int]:
    """-> (row_id_map int32 [T, S], N the number of permuted rows). Rows go expert by expert, tokens in order within
    an expert; rows at or past num_out_tokens (when >= 0) are dropped (-1)."""
    if routing_map.dim() != 2:
        raise ValueError(f"routing_map: expected a 2-D tensor ([tokens, experts] for 'mask', [tokens, topk] for "
                         f"'index'), got shape {tuple(routing_map.shape)}")
    t, s = routing_map.shape
    if map_type == "index":
        if routing_map.dtype.is_floating_point or routing_map.dtype == torch.bool:
            raise TypeError(f"routing_map: expected an integer tensor of expert indices for map_type='index', got "
                            f"{routing_map.dtype}")
        flat = routing_map.reshape(-1)
        order = torch.sort(flat, stable=True).indices  # slots by expert, token order within an expert
        dest = torch.empty_like(order)
        dest[order] = torch.arange(order.numel(), device=order.device)
        routed = t * s
        rows = dest.view(t, s)
    else:
        routed_mask = routing_map.bool()
        rank = torch.cumsum(routed_mask.to(torch.int32), dim=0)  # 1-based rank of each token within its expert
        counts = rank[-1] if t else torch.zeros(s, dtype=torch.int32, device=routing_map.device)
        starts = torch.cumsum(counts, 0) - counts
        rows = torch.where(routed_mask, starts + rank - 1, -1)
        routed = int(routed_mask.sum()) if num_out_tokens < 0 else -1  # (a host sync: only without num_out_tokens)
    n = routed if num_out_tokens < 0 else num_out_tokens
    if n < t * s or map_type == "mask":
        rows = torch.where(rows < n, rows, -1)
    return rows.to(torch.int32), n


def _slot_of_row(row_id_map: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The inverse of row_id_map: int32 [num_rows], the flat slot t * S + s whose copy fills each row, -1 for none."""
    flat = row_id_map.reshape(-1).long()
    target = torch.where(flat >= 0, flat, num_rows)  # (unrouted slots land in one extra, discarded, row)
    out = torch.full((num_rows + 1,), -1, dtype=torch.int32, device=row_id_map.device)
    out.scatter_(0, target, torch.arange(flat.numel(), dtype=torch.int32, device=row_id_map.device))
    return out[:num_rows]


def _aligned_rows(rows: torch.Tensor, expert_of_slot: torch.Tensor, counts: torch.Tensor, align_size: int,
                  total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Move each expert's rows so that they start at a multiple of align_size (on the device, no sync).

    Args:
        rows: int32 [T, S], the unpadded row map (-1: not routed or dropped); expert e's kept rows are consecutive
            from the sum of the kept counts before it (dropping only cuts the tail of the expert order).
        expert_of_slot: integer [T, S], the expert of each slot.
        counts: int32 [E], the kept rows of each expert.
        align_size: the alignment in rows.
        total: rows of the padded layout (padded_rows_bound of the unpadded rows).

    Returns:
        (the padded row map int32 [T, S], rows per expert int32 [E] including its padding: multiples of align_size
        except the last, which also takes the rows up to `total`).
    """
    starts = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    padded = (counts + (align_size - 1)) // align_size * align_size
    padded_ends = torch.cumsum(padded, 0, dtype=torch.int32)
    shift = padded_ends - padded - starts
    aligned = torch.where(rows >= 0, rows + shift[expert_of_slot.long()], -1).to(torch.int32)
    # (the last end set to `total` by a device op: a host number written into a device tensor would be a sync)
    sizes = torch.diff(torch.cat((padded_ends[:-1], padded_ends.new_full((1,), total))), prepend=padded_ends[:1] * 0)
    return aligned, sizes.to(torch.int32)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, row_id_map, slot_of_row):
        ctx.save_for_backward(row_id_map)
        return tfp8.moe_permute_rows(inp, slot_of_row, row_id_map.shape[1], None)

    @staticmethod
    def backward(ctx, grad):
        (row_id_map,) = ctx.saved_tensors
        return tfp8.moe_unpermute_rows(grad.contiguous(), row_id_map, None), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, row_id_map, probs):
        ctx.save_for_backward(inp, row_id_map, probs)
        return tfp8.moe_unpermute_rows(inp, row_id_map, None if probs is None else probs.float())

    @staticmethod
    def backward(ctx, grad):
        inp, row_id_map, probs = ctx.saved_tensors
        grad = grad.contiguous()
        d_inp = d_probs = None
        if ctx.needs_input_grad[0]:
            slot_of_row = _slot_of_row(row_id_map, inp.shape[0])
            d_inp = tfp8.moe_permute_rows(grad, slot_of_row, row_id_map.shape[1],
                                          None if probs is None else probs.float())
        if probs is not None and ctx.needs_input_grad[2]:
            d_probs = tfp8.moe_merging_probs_grad(grad, inp, row_id_map).to(probs.dtype)
        return d_inp, None, d_probs


def moe_permute(inp: torch.Tensor | FP8Operand, routing_map: torch.Tensor, num_out_tokens: int = -1,
                max_token_num: int = -1, map_type: str = "mask", *, return_tokens_per_expert: bool = False,
                num_experts: int | None = None, align_size: int = 1) -> tuple:
    """Copy each token's row to the experts it is routed to, grouped by expert (Transformer Engine's moe_permute).

    Args:
        inp: [T, H] tokens (float32 / float16 / bfloat16, differentiable), or an FP8Operand with rowwise data
            (per-tensor scaled: its bytes are permuted and the result keeps its scale_inv; data_t is not made).
        routing_map: map_type "mask": [T, E] bool (or 0/1) tensor, True where token t goes to expert e;
            "index": [T, topk] integer tensor of expert indices (distinct within a row).
        num_out_tokens: rows of the output: the routed rows past it are dropped (rows beyond the routed count are
            zeros). -1: every routed row; for "mask" that count needs a host sync, so pass it (e.g. T * topk) in a
            training step. For "index" the default is T * topk, known without a sync.
        max_token_num: accepted for Transformer Engine compatibility (unused).
        map_type: "mask" or "index".
        return_tokens_per_expert: also return the per-expert row counts (int32 [E] on the device, no sync): the
            m_splits of a GroupedLinear.
        num_experts: E, needed with map_type="index" and return_tokens_per_expert or align_size > 1.
        align_size: every expert's rows start at a multiple of it (see the module docstring; 16 for FP8 training):
            N becomes padded_rows_bound(rows, E, align_size) (a bound known without a sync), the padding rows are
            zeros, and tokens_per_expert counts them (multiples of align_size, the trailing padding in the last
            expert's count). 1: no padding.

    Returns:
        (permuted [N, H] (a tensor, or an FP8Operand like inp), row_id_map int32 [T, S] for moe_unpermute), plus
        tokens_per_expert when asked for.
    """
    _check_map_type(map_type)
    fp8 = isinstance(inp, FP8Operand)
    data = inp.data if fp8 else inp
    if not isinstance(data, torch.Tensor) or data.dim() != 2:
        raise ValueError(f"inp: expected a 2-D tensor [tokens, hidden] (or an FP8 operand of one), got "
                         f"{tuple(data.shape) if isinstance(data, torch.Tensor) else type(inp).__name__}")
    if routing_map.shape[0] != data.shape[0] or routing_map.device != data.device:
        raise ValueError(f"routing_map: expected {data.shape[0]} rows on {data.device} (inp's tokens), got shape "
                         f"{tuple(routing_map.shape)} on {routing_map.device}")
    if isinstance(align_size, bool) or not isinstance(align_size, int) or align_size < 1:
        raise ValueError(f"align_size: expected an int >= 1, got {align_size!r}")
    row_id_map, n = _routing_rows(routing_map, num_out_tokens, map_type)
    counts = None
    if align_size > 1:
        counts = _tokens_per_expert(routing_map, row_id_map, map_type, num_experts)
        experts = counts.numel()
        expert_of_slot = routing_map if map_type == "index" else \
            torch.arange(experts, device=routing_map.device).expand(routing_map.shape)
        n = padded_rows_bound(n, experts, align_size) if n else 0
        row_id_map, counts = _aligned_rows(row_id_map, expert_of_slot, counts, align_size, n)
    slot_of_row = _slot_of_row(row_id_map, n)
    if fp8:
        permuted = _permuted_operand(inp, slot_of_row, row_id_map.shape[1])
    else:
        permuted = _Permute.apply(data.contiguous(), row_id_map, slot_of_row)
    if not return_tokens_per_expert:
        return permuted, row_id_map
    if counts is None:
        counts = _tokens_per_expert(routing_map, row_id_map, map_type, num_experts)
    return permuted, row_id_map, counts


def _permuted_operand(operand: FP8Operand, slot_of_row: torch.Tensor, slots: int) -> FP8Operand:
    """An FP8 operand whose rowwise data is permuted: same scale_inv and dtype, no transposed data."""
    if operand.layout != "tensor" or operand.data is None:
        raise ValueError(f"inp: expected an FP8Operand with rowwise data and per-tensor scaling, got {operand!r}")
    data = tfp8.moe_permute_rows(operand.data, slot_of_row, slots, None)
    return FP8Operand(data, None, operand.scale_inv, operand.fp8_dtype, operand.layout)


def _tokens_per_expert(routing_map: torch.Tensor, row_id_map: torch.Tensor, map_type: str,
                       num_experts: int | None) -> torch.Tensor:
    """Rows of each expert that were kept (int32 [E], on the device)."""
    kept = (row_id_map >= 0).to(torch.int32)
    if map_type == "mask":
        return kept.sum(0, dtype=torch.int32)
    if num_experts is None or num_experts <= 0:
        raise ValueError("num_experts: expected a positive int with map_type='index' and return_tokens_per_expert "
                         "or align_size > 1")
    counts = torch.zeros(num_experts, dtype=torch.int32, device=routing_map.device)
    return counts.scatter_add_(0, routing_map.reshape(-1).long(), kept.reshape(-1))


def moe_unpermute(inp: torch.Tensor, row_id_map: torch.Tensor, merging_probs: torch.Tensor | None = None,
                  restore_shape: torch.Size | tuple | None = None, map_type: str = "mask",
                  probs: torch.Tensor | None = None) -> torch.Tensor:
    """Sum the expert outputs of each token back into token order (Transformer Engine's moe_unpermute):
    out[t] = sum over routed slots s of merging_probs[t, s] * inp[row_id_map[t, s]], accumulated in float32.

    Args:
        inp: [N, H] expert outputs in moe_permute's row order (float32 / float16 / bfloat16, differentiable).
        row_id_map: int32 [T, S] from moe_permute.
        merging_probs: [T, S] weights ([T, E] for "mask", [T, topk] for "index"; differentiable), or None: plain sum.
        restore_shape: the shape of the result, [T, H] (checked when given).
        map_type: the map_type given to moe_permute (the row map already encodes it).
        probs: Transformer Engine's older name for merging_probs.

    Returns:
        [T, H] in inp's dtype.
    """
    _check_map_type(map_type)
    if merging_probs is None:
        merging_probs = probs
    elif probs is not None:
        raise ValueError("probs: give merging_probs or probs (its older name), not both")
    if not isinstance(inp, torch.Tensor) or inp.dim() != 2:
        raise ValueError(f"inp: expected a 2-D tensor [rows, hidden], got "
                         f"{tuple(inp.shape) if isinstance(inp, torch.Tensor) else type(inp).__name__}")
    if merging_probs is not None and tuple(merging_probs.shape) != tuple(row_id_map.shape):
        raise ValueError(f"merging_probs: expected shape {tuple(row_id_map.shape)} (row_id_map's), got "
                         f"{tuple(merging_probs.shape)}")
    if restore_shape is not None and tuple(restore_shape) != (row_id_map.shape[0], inp.shape[1]):
        raise ValueError(f"restore_shape: expected {(row_id_map.shape[0], inp.shape[1])} ([tokens, hidden]), got "
                         f"{tuple(restore_shape)}")
    return _Unpermute.apply(inp.contiguous(), row_id_map, merging_probs)
