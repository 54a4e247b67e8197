"""Memory layouts the ops take besides contiguous (their contracts: csrc/ops.cpp)."""


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
