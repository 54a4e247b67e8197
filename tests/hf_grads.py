"""Gradients of a converted model under Hugging Face parameter names (shared by the dense and MoE conversion tests)."""
import torch
import torch.nn as nn

from transformer_fp8.integrations import LlamaTransformerLayer, layer_weight_map
from transformer_fp8.integrations.hf_mapping import split_fused_weights


def grads_under_hf_names(converted: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gradient of a converted model, keyed by the Hugging Face parameter name.

    Args:
        converted: a model converted by transformer_fp8.integrations.convert_model, after a backward.
    Returns:
        {hf_name: gradient}; a decoder-layer parameter without a gradient (an expert no token went to) gives zeros,
        as transformers' stacked expert tensors have.
    """
    out = {}
    for name, module in converted.named_modules():
        if isinstance(module, LlamaTransformerLayer):
            grads = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in module.named_parameters()}
            out.update({f"{name}.{k}": g for k, g in split_fused_weights(grads, layer_weight_map(module)).items()})
    layer_names = tuple(name + "." for name, m in converted.named_modules() if isinstance(m, LlamaTransformerLayer))
    out.update({n: p.grad for n, p in converted.named_parameters() if not n.startswith(layer_names)})
    return out
