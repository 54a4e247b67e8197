"""The Hugging Face decoder families that convert_model maps onto TransformerLayer, as data.

A family is recognised by `config.model_type`. Everything that differs between the families we convert is a field
of `Family`; the converter, the weight mapping (hf_mapping.py) and the exporter read these fields and nothing else.
Families whose decoder layer does not map exactly are listed in REFUSED with the reason. Nothing here imports
transformers.
"""
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    """What distinguishes one Llama-like decoder family.

    Attributes:
        name: the config's model_type.
        decoder_layer: class name of the Hugging Face decoder layer that is replaced.
        norm: class name of the family's RMSNorm (the final norm is replaced by ours).
        qkv_bias: q, k and v projections always carry a bias (Qwen2); otherwise config.attention_bias decides
            (and then o_proj has one too).
        qk_norm: an RMSNorm over head_dim on every q and k head, before RoPE (Qwen3: self_attn.q_norm / k_norm).
    """

    name: str
    decoder_layer: str
    norm: str
    qkv_bias: bool = False
    qk_norm: bool = False


FAMILIES = {family.name: family for family in (
    Family("llama", "LlamaDecoderLayer", "LlamaRMSNorm"),
    Family("mistral", "MistralDecoderLayer", "MistralRMSNorm"),
    Family("qwen2", "Qwen2DecoderLayer", "Qwen2RMSNorm", qkv_bias=True),
    Family("qwen3", "Qwen3DecoderLayer", "Qwen3RMSNorm", qk_norm=True),
)}

_GEMMA_DIFFERENCES = ("its norms scale by (1 + weight) and add post-attention and post-feedforward norms inside "
                      "the residual branches (TransformerLayer has no output norms), its MLP is GeGLU with tanh-GELU, "
                      "and it alternates sliding-window and global attention layers (with attention logit soft-capping "
                      "in Gemma 2)")
REFUSED = {name: _GEMMA_DIFFERENCES for name in ("gemma2", "gemma3", "gemma3_text")}


def family_of(config: Any) -> Family | None:
    """The Family of a Hugging Face config (by config.model_type), or None for models we do not map layer by layer.

    Args:
        config: a transformers PretrainedConfig (or anything with `model_type`).
    Returns:
        The Family, or None.
    Raises:
        NotImplementedError: for a family whose decoder layer is known not to map (Gemma 2/3), naming what differs.
    """
    model_type = getattr(config, "model_type", None)
    if model_type in REFUSED:
        raise NotImplementedError(f"config.model_type {model_type!r}: the decoder layer does not map onto "
                                  f"TransformerLayer: {REFUSED[model_type]}. Use convert_linear_layers(model) to run "
                                  f"its linear layers in FP8 instead")
    return FAMILIES.get(model_type)


def has_attention_bias(config: Any, family: Family) -> tuple[bool, bool]:
    """(q/k/v projections have a bias, o_proj has a bias) for this config of `family`.

    Args:
        config: the Hugging Face config.
        family: its Family.
    Returns:
        Two bools.
    """
    attention_bias = bool(getattr(config, "attention_bias", False))
    return family.qkv_bias or attention_bias, attention_bias
