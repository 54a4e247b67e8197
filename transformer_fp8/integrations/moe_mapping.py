"""The mixture-of-experts MLP of a Hugging Face decoder layer (Mixtral, Qwen2-MoE, Qwen3-MoE) and its weight mapping
onto our LayerNormMoE (transformer_fp8.moe), as data.

Relative to the converted decoder layer (ours) and to the Hugging Face decoder layer:

    ours: layer.layernorm_mlp. ...             Hugging Face: mlp. ...
    router.weight                              gate.weight
    experts.linear_fc1.weight{i}               expert i's gate and up projections, rows [gate | up]
    experts.linear_fc2.weight{i}               expert i's down projection
    shared_experts.linear_fc1.weight           shared_expert.gate_proj.weight | shared_expert.up_proj.weight
    shared_experts.linear_fc2.weight           shared_expert.down_proj.weight
    shared_experts.gate_weight                 shared_expert_gate.weight

How the experts are stored depends on the transformers version; `expert_layout` reads it from the module:
- "fused" (transformers 5.x): experts.gate_up_proj [E, 2F, H] (rows [gate | up]) and experts.down_proj [E, H, F];
- "fused_transposed": the same tensors stored [E, H, 2F] and [E, F, H] (experts.is_transposed);
- "w1w3w2" (Mixtral, transformers 4.x): experts.{i}.w1 (gate), .w3 (up), .w2 (down);
- "gate_up_down" (Qwen-MoE, transformers 4.x): experts.{i}.gate_proj, .up_proj, .down_proj.
Nothing here imports transformers.
"""
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from .hf_mapping import FusedWeight, WeightPart

EXPERT_LAYOUTS = ("fused", "fused_transposed", "w1w3w2", "gate_up_down")
_LIST_NAMES = {"w1w3w2": ("w1", "w3", "w2"), "gate_up_down": ("gate_proj", "up_proj", "down_proj")}


def is_moe_block(mlp: nn.Module) -> bool:
    """Whether a Hugging Face decoder layer's `mlp` is a sparse mixture-of-experts block (a router `gate` and
    `experts`), as opposed to a dense MLP (Qwen-MoE's mlp_only_layers / decoder_sparse_step layers).

    Args:
        mlp: the decoder layer's mlp module.
    Returns:
        True for an MoE block.
    """
    return hasattr(mlp, "gate") and hasattr(mlp, "experts")


def expert_layout(experts: nn.Module) -> str:
    """How a Hugging Face MoE block stores its experts (see the module docstring).

    Args:
        experts: the block's `experts` module.
    Returns:
        One of EXPERT_LAYOUTS.
    Raises:
        NotImplementedError: a layout not listed there (e.g. expert biases), naming what was found.
    """
    params = dict(experts.named_parameters(recurse=False))
    if set(params) == {"gate_up_proj", "down_proj"}:
        return "fused_transposed" if getattr(experts, "is_transposed", False) else "fused"
    if isinstance(experts, nn.ModuleList) and len(experts) > 0:
        names = {name for name, _ in experts[0].named_parameters()}
        for layout, parts in _LIST_NAMES.items():
            if names == {f"{part}.weight" for part in parts}:
                return layout
        raise NotImplementedError(f"experts: per-expert parameters {sorted(names)} are not a SwiGLU MLP without "
                                  f"biases (expected {[f'{p}.weight' for p in _LIST_NAMES['w1w3w2']]} or "
                                  f"{[f'{p}.weight' for p in _LIST_NAMES['gate_up_down']]})")
    raise NotImplementedError(f"experts: {type(experts).__name__} with parameters {sorted(params)} is not a known "
                              f"expert layout (expected gate_up_proj and down_proj, or a ModuleList of MLPs)")


@dataclass(frozen=True)
class MoEShape:
    """The sizes and options of one Hugging Face MoE block that the mapping and our LayerNormMoE depend on.

    Attributes:
        hidden: hidden size H. num_experts: E. top_k: experts per token. ffn: each expert's intermediate size.
        norm_topk_prob: the top-k probabilities are renormalised (Mixtral: always).
        shared_ffn: the shared expert's intermediate size (0: none). shared_gate: the shared expert is gated.
        layout: how the Hugging Face experts are stored (EXPERT_LAYOUTS).
        jitter_noise: Mixtral's router_jitter_noise (training only).
    """

    hidden: int
    num_experts: int
    top_k: int
    ffn: int
    norm_topk_prob: bool = True
    shared_ffn: int = 0
    shared_gate: bool = False
    layout: str = "fused"
    jitter_noise: float = 0.0

    @classmethod
    def from_hf_block(cls, mlp: nn.Module, config: Any) -> "MoEShape":
        """The shape of a Hugging Face MoE block (see is_moe_block), read from its modules and config.

        Args:
            mlp: the decoder layer's MoE block (Mixtral/Qwen2-MoE/Qwen3-MoE SparseMoeBlock).
            config: the model's config (num_experts_per_tok, norm_topk_prob, router_jitter_noise).
        Returns:
            The MoEShape.
        """
        router_weight = mlp.gate.weight
        num_experts, hidden = router_weight.shape
        layout = expert_layout(mlp.experts)
        if layout in _LIST_NAMES:
            ffn = getattr(mlp.experts[0], _LIST_NAMES[layout][2]).weight.shape[1]
        else:
            down = mlp.experts.down_proj
            ffn = down.shape[1] if layout == "fused_transposed" else down.shape[2]
        shared = getattr(mlp, "shared_expert", None)
        top_k = getattr(mlp.gate, "top_k", None) or getattr(mlp, "top_k", None) or config.num_experts_per_tok
        norm = getattr(mlp.gate, "norm_topk_prob", getattr(config, "norm_topk_prob", True))
        return cls(hidden=hidden, num_experts=num_experts, top_k=int(top_k), ffn=int(ffn), norm_topk_prob=bool(norm),
                   shared_ffn=0 if shared is None else int(shared.down_proj.weight.shape[1]),
                   shared_gate=getattr(mlp, "shared_expert_gate", None) is not None, layout=layout,
                   jitter_noise=float(getattr(mlp, "jitter_noise", 0.0) or 0.0))

    def layer_kwargs(self) -> dict:
        """Returns:
            The LayerNormMoE arguments (after hidden_size) for this block."""
        return dict(ffn_hidden_size=self.ffn, num_experts=self.num_experts, top_k=self.top_k,
                    norm_topk_prob=self.norm_topk_prob, shared_expert_ffn_hidden_size=self.shared_ffn or None,
                    shared_expert_gate=self.shared_gate, jitter_noise=self.jitter_noise)

    def _expert_parts(self, i: int) -> tuple[tuple[WeightPart, ...], tuple[WeightPart, ...]]:
        """(fc1 parts, fc2 parts) of expert i, Hugging Face names relative to the MoE block."""
        f, h = self.ffn, self.hidden
        if self.layout in _LIST_NAMES:
            gate, up, down = (f"experts.{i}.{name}.weight" for name in _LIST_NAMES[self.layout])
            return (WeightPart(gate, 0, f), WeightPart(up, f, 2 * f)), (WeightPart(down, 0, h),)
        transposed = self.layout == "fused_transposed"
        return ((WeightPart("experts.gate_up_proj", 0, 2 * f, index=i, transposed=transposed),),
                (WeightPart("experts.down_proj", 0, h, index=i, transposed=transposed),))

    def weight_map(self, ours: str, hf: str) -> list[FusedWeight]:
        """The block's rows of the decoder layer's weight map (hf_mapping.layer_weight_map).

        Args:
            ours: prefix of our LayerNormMoE relative to the converted layer, e.g. "layer.layernorm_mlp.".
            hf: prefix of the Hugging Face block relative to its decoder layer, e.g. "mlp.".
        Returns:
            One FusedWeight per parameter of our block but the norm weight (mapped with the attention's).
        """
        def prefixed(parts):
            return tuple(WeightPart(hf + p.hf_name, p.row_start, p.row_end, p.index, p.transposed) for p in parts)

        table = [FusedWeight(ours + "router.weight", prefixed([WeightPart("gate.weight", 0, self.num_experts)]))]
        for i in range(self.num_experts):
            fc1, fc2 = self._expert_parts(i)
            table += [FusedWeight(ours + f"experts.linear_fc1.weight{i}", prefixed(fc1)),
                      FusedWeight(ours + f"experts.linear_fc2.weight{i}", prefixed(fc2))]
        if self.shared_ffn:
            s = self.shared_ffn
            table += [FusedWeight(ours + "shared_experts.linear_fc1.weight",
                                  prefixed([WeightPart("shared_expert.gate_proj.weight", 0, s),
                                            WeightPart("shared_expert.up_proj.weight", s, 2 * s)])),
                      FusedWeight(ours + "shared_experts.linear_fc2.weight",
                                  prefixed([WeightPart("shared_expert.down_proj.weight", 0, self.hidden)]))]
            if self.shared_gate:
                table.append(FusedWeight(ours + "shared_experts.gate_weight",
                                         prefixed([WeightPart("shared_expert_gate.weight", 0, 1)])))
        return table
