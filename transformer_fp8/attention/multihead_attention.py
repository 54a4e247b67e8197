"""MultiheadAttention with Transformer Engine's names and defaults: one fused QKV projection (Linear, or
LayerNormLinear with input_layernorm), optional RoPE on q and k, DotProductAttention, output projection.
"""

import torch
from torch import nn

from ..distributed import TensorParallel, model_parallel_rng
from ..module.layernorm_linear import LayerNormLinear
from ..module.linear import Linear
from ..module.norm import RMSNorm
from ..module._residual_relay import ResidualGradRelay
from .qkv_split import rope_split_fits, split_qkv, split_qkv_rope
from .rope import apply_rotary_pos_emb
from .dot_product_attention import (QK_NORM_TYPES, DotProductAttention)


class MultiheadAttention(nn.Module):
    """Self-attention block: [LayerNorm/RMSNorm +] fused QKV GEMM, RoPE on q and k, attention, output GEMM.

    hidden_states [s, b, hidden] ("sbhd") or [b, s, hidden] ("bshd") -> same shape. The QKV weight has
    (h + 2 * g) * kv_channels rows (g = num_gqa_groups): with qkv_weight_interleaved they are ordered per group
    [q heads of the group, k, v] (TE's default), else [all q | all k | all v]. fuse_qkv_params is accepted: the QKV
    weight is always one parameter. Returns out, then bias (return_bias), then the norm output
    (return_layernorm_output), as TE does.

    Tensor parallelism (set_parallel_mode=True, a tp_group of size tp > 1; interleaved QKV weights): the QKV
    projection is column-parallel (this rank's num_gqa_groups/tp groups, i.e. num_attention_heads/tp query heads),
    attention runs on those heads, the output projection is row-parallel. With sequence_parallel ("sbhd" only) the
    input and output are this rank's sequence block: the input norm runs on it, and the QKV projection all-gathers
    its (normalised) input along the sequence, in FP8 inside fp8_autocast. Attention dropout then draws from the RNG
    tracker's "model-parallel-rng" state when it has one (distributed.get_rng_state_tracker(): seed it per rank for
    independent masks). return_layernorm_output is not supported with TP.

    qk_norm_type="RMSNorm" (TE's argument; as Qwen3): an RMSNorm over kv_channels on every q and k head (weights
    `q_norm.weight`, `k_norm.weight` [kv_channels], eps qk_norm_eps), after RoPE, or before it with
    qk_norm_before_rope=True. It runs in high precision (also inside fp8_autocast: the norms sit between the QKV
    GEMM and attention).
    """

    def __init__(self, hidden_size, num_attention_heads, kv_channels=None, attention_dropout=0.1,
                 layernorm_epsilon=1e-5, init_method=None, output_layer_init_method=None, layer_number=None,
                 attn_mask_type="causal", tp_group=None, tp_size=1, num_gqa_groups=None,
                 fuse_wgrad_accumulation=False, sequence_parallel=False, params_dtype=None, return_bias=False,
                 return_layernorm_output=False, input_layernorm=False, attention_type="self",
                 set_parallel_mode=False, fuse_qkv_params=False, zero_centered_gamma=False,
                 qkv_weight_interleaved=True, bias=True, normalization="LayerNorm", device="cuda",
                 attn_input_format=None, qkv_format="sbhd", qk_norm_type=None, qk_norm_eps=1e-6,
                 qk_norm_before_rope=False):
        super().__init__()
        if qk_norm_type not in QK_NORM_TYPES:
            raise NotImplementedError(f"qk_norm_type: supported {QK_NORM_TYPES}, got {qk_norm_type!r}")
        if attention_type != "self":
            raise NotImplementedError(f"attention_type: only 'self' is supported, got {attention_type!r}")
        if return_layernorm_output and not input_layernorm:
            raise ValueError("return_layernorm_output: needs input_layernorm=True")
        self.qkv_format = attn_input_format or qkv_format
        if self.qkv_format in ("thd", "bhsd"):
            raise NotImplementedError(f"qkv_format: MultiheadAttention and TransformerLayer take 'sbhd' or 'bshd'; "
                                      f"{self.qkv_format!r} is supported by DotProductAttention only")
        kv_channels = kv_channels or hidden_size // num_attention_heads
        num_gqa_groups = num_gqa_groups or num_attention_heads
        tp = TensorParallel.create(tp_group, tp_size, "column" if set_parallel_mode else None, sequence_parallel)
        local_heads, local_groups = num_attention_heads, num_gqa_groups
        if tp is not None:
            local_heads = tp.local("num_attention_heads", num_attention_heads)
            local_groups = tp.local("num_gqa_groups", num_gqa_groups)
            if not qkv_weight_interleaved:
                raise NotImplementedError("qkv_weight_interleaved: tensor parallelism needs the interleaved layout")
            if sequence_parallel and self.qkv_format != "sbhd":
                raise ValueError(f"qkv_format: sequence_parallel needs 'sbhd', got {self.qkv_format!r}")
        self.tp = tp
        self.heads, self.groups, self.head_dim = local_heads, local_groups, kv_channels
        self.qkv_weight_interleaved = qkv_weight_interleaved
        self.input_layernorm, self.return_layernorm_output = input_layernorm, return_layernorm_output
        self.return_bias = return_bias
        common = dict(bias=bias, params_dtype=params_dtype, device=device,
                      fuse_wgrad_accumulation=fuse_wgrad_accumulation)
        parallel = {} if tp is None else dict(tp_group=tp_group, tp_size=tp_size, sequence_parallel=sequence_parallel)
        column = dict(parallel, parallel_mode="column") if parallel else {}
        row = dict(parallel, parallel_mode="row") if parallel else {}
        qkv_features = (num_attention_heads + 2 * num_gqa_groups) * kv_channels
        if input_layernorm:
            self.layernorm_qkv = LayerNormLinear(
                hidden_size, qkv_features, eps=layernorm_epsilon, normalization=normalization,
                zero_centered_gamma=zero_centered_gamma, return_layernorm_output=return_layernorm_output,
                init_method=init_method, **column, **common)
        else:
            self.qkv = Linear(hidden_size, qkv_features, init_method=init_method, **column, **common)
        self.core_attention = DotProductAttention(
            local_heads, kv_channels, num_gqa_groups=local_groups, attention_dropout=attention_dropout,
            attn_mask_type=attn_mask_type, qkv_format=self.qkv_format, layer_number=layer_number)
        self.proj = Linear(num_attention_heads * kv_channels, hidden_size, init_method=output_layer_init_method,
                           return_bias=return_bias, **row, **common)
        self.qk_norm_before_rope = bool(qk_norm_before_rope)
        if qk_norm_type == "RMSNorm":  # one weight [kv_channels] shared by all heads, as TE's q_norm / k_norm
            norm_args = dict(eps=qk_norm_eps, params_dtype=params_dtype, device=device)
            self.q_norm, self.k_norm = RMSNorm(kv_channels, **norm_args), RMSNorm(kv_channels, **norm_args)
        else:
            self.q_norm = self.k_norm = None
        # Training with RoPE and no q/k norm: split and rotate in one node (qkv_split.split_qkv_rope); False: the
        # separate split, rope and v copy (kept to compare against).
        self.fused_rope_split = True

    def _split_qkv(self, qkv, fold=False):
        """[*lead, (h + 2g) * d] -> q [*lead, h, d], k and v [*lead, g, d]; fold: the groups folded into the batch
        (see qkv_split.py)."""
        return split_qkv(qkv, self.heads, self.groups, self.head_dim, self.qkv_weight_interleaved, fold)

    @staticmethod
    def rotate_qk(q, k, v, rotary_pos_emb, tensor_format):
        """RoPE on q and k (rotary_pos_emb: freqs, or a (q_freqs, k_freqs) pair) -> (q, k, v), v made contiguous:
        q and k are new tensors now, and a view v alone would keep the whole QKV output alive."""
        q_freqs, k_freqs = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
        return (apply_rotary_pos_emb(q, q_freqs, tensor_format), apply_rotary_pos_emb(k, k_freqs, tensor_format),
                v.contiguous())

    def _folds_groups(self, attention_mask, attn_mask_type, rotary_pos_emb):
        """Whether q, k, v go to the attention as views of the QKV output with the GQA groups folded into the batch
        (DotProductAttention's gqa_groups_folded): interleaved GQA in sbhd without a mask tensor or RoPE (also under
        FP8 attention). Else interleaved GQA copies q, k and v (its q heads are not evenly spaced)."""
        return (self.qkv_weight_interleaved and self.groups != self.heads and self.qkv_format == "sbhd" and
                attention_mask is None and rotary_pos_emb is None and
                (attn_mask_type or self.core_attention.attn_mask_type) in ("no_mask", "causal"))

    def forward(self, hidden_states, attention_mask=None, attn_mask_type=None, is_first_microbatch=None,
                rotary_pos_emb=None, residual=None, checkpoint_core_attention=False):
        """rotary_pos_emb: freqs [s, 1, 1, rot_dim] from RotaryPositionEmbedding, or a (q_freqs, k_freqs) pair.
        residual: added to the output in the projection GEMM's epilogue (see Linear; not with sequence
        parallelism). checkpoint_core_attention: the attention core under transformer_fp8.checkpoint (recomputed in
        the backward; it then keeps q, k, v but not its output and softmax statistics)."""
        layernorm_output = None
        relay = None  # (the residual's gradient joins the QKV norm backward's dx: see _residual_relay.py)
        if residual is hidden_states and self.input_layernorm and torch.is_grad_enabled() and \
                not torch.compiler.is_compiling():
            relay = ResidualGradRelay()
        if self.input_layernorm:
            qkv = self.layernorm_qkv(hidden_states, is_first_microbatch=is_first_microbatch,
                                     residual_grad_relay=relay)
            if self.return_layernorm_output:
                qkv, layernorm_output = qkv
        else:
            qkv = self.qkv(hidden_states, is_first_microbatch=is_first_microbatch)
        fold = self._folds_groups(attention_mask, attn_mask_type, rotary_pos_emb)
        if rotary_pos_emb is not None and self.q_norm is None and self.fused_rope_split and \
                rope_split_fits(qkv, self.heads, self.groups, self.qkv_weight_interleaved, fold, self.qkv_format):
            q_freqs, k_freqs = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            q, k, v = split_qkv_rope(qkv, self.heads, self.groups, self.head_dim, self.qkv_weight_interleaved,
                                     q_freqs, k_freqs, self.qkv_format)
        else:
            q, k, v = self._split_qkv(qkv, fold)
            if self.q_norm is not None and (self.qk_norm_before_rope or rotary_pos_emb is None):
                q, k = self.q_norm(q), self.k_norm(k)
            if rotary_pos_emb is not None:
                q, k, v = self.rotate_qk(q, k, v, rotary_pos_emb, self.qkv_format)
                if self.q_norm is not None and not self.qk_norm_before_rope:
                    q, k = self.q_norm(q), self.k_norm(k)
        with model_parallel_rng(self.tp is not None):  # dropout on this rank's heads
            if checkpoint_core_attention and torch.is_grad_enabled():
                from ..checkpoint import checkpoint  # (here: checkpoint.py imports the modules)
                context = checkpoint(self.core_attention, q, k, v, attention_mask=attention_mask,
                                     attn_mask_type=attn_mask_type, gqa_groups_folded=fold)
            else:
                context = self.core_attention(q, k, v, attention_mask=attention_mask, attn_mask_type=attn_mask_type,
                                              gqa_groups_folded=fold)
        out = self.proj(context, is_first_microbatch=is_first_microbatch, residual=residual,
                        residual_grad_relay=relay)
        outputs = (*out,) if self.return_bias else (out,)
        if self.return_layernorm_output:
            outputs += (layernorm_output,)
        return outputs if len(outputs) > 1 else outputs[0]
