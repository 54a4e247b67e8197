"""add_lora, merge_lora, remove_lora, cast_frozen_weights_to_fp8: LoRA on a converted model, by Hugging Face names."""
import math
from collections.abc import Sequence

import torch
import torch.nn as nn

from ..float8_tensor import Float8Tensor
from ..module.grouped_linear import GroupedLinear
from ..module.linear import Linear
from ..recipe import FP8_MAX
from .adapter import LoraAdapter
from .layers import attach_adapter, detach_adapters, is_lora_module
from .save_route import restore_save_pretrained, route_save_pretrained
from .targets import GEMM_WEIGHTS, is_fp8_gemm_module, select_projections

DEFAULT_TARGETS = ("q_proj", "v_proj")  # PEFT's default for Llama-like models


def _check_args(r, alpha, dropout, use_rslora, dtype):
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise ValueError(f"r: expected a positive int (the adapters' rank), got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"alpha: expected a finite number > 0 (the update is scaled by alpha / r), got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"dropout: expected a probability in [0, 1), got {dropout!r}")
    if not isinstance(use_rslora, bool):
        raise TypeError(f"use_rslora: expected a bool, got {use_rslora!r}")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype in FP8_MAX):
        raise TypeError(f"dtype: expected None or a high-precision floating dtype for the adapters, got {dtype!r}")


def lora_adapters(model: nn.Module) -> dict[str, LoraAdapter]:
    """The LoRA adapters of `model` by the qualified name of the Hugging Face module each adapts.

    Args:
        model: a model with adapters (add_lora), or without (an empty dict).
    Returns:
        {hf_name: adapter}, in module order.
    """
    return {a.hf_name: a for m in model.modules() if is_lora_module(m) for a in m.lora.values()}


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapters' parameters (lora_A and lora_B weights): what the optimizer trains.

    Args:
        model: a model with adapters.
    Returns:
        The parameters, in module order.
    """
    return [p for a in lora_adapters(model).values() for p in a.parameters()]


def add_lora(model: nn.Module, r: int = 16, alpha: float = 32, dropout: float = 0.0,
             target_modules: str | Sequence[str] = DEFAULT_TARGETS, use_rslora: bool = False, fp8_weights: bool = False,
             freeze_base: bool = True, dtype: torch.dtype | None = None,
             cache_weight_transpose: bool = False) -> nn.Module:
    """Add LoRA adapters to the projections of a converted model named as in Hugging Face (PEFT's LoraConfig).

    Each adapted projection gets A [r, in] (Kaiming-uniform) and B [out, r] (zeros), and its output gains
    alpha / r * B A dropout(x) (see adapter.py); on a fused GEMM (q|k|v, gate|up) only its own rows do.

    Args:
        model: converted by transformer_fp8.integrations.convert_llama / convert_model (decoder layers) and/or
            convert_linear_layers (transformer_fp8.Linear layers).
        r: the adapters' rank (> 0).
        alpha: the scaling numerator (> 0): updates are scaled by alpha / r.
        dropout: dropout probability on the adapters' input in training, in [0, 1).
        target_modules: Hugging Face module names such as ("q_proj", "v_proj", "gate_proj"), each matching the
            modules whose qualified name equals it or ends with "." + it; or a regular expression string the whole
            qualified name must match; or "all-linear" (every projection but lm_head). Each name must match.
        use_rslora: scale by alpha / sqrt(r) (rank-stabilised LoRA) instead of alpha / r.
        fp8_weights: store the frozen GEMM weights as FP8 Float8Tensors (half the memory of BF16; see
            cast_frozen_weights_to_fp8). Needs freeze_base.
        freeze_base: set requires_grad False on every parameter of the model but the adapters (PEFT does too).
        dtype: the adapters' dtype (default: each adapted module's params_dtype).
        cache_weight_transpose: with fp8_weights, keep each frozen FP8 weight's transpose (made by the first backward
            that needs it) for the dgrad GEMMs of the later steps: one more byte per frozen GEMM parameter (the FP8
            base then takes what a BF16 one takes) for no weight transpose per step. Default False: minimal memory,
            one FP8 transpose per frozen weight per backward. See cast_frozen_weights_to_fp8.
    Returns:
        `model`, changed in place. Its save_pretrained (a transformers model's) now writes the adapters in PEFT's
        format, as PeftModel.save_pretrained does (see save_route.py), until merge_lora or remove_lora.
    Raises:
        ValueError / TypeError: a bad argument (named), a target that matches nothing, or a projection that has an
            adapter already.
        NotImplementedError: a projection inside a tensor-parallel module.
    """
    _check_args(r, alpha, dropout, use_rslora, dtype)
    if not isinstance(fp8_weights, bool) or not isinstance(freeze_base, bool):
        raise TypeError(f"fp8_weights, freeze_base: expected bools, got {fp8_weights!r}, {freeze_base!r}")
    if fp8_weights and not freeze_base:
        raise ValueError("fp8_weights=True needs freeze_base=True (FP8 weights are for frozen base weights)")
    _check_cache_weight_transpose(cache_weight_transpose)
    if cache_weight_transpose and not fp8_weights:
        raise ValueError("cache_weight_transpose=True needs fp8_weights=True (it keeps the transposes of FP8 base "
                         "weights; high-precision ones are cast, with their transpose, in every step)")
    projections = select_projections(model, target_modules)
    existing = lora_adapters(model)
    taken = [p.hf_name for p in projections if p.hf_name in existing]
    if taken:
        raise ValueError(f"target_modules: {taken[:3]}{' ...' if len(taken) > 3 else ''} already have LoRA adapters "
                         f"(merge_lora or remove_lora first)")
    for p in projections:
        module = model.get_submodule(p.module_name)
        weight = getattr(module, p.gemm)
        adapter = LoraAdapter(weight.shape[1], p.row_end - p.row_start, r, alpha, float(dropout), use_rslora,
                              p.row_start, p.gemm, p.hf_name, dtype or module.params_dtype, weight.device)
        adapter.train(module.training)  # (its dropout follows the model's mode)
        attach_adapter(module, adapter, p.module_name)
    if freeze_base:
        adapter_params = {id(p) for p in lora_parameters(model)}
        for param in model.parameters():
            if id(param) not in adapter_params:
                param.requires_grad_(False)
    if fp8_weights:
        cast_frozen_weights_to_fp8(model, cache_weight_transpose=cache_weight_transpose)
    route_save_pretrained(model)
    return model


def _refresh_fp8_flags(module: nn.Module) -> None:
    """After a module's GEMM weights changed kind (FP8 <-> high precision): the flags its forward reads."""
    module._fp8_params = any(isinstance(getattr(module, g), Float8Tensor) for g in _gemm_weight_names(module))
    if isinstance(module, Linear):  # (Linear's one-call paths take high-precision weights only)
        module._plain = module.tp is None and not module.return_bias and not module.fuse_wgrad_accumulation and \
            not module._fp8_params
    module._weight_cache.clear()
    module.__dict__.pop("_lora_views", None)  # (a LoRA MLP's unfused views would hold the replaced weights)


def _base_type(module):
    return next(cls for cls in GEMM_WEIGHTS if isinstance(module, cls))


def _holds_gemm_weights(module: nn.Module) -> bool:
    """Our GEMM modules whose frozen weights cast_frozen_weights_to_fp8 casts: Linear, LayerNormLinear,
    LayerNormMLP and GroupedLinear (MoE experts)."""
    return is_fp8_gemm_module(module) or isinstance(module, GroupedLinear)


def _gemm_weight_names(module: nn.Module) -> tuple[str, ...]:
    """The names of a _holds_gemm_weights module's GEMM weights."""
    if isinstance(module, GroupedLinear):
        return tuple(f"weight{i}" for i in range(module.num_gemms))
    return GEMM_WEIGHTS[_base_type(module)]


def _check_cache_weight_transpose(value):
    if not isinstance(value, bool):
        raise TypeError(f"cache_weight_transpose: expected a bool, got {value!r}")


def _frozen_fp8_weights(model: nn.Module) -> list[Float8Tensor]:
    """The frozen FP8 GEMM weights of our modules in `model`."""
    return [w for m in model.modules() if _holds_gemm_weights(m) for w in
            (getattr(m, name) for name in _gemm_weight_names(m))
            if isinstance(w, Float8Tensor) and not w.requires_grad]


def _drop_weight_transposes(model: nn.Module) -> None:
    """Stop keeping (and free) the FP8 weight transposes that cache_weight_transpose kept."""
    for weight in _frozen_fp8_weights(model):
        weight.keep_transpose_(False)


@torch.no_grad()
def cast_frozen_weights_to_fp8(model: nn.Module, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                               cache_weight_transpose: bool = False) -> int:
    """Store every frozen GEMM weight of our modules (requires_grad False) as an FP8 Float8Tensor, in place.

    Each weight is quantized with one scale from its own amax (Float8Tensor.from_hp): one byte an element instead
    of two, and no cast of it in any step (inside fp8_autocast the GEMMs read the FP8 bytes). The backward's dgrad
    GEMM needs Wᵀ (Hopper's FP8 GEMMs take K-major operands only): by default each backward makes it with one byte
    transpose per weight (fp8_transpose), freed after use; cache_weight_transpose=True keeps the first one on the
    weight (Float8Tensor.keep_transpose_) for every later step, made again only if the weight is written in place.
    The trade-off: one more byte per frozen parameter (FP8 weight + its transpose take what the BF16 weight took)
    against one read and one write of each weight per step. merge_lora and remove_lora free the kept transposes.
    Outside fp8_autocast the modules compute with the dequantized weight. A GroupedLinear (MoE experts) is cast when
    all its weights are frozen, each expert's weight with its own scale (the grouped GEMMs take one scale per
    expert); one with some weights frozen and others not is refused (its GEMMs take all FP8 weights or none).

    Args:
        model: any model holding transformer_fp8 Linear / LayerNormLinear / LayerNormMLP / GroupedLinear modules.
        fp8_dtype: torch.float8_e4m3fn (default) or torch.float8_e5m2.
        cache_weight_transpose: keep the transposes of every frozen FP8 GEMM weight (those cast now and those that
            were FP8 already); False leaves each weight as it is (weights cast now keep none).
    Returns:
        The number of weights cast.
    Raises:
        TypeError: a bad fp8_dtype or cache_weight_transpose.
        ValueError: a GroupedLinear with frozen and trainable weights.
    """
    if fp8_dtype not in FP8_MAX:
        raise TypeError(f"fp8_dtype: expected torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}")
    _check_cache_weight_transpose(cache_weight_transpose)
    count = 0
    for module_name, module in model.named_modules():
        if not _holds_gemm_weights(module):
            continue
        if isinstance(module, GroupedLinear) and len({w.requires_grad for w in module.weights}) > 1:
            raise ValueError(f"model: GroupedLinear {module_name!r} has frozen and trainable expert weights; its "
                             f"grouped GEMMs take all FP8 weights or none: freeze all of them or none")
        changed = False
        for name in _gemm_weight_names(module):
            weight = getattr(module, name)
            if isinstance(weight, Float8Tensor) or weight.requires_grad:
                continue
            setattr(module, name, nn.Parameter(Float8Tensor.from_hp(weight.detach().contiguous(), fp8_dtype),
                                               requires_grad=False))
            changed, count = True, count + 1
        if changed:
            _refresh_fp8_flags(module)
    if cache_weight_transpose:
        for weight in _frozen_fp8_weights(model):
            weight.keep_transpose_(True)
    return count


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (W[rows] += scale * B A) and remove the adapters, in place.

    An FP8 (Float8Tensor) base weight is dequantized and the merged weight kept in high precision (its fake dtype,
    the module's params_dtype): merging into FP8 would round the update away. The model then computes what it
    computed with the adapters (up to rounding), and its state dict is the converted model's (for export, e.g. the
    Hugging Face checkpoint writer of transformer_fp8.integrations).

    Args:
        model: a model with adapters (add_lora).
    Returns:
        `model`.
    Raises:
        ValueError: the model has no adapters.
    """
    modules = [m for m in model.modules() if is_lora_module(m)]
    if not modules:
        raise ValueError("model: has no LoRA adapters to merge (add_lora or load_lora first)")
    for module in modules:
        for adapter in module.lora.values():
            weight = getattr(module, adapter.gemm)
            if isinstance(weight, Float8Tensor):
                merged = weight.dequantize(torch.float32)
                merged[adapter.row_start:adapter.row_end] += adapter.delta_weight().to(merged.device)
                setattr(module, adapter.gemm, nn.Parameter(merged.to(weight.dtype), requires_grad=False))
            else:
                rows = weight[adapter.row_start:adapter.row_end]
                rows.copy_((rows.float() + adapter.delta_weight().to(rows.device)).to(weight.dtype))
        detach_adapters(module)
        _refresh_fp8_flags(module)
    _drop_weight_transposes(model)
    restore_save_pretrained(model)
    return model


def remove_lora(model: nn.Module) -> nn.Module:
    """Remove every adapter without merging (the base model again), in place; FP8 base weights stay FP8, without
    the transposes cache_weight_transpose kept.

    Args:
        model: a model with or without adapters.
    Returns:
        `model`.
    """
    for module in [m for m in model.modules() if is_lora_module(m)]:
        detach_adapters(module)
    _drop_weight_transposes(model)
    restore_save_pretrained(model)
    return model
