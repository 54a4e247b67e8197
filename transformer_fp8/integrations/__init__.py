"""Use transformer_fp8 with existing models (Hugging Face transformers and plain PyTorch) without importing them."""
from .convert import convert_linear_layers, microbatch

__all__ = ["convert_linear_layers", "microbatch"]
