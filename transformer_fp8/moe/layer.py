"""MoELayer: a mixture-of-experts SwiGLU MLP with FP8 expert GEMMs (Megatron's MoELayer, on our GroupedLinear).

    logits, probs, experts = router(x)                      high precision, top-k softmax (router.py)
    rows, row_id_map, tokens_per_expert = moe_permute(x, experts)   each token once per chosen expert, by expert
    y = GroupedMLP(rows, tokens_per_expert)                 fc1 (gate | up), SwiGLU, fc2: one GroupedLinear each
    out = moe_unpermute(y, row_id_map, probs)               the k outputs of a token summed, weighted by probs
    out += SharedExpertMLP(x)                               optional, sigmoid-gated (Qwen2-MoE)

The group sizes stay on the device from the router to the grouped GEMMs: the forward never synchronises with the
host (unless host_splits=True asks for one read of the counts, for the faster dense per-expert GEMMs). In FP8 the
permutation pads every expert's rows to a multiple of 16 (zero rows the unpermutation skips), so that the expert
GEMMs' weight gradients need no padded copies, and fc1's backward writes its FP8 gradient in the d(SwiGLU) pass.
With aux_loss_coeff > 0, training adds aux_loss_coeff * load_balancing_loss (router.py) to the loss through the
backward (the output is unchanged; Megatron's way): `layer.aux_loss` keeps the last value for logging.
LayerNormMoE puts the normalization in front, with LayerNormMLP's call (forward(x, is_first_microbatch, residual)),
so that it can take a LayerNormMLP's place in a TransformerLayer.
"""
import torch
import torch.nn as nn

from .. import autocast
from ..grouped_gemm import ALIGN
from ..module.base import check_choice, check_dtype, check_input, check_positive
from ..module.norm import NORMALIZATIONS, _NormFunction, init_norm_params
from ..permutation import moe_permute, moe_unpermute
from .experts import GroupedMLP, SharedExpertMLP
from .router import TopKRouter, load_balancing_loss


class _AuxLossScaler(torch.autograd.Function):
    """Identity on `output` whose backward also gives `aux_loss` the gradient `coeff`: the auxiliary loss joins the
    training loss without the caller adding it."""

    @staticmethod
    def forward(ctx, output, aux_loss, coeff):
        ctx.coeff = coeff
        ctx.save_for_backward(aux_loss)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.coeff), None


class MoELayer(nn.Module):
    """Top-k routed SwiGLU experts, plus an optional shared expert (see the module docstring).

    Args:
        hidden_size: H.
        ffn_hidden_size: each routed expert's intermediate size.
        num_experts: E.
        top_k: experts per token (Megatron's moe_router_topk).
        norm_topk_prob: renormalise each token's k probabilities to sum to 1 (Mixtral: True; Qwen-MoE: config).
        shared_expert_ffn_hidden_size: the shared expert's intermediate size, or None / 0 for none.
        shared_expert_gate: gate the shared expert's output by sigmoid(x · gate_weight) (Qwen2-MoE).
        aux_loss_coeff: weight of the load-balancing loss added through the backward in training (0: none).
        jitter_noise: in training, the input is multiplied by uniform noise in [1 - jitter, 1 + jitter] before the
            router and the experts (transformers' Mixtral router_jitter_noise); 0: none.
        params_dtype, device: of the parameters.
        init_method: callable(weight) for the router and the fc1 weights (default: nn.Linear's).
        output_layer_init_method: the same for the fc2 weights (default: init_method).
        fuse_wgrad_accumulation: the expert and shared-expert weights' gradients accumulate into `main_grad`.
        host_splits: read the per-expert row counts on the host once per forward (one device sync, as Megatron's
            tokens_per_expert.tolist()): with <= 16 experts on CUDA the expert GEMMs then run as one dense cuBLASLt
            FP8 GEMM per expert, faster than the grouped kernel (H100, bench_moe.py: 20.85 against 23.92 ms fwd +
            bwd at hidden 4096, 8 experts of 14336, top-2, 8192 tokens). False (default): no sync.

    Attributes:
        router: TopKRouter. experts: GroupedMLP. shared_experts: SharedExpertMLP or None.
        aux_loss: the last training forward's load-balancing loss (detached), or None.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool = True, shared_expert_ffn_hidden_size: int | None = None,
                 shared_expert_gate: bool = True, aux_loss_coeff: float = 0.0, jitter_noise: float = 0.0,
                 params_dtype: torch.dtype | None = None, device: str | torch.device = "cuda", init_method=None,
                 output_layer_init_method=None, fuse_wgrad_accumulation: bool = False,
                 host_splits: bool = False) -> None:
        super().__init__()
        check_positive(hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size, num_experts=num_experts)
        self.host_splits = bool(host_splits)
        for name, value in (("aux_loss_coeff", aux_loss_coeff), ("jitter_noise", jitter_noise)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")
        if jitter_noise >= 1:
            raise ValueError(f"jitter_noise: expected a number in [0, 1), got {jitter_noise!r}")
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.aux_loss_coeff, self.jitter_noise = float(aux_loss_coeff), float(jitter_noise)
        self.aux_loss = None
        common = dict(params_dtype=params_dtype, device=device, init_method=init_method)
        self.router = TopKRouter(hidden_size, num_experts, top_k, norm_topk_prob, **common)
        experts_args = dict(output_layer_init_method=output_layer_init_method,
                            fuse_wgrad_accumulation=fuse_wgrad_accumulation, **common)
        self.experts = GroupedMLP(num_experts, hidden_size, ffn_hidden_size, **experts_args)
        self.shared_experts = SharedExpertMLP(hidden_size, shared_expert_ffn_hidden_size, shared_expert_gate,
                                              **experts_args) if shared_expert_ffn_hidden_size else None

    def forward(self, hidden_states: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        """Args:
            hidden_states: [..., H] tokens (any leading shape).
            is_first_microbatch: the FP8 weight cache switch of the expert GEMMs (see Linear).
        Returns:
            [..., H] in the input's dtype.
        """
        check_input(hidden_states, self.hidden_size, "hidden_states")
        x = hidden_states.reshape(-1, self.hidden_size)
        if self.training and self.jitter_noise > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        logits, probs, indices = self.router(x)
        # (in FP8, every expert's rows start at a multiple of 16: the expert GEMMs' weight gradients need no copies)
        align = ALIGN if autocast.STATE.enabled else 1
        rows, row_id_map, tokens_per_expert = moe_permute(x, indices, map_type="index", return_tokens_per_expert=True,
                                                          num_experts=self.num_experts, align_size=align)
        splits = tokens_per_expert.tolist() if self.host_splits else tokens_per_expert  # (a sync when asked for)
        expert_out = self.experts(rows, splits, is_first_microbatch=is_first_microbatch, splits_aligned=align > 1)
        out = moe_unpermute(expert_out, row_id_map, merging_probs=probs, map_type="index")
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, is_first_microbatch=is_first_microbatch)
        if self.training and self.aux_loss_coeff > 0 and torch.is_grad_enabled():
            aux_loss = load_balancing_loss(logits, self.top_k)
            self.aux_loss = aux_loss.detach()
            out = _AuxLossScaler.apply(out, aux_loss, self.aux_loss_coeff)
        return out.view(hidden_states.shape)

    def extra_repr(self) -> str:
        return f"aux_loss_coeff={self.aux_loss_coeff}, jitter_noise={self.jitter_noise}"


class LayerNormMoE(MoELayer):
    """norm(x) -> MoELayer, with LayerNormMLP's parameters for the norm (`layer_norm_weight`, and `layer_norm_bias`
    for LayerNorm) and its call, forward(x, is_first_microbatch=None, residual=None): it can replace a
    TransformerLayer's layernorm_mlp.

    Args:
        hidden_size, ffn_hidden_size, num_experts, top_k: see MoELayer.
        eps: the norm's epsilon.
        normalization: "RMSNorm" or "LayerNorm".
        zero_centered_gamma: the norm weight stores gamma - 1.
        **kwargs: the other MoELayer arguments (params_dtype, device, norm_topk_prob, shared_expert_..., ...).
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int, eps: float = 1e-5,
                 normalization: str = "RMSNorm", zero_centered_gamma: bool = False, **kwargs) -> None:
        super().__init__(hidden_size, ffn_hidden_size, num_experts, top_k, **kwargs)
        check_choice("normalization", normalization, NORMALIZATIONS)
        self.normalization, self.eps, self.zero_centered_gamma = normalization, float(eps), bool(zero_centered_gamma)
        self.params_dtype = check_dtype(kwargs.get("params_dtype"))
        self._device = torch.device(kwargs.get("device", "cuda"))
        init_norm_params(self, hidden_size, normalization, self.zero_centered_gamma, "layer_norm_")

    def forward(self, hidden_states: torch.Tensor, is_first_microbatch: bool | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """Args:
            hidden_states: [..., H].
            is_first_microbatch: see MoELayer.
            residual: added to the output (the input's shape), or None.
        Returns:
            [..., H].
        """
        check_input(hidden_states, self.hidden_size, "hidden_states")
        normed = _NormFunction.apply(hidden_states.contiguous(), self.layer_norm_weight, self.layer_norm_bias,
                                     self.normalization, self.eps, self.zero_centered_gamma)
        out = super().forward(normed, is_first_microbatch=is_first_microbatch)
        return out if residual is None else out + residual

    def extra_repr(self) -> str:
        return f"normalization={self.normalization}, eps={self.eps}, {super().extra_repr()}"
