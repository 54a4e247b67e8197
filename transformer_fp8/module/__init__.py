"""The FP8 modules (and, re-exported, the attention modules of transformer_fp8.attention)."""
from ..attention import DotProductAttention, MultiheadAttention, RotaryPositionEmbedding, apply_rotary_pos_emb
from .grouped_linear import GroupedLinear
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear
from .norm import LayerNorm, RMSNorm
from .transformer import TransformerLayer

__all__ = ["DotProductAttention", "GroupedLinear", "LayerNorm", "LayerNormLinear", "LayerNormMLP", "Linear",
           "MultiheadAttention", "RMSNorm", "RotaryPositionEmbedding", "TransformerLayer", "apply_rotary_pos_emb"]
