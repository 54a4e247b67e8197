"""Which Hugging Face projections of a model can carry a LoRA adapter, and where each one's output lies in ours.

A projection named by Hugging Face (`model.layers.0.self_attn.k_proj`) is, in a converted model, a block of output
rows of one of our GEMMs: k_proj is rows [q, q + kv) of `layer.self_attention.layernorm_qkv.weight`, gate_proj the
first half of `layer.layernorm_mlp.fc1_weight`, and so on. Converted decoder layers (convert_llama / convert_model)
take this from the weight map of integrations/hf_mapping.py; a transformer_fp8.Linear made by convert_linear_layers
is its Hugging Face module, under the same name, all rows.
Target names follow PEFT's LoraConfig.target_modules: a list of names, each matching a module whose qualified name
equals it or ends with "." + it; a string is a regular expression the whole qualified name must match;
"all-linear" is every projection but the output layer.
MoE experts (GroupedLinear: Hugging Face's stacked `experts.gate_up_proj` / `experts.down_proj`, or per-expert
modules) take no adapter: a target list or expression that names an expert weight is refused (ValueError);
"all-linear" leaves them out with a warning that names them.
"""
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch.nn as nn

from ..integrations.hf_mapping import LayerShape, layer_weight_map
from ..module.base import FP8ModuleBase
from ..module.grouped_linear import GroupedLinear
from ..module.layernorm_linear import LayerNormLinear
from ..module.layernorm_mlp import LayerNormMLP
from ..module.linear import Linear
from ..module.transformer import TransformerLayer

GEMM_WEIGHTS = {Linear: ("weight",), LayerNormLinear: ("weight",), LayerNormMLP: ("fc1_weight", "fc2_weight")}
ALL_LINEAR = "all-linear"  # PEFT's name for every linear layer but the output layer
OUTPUT_LAYER_NAMES = ("lm_head",)


@dataclass(frozen=True)
class Projection:
    """One Hugging Face projection inside our model.

    Attributes:
        hf_name: the Hugging Face module's qualified name, e.g. "model.layers.0.self_attn.q_proj".
        module_name: qualified name of our module that computes it, e.g.
            "model.layers.0.layer.self_attention.layernorm_qkv".
        gemm: the name of that module's GEMM weight: "weight", "fc1_weight" or "fc2_weight".
        row_start: first output row (feature) of the GEMM that is this projection's output.
        row_end: one past its last.
    """

    hf_name: str
    module_name: str
    gemm: str
    row_start: int
    row_end: int

    @property
    def target(self) -> str:
        """Returns:
            The last component of hf_name (e.g. "q_proj"): the key of its adapter."""
        return self.hf_name.rsplit(".", 1)[-1]


def _is_converted_layer(module: nn.Module) -> bool:
    """A decoder layer made by convert_llama / convert_model: a LayerShape `shape` and a TransformerLayer `layer`."""
    return isinstance(getattr(module, "shape", None), LayerShape) and \
        isinstance(getattr(module, "layer", None), TransformerLayer)


def _layer_projections(layer_name: str, layer: nn.Module, experts: list[str] | None = None) -> list[Projection]:
    """The projections of one converted decoder layer at `layer_name`, from its weight map (GEMM weights only).
    experts: a list the Hugging Face names of the layer's MoE expert weights (GroupedLinear, no adapters) are
    appended to, in order, once each."""
    prefix = layer_name + "." if layer_name else ""
    out = []
    for fused in layer_weight_map(layer):
        module_path, _, param = fused.name.rpartition(".")
        module = layer.get_submodule(module_path)
        if isinstance(module, GroupedLinear):
            if experts is not None:
                names = (prefix + part.hf_name.removesuffix(".weight") for part in fused.parts)
                experts += [name for name in names if name not in experts]
            continue
        if param not in GEMM_WEIGHTS.get(_fp8_base_class(module), ()):
            continue  # (norm weights, biases, q/k norms)
        for part in fused.parts:
            hf_module = part.hf_name.rpartition(".")[0]
            out.append(Projection(prefix + hf_module, prefix + module_path, param, part.row_start, part.row_end))
    return out


def _fp8_base_class(module: nn.Module):
    """The one of Linear, LayerNormLinear, LayerNormMLP that module is an instance of (LoRA subclasses too)."""
    return next((cls for cls in GEMM_WEIGHTS if isinstance(module, cls)), None)


def find_projections(model: nn.Module) -> list[Projection]:
    """Every projection of `model` that add_lora can adapt, in module order.

    Args:
        model: a model converted by convert_llama / convert_model (decoder layers) and/or convert_linear_layers
            (transformer_fp8.Linear layers under their Hugging Face names).
    Returns:
        The projections: those of every converted decoder layer, then (in module order) every transformer_fp8.Linear
        outside converted layers. MoE expert weights are not among them (see find_expert_weights).
    """
    return _projections_and_experts(model)[0]


def find_expert_weights(model: nn.Module) -> list[str]:
    """The Hugging Face names of the MoE expert weights of `model`'s converted decoder layers: weights of our
    GroupedLinear experts, which take no LoRA adapter (e.g. "model.layers.0.mlp.experts.gate_up_proj").

    Args:
        model: a converted model (see find_projections).
    Returns:
        The names, in module order (empty for a dense model).
    """
    return _projections_and_experts(model)[1]


def _projections_and_experts(model: nn.Module) -> tuple[list[Projection], list[str]]:
    out, experts, inside = [], [], []
    for name, module in model.named_modules():
        if any(name.startswith(p) for p in inside):
            continue
        if _is_converted_layer(module):
            out += _layer_projections(name, module, experts)
            inside.append(name + ".")
        elif isinstance(module, Linear):
            out.append(Projection(name, name, "weight", 0, module.weight.shape[0]))
    return out, experts


def _check_no_expert_targets(experts: list[str], target_modules: str | tuple[str, ...]) -> None:
    """Refuse target_modules that name an MoE expert weight (GroupedLinear: no adapters); "all-linear" warns that
    it leaves them out."""
    hit = [name for name in experts if _matches(name, target_modules)]
    if not hit:
        return
    listed = f"{hit[:4]}{f' and {len(hit) - 4} more' if len(hit) > 4 else ''}"
    if target_modules == ALL_LINEAR:
        warnings.warn(f"add_lora(target_modules='all-linear'): the MoE expert weights {listed} get no adapters "
                      f"(LoRA on GroupedLinear experts is not supported); the attention, dense MLP and shared "
                      f"expert projections do", UserWarning, stacklevel=3)
        return
    raise ValueError(f"target_modules: {target_modules!r} names the MoE expert weights {listed}; LoRA on "
                     f"GroupedLinear experts is not supported: leave them out (e.g. target the attention "
                     f"projections, the shared expert's or dense layers' MLP by a full-name expression)")


def _matches(hf_name: str, target_modules) -> bool:
    if isinstance(target_modules, str):
        if target_modules == ALL_LINEAR:
            return hf_name.rsplit(".", 1)[-1] not in OUTPUT_LAYER_NAMES
        return re.fullmatch(target_modules, hf_name) is not None
    return any(hf_name == t or hf_name.endswith("." + t) for t in target_modules)


def check_target_modules(target_modules: str | Iterable[str]) -> str | tuple[str, ...]:
    """target_modules as add_lora keeps it: a regular expression / "all-linear" string, or a tuple of names.

    Args:
        target_modules: module names, a regular expression string, or "all-linear" (see add_lora).
    Returns:
        The string as given, or the names as a tuple.
    Raises:
        TypeError / ValueError: not a string or an iterable of non-empty strings; an empty list; a bad regex.
    """
    if isinstance(target_modules, str):
        if target_modules != ALL_LINEAR:
            try:
                re.compile(target_modules)
            except re.error as error:
                raise ValueError(f"target_modules: {target_modules!r} is not a valid regular expression "
                                 f"({error})") from None
        return target_modules
    if not isinstance(target_modules, Iterable):
        raise TypeError(f"target_modules: expected a list of module names (e.g. ['q_proj', 'v_proj']) or a regular "
                        f"expression string, got {type(target_modules).__name__}")
    names = tuple(target_modules)
    if not names or not all(isinstance(t, str) and t for t in names):
        raise ValueError(f"target_modules: expected a non-empty list of non-empty module names, got {names!r}")
    return names


def select_projections(model: nn.Module, target_modules: str | Iterable[str]) -> list[Projection]:
    """The projections of `model` that target_modules names (PEFT's matching rules, see the module docstring).

    Args:
        model: a converted model (see find_projections).
        target_modules: as check_target_modules takes it.
    Returns:
        The matching projections (at least one).
    Raises:
        ValueError: a target name that matches no projection (each such name is listed with the ones available), or
            target_modules that name an MoE expert weight (GroupedLinear; "all-linear" warns instead, see
            find_expert_weights).
    """
    target_modules = check_target_modules(target_modules)
    projections, experts = _projections_and_experts(model)
    _check_no_expert_targets(experts, target_modules)
    available = sorted({p.target for p in projections})
    if not projections:
        raise ValueError(f"model: {type(model).__name__} has no converted decoder layer nor transformer_fp8.Linear; "
                         f"convert it first (transformer_fp8.integrations.convert_llama or convert_linear_layers)")
    if isinstance(target_modules, str):
        chosen = [p for p in projections if _matches(p.hf_name, target_modules)]
        if not chosen:
            raise ValueError(f"target_modules: the expression {target_modules!r} matches no projection of the model "
                             f"(projections: {available}, e.g. {projections[0].hf_name!r})")
        return chosen
    unmatched = [t for t in target_modules if not any(_matches(p.hf_name, (t,)) for p in projections)]
    if unmatched:
        raise ValueError(f"target_modules: {unmatched} match no projection that add_lora can adapt; available: "
                         f"{available} (layers left as torch.nn.Linear, such as lm_head, cannot carry adapters)")
    return [p for p in projections if _matches(p.hf_name, target_modules)]


def is_fp8_gemm_module(module: nn.Module) -> bool:
    """Whether module is one of our GEMM modules (Linear, LayerNormLinear, LayerNormMLP).

    Args:
        module: any module.
    Returns:
        True for Linear, LayerNormLinear and LayerNormMLP (their LoRA subclasses included).
    """
    return isinstance(module, FP8ModuleBase) and _fp8_base_class(module) is not None
