"""model.save_pretrained of a model with adapters writes the adapters in PEFT's format (as PEFT's own PeftModel does).

A converted model's save_pretrained writes a plain Hugging Face checkpoint, which has no place for adapters (and
integrations.to_hf_state_dict refuses a model that has them). While a model carries adapters, its save_pretrained
(transformers' Trainer saves through it) writes adapter_config.json + adapter_model.safetensors instead; merge_lora
and remove_lora give it back its previous save_pretrained.
"""
import functools

import torch.nn as nn

_SAVED = "_lora_previous_save_pretrained"  # instance attribute: the save_pretrained to restore (None: the class's)


def _save_adapters(model: nn.Module, save_directory, state_dict=None, **kwargs) -> None:
    """save_pretrained's signature: writes save_lora(model, save_directory); the other arguments (a full state_dict,
    safe_serialization, ... from Trainer) do not apply to an adapter folder and are ignored."""
    from .peft_format import save_lora  # (here: peft_format imports model.py, which imports this module)
    save_lora(model, save_directory)


def route_save_pretrained(model: nn.Module) -> None:
    """Make model.save_pretrained write its adapters (transformers models only; once).

    Args:
        model: a model with adapters (models without a save_pretrained are left as they are).
    """
    if not hasattr(type(model), "save_pretrained") or _SAVED in model.__dict__:
        return
    model.__dict__[_SAVED] = model.__dict__.get("save_pretrained")
    model.save_pretrained = functools.partial(_save_adapters, model)


def restore_save_pretrained(model: nn.Module) -> None:
    """Give model back the save_pretrained it had before route_save_pretrained.

    Args:
        model: a model that route_save_pretrained changed (others are left as they are).
    """
    if _SAVED not in model.__dict__:
        return
    previous = model.__dict__.pop(_SAVED)
    if previous is None:
        model.__dict__.pop("save_pretrained", None)
    else:
        model.save_pretrained = previous
