"""transformer_fp8: FP8 Transformer layers for NVIDIA Hopper GPUs with a Transformer Engine-style API."""
import torch

from ._extension import load_extension

load_extension()  # first: a missing build fails here, with a message that says so

from . import cpu, ops  # noqa: F401  (registers the CPU reference kernels and the fake kernels)
from . import distributed, quantization, recipe
from .autocast import fp8_autocast, fp8_model_init, get_fp8_recipe, is_fp8_enabled
from .checkpoint import checkpoint
from .float8_tensor import Float8Tensor
from .graphs import make_graphed_callables
from .module import (DotProductAttention, GroupedLinear, LayerNorm, LayerNormLinear, LayerNormMLP, Linear,
                     MultiheadAttention, RMSNorm, RotaryPositionEmbedding, TransformerLayer, apply_rotary_pos_emb)
from . import debug  # (after .module, whose classes it hooks)
from .module.base import FP8FallbackWarning, get_fp8_min_gemm_size, set_fp8_min_gemm_size
from .permutation import moe_permute, moe_unpermute
from . import moe  # (after .module and .permutation, which it builds on)
from .optim import FusedAdamW
from . import optimizers  # (TE's `optimizers.FusedAdam`)

__all__ = ["DotProductAttention", "FP8FallbackWarning", "Float8Tensor", "FusedAdamW", "GroupedLinear", "LayerNorm",
           "LayerNormLinear", "LayerNormMLP", "Linear", "MultiheadAttention", "RMSNorm", "RotaryPositionEmbedding",
           "TransformerLayer", "apply_rotary_pos_emb", "checkpoint", "cuda_kernels_available", "debug", "distributed",
           "fp8_autocast", "fp8_model_init", "get_fp8_min_gemm_size", "get_fp8_recipe", "is_fp8_enabled",
           "make_graphed_callables", "moe", "moe_permute", "moe_unpermute", "optimizers", "quantization", "recipe",
           "set_fp8_min_gemm_size"]

__version__ = "0.1.0"


def cuda_kernels_available(which=all) -> bool:
    """True when the extension was built with its CUDA kernels (and so can run on a GPU).
    `which=any` asks whether some op family has them (a partial TFP8_ONLY build)."""
    ops_ = ("quantize", "fp8_gemm", "layernorm_fwd", "activation_fwd", "delayed_scaling_update", "rope_fwd")
    return which(torch._C._dispatch_has_kernel_for_dispatch_key(f"transformer_fp8::{op}", "CUDA") for op in ops_)
