"""TransformerLayer: a pre-LN encoder block with Transformer Engine's arguments.

    a = x + drop_path(dropout(MultiheadAttention(norm1(x))))      (residual = norm1(x) with
    y = a + drop_path(dropout(LayerNormMLP(norm2(a))))             apply_residual_connection_post_layernorm)

hidden_states [s, b, hidden] ("sbhd") or [b, s, hidden] ("bshd") -> same shape and dtype. Under fp8_autocast every
GEMM runs in FP8; attention runs in BF16/FP16 through fused kernels (FP32 activations are cast around it). Without
hidden dropout and drop path (or in eval mode), sequence parallelism or the post-LN residual, the two residual adds
ride in the epilogues of the projection and FC2 GEMMs (with tensor parallelism: rank 0's, before the sum over the
ranks). drop_path (stochastic depth, drop_path_rate > 0, training only): each sample's (batch element's) whole branch
output is dropped with probability drop_path_rate and the kept ones are scaled by 1 / (1 - drop_path_rate); its
masks draw from torch's default random state (the same on the TP ranks, which hold the same samples).
"""
import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import model_parallel_rng
from ..attention import MultiheadAttention
from .layernorm_mlp import LayerNormMLP


class TransformerLayer(nn.Module):
    """Self-attention + MLP block. Not supported yet: output_layernorm, layer_type="decoder".

    Tensor parallelism: tp_group (size tp) with set_parallel_mode=True splits the attention heads and the MLP's ffn
    across ranks (see MultiheadAttention and LayerNormMLP); with sequence_parallel the input and output are this
    rank's sequence block ("sbhd"), and the norms, residual adds and hidden dropout run on it (the QKV and FC1 inputs
    are all-gathered after their norms, in FP8 inside fp8_autocast) (hidden dropout then draws
    from the RNG tracker's "model-parallel-rng" state when it has one: see distributed.model_parallel_rng).
    qk_norm_type, qk_norm_eps, qk_norm_before_rope: per-head q/k norms, see MultiheadAttention."""

    def __init__(self, hidden_size, ffn_hidden_size, num_attention_heads, num_gqa_groups=None,
                 layernorm_epsilon=1e-5, hidden_dropout=0.1, attention_dropout=0.1, init_method=None,
                 output_layer_init_method=None, layer_number=None, kv_channels=None, self_attn_mask_type="causal",
                 tp_group=None, tp_size=1, params_dtype=None, seq_length=None, micro_batch_size=None,
                 sequence_parallel=False, apply_residual_connection_post_layernorm=False, output_layernorm=False,
                 layer_type="encoder", drop_path_rate=0.0, set_parallel_mode=False, fuse_qkv_params=False,
                 fuse_wgrad_accumulation=False, zero_centered_gamma=False, qkv_weight_interleaved=True, bias=True,
                 activation="gelu", normalization="LayerNorm", device="cuda", attn_input_format="sbhd",
                 qk_norm_type=None, qk_norm_eps=1e-6, qk_norm_before_rope=False):
        super().__init__()
        if output_layernorm or layer_type != "encoder":
            raise NotImplementedError("output_layernorm and layer_type='decoder' are not supported")
        if isinstance(drop_path_rate, bool) or not isinstance(drop_path_rate, (int, float)) or \
                not 0 <= drop_path_rate < 1:
            raise ValueError(f"drop_path_rate: expected a number in [0, 1), got {drop_path_rate!r}")
        self.hidden_dropout, self.drop_path_rate = hidden_dropout, float(drop_path_rate)
        self.batch_dim = 1 if attn_input_format == "sbhd" else 0
        self.post_ln_residual = apply_residual_connection_post_layernorm
        common = dict(params_dtype=params_dtype, device=device, bias=bias, normalization=normalization,
                      zero_centered_gamma=zero_centered_gamma, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                      tp_group=tp_group, tp_size=tp_size, sequence_parallel=sequence_parallel,
                      set_parallel_mode=set_parallel_mode)
        self.self_attention = MultiheadAttention(
            hidden_size, num_attention_heads, kv_channels=kv_channels, num_gqa_groups=num_gqa_groups,
            attention_dropout=attention_dropout, layernorm_epsilon=layernorm_epsilon, init_method=init_method,
            output_layer_init_method=output_layer_init_method, layer_number=layer_number,
            attn_mask_type=self_attn_mask_type, input_layernorm=True,
            return_layernorm_output=apply_residual_connection_post_layernorm, fuse_qkv_params=fuse_qkv_params,
            qkv_weight_interleaved=qkv_weight_interleaved, attn_input_format=attn_input_format,
            qk_norm_type=qk_norm_type, qk_norm_eps=qk_norm_eps, qk_norm_before_rope=qk_norm_before_rope, **common)
        mlp_extra = dict(return_layernorm_output=True) if apply_residual_connection_post_layernorm else {}
        self.layernorm_mlp = LayerNormMLP(
            hidden_size, ffn_hidden_size, eps=layernorm_epsilon, activation=activation, init_method=init_method,
            output_layer_init_method=output_layer_init_method, **mlp_extra, **common)
        self.split_sequence = self.self_attention.tp is not None and bool(sequence_parallel)

    def _adds_residuals_in_gemms(self):
        return (not self.post_ln_residual and not self.split_sequence and
                (self.hidden_dropout == 0 and self.drop_path_rate == 0 or not self.training))

    def _drop_path(self, branch):
        """Stochastic depth on a branch output (see the module docstring); identity outside training."""
        if not self.training or self.drop_path_rate == 0:
            return branch
        shape = [1] * branch.dim()
        shape[self.batch_dim] = branch.shape[self.batch_dim]
        keep = torch.empty(shape, dtype=branch.dtype, device=branch.device).bernoulli_(1 - self.drop_path_rate)
        return branch * (keep / (1 - self.drop_path_rate))

    def forward(self, hidden_states, attention_mask=None, self_attn_mask_type=None, rotary_pos_emb=None,
                is_first_microbatch=None, checkpoint_core_attention=False):
        """checkpoint_core_attention: see MultiheadAttention.forward."""
        attention_args = dict(attention_mask=attention_mask, attn_mask_type=self_attn_mask_type,
                              is_first_microbatch=is_first_microbatch, rotary_pos_emb=rotary_pos_emb,
                              checkpoint_core_attention=checkpoint_core_attention)
        if self._adds_residuals_in_gemms():
            hidden = self.self_attention(hidden_states, residual=hidden_states, **attention_args)
            return self.layernorm_mlp(hidden, is_first_microbatch=is_first_microbatch, residual=hidden)
        attn = self.self_attention(hidden_states, **attention_args)
        attn_out, residual = attn if self.post_ln_residual else (attn, hidden_states)
        with model_parallel_rng(self.split_sequence):
            attn_out = F.dropout(attn_out, self.hidden_dropout, self.training)
        hidden = residual + self._drop_path(attn_out)
        mlp = self.layernorm_mlp(hidden, is_first_microbatch=is_first_microbatch)
        mlp_out, residual = mlp if self.post_ln_residual else (mlp, hidden)
        with model_parallel_rng(self.split_sequence):
            mlp_out = F.dropout(mlp_out, self.hidden_dropout, self.training)
        return residual + self._drop_path(mlp_out)
