"""transformer_fp8: FP8 Transformer layers for NVIDIA Hopper GPUs with a Transformer Engine-style API."""
import torch

from . import cpu, ops  # noqa: F401  (registers the CPU reference kernels and the fake kernels)
from . import recipe
from .autocast import fp8_autocast, fp8_model_init, get_fp8_recipe, is_fp8_enabled
from .float8_tensor import Float8Tensor
from .module import LayerNorm, LayerNormLinear, LayerNormMLP, Linear, RMSNorm

__all__ = ["Float8Tensor", "LayerNorm", "LayerNormLinear", "LayerNormMLP", "Linear", "RMSNorm", "cuda_kernels_available",
           "fp8_autocast", "fp8_model_init", "get_fp8_recipe", "is_fp8_enabled", "recipe"]

__version__ = "0.1.0"


def cuda_kernels_available() -> bool:
    """True when the extension was built with its CUDA kernels (and so can run on a GPU)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("transformer_fp8::quantize", "CUDA")
