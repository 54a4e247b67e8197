"""Block-FP8 Hugging Face checkpoints (DeepSeek-V3 / Qwen3-FP8 format) loaded into converted models, bytes kept.

Such a checkpoint stores each quantized linear weight as E4M3 `<module>.weight` [out, in] with a float32
`<module>.weight_scale_inv` [cdiv(out, 128), cdiv(in, 128)] (value = weight * weight_scale_inv per 128x128 block), and
its config.json says so: `quantization_config` {"quant_method": "fp8", "activation_scheme": "dynamic",
"weight_block_size": [128, 128], "fmt": "e4m3", "modules_to_not_convert": [...]} (transformers'
FineGrainedFP8Config; the unquantized modules, e.g. lm_head and the embeddings, are stored in high precision).

`load_block_fp8_pretrained(directory)` builds the model from its config, converts it (convert_model) inside
fp8_model_init(recipe=Float8BlockScaling()), so that every GEMM weight of ours is a block-scaled Float8Tensor, and
loads the checkpoint into it: each weight + scale pair becomes a Float8Tensor (Float8Tensor.from_block_scaled: the
file's FP8 bytes, the scales padded to the block operand layout) and is copied bytes-for-bytes into ours. Fused
weights (q|k|v, gate|up: hf_mapping.py) concatenate their parts' data and block scales along dim 0, which keeps every
128x128 block whole only where each part but the last has a multiple of 128 rows: other layouts are refused, naming
the part, unless requantize=True (the fused weight is then re-quantized in 128x128 blocks from the dequantized
parts; its bytes differ from the file's). Weights of ours that the checkpoint stores in high precision
(modules_to_not_convert) are quantized at the load; checkpoint FP8 weights of modules that stay high precision
here (e.g. a quantized lm_head) are dequantized. Nothing else is dequantized: no BF16 round trip of the FP8 weights.
Refused, naming what differs: other quant methods, block sizes, activation schemes (static activation scales),
scale formats (UE8M0) and FP8 formats, and modules_to_convert (quantized embeddings).
"""
import json
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from ..autocast import fp8_model_init
from ..float8_block import BLOCK, cdiv
from ..float8_tensor import Float8Tensor
from ..recipe import Float8BlockScaling
from .hf_mapping import layer_weight_map

SCALE_SUFFIX = "_scale_inv"  # `<module>.weight` + `<module>.weight_scale_inv`
# quantization_config fields and the values we load (None: the field may be absent)
_SUPPORTED = {"quant_method": ("fp8",), "activation_scheme": ("dynamic",), "weight_block_size": ([128, 128],),
              "fmt": (None, "e4m3"), "scale_fmt": (None, "float"), "expert_dtype": (None, "fp8"),
              "modules_to_convert": (None, [])}


def check_block_fp8_config(quantization_config: Mapping[str, Any] | Any) -> None:
    """Accept only the block-FP8 quantization_config this loader reads (see the module docstring).

    Args:
        quantization_config: the config.json entry (a dict, or transformers' config object with to_dict()).
    Raises:
        ValueError: a field with another value, naming the field, what it holds and what is supported.
    """
    config = quantization_config.to_dict() if hasattr(quantization_config, "to_dict") else dict(quantization_config)
    for field, supported in _SUPPORTED.items():
        value = config.get(field)
        value = list(value) if isinstance(value, tuple) else value
        if isinstance(value, str):
            value = value.lower()
        if value not in supported:
            wanted = " or ".join("absent" if s is None else repr(s) for s in supported)
            raise ValueError(f"quantization_config.{field}: block-FP8 loading supports {wanted}, got {value!r}")


def read_safetensors(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder: model.safetensors, or the shards its model.safetensors.index.json names.

    Args:
        directory: the checkpoint folder.
    Returns:
        name -> tensor (on the CPU, as stored).
    Raises:
        FileNotFoundError: neither file in the folder.
    """
    from safetensors.torch import load_file

    single = os.path.join(directory, "model.safetensors")
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(single):
        return load_file(single)
    if not os.path.exists(index):
        raise FileNotFoundError(f"directory: no model.safetensors or model.safetensors.index.json in {directory}")
    with open(index) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    tensors = {}
    for shard in shards:
        tensors.update(load_file(os.path.join(directory, shard)))
    return tensors


def block_fp8_state_dict(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16
                         ) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> a state dict whose block-FP8 weights are Float8Tensors (bytes kept, scales padded).

    Args:
        tensors: name -> tensor as stored (`X.weight` FP8 with `X.weight_scale_inv`; other tensors as they are).
        dtype: the high-precision dtype the FP8 weights stand for (their dequantized dtype).
    Returns:
        name -> tensor: `X.weight` a Float8Tensor of layout "block_128x128" for each pair, no `*_scale_inv` entries.
    Raises:
        ValueError: an FP8 weight without its scale (or a scale without its weight), a scale of the wrong shape,
            an FP8 weight that is not E4M3 or not 2-D, or static activation scales (`*.activation_scale`).
    """
    out, scales = {}, {name for name in tensors if name.endswith(SCALE_SUFFIX)}
    for name, tensor in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            if name[:-len(SCALE_SUFFIX)] not in tensors:
                raise ValueError(f"tensors: {name!r} has no weight {name[:-len(SCALE_SUFFIX)]!r}")
            continue
        if name.endswith("activation_scale"):
            raise ValueError(f"tensors: {name!r} is a static activation scale; block-FP8 loading supports dynamic "
                             f"activation scaling only")
        if tensor.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            out[name] = tensor
            continue
        scale_name = name + SCALE_SUFFIX
        if tensor.dtype != torch.float8_e4m3fn or tensor.dim() != 2:
            raise ValueError(f"tensors[{name!r}]: expected a 2-D torch.float8_e4m3fn weight, got {tensor.dtype} of "
                             f"shape {tuple(tensor.shape)}")
        if scale_name not in scales:
            raise ValueError(f"tensors: the FP8 weight {name!r} has no {scale_name!r}")
        scale_inv, (rows, cols) = tensors[scale_name], tensor.shape
        expected = (cdiv(rows, BLOCK), cdiv(cols, BLOCK))
        if tuple(scale_inv.shape) != expected or not scale_inv.is_floating_point():
            raise ValueError(f"tensors[{scale_name!r}]: expected float block scales of shape {expected} for the "
                             f"weight's {(rows, cols)} in 128x128 blocks, got {scale_inv.dtype} "
                             f"{tuple(scale_inv.shape)}")
        out[name] = Float8Tensor.from_block_scaled(tensor, scale_inv.float(), dtype)
    return out


def check_fused_rows(model: nn.Module, state: Mapping[str, torch.Tensor]) -> list[str]:
    """The fused weights of the converted decoder layers whose block-FP8 parts cannot be concatenated with whole
    128x128 blocks (a part before the last with a row count that is not a multiple of 128).

    Args:
        model: a converted model. state: block_fp8_state_dict(...) of its checkpoint.
    Returns:
        One line per such part, naming it and its rows (empty: every fused weight keeps its bytes).
    """
    from .llama import LlamaTransformerLayer  # (llama.py imports the mapping)

    problems = []
    for prefix, layer in model.named_modules():
        if not isinstance(layer, LlamaTransformerLayer):
            continue
        for fused in layer_weight_map(layer):
            for part in fused.parts[:-1]:
                tensor = state.get(f"{prefix}.{part.hf_name}")
                rows = part.row_end - part.row_start
                if isinstance(tensor, Float8Tensor) and rows % BLOCK:
                    problems.append(f"{prefix}.{part.hf_name} ({rows} rows, fused into {prefix}.{fused.name})")
    return problems


def load_block_fp8_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], requantize: bool = False) -> None:
    """Load block_fp8_state_dict(...) into a model converted inside fp8_model_init(recipe=Float8BlockScaling()).

    Args:
        model: the converted model (its Hugging Face names load through the converted layers' fusing hook).
        state: the checkpoint's state dict under Hugging Face names.
        requantize: fused weights whose parts do not align with 128-row blocks are re-quantized instead of refused.
    Raises:
        ValueError: fused parts that do not align (requantize=False); tensors the model has no place for; model
            parameters the checkpoint lacks (tied weights and FP8 scaling state excepted).
    """
    misaligned = check_fused_rows(model, state)
    if misaligned and not requantize:
        raise ValueError("block-FP8 weights fused along rows must keep whole 128x128 blocks (every part but the "
                         "last a multiple of 128 rows); these do not: " + "; ".join(misaligned) + ". Pass "
                         "requantize=True to re-quantize the fused weights from their dequantized parts")
    tied = _tied_names(model)
    result = model.load_state_dict(dict(state), strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state") and k not in tied]
    if missing or result.unexpected_keys:
        raise ValueError(f"state: checkpoint and model differ: missing {missing}, unexpected "
                         f"{result.unexpected_keys}")


def _tied_names(model: nn.Module) -> set[str]:
    """Parameter names whose tensor an earlier name holds already (tied weights, e.g. lm_head.weight: saved once)."""
    first, tied = set(), set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied.add(name)
        first.add(id(param))
    return tied


def load_block_fp8_pretrained(directory: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                              device: torch.device | str = "cpu", requantize: bool = False,
                              model_class: Any = None, **convert_kwargs: Any) -> nn.Module:
    """A block-FP8 Hugging Face checkpoint as a converted model whose GEMM weights keep the checkpoint's FP8 bytes
    (see the module docstring). Run it under fp8_autocast(fp8_recipe=Float8BlockScaling()): the block GEMM reads
    those weights as they are. Outside fp8_autocast it computes in `dtype` with the dequantized weights.

    Args:
        directory: the checkpoint folder (config.json + safetensors).
        dtype: the high-precision dtype (embeddings, norms, activations; the FP8 weights' dequantized dtype).
        device: where the model is built and loaded.
        requantize: see load_block_fp8_state_dict.
        model_class: the transformers class to build (default: AutoModelForCausalLM).
        **convert_kwargs: passed to convert_model (e.g. fuse_wgrad_accumulation).
    Returns:
        The converted model (transformers model, in eval mode), its quantization_config dropped from the config
        (save_pretrained writes plain high-precision checkpoints).
    Raises:
        ValueError: no or an unsupported quantization_config (check_block_fp8_config), or a checkpoint that does not
            match the model (load_block_fp8_state_dict).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from .convert_model import convert_model  # (convert_model imports the converters of this package)

    config = AutoConfig.from_pretrained(directory)
    quantization_config = getattr(config, "quantization_config", None)
    if quantization_config is None:
        raise ValueError(f"directory: {directory}'s config.json has no quantization_config (not a block-FP8 "
                         f"checkpoint)")
    check_block_fp8_config(quantization_config)
    del config.quantization_config  # (else transformers would build its own FP8 layers)
    with torch.device(device):
        model = (model_class or AutoModelForCausalLM).from_config(config, dtype=dtype)
    with fp8_model_init(recipe=Float8BlockScaling()):
        convert_model(model, **convert_kwargs)
    load_block_fp8_state_dict(model, block_fp8_state_dict(read_safetensors(directory), dtype), requantize)
    return model.eval()
