"""Memory layouts of the ops' operands besides contiguous (their contracts: csrc/ops.cpp): rows at a stride, dim
order."""


def row_layout(t):
    """(cols, ld) when t is rows of contiguous elements at one stride: its trailing dims, contiguous among themselves,
    make a row of cols elements, its leading dims merge into one row index at stride ld (a contiguous t: one row,
    ld = cols); else None. The q of a fused QKV output is such a tensor: a slice of the last dim."""
    cols, dim = 1, t.dim() - 1
    while dim >= 0 and (t.shape[dim] == 1 or t.stride(dim) == cols):
        cols *= t.shape[dim]
        dim -= 1
    ld, span = None, 1
    for d in range(dim, -1, -1):
        if t.shape[d] == 1:
            continue
        if ld is None:
            ld = t.stride(d)
            if ld < cols:
                return None
        elif t.stride(d) != ld * span:
            return None
        span *= t.shape[d]
    return cols, cols if ld is None else ld


def dim_order(t, ndims=None):
    """(t's first ndims dims (default all) by decreasing stride, the inverse permutation): t.permute(order) is
    contiguous when t is dense."""
    order = sorted(range(ndims or t.dim()), key=lambda i: -t.stride(i))
    return order, sorted(range(len(order)), key=order.__getitem__)


def dense_in_order_of(like, shape, zeroed=False, dtype=None):
    """A 4-D tensor of `shape` like `like` (of dtype, default like's), dense in like's dim order (dims 0..2 by
    decreasing stride, the last dim last), as the CUDA attention kernels allocate their outputs."""
    order, inverse = dim_order(like, 3)
    memory_shape = [shape[i] for i in order] + [shape[3]]
    dtype = dtype or like.dtype
    t = like.new_zeros(memory_shape, dtype=dtype) if zeroed else like.new_empty(memory_shape, dtype=dtype)
    return t.permute(inverse + [3])
