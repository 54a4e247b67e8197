"""The converted decoder layer of the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE).

`MoETransformerLayer` is a LlamaTransformerLayer (llama.py: the same attention, KV cache, prefill and decode paths)
whose TransformerLayer has a LayerNormMoE (transformer_fp8.moe) in place of its LayerNormMLP: post-attention RMSNorm,
router, grouped SwiGLU experts, shared expert. Its weights are mapped by hf_mapping.layer_weight_map with the MoE
rows of moe_mapping.MoEShape. Its router records its logits for transformers' output_router_logits, so that
transformers' load-balancing loss (router_aux_loss_coef) works on the converted model as on the original.
"""
import copy
from typing import Any

import torch
import torch.nn as nn

from ..moe.layer import LayerNormMoE
from .hf_mapping import LayerShape
from .llama import LlamaTransformerLayer
from .rope_angles import RopeAngles

# TransformerLayer builds a dense LayerNormMLP of config.intermediate_size that the LayerNormMoE replaces right away:
# built at this width it allocates next to nothing.
_PLACEHOLDER_FFN = 16


def _skip_init(weight):
    """No random init: the weights are overwritten with the Hugging Face layer's right after."""


class MoETransformerLayer(LlamaTransformerLayer):
    """Drop-in for a Hugging Face Mixtral / Qwen2-MoE / Qwen3-MoE decoder layer with a sparse MoE block (see the module
    docstring); called and returning as LlamaTransformerLayer.

    Attributes:
        layer: the TransformerLayer, whose `layernorm_mlp` is a LayerNormMoE. shape: the LayerShape, `shape.moe` the
            block's MoEShape.
    """

    def __init__(self, config: Any, rope: RopeAngles, params_dtype: torch.dtype, device: torch.device | str | None,
                 fuse_wgrad_accumulation: bool = False, shape: LayerShape | None = None, layer_idx: int = 0) -> None:
        """Args:
            config: the Hugging Face config. rope: the model's RopeAngles.
            params_dtype, device: of the new parameters. fuse_wgrad_accumulation: see TransformerLayer.
            shape: the layer's LayerShape, with `moe` set (moe_mapping.MoEShape.from_hf_block).
            layer_idx: the layer's index in the model.
        Raises:
            ValueError: shape is None or has no MoEShape.
        """
        if shape is None or shape.moe is None:
            raise ValueError("shape: expected a LayerShape whose `moe` is the block's MoEShape")
        placeholder = copy.copy(config)
        placeholder.intermediate_size = _PLACEHOLDER_FFN
        super().__init__(placeholder, rope, params_dtype, device, fuse_wgrad_accumulation, shape, layer_idx)
        self.layer.layernorm_mlp = LayerNormMoE(
            config.hidden_size, eps=config.rms_norm_eps, normalization="RMSNorm", params_dtype=params_dtype,
            device=device, init_method=_skip_init, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            **shape.moe.layer_kwargs())
        _record_router_logits(self.layer.layernorm_mlp.router)


def _record_router_logits(router: nn.Module) -> None:
    """Have transformers' output_router_logits collect this router's logits (its output 0), as it does those of the
    Hugging Face router it replaces (transformers.utils.output_capturing, 5.x); without that module, nothing to do:
    such versions collect router logits from the decoder layers' outputs, which ours do not return."""
    try:
        from transformers.utils.output_capturing import install_output_capuring_hook
    except ImportError:
        return
    install_output_capuring_hook(router, "router_logits", 0, True)
