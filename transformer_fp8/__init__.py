"""transformer_fp8: FP8 Transformer layers for NVIDIA Hopper GPUs with a Transformer Engine-style API."""
import torch

from . import cpu, ops  # noqa: F401  (registers the CPU reference kernels and the fake kernels)

__version__ = "0.1.0"


def cuda_kernels_available() -> bool:
    """True when the extension was built with its CUDA kernels (and so can run on a GPU)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("transformer_fp8::quantize", "CUDA")
