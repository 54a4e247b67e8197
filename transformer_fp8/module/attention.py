"""Moved to transformer_fp8.attention (dot_product_attention.py, multihead_attention.py, sdpa.py); the names this
former module gave stay importable from it."""
from ..attention.dot_product_attention import (ATTN_MASK_TYPES, QK_NORM_TYPES, QKV_FORMATS,  # noqa: F401
                                               DotProductAttention, check_no_tensor_parallel)
from ..attention.multihead_attention import MultiheadAttention  # noqa: F401
from ..attention.sdpa import scaled_dot_product_attention  # noqa: F401
