"""convert_model: one entry point that puts a Hugging Face model on transformer_fp8.

Llama-like families (families.py: Llama 1/2/3/3.1, Mistral, Qwen2/2.5, Qwen3) get every decoder layer replaced by a
LlamaTransformerLayer (llama.py: our TransformerLayer with the weights mapped by hf_mapping.py) and the final RMSNorm
by ours; the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) the same, their sparse MoE blocks becoming
LayerNormMoE (a MoETransformerLayer, moe_decoder.py; Qwen-MoE's dense layers stay LlamaTransformerLayers). The
converter is one skeleton, the families differ only in their Family data. Families known not to map (Gemma 2/3)
are refused naming what differs. Any other model falls back to convert_linear_layers (its nn.Linear and transformers
Conv1D layers become our Linear). What was converted is logged and kept in `model.tfp8_conversion`.
Only the hook that makes output_hidden_states see the converted layers comes from transformers (imported there).
"""
import dataclasses
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..module.norm import RMSNorm
from .convert import convert_linear_layers
from .families import FAMILIES, REFUSED, Family, family_of
from .hf_export import route_save_pretrained
from .hf_mapping import LayerShape
from .llama import LlamaTransformerLayer
from .moe_decoder import MoETransformerLayer
from .moe_mapping import MoEShape, is_moe_block
from .rope_angles import RopeAngles, inverse_frequencies

logger = logging.getLogger(__name__)


@dataclass
class Conversion:
    """What convert_model did to a model (kept as `model.tfp8_conversion`).

    Attributes:
        family: the family's model_type, or None when the model fell back to convert_linear_layers.
        decoder_layers: qualified names of the decoder layers replaced by LlamaTransformerLayer.
        norms: qualified names of the RMSNorms replaced by ours.
        linear_layers: qualified names of the nn.Linear / Conv1D layers replaced by our Linear (fallback).
    """

    family: str | None
    decoder_layers: list[str] = field(default_factory=list)
    norms: list[str] = field(default_factory=list)
    linear_layers: list[str] = field(default_factory=list)


def _check_config(config, family: Family) -> None:
    """Refuse configurations of a family that TransformerLayer cannot compute exactly, naming the config field."""
    switch = family.sliding_window_switch
    sliding = getattr(config, "sliding_window", None) if switch is None or getattr(config, switch, False) else None
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    unsupported = {"hidden_act": (getattr(config, "hidden_act", "silu"), "silu"),
                   "mlp_bias": (getattr(config, "mlp_bias", False), False),
                   "pretraining_tp": (getattr(config, "pretraining_tp", 1) or 1, 1),
                   "sliding_window": (sliding, None),
                   "layer_types": (sorted(layer_types), ["full_attention"])}
    for name, (got, expected) in unsupported.items():
        if got != expected:
            raise NotImplementedError(f"config.{name}: converting a {family.name} model supports {expected!r} only, "
                                      f"got {got!r}")
    inverse_frequencies(config, LayerShape.from_config(config, family).head_dim)  # refuses unsupported RoPE


def _family_layers(model: nn.Module) -> tuple[Family | None, list[tuple[str, nn.Module]]]:
    """(family, [(name, decoder layer)]) of the first family whose decoder layers `model` contains; refuses families
    known not to map."""
    for name, module in model.named_modules():
        config = getattr(getattr(module, "self_attn", None), "config", None)
        if config is not None and getattr(config, "model_type", None) in REFUSED:
            family_of(config)  # raises, naming what differs
    for family in FAMILIES.values():
        layers = [(name, m) for name, m in model.named_modules() if type(m).__name__ == family.decoder_layer]
        if layers:
            return family, layers
    return None, []


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child_name = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child_name, new)


def _converted_norm(hf_norm: nn.Module, eps: float, params_dtype: torch.dtype | None) -> RMSNorm:
    """Our RMSNorm with the weight (and epsilon) of a Hugging Face RMSNorm, on its device."""
    weight = hf_norm.weight
    norm = RMSNorm(weight.shape[0], eps=getattr(hf_norm, "variance_epsilon", eps),
                   params_dtype=params_dtype or weight.dtype, device=weight.device)
    with torch.no_grad():
        norm.weight.copy_(weight)
    norm.weight.requires_grad_(weight.requires_grad)
    return norm.train(hf_norm.training)


def _record_hidden_states(layer: nn.Module) -> None:
    """Have transformers' output_hidden_states collect this converted layer's output, as it does the decoder layer's
    it replaced: transformers puts a forward hook on the instances of the decoder-layer class its model declares
    (transformers.utils.output_capturing, 5.x), which ours is not. Warns where that module is missing."""
    try:
        from transformers.utils.output_capturing import install_output_capuring_hook
    except ImportError:
        warnings.warn("convert_model: this transformers version has no output_capturing hooks: output_hidden_states "
                      "will not include the converted decoder layers' outputs", stacklevel=4)
        return
    install_output_capuring_hook(layer, "hidden_states", 0, True)


def _layer_class(family: Family, hf_layer: nn.Module, config, shape: LayerShape) -> tuple[type, LayerShape]:
    """(class of the converted layer, its LayerShape): a MoETransformerLayer for a decoder layer whose MLP is a sparse
    MoE block (the MoEShape read from it), else a LlamaTransformerLayer (also Qwen-MoE's dense layers)."""
    if family.moe and is_moe_block(hf_layer.mlp):
        return MoETransformerLayer, dataclasses.replace(shape, moe=MoEShape.from_hf_block(hf_layer.mlp, config))
    return LlamaTransformerLayer, shape


def _convert_family(model: nn.Module, family: Family, layers: list, params_dtype, fuse_wgrad_accumulation,
                    conversion: Conversion) -> None:
    config = layers[0][1].self_attn.config
    _check_config(config, family)
    shape = LayerShape.from_config(config, family)
    rope = RopeAngles(config, shape.head_dim)
    for index, (name, hf_layer) in enumerate(layers):
        weight = hf_layer.self_attn.q_proj.weight
        layer_idx = getattr(hf_layer.self_attn, "layer_idx", None)
        layer_class, layer_shape = _layer_class(family, hf_layer, config, shape)
        new = layer_class(config, rope, params_dtype or weight.dtype, weight.device, fuse_wgrad_accumulation,
                          shape=layer_shape, layer_idx=index if layer_idx is None else layer_idx)
        new.load_hf_layer(hf_layer)
        new.train(hf_layer.training)
        _record_hidden_states(new)
        _replace(model, name, new)
        conversion.decoder_layers.append(name)
    for name, hf_norm in [(n, m) for n, m in model.named_modules() if type(m).__name__ == family.norm]:
        _replace(model, name, _converted_norm(hf_norm, config.rms_norm_eps, params_dtype))
        conversion.norms.append(name)
    config._attn_implementation = "sdpa"  # its mask builder gives None or a 4-D bool mask (llama.py reads both)


def convert_model(model: nn.Module, params_dtype: torch.dtype | None = None, fuse_wgrad_accumulation: bool = False,
                  fallback: bool = True, exclude: str | Sequence[str] = ("lm_head",)) -> nn.Module:
    """Put a Hugging Face model on transformer_fp8, in place (see the module docstring).

    Args:
        model: a Hugging Face model (e.g. LlamaForCausalLM, Qwen3ForCausalLM) or any nn.Module.
        params_dtype: dtype of the new parameters (default: each replaced module's own weight dtype).
        fuse_wgrad_accumulation: the GEMM weights' gradients accumulate into `weight.main_grad` (FP32, to attach).
        fallback: models of no supported family get convert_linear_layers (True) or are refused (False).
        exclude: for the fallback, fnmatch patterns of layers to keep (see convert_linear_layers).
    Returns:
        `model`, with `model.tfp8_conversion` (a Conversion) saying what was converted. config.use_cache is left as
        it was (the converted layers keep transformers' KV cache); config._attn_implementation becomes "sdpa".
        `model.save_pretrained(dir)` then writes a plain Hugging Face checkpoint (hf_export.save_hf_pretrained);
        save `model.state_dict()` for our own (resumable, with the FP8 scaling state) checkpoints.
    Raises:
        NotImplementedError: a family or configuration that does not map (Gemma 2/3, a sliding window, a non-SiLU
            MLP, MLP biases, an unsupported RoPE scaling), naming it.
        ValueError: fallback=False and no decoder layer of a supported family in `model`; a model converted
            already.
    """
    if any(isinstance(m, LlamaTransformerLayer) for m in model.modules()):
        raise ValueError(f"model: {type(model).__name__} is already converted (it holds LlamaTransformerLayers)")
    family, layers = _family_layers(model)
    conversion = Conversion(family.name if family else None)
    if family is not None:
        _convert_family(model, family, layers, params_dtype, fuse_wgrad_accumulation, conversion)
    elif fallback:
        before = {id(m) for m in model.modules()}
        convert_linear_layers(model, exclude=exclude, params_dtype=params_dtype,
                              fuse_wgrad_accumulation=fuse_wgrad_accumulation)
        conversion.linear_layers = [n for n, m in model.named_modules()
                                    if id(m) not in before and type(m).__module__.startswith("transformer_fp8.")]
    else:
        names = ", ".join(f.decoder_layer for f in FAMILIES.values())
        raise ValueError(f"model: no {names} found in {type(model).__name__}")
    model.tfp8_conversion = conversion
    route_save_pretrained(model)
    converted_any = bool(conversion.decoder_layers or conversion.linear_layers)
    logger.log(logging.INFO if converted_any else logging.WARNING,
               "convert_model: %s: %d decoder layers, %d norms, %d linear layers converted",
               conversion.family or "no known family (linear layers only)", len(conversion.decoder_layers),
               len(conversion.norms), len(conversion.linear_layers))
    return model
