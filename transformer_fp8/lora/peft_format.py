"""LoRA adapters in PEFT's format: adapter_config.json + adapter_model.safetensors under Hugging Face module names.

save_lora writes what `peft.PeftModel.from_pretrained(hf_model, folder)` loads onto the original (unconverted)
Hugging Face model: tensors `base_model.model.<hf module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r], and a
LoraConfig (peft_type LORA, r, lora_alpha, lora_dropout, target_modules, use_rslora). load_lora reads such a folder
(ours or PEFT's own) into a converted model. PEFT options that change the adapter's math (DoRA, LoRA biases, per-module
ranks or alphas, modules_to_save, ...) are refused by name.
"""
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .model import add_lora, lora_adapters
from .targets import find_projections

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."  # PEFT's: the PeftModel's LoraModel, then the Hugging Face model
# PEFT config fields whose non-default values we cannot honour: (field, default(s) we take)
_UNSUPPORTED = {"use_dora": (False, None), "bias": ("none", None), "lora_bias": (False, None),
                "modules_to_save": (None, []), "rank_pattern": ({}, None), "alpha_pattern": ({}, None),
                "layers_to_transform": (None,), "layers_pattern": (None, []), "fan_in_fan_out": (False, None),
                "target_parameters": (None, []), "layer_replication": (None,), "use_qalora": (False, None),
                "trainable_token_indices": (None,)}


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors under PEFT's names (`base_model.model.<hf module>.lora_A.weight`, ...), detached.

    Args:
        model: a model with adapters (add_lora / load_lora).
    Returns:
        {name: tensor} in module order.
    """
    out = {}
    for hf_name, adapter in lora_adapters(model).items():
        out[f"{KEY_PREFIX}{hf_name}.lora_A.weight"] = adapter.lora_A.weight.detach()
        out[f"{KEY_PREFIX}{hf_name}.lora_B.weight"] = adapter.lora_B.weight.detach()
    return out


def _saved_targets(model: nn.Module, adapters: dict) -> list[str]:
    """target_modules for the config: the short names (q_proj, ...) when the adapters cover every projection of
    those names, else the full qualified names (PEFT matches a name that equals the module's)."""
    names = sorted({name.rsplit(".", 1)[-1] for name in adapters})
    covered = {p.hf_name for p in find_projections(model) if p.target in names}
    return names if covered == set(adapters) else sorted(adapters)


def save_lora(model: nn.Module, directory: str | os.PathLike, base_model_name_or_path: str | None = None) -> Path:
    """Write the model's adapters in PEFT's format (see the module docstring) into `directory` (created).

    Args:
        model: a model with adapters, all of one rank, alpha, dropout and scaling rule (one add_lora call's).
        directory: the folder to write adapter_config.json and adapter_model.safetensors into.
        base_model_name_or_path: recorded in the config (default: model.config._name_or_path, if any).
    Returns:
        The folder's Path.
    Raises:
        ValueError: no adapters, or adapters of different settings (PEFT's rank_pattern is not written).
    """
    from safetensors.torch import save_file

    adapters = lora_adapters(model)
    if not adapters:
        raise ValueError("model: has no LoRA adapters to save (add_lora or load_lora first)")
    settings = {(a.r, a.alpha, a.dropout, a.use_rslora) for a in adapters.values()}
    if len(settings) != 1:
        raise ValueError(f"model: its adapters differ in (r, alpha, dropout, use_rslora): {sorted(settings)}; "
                         f"save_lora writes one LoraConfig for all")
    (r, alpha, dropout, use_rslora), = settings
    if base_model_name_or_path is None:
        base_model_name_or_path = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM" if type(model).__name__.endswith("ForCausalLM") else None,
              "base_model_name_or_path": base_model_name_or_path, "r": r, "lora_alpha": alpha,
              "lora_dropout": dropout, "target_modules": _saved_targets(model, adapters), "use_rslora": use_rslora,
              "bias": "none", "use_dora": False, "fan_in_fan_out": False, "init_lora_weights": True,
              "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
              "alpha_pattern": {}, "inference_mode": True}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    tensors = {name: t.contiguous().cpu() for name, t in lora_state_dict(model).items()}
    save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
    return directory


def read_lora_config(directory: str | os.PathLike) -> dict[str, Any]:
    """The adapter_config.json of a PEFT LoRA folder, checked: a LORA config whose options we support.

    Args:
        directory: the folder.
    Returns:
        The config as a dict.
    Raises:
        FileNotFoundError: no adapter_config.json. ValueError: not LoRA, or an unsupported option (named).
    """
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"directory: no {CONFIG_NAME} in {directory} (expected a PEFT LoRA adapter folder)")
    config = json.loads(path.read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r}, expected 'LORA'")
    for field, accepted in _UNSUPPORTED.items():
        if field in config and config[field] not in accepted:
            raise ValueError(f"{path}: {field}={config[field]!r} is not supported by transformer_fp8.lora "
                             f"(supported: {accepted[0]!r})")
    return config


def load_lora(model: nn.Module, directory: str | os.PathLike, fp8_weights: bool = False,
              cache_weight_transpose: bool = False) -> nn.Module:
    """Load a PEFT LoRA folder (save_lora's, or PEFT's save_pretrained) into a converted model, in place.

    Without adapters the model first gets them, as the config says (add_lora with its r, lora_alpha, lora_dropout,
    target_modules, use_rslora; fp8_weights as given); with adapters they must be those of the folder.

    Args:
        model: a converted model (see add_lora), with or without adapters.
        directory: the folder with adapter_config.json and adapter_model.safetensors.
        fp8_weights: when adding the adapters, store the frozen base weights in FP8 (see add_lora).
        cache_weight_transpose: when adding the adapters, keep the FP8 base weights' transposes (see add_lora).
    Returns:
        `model`.
    Raises:
        FileNotFoundError: a file missing. ValueError: an unsupported config, or tensors that do not fit the
            adapters (missing, unexpected or of another shape: named).
    """
    from safetensors.torch import load_file

    config = read_lora_config(directory)
    weights = Path(directory) / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"directory: no {WEIGHTS_NAME} in {directory}")
    if not lora_adapters(model):
        add_lora(model, r=config["r"], alpha=config.get("lora_alpha", 8), dropout=config.get("lora_dropout", 0.0),
                 target_modules=config["target_modules"], use_rslora=config.get("use_rslora", False),
                 fp8_weights=fp8_weights, cache_weight_transpose=cache_weight_transpose)
    params = {name[len(KEY_PREFIX):]: t for name, t in lora_state_dict(model).items()}
    saved = {}
    for name, tensor in load_file(str(weights)).items():
        short = name[len(KEY_PREFIX):] if name.startswith(KEY_PREFIX) else name
        saved[short.replace(".default.weight", ".weight")] = tensor  # (PEFT's in-memory names carry the adapter name)
    missing, unexpected = sorted(params.keys() - saved.keys()), sorted(saved.keys() - params.keys())
    if missing or unexpected:
        raise ValueError(f"{weights}: does not fit the model's adapters: missing {missing[:4]}, unexpected "
                         f"{unexpected[:4]} ({len(missing)} missing, {len(unexpected)} unexpected)")
    with torch.no_grad():
        for name, param in params.items():
            if saved[name].shape != param.shape:
                raise ValueError(f"{weights}: {name} has shape {tuple(saved[name].shape)}, the model's adapter "
                                 f"{tuple(param.shape)}")
            param.copy_(saved[name])
    return model
