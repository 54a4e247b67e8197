"""The FP8 modules."""
from .attention import DotProductAttention, MultiheadAttention
from .grouped_linear import GroupedLinear
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear
from .norm import LayerNorm, RMSNorm
from .rope import RotaryPositionEmbedding, apply_rotary_pos_emb
from .transformer import TransformerLayer

__all__ = ["DotProductAttention", "GroupedLinear", "LayerNorm", "LayerNormLinear", "LayerNormMLP", "Linear",
           "MultiheadAttention", "RMSNorm", "RotaryPositionEmbedding", "TransformerLayer", "apply_rotary_pos_emb"]
