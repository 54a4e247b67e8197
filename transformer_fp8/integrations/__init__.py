"""Use transformer_fp8 with existing models (Hugging Face transformers and plain PyTorch) without importing them."""
from .causal_lm import causal_lm_loss
from .convert import convert_linear_layers, microbatch
from .gradient_checkpointing import gradient_checkpointing_enable
from .linear_cross_entropy import linear_cross_entropy
from .llama import LlamaTransformerLayer, convert_llama

__all__ = ["LlamaTransformerLayer", "causal_lm_loss", "convert_linear_layers", "convert_llama",
           "gradient_checkpointing_enable", "linear_cross_entropy", "microbatch"]
