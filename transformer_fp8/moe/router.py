"""The router of a mixture-of-experts layer and its load-balancing loss.

TopKRouter is a high-precision linear hidden -> num_experts (its GEMM is tiny and the routing decision is sensitive
to rounding, so it never runs in FP8), a softmax over the experts in float32, the top-k experts of each token and
their probabilities, renormalised to sum to 1 when `norm_topk_prob` (Mixtral always; Qwen2/3-MoE per config).
Its forward returns (logits, top-k probabilities, top-k indices) as transformers' TopKRouter modules do, so that
transformers' output_router_logits recorder can read the logits from it.

load_balancing_loss is the Switch Transformer auxiliary loss as transformers computes it
(load_balancing_loss_func): num_experts * sum over experts of (share of the top-k assignments that went to the
expert) * (mean router probability of the expert). Nothing here synchronises with the device.
"""
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..module.base import check_dtype, check_input, check_positive, default_init


def check_top_k(top_k: int, num_experts: int) -> None:
    """Refuse a top_k that is not an int in [1, num_experts], naming it."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k: expected an int in [1, num_experts={num_experts}], got {top_k!r}")


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing of router logits.

    Args:
        logits: [T, E] router logits (any floating dtype; the softmax runs in float32).
        top_k: experts per token.
        norm_topk_prob: renormalise each token's k probabilities to sum to 1.
    Returns:
        (probs float32 [T, top_k], indices int64 [T, top_k]), the experts of each token in decreasing probability.
    """
    probs = torch.softmax(logits.float(), dim=-1)
    top_probs, indices = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
    return top_probs, indices


class TopKRouter(nn.Module):
    """logits = x Wᵀ (high precision, also inside fp8_autocast), then top-k softmax routing (see `route`).

    Args:
        hidden_size: the tokens' hidden size H.
        num_experts: E.
        top_k: experts per token, in [1, E].
        norm_topk_prob: renormalise the k probabilities of each token to sum to 1 (Mixtral: True).
        params_dtype: dtype of `weight` (default: torch's default dtype).
        device: where `weight` lives.
        init_method: callable(weight) initialising `weight` [E, H] in place (default: nn.Linear's).

    Attributes:
        weight: [E, H], the router's parameter (Megatron's and transformers' name).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool = True,
                 params_dtype: torch.dtype | None = None, device: str | torch.device = "cuda",
                 init_method=None) -> None:
        super().__init__()
        check_positive(hidden_size=hidden_size, num_experts=num_experts)
        check_top_k(top_k, num_experts)
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.norm_topk_prob = bool(norm_topk_prob)
        weight = torch.empty(num_experts, hidden_size, dtype=check_dtype(params_dtype), device=device)
        (init_method or default_init)(weight)
        self.weight = nn.Parameter(weight)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Args:
            hidden_states: [..., H] tokens.
        Returns:
            (logits [T, E] in the input's dtype, probs float32 [T, top_k], indices int64 [T, top_k]), T the number
            of tokens (the input's leading dims flattened).
        """
        check_input(hidden_states, self.hidden_size, "hidden_states")
        x = hidden_states.reshape(-1, self.hidden_size)
        logits = F.linear(x, self.weight.to(x.dtype))
        probs, indices = route(logits, self.top_k, self.norm_topk_prob)
        return logits, probs, indices

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"norm_topk_prob={self.norm_topk_prob}")


def load_balancing_loss(router_logits: torch.Tensor | Sequence[torch.Tensor], top_k: int,
                        token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The load-balancing auxiliary loss of one or several MoE layers, as transformers' load_balancing_loss_func:
    E * sum_e f_e * P_e, f_e the share of all top-k assignments (per token: k of them) that chose expert e, divided by
    the number of tokens (so sum_e f_e = k), P_e the mean softmax probability of expert e; several layers' logits
    count as one set of tokens (as transformers does). Multiply by the config's router_aux_loss_coef.

    Args:
        router_logits: [T, E] logits of one layer, or a sequence of them (one per layer, same E).
        top_k: experts per token.
        token_mask: [T] (or any shape of T elements; 1 = real token, 0 = padding) weights of each token, the same
            for every layer; None: all tokens count.
    Returns:
        A float32 scalar tensor, differentiable with respect to the logits (through P_e).
    """
    logits = router_logits if isinstance(router_logits, torch.Tensor) else torch.cat(list(router_logits), dim=0)
    if logits.dim() != 2:
        raise ValueError(f"router_logits: expected [tokens, experts] tensors, got shape {tuple(logits.shape)}")
    num_experts = logits.shape[1]
    check_top_k(top_k, num_experts)
    probs = torch.softmax(logits.float(), dim=-1)
    indices = torch.topk(probs, top_k, dim=-1).indices
    if token_mask is None:
        weights = torch.ones(logits.shape[0], dtype=torch.float32, device=logits.device)
    else:
        weights = token_mask.reshape(-1).to(device=logits.device, dtype=torch.float32)
        if logits.shape[0] % weights.numel() != 0:
            raise ValueError(f"token_mask: expected {logits.shape[0]} elements (or a divisor: one mask for every "
                             f"layer), got {weights.numel()}")
        weights = weights.repeat(logits.shape[0] // weights.numel())
    counts = torch.zeros(num_experts, dtype=torch.float32, device=logits.device)
    counts.scatter_add_(0, indices.reshape(-1), weights.repeat_interleave(top_k))  # (no bincount: it would sync)
    total = weights.sum()
    return num_experts * torch.sum((counts / total) * ((probs * weights[:, None]).sum(dim=0) / total))
