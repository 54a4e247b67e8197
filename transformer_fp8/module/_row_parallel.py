"""The output side of a row-parallel FP8 GEMM (Linear with parallel_mode="row", LayerNormMLP's FC2), inside the
module's autograd Function.

Each TP rank's GEMM gives a partial sum of the output [M, N]. The bias and the residual go into rank 0's GEMM epilogue
only, so that the sum over the ranks adds them once, with no separate broadcast add or residual add. Their gradients
are the output gradient, complete on every rank (the Function returns them on all ranks: dbias from the fused
gradient cast, the residual's gradient as is). Without sequence parallelism the Function all-reduces the GEMM
output in place (its own fresh [M, N] tensor: no copy, unlike an all-reduce on the reshaped output outside it);
with sequence parallelism the caller reduce-scatters it, whose backward all-gathers the gradient, so the bias
gradient is still the full sum (no all-reduce of it). The residual is not taken with sequence parallelism (it is
this rank's sequence block, the GEMM output the full sequence).
"""
from ..distributed import all_reduce


def epilogue_terms(tp, bias, residual):
    """(bias, residual) to add in this rank's GEMM epilogue: both on rank 0 or without TP (tp None), none elsewhere."""
    return (bias, residual) if tp is None or tp.rank == 0 else (None, None)


def sum_partials(tp, out):
    """out [M, N], this rank's partial output: all-reduced in place over the TP group unless tp is None or sequence
    parallel (the caller reduce-scatters it then). Returns out."""
    if tp is not None and not tp.sequence_parallel:
        all_reduce(out, tp.group)
    return out
