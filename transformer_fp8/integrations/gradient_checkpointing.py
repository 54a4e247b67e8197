"""Hugging Face gradient checkpointing with FP8 layers inside."""
from torch import nn

from ..checkpoint import checkpoint


def gradient_checkpointing_enable(model: nn.Module) -> nn.Module:
    """transformers' `model.activation_checkpointing_enable()` (`gradient_checkpointing_enable()` before
    transformers 5.23), with transformer_fp8.checkpoint as every layer's checkpoint function: FP8 modules inside
    (convert_linear_layers) recompute in FP8 with the forward's scales, where transformers' torch.utils.checkpoint
    would have them refuse the recompute. Layers from convert_llama use transformer_fp8.checkpoint in any case.

    Args:
        model: a Hugging Face PreTrainedModel (converted or not).

    Returns:
        `model`, with checkpointing enabled.
    """
    hf_enable(model)
    for module in model.modules():
        if hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = checkpoint
    return model


def hf_enable(model: nn.Module) -> None:
    """transformers' own activation checkpointing switch, under its current name.

    Args:
        model: a Hugging Face PreTrainedModel.
    """
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
