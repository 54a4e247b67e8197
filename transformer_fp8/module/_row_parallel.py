"""The output side of a row-parallel FP8 GEMM (Linear parallel_mode="row", LayerNormMLP's FC2 with tensor
parallelism), inside the module's autograd Function.

Forward (summed_gemm): out = a bᵀ summed over the TP ranks: all-reduced ([M, N] on every rank) or, with
sequence_parallel, reduce-scattered along dim 0 (this rank's [M/tp, N] row block). With
distributed.FORWARD_OVERLAP_CHUNKS = k > 1 the GEMM runs in k row chunks (fewer where a chunk would have fewer than
distributed.MIN_OVERLAP_CHUNK_ROWS rows; k need not divide M) and chunk i's collective starts (async) right after
its GEMM, so it runs while the next chunks' GEMMs do. All-reduce: chunk i is a contiguous row range of a; the
reduced chunks are concatenated. Reduce-scatter: chunk i is sub-block i of every rank's row block, in rank order
(an FP8 copy of those rows of a), so that the reduce-scatter hands each rank sub-block i of its own block, written
straight into its output rows.
Backward (output_grad): the gradient of the summed output is the gradient of every rank's partial output as it is
(all-reduce) or all-gathered along dim 0 (reduce-scatter).
"""
import torch

from .. import distributed as tpd
from ._gemm import fp8_gemm_bias


def sums_output(module):
    """True when `module`'s FP8 Function sums its GEMM output over the TP ranks (row-parallel)."""
    return module.tp is not None and module.tp.mode == "row"


def check_sequence_rows(inp, tp):
    """Sequence parallel: the reduce-scatter splits inp's dim 0 (the sequence) into tp blocks."""
    if tp.sequence_parallel and inp.shape[0] % tp.size:
        raise ValueError(f"inp: dim 0 ({inp.shape[0]}) must be divisible by tp_size={tp.size} with "
                         f"sequence_parallel")


def overlap_chunks(gemm_rows):
    """How many row chunks a row-parallel GEMM of gemm_rows rows (all ranks' rows with sequence_parallel) runs in."""
    return max(1, min(tpd.FORWARD_OVERLAP_CHUNKS, gemm_rows // max(1, tpd.MIN_OVERLAP_CHUNK_ROWS)))


def _row_ranges(rows, chunks):
    edges = [rows * i // chunks for i in range(chunks + 1)]
    return [(lo, hi) for lo, hi in zip(edges[:-1], edges[1:]) if hi > lo]


def summed_gemm(module, a, a_scale_inv, b, b_scale_inv, out_dtype):
    """a [M, K] FP8 @ b [N, K]ᵀ FP8 summed over module.tp: [M, N] (all-reduce) or [M / tp, N] (sequence parallel:
    this rank's block of rows; M divisible by tp), in out_dtype."""
    tp = module.tp
    chunks = overlap_chunks(a.shape[0])

    def gemm(rows):
        return fp8_gemm_bias(rows, a_scale_inv, b, b_scale_inv, out_dtype, None)

    if not tp.sequence_parallel:
        pending = [tpd.start_all_reduce(gemm(a[lo:hi]), tp.group) for lo, hi in _row_ranges(a.shape[0], chunks)]
        outs = [p.wait() for p in pending]
        return outs[0] if len(outs) == 1 else torch.cat(outs)
    block = a.shape[0] // tp.size
    if chunks == 1:
        return tpd.start_reduce_scatter_first_dim(gemm(a), tp.group).wait()
    blocks = a.view(tp.size, block, a.shape[1])
    out = torch.empty((block, b.shape[0]), dtype=out_dtype, device=a.device)
    pending = [tpd.start_reduce_scatter_first_dim(gemm(blocks[:, lo:hi].reshape(-1, a.shape[1])), tp.group,
                                                  out=out[lo:hi])
               for lo, hi in _row_ranges(block, chunks)]
    for p in pending:
        p.wait()
    return out


def output_grad(module, grad):
    """The gradient of this rank's partial GEMM output from that of the summed output (see the module docstring)."""
    if grad is None or not module.tp.sequence_parallel:
        return grad
    return tpd.all_gather_first_dim(grad, module.tp.group)
