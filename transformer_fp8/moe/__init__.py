"""Mixture of experts: MoELayer (router, FP8 grouped SwiGLU experts, optional shared expert, load-balancing loss)."""
from .experts import GroupedMLP, SharedExpertMLP
from .layer import LayerNormMoE, MoELayer
from .router import TopKRouter, load_balancing_loss

__all__ = ["GroupedMLP", "LayerNormMoE", "MoELayer", "SharedExpertMLP", "TopKRouter", "load_balancing_loss"]
