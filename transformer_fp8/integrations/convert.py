"""Swap the nn.Linear layers of an existing model (e.g. a Hugging Face LlamaForCausalLM) for transformer_fp8.Linear.

Works on any nn.Module: nothing here imports transformers. The converted layers compute the same thing as before
outside `fp8_autocast`, and run their GEMMs in FP8 inside it.
"""
import contextlib
import fnmatch
import inspect
from collections.abc import Iterator, Sequence

import torch
import torch.nn as nn

from ..module.linear import Linear

FP8_ALIGNMENT = 16  # FP8 tensor-core GEMMs need in_features and out_features to be multiples of 16


def _is_excluded(name, exclude):
    """True if the module's qualified name, or its last component, matches one of the exclude patterns (fnmatch)."""
    last = name.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(name, pat) or fnmatch.fnmatchcase(last, pat) for pat in exclude)


def _is_conv1d(module):
    """transformers' Conv1D (GPT-2 style): a Linear whose weight is stored transposed, [in_features, out_features]."""
    return type(module).__name__ == "Conv1D" and isinstance(getattr(module, "weight", None), torch.Tensor) and \
        module.weight.dim() == 2


def _features(layer):
    """(in_features, out_features) of an nn.Linear or a Conv1D."""
    return tuple(layer.weight.shape) if _is_conv1d(layer) else (layer.in_features, layer.out_features)


def _fp8_compatible(layer):
    return all(n % FP8_ALIGNMENT == 0 for n in _features(layer))


def _skip_init(weight):
    """No random init: the weight is overwritten with the original layer's right after."""


def _converted(layer, params_dtype, fuse_wgrad_accumulation):
    """A transformer_fp8.Linear holding a copy of layer's weight (and bias), on its device. From a Conv1D the weight
    is transposed, and the new layer keeps Conv1D's [in, out] layout in its state dict (saved and loaded), so that
    checkpoints are the original model's either way (a square weight could not tell one layout from the other)."""
    weight = layer.weight
    in_features, out_features = _features(layer)
    new = Linear(in_features, out_features, bias=layer.bias is not None,
                 params_dtype=params_dtype or weight.dtype, device=weight.device, init_method=_skip_init,
                 fuse_wgrad_accumulation=fuse_wgrad_accumulation)
    conv1d = _is_conv1d(layer)
    if conv1d:
        new.register_state_dict_post_hook(_weight_to_conv1d_layout)
        new.register_load_state_dict_pre_hook(_weight_from_conv1d_layout)
    with torch.no_grad():
        new.weight.copy_(weight.t() if conv1d else weight)
        if layer.bias is not None:
            new.bias.copy_(layer.bias)
    new.weight.requires_grad_(weight.requires_grad)
    if layer.bias is not None:
        new.bias.requires_grad_(layer.bias.requires_grad)
    new.train(layer.training)
    return new


def _weight_to_conv1d_layout(module, state_dict, prefix, local_metadata):
    """State-dict post-hook of a Linear converted from a Conv1D: its weight as Conv1D's [in, out]."""
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = state_dict[key].t()


def _weight_from_conv1d_layout(module, state_dict, prefix, *args):
    """Load-state-dict pre-hook of a Linear converted from a Conv1D: the [in, out] weight back to ours."""
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = state_dict[key].t()


def convert_linear_layers(model: nn.Module, exclude: str | Sequence[str] = ("lm_head",),
                          params_dtype: torch.dtype | None = None, fuse_wgrad_accumulation: bool = False) -> nn.Module:
    """Replace every nn.Linear inside `model` (recursively), and every transformers Conv1D (GPT-2's Linear with a
    transposed [in, out] weight), by a transformer_fp8.Linear with the same weights; in place.
    Layers whose in_features or out_features is not a multiple of 16 stay nn.Linear: the FP8 tensor cores cannot
    take them. Weight tying between a converted layer and another module is not kept (exclude tied layers).

    Args:
        model: the module to convert.
        exclude: fnmatch patterns matched against each layer's qualified name (e.g. "model.layers.0.mlp.up_proj") and
            against its last component, so "lm_head" or "*.mlp.*" both work. Matching layers stay nn.Linear. The
            default keeps the output head (often tied to the embedding, and its GEMM is the most
            precision-sensitive) in BF16.
        params_dtype: dtype of the new parameters (default: each layer's own weight dtype).
        fuse_wgrad_accumulation: passed to each new Linear (its weight gradient then accumulates into
            weight.main_grad).

    Returns:
        `model`, converted in place.
    """
    exclude = (exclude,) if isinstance(exclude, str) else tuple(exclude)
    targets = [(name, m) for name, m in model.named_modules()
               if (type(m) is nn.Linear or _is_conv1d(m)) and not _is_excluded(name, exclude) and _fp8_compatible(m)]
    for name, layer in targets:
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child_name, _converted(layer, params_dtype, fuse_wgrad_accumulation))
    return model


def _takes_microbatch_flag(module):
    """True for transformer_fp8 modules (Linear, LayerNormLinear, ...) whose forward has an is_first_microbatch arg."""
    return (type(module).__module__.startswith("transformer_fp8.")
            and "is_first_microbatch" in inspect.signature(module.forward).parameters)


@contextlib.contextmanager
def microbatch(model: nn.Module, is_first: bool) -> Iterator[nn.Module]:
    """Inside the block, every transformer_fp8 module of `model` whose forward takes `is_first_microbatch` gets it.

    For gradient accumulation through code that calls the layers without that argument (e.g. a Hugging Face model):
    is_first=True on the first micro-batch of a step casts each weight to FP8 and caches it, False on the others
    reuses the cache. An explicit is_first_microbatch= argument at the call site wins.

    Args:
        model: the module whose transformer_fp8 modules get the flag.
        is_first: whether this is the first micro-batch of the step.

    Returns:
        A context manager that yields `model`.
    """
    def pass_flag(module, args, kwargs):
        kwargs.setdefault("is_first_microbatch", is_first)
        return args, kwargs

    handles = [m.register_forward_pre_hook(pass_flag, with_kwargs=True)
               for m in model.modules() if _takes_microbatch_flag(m)]
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()
