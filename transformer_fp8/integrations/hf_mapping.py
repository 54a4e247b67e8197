"""Which Hugging Face weights of a decoder layer make up which parameter of our converted layer, both ways.

A converted decoder layer (LlamaTransformerLayer, in llama.py, for every family) holds a TransformerLayer as `layer`;
some of its parameters are the row blocks of several Hugging Face weights stacked in order (Llama names, relative
to the layer):

    ours (relative to the converted layer)            Hugging Face parts (relative to the HF decoder layer), rows
    layer.self_attention.layernorm_qkv.layer_norm_weight  input_layernorm.weight
    layer.self_attention.layernorm_qkv.weight         self_attn.q_proj.weight | k_proj.weight | v_proj.weight
    layer.self_attention.layernorm_qkv.bias           self_attn.q_proj.bias | k_proj.bias | v_proj.bias  (if biased)
    layer.self_attention.q_norm.weight, k_norm.weight self_attn.q_norm.weight, self_attn.k_norm.weight  (Qwen3)
    layer.self_attention.proj.weight (and .bias)      self_attn.o_proj.weight (and .bias)
    layer.layernorm_mlp.layer_norm_weight             post_attention_layernorm.weight
    layer.layernorm_mlp.fc1_weight                    mlp.gate_proj.weight | mlp.up_proj.weight  (our SwiGLU's order)
    layer.layernorm_mlp.fc2_weight                    mlp.down_proj.weight

A converted layer and the Hugging Face layer it replaced sit under the same module path, so a model-level name is
`<layer path>.` + either side's name. `layer_weight_map(config)` gives this table for one config;
`fuse_hf_weights` and `split_fused_weights` apply it to state dicts. The loader (LlamaTransformerLayer.load_hf_layer),
the exporter (hf_export.py) and the LoRA adapters (rows of q_proj inside the QKV weight, ...) all read it.
A mixture-of-experts layer (Mixtral, Qwen2/3-MoE: LayerShape.moe set) maps its MLP rows by moe_mapping.MoEShape
instead; there a part may be one expert's slice of a Hugging Face tensor that stacks all the experts
(WeightPart.index), possibly transposed.
"""
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .families import FAMILIES, Family, has_attention_bias

OUR_LAYER_PREFIX = "layer."  # the TransformerLayer inside a converted decoder layer


@dataclass(frozen=True)
class WeightPart:
    """One Hugging Face tensor inside one of our parameters: rows [row_start, row_end) of ours are `hf_name`
    (or `hf_name[index]`, transposed when `transposed`).

    Attributes:
        hf_name: name relative to the Hugging Face decoder layer, e.g. "self_attn.k_proj.weight".
        row_start: first row (dim 0 index) of our parameter that holds it.
        row_end: one past its last row.
        index: None: the whole tensor; i: its slice [i] along dim 0 (one expert of a [experts, ...] tensor).
        transposed: the (sliced) tensor is stored transposed relative to ours.
    """

    hf_name: str
    row_start: int
    row_end: int
    index: int | None = None
    transposed: bool = False

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """Args:
            tensor: the Hugging Face tensor `hf_name`.
        Returns:
            The block of it that fills rows [row_start, row_end) of ours (a view).
        """
        tensor = tensor if self.index is None else tensor[self.index]
        return tensor.t() if self.transposed else tensor


@dataclass(frozen=True)
class FusedWeight:
    """One parameter of our converted layer and the Hugging Face tensors that make it, in row order.

    Attributes:
        name: our parameter's name relative to the converted decoder layer, e.g.
            "layer.self_attention.layernorm_qkv.weight".
        parts: the Hugging Face parts in row order; together they cover all of its rows.
    """

    name: str
    parts: tuple[WeightPart, ...]

    @property
    def rows(self) -> int:
        """Returns:
            Rows of our parameter (the sum of the parts' rows)."""
        return self.parts[-1].row_end


@dataclass(frozen=True)
class LayerShape:
    """The sizes and options of one Llama-like decoder layer that the mapping depends on.

    Attributes:
        hidden: hidden size. heads / groups: query heads and key-value heads. head_dim: channels per head.
        ffn: the MLP's intermediate size. qkv_bias / o_bias: q, k, v (o) projections with a bias.
        qk_norm: per-head RMSNorm weights on q and k (Qwen3).
        moe: for a mixture-of-experts MLP, its moe_mapping.MoEShape (which maps the MLP's weights); None: dense.
    """

    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    moe: Any = None

    @classmethod
    def from_config(cls, config: Any, family: Family | None = None) -> "LayerShape":
        """The shape of a Hugging Face config's decoder layers.

        Args:
            config: a Llama, Mistral, Qwen2 or Qwen3 config (transformers).
            family: its Family; default: looked up by config.model_type (Llama's if unknown).
        Returns:
            The LayerShape.
        """
        family = family or FAMILIES.get(getattr(config, "model_type", None), FAMILIES["llama"])
        qkv_bias, o_bias = has_attention_bias(config, family)
        heads = config.num_attention_heads
        return cls(hidden=config.hidden_size, heads=heads,
                   groups=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   ffn=config.intermediate_size, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=family.qk_norm)


def _stacked(name: str, parts: list[tuple[str, int]]) -> FusedWeight:
    """FusedWeight `name` made of (hf_name, rows) blocks stacked in the given order."""
    out, start = [], 0
    for hf_name, rows in parts:
        out.append(WeightPart(hf_name, start, start + rows))
        start += rows
    return FusedWeight(name, tuple(out))


def layer_weight_map(config_or_shape: Any) -> list[FusedWeight]:
    """The weight mapping of one decoder layer (see the module docstring).

    Args:
        config_or_shape: a Hugging Face config, a LayerShape, or a converted decoder layer (anything with a
            `shape` LayerShape attribute).
    Returns:
        One FusedWeight per parameter of our converted layer, each with its Hugging Face parts in row order.
    """
    shape = getattr(config_or_shape, "shape", config_or_shape)
    if not isinstance(shape, LayerShape):
        shape = LayerShape.from_config(config_or_shape)
    attn, mlp = OUR_LAYER_PREFIX + "self_attention.", OUR_LAYER_PREFIX + "layernorm_mlp."
    q_rows, kv_rows = shape.heads * shape.head_dim, shape.groups * shape.head_dim
    qkv = [("self_attn.q_proj", q_rows), ("self_attn.k_proj", kv_rows), ("self_attn.v_proj", kv_rows)]
    table = [_stacked(attn + "layernorm_qkv.layer_norm_weight", [("input_layernorm.weight", shape.hidden)]),
             _stacked(attn + "layernorm_qkv.weight", [(name + ".weight", rows) for name, rows in qkv])]
    if shape.qkv_bias:
        table.append(_stacked(attn + "layernorm_qkv.bias", [(name + ".bias", rows) for name, rows in qkv]))
    if shape.qk_norm:
        table += [_stacked(attn + f"{t}_norm.weight", [(f"self_attn.{t}_norm.weight", shape.head_dim)])
                  for t in ("q", "k")]
    table.append(_stacked(attn + "proj.weight", [("self_attn.o_proj.weight", shape.hidden)]))
    if shape.o_bias:
        table.append(_stacked(attn + "proj.bias", [("self_attn.o_proj.bias", shape.hidden)]))
    table.append(_stacked(mlp + "layer_norm_weight", [("post_attention_layernorm.weight", shape.hidden)]))
    if shape.moe is not None:
        return table + shape.moe.weight_map(mlp, "mlp.")
    table += [_stacked(mlp + "fc1_weight", [("mlp.gate_proj.weight", shape.ffn), ("mlp.up_proj.weight", shape.ffn)]),
              _stacked(mlp + "fc2_weight", [("mlp.down_proj.weight", shape.hidden)])]
    return table


def fuse_hf_weights(hf_state: Mapping[str, torch.Tensor], table: list[FusedWeight]) -> dict[str, torch.Tensor]:
    """Hugging Face layer tensors -> our layer's tensors (parts concatenated along dim 0).

    Args:
        hf_state: tensors by name relative to the Hugging Face decoder layer (e.g. its state_dict()).
        table: layer_weight_map(...) of that layer.
    Returns:
        Our tensors by name relative to the converted layer.
    Raises:
        KeyError: a part missing from hf_state (named). ValueError: a part with the wrong number of rows.
    """
    out = {}
    for fused in table:
        tensors = []
        for part in fused.parts:
            if part.hf_name not in hf_state:
                raise KeyError(f"hf_state: no {part.hf_name!r} (needed for {fused.name})")
            tensor = part.take(hf_state[part.hf_name])
            if tensor.shape[0] != part.row_end - part.row_start:
                raise ValueError(f"hf_state[{part.hf_name!r}]: expected {part.row_end - part.row_start} rows, got "
                                 f"shape {tuple(tensor.shape)}"
                                 + ("" if part.index is None else f" (expert {part.index})"))
            tensors.append(tensor)
        out[fused.name] = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
    return out


def split_fused_weights(our_state: Mapping[str, torch.Tensor], table: list[FusedWeight]) -> dict[str, torch.Tensor]:
    """Our layer's tensors -> Hugging Face layer tensors (row blocks, as views of ours).

    Args:
        our_state: tensors by name relative to the converted layer (entries not in the table are ignored).
        table: layer_weight_map(...) of that layer.
    Returns:
        Hugging Face tensors by name relative to its decoder layer (views of ours, except the tensors that stack the
        experts: those are new, stacked in expert order).
    Raises:
        KeyError: a parameter of the table missing from our_state. ValueError: one with the wrong number of rows.
    """
    out, stacked = {}, {}
    for fused in table:
        if fused.name not in our_state:
            raise KeyError(f"our_state: no {fused.name!r}")
        tensor = our_state[fused.name]
        if tensor.shape[0] != fused.rows:
            raise ValueError(f"our_state[{fused.name!r}]: expected {fused.rows} rows, got {tuple(tensor.shape)}")
        for part in fused.parts:
            block = tensor[part.row_start:part.row_end]
            block = block.t() if part.transposed else block
            if part.index is None:
                out[part.hf_name] = block
            else:
                stacked.setdefault(part.hf_name, {})[part.index] = block
    for hf_name, blocks in stacked.items():
        if sorted(blocks) != list(range(len(blocks))):
            raise ValueError(f"table: the experts of {hf_name!r} are {sorted(blocks)}, expected 0..{len(blocks) - 1}")
        out[hf_name] = torch.stack([blocks[i] for i in range(len(blocks))])
    return out
