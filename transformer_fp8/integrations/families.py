"""The Hugging Face decoder families that convert_model maps onto TransformerLayer, as data (the mixture-of-experts
families' MLPs onto LayerNormMoE).

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
        qkv_bias_key: the config field that gives q, k and v a bias (Qwen2-MoE: "qkv_bias"), or None.
        sliding_window_switch: the config field that turns config.sliding_window on ("use_sliding_window"), or None
            where a sliding_window that is set is used (Mistral, Mixtral, Qwen3-MoE).
        moe: the decoder layers' MLPs are (or, Qwen-MoE, may be) sparse mixture-of-experts blocks, converted to
            LayerNormMoE (moe_mapping.py).
    """

    name: str
    decoder_layer: str
    norm: str
    qkv_bias: bool = False
    qk_norm: bool = False
    qkv_bias_key: str | None = None
    sliding_window_switch: str | None = "use_sliding_window"
    moe: bool = False


FAMILIES = {family.name: family for family in (
    Family("llama", "LlamaDecoderLayer", "LlamaRMSNorm"),
    Family("mistral", "MistralDecoderLayer", "MistralRMSNorm", sliding_window_switch=None),
    Family("qwen2", "Qwen2DecoderLayer", "Qwen2RMSNorm", qkv_bias=True),
    Family("qwen3", "Qwen3DecoderLayer", "Qwen3RMSNorm", qk_norm=True),
    Family("mixtral", "MixtralDecoderLayer", "MixtralRMSNorm", sliding_window_switch=None, moe=True),
    Family("qwen2_moe", "Qwen2MoeDecoderLayer", "Qwen2MoeRMSNorm", qkv_bias_key="qkv_bias", moe=True),
    Family("qwen3_moe", "Qwen3MoeDecoderLayer", "Qwen3MoeRMSNorm", qk_norm=True, sliding_window_switch=None,
           moe=True),
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
    qkv_bias = family.qkv_bias or attention_bias or bool(family.qkv_bias_key and getattr(config, family.qkv_bias_key,
                                                                                           False))
    return qkv_bias, attention_bias
