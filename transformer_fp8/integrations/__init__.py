"""Use transformer_fp8 with existing models (Hugging Face transformers and plain PyTorch) without importing them."""
from .convert import convert_linear_layers, microbatch
from .llama import LlamaTransformerLayer, convert_llama

__all__ = ["LlamaTransformerLayer", "convert_linear_layers", "convert_llama", "microbatch"]
