"""The attention subsystem: DotProductAttention (cuDNN graph ops, PyTorch's fused SDPA, FP8 attention, packed
sequences), MultiheadAttention, rotary position embeddings, the fused-QKV split.

dot_product_attention.py, multihead_attention.py: the modules; sdpa.py: PyTorch's SDPA through its fused backends;
cudnn.py: our cuDNN graph ops; fp8.py: FP8 attention (fp8_dpa); varlen.py: packed (thd) sequences; rope.py;
qkv_split.py. (The former paths transformer_fp8.module.attention, .attention_cudnn, .attention_fp8,
.attention_varlen, .rope and .qkv_split still import.)
"""
from .dot_product_attention import DotProductAttention
from .multihead_attention import MultiheadAttention
from .rope import RotaryPositionEmbedding, apply_rotary_pos_emb
from .sdpa import scaled_dot_product_attention

__all__ = ["DotProductAttention", "MultiheadAttention", "RotaryPositionEmbedding", "apply_rotary_pos_emb",
           "scaled_dot_product_attention"]
