"""The way back: a converted model's weights under Hugging Face names, as a plain transformers checkpoint.

`to_hf_state_dict(model)` rewrites `model.state_dict()`: the parameters of every converted decoder layer are split
into the Hugging Face tensors they were made of (hf_mapping.layer_weight_map), FP8 weights (fp8_model_init) are
dequantized, Linear layers converted from transformers' Conv1D have their [in, out] weight (their state dict keeps
that layout), and our FP8 scaling state (`_extra_state`) is left out. `save_hf_pretrained(model, directory)` passes
that state dict to the model's own `save_pretrained`, so the directory loads with plain transformers
(`AutoModelForCausalLM.from_pretrained`, without transformer_fp8). convert_model makes `model.save_pretrained` do the
same. Nothing here imports transformers.
"""
import functools
import json
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from ..float8_tensor import Float8Tensor
from .hf_mapping import split_fused_weights, layer_weight_map

EXTRA_STATE_SUFFIX = "_extra_state"


def _plain(tensor: torch.Tensor, dtype: torch.dtype | None, device) -> torch.Tensor:
    """A detached dense copy (FP8 weights dequantized), of its own storage (safetensors refuses shared storage)."""
    if isinstance(tensor, Float8Tensor):
        tensor = tensor.dequantize(dtype)
    tensor = tensor.detach().to(device=device, dtype=dtype)
    return tensor.clone(memory_format=torch.contiguous_format)


def _is_converted_layer(module: nn.Module) -> bool:
    from .llama import LlamaTransformerLayer  # (llama.py imports the mapping that this module shares)
    return isinstance(module, LlamaTransformerLayer)


@torch.no_grad()
def to_hf_state_dict(model: nn.Module, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                     state_dict: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The state dict of a converted model under the Hugging Face names of the model it was converted from.

    Args:
        model: a model converted by convert_model / convert_llama / convert_linear_layers (or never converted).
        state_dict: the model's state dict to translate (e.g. the one transformers' Trainer gathered); default
            model.state_dict(). Layers whose entries are under Hugging Face names already pass through.
        dtype: dtype of the floating-point tensors (default: each parameter's own; FP8 weights: their
            high-precision dtype).
        device: where the tensors go (default: where they are), e.g. "cpu" to save a GPU model's copy in host memory.
    Returns:
        name -> tensor, every tensor a copy with its own storage (tied weights: one copy per name).
    """
    from ..lora.layers import is_lora_module  # (here: transformer_fp8.lora imports this package)
    if any(is_lora_module(m) for m in model.modules()):  # (the adapters would be dropped without a word)
        raise ValueError("model: has LoRA adapters, which a Hugging Face checkpoint has no place for: fold them in "
                         "first (transformer_fp8.lora.merge_lora(model)) or save them in PEFT's format (save_lora)")
    state = model.state_dict(keep_vars=False) if state_dict is None else state_dict
    modules = dict(model.named_modules())
    out, converted = {}, []
    for prefix in [name for name, m in modules.items() if _is_converted_layer(m)]:
        table = layer_weight_map(modules[prefix])
        ours = {key[len(prefix) + 1:]: t for key, t in state.items() if key.startswith(prefix + ".")}
        if table[0].name not in ours:  # (under Hugging Face names already)
            continue
        converted.append(prefix)
        for hf_name, tensor in split_fused_weights(ours, table).items():
            out[f"{prefix}.{hf_name}"] = tensor
    converted_prefixes = tuple(prefix + "." for prefix in converted)
    for key, tensor in state.items():
        if key.endswith(EXTRA_STATE_SUFFIX) or key.startswith(converted_prefixes):
            continue
        out[key] = tensor  # (Linear layers from Conv1D keep Conv1D's weight layout in their state dict)
    return {key: _plain(tensor, dtype if tensor.is_floating_point() else None, device) for key, tensor in out.items()}


def save_hf_pretrained(model: nn.Module, save_directory: str | os.PathLike, **kwargs: Any) -> None:
    """Write a converted Hugging Face model as a plain transformers checkpoint (config + safetensors).

    Args:
        model: a converted transformers PreTrainedModel (it keeps its config and save_pretrained).
        save_directory: the output directory (created if missing).
        **kwargs: passed to transformers' save_pretrained (max_shard_size, safe_serialization, ...); a `dtype`
            keyword sets the saved tensors' dtype, a `state_dict` (ours, as transformers' Trainer passes it) is
            translated (see to_hf_state_dict).
    Raises:
        TypeError: `model` has no transformers save_pretrained.
    """
    original = getattr(type(model), "save_pretrained", None)
    if original is None:
        raise TypeError(f"model: expected a transformers PreTrainedModel (with save_pretrained), got "
                        f"{type(model).__name__}; use to_hf_state_dict(model) and save it yourself")
    state_dict, dtype = kwargs.pop("state_dict", None), kwargs.pop("dtype", None)  # (Trainer passes a state_dict)
    original(model, save_directory, state_dict=to_hf_state_dict(model, dtype=dtype, state_dict=state_dict), **kwargs)
    if dtype is not None:
        _record_dtype(save_directory, dtype)


def _record_dtype(save_directory, dtype: torch.dtype) -> None:
    """Write the saved tensors' dtype into config.json (transformers wrote the model's parameter dtype there), so
    that from_pretrained's default loads them as saved."""
    path = os.path.join(save_directory, "config.json")
    if not os.path.exists(path):
        return
    with open(path) as f:
        config = json.load(f)
    keys = [key for key in ("dtype", "torch_dtype") if key in config] or ["dtype"]
    config.update({key: str(dtype).removeprefix("torch.") for key in keys})
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def route_save_pretrained(model: nn.Module) -> None:
    """Make `model.save_pretrained(...)` write the Hugging Face checkpoint (save_hf_pretrained) for this instance:
    the class's own would write our parameter names, which transformers cannot load.

    Args:
        model: a converted model (models without a save_pretrained are left as they are).
    """
    if hasattr(type(model), "save_pretrained"):
        model.save_pretrained = functools.partial(save_hf_pretrained, model)
