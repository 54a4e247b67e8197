"""The converted decoder layer of every Llama-like family (Llama, Mistral, Qwen2, Qwen3), on our TransformerLayer.

`LlamaTransformerLayer` is a drop-in for the Hugging Face decoder layer it replaces (same call and return), computed
by `self.layer`, a TransformerLayer (RMSNorm, SwiGLU, GQA, RoPE, bshd), with the weights mapped as hf_mapping.py
says; Qwen2's q/k/v bias is a bias on the fused QKV GEMM only, Qwen3's per-head q/k RMSNorm is TransformerLayer's
qk_norm_type="RMSNorm" before RoPE. Outside fp8_autocast it computes what the Hugging Face layer does; inside it every
GEMM runs in FP8.

Without a KV cache (training, scoring) the whole layer is TransformerLayer's forward. So is the first fill of an
empty dynamic cache (a prompt, or a plain forward with use_cache=True): the k and v its core attention receives (a
forward pre-hook keeps them) then go to the cache. Otherwise (decode; any static-cache step) the layer runs the same
modules step by step: QKV GEMM, q/k norms, RoPE at the given positions, `Cache.update` and PyTorch's SDPA over the
cached keys with transformers' mask (kv_cache.py; a query shorter than the keys), then the output and MLP GEMMs with
the residual adds in their epilogues.
`convert_llama` is convert_model (convert_model.py) for these families.
"""
import warnings
from typing import Any

import torch
import torch.nn as nn

from ..checkpoint import checkpoint
from ..attention.rope import apply_rotary_pos_emb
from ..module.transformer import TransformerLayer
from .hf_mapping import LayerShape, fuse_hf_weights, layer_weight_map
from .kv_cache import cached_attention, cached_attention_mask, pick_cache, update_cache
from .rope_angles import RopeAngles


_warned = set()


def _warn_once(message):
    if message not in _warned:
        _warned.add(message)
        warnings.warn(f"LlamaTransformerLayer: {message}", stacklevel=3)


def _skip_init(weight):
    """No random init: the weights are overwritten with the Hugging Face layer's right after."""


def _attention_args(attention_mask, batch, seq_len):
    """Hugging Face's 4-D mask -> (our mask, mask type). None (what the "sdpa" mask builder gives for causal attention
    without padding) -> causal. A bool (True = attend) or additive float (0 = attend) [b or 1, 1, s, s] mask ->
    "padding" with TE's convention (True = masked out); rows with nothing to attend to (padding queries) attend to
    every key instead, so that they stay finite (their outputs are padding)."""
    if attention_mask is None:
        return None, "causal"
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4 \
            or attention_mask.shape[-2:] != (seq_len, seq_len) or attention_mask.shape[0] not in (1, batch):
        got = type(attention_mask).__name__ if not isinstance(attention_mask, torch.Tensor) \
            else f"shape {tuple(attention_mask.shape)}"
        raise ValueError(f"attention_mask: expected None or a [{batch} or 1, 1, {seq_len}, {seq_len}] tensor (the "
                         f"'sdpa' or 'eager' mask of transformers), got {got}")
    masked = ~attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
    masked = masked & ~masked.all(dim=-1, keepdim=True)
    return masked.expand(batch, 1, seq_len, seq_len), "padding"


def _add_bias(linear_module: nn.Module) -> None:
    """Give a bias-less Linear / LayerNormLinear (built with bias=False) a bias parameter [out_features]: one GEMM of
    a TransformerLayer with a bias while the others have none (TransformerLayer's `bias` flag covers all of them)."""
    weight = linear_module.weight
    linear_module.bias = nn.Parameter(torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device))


class LlamaTransformerLayer(nn.Module):
    """Drop-in for a Hugging Face Llama-like decoder layer: forward(hidden_states [b, s, hidden], attention_mask,
    position_ids, cache / past_key_values, ...) -> hidden_states, through `self.layer`, a TransformerLayer.

    Not supported: transformers' output_attentions (not recorded). transformers'
    model.gradient_checkpointing_enable() sets `gradient_checkpointing`: in training the layer is then checkpointed
    with transformer_fp8.checkpoint (FP8 recompute), whatever checkpoint function transformers passes.

    Attributes:
        layer: the TransformerLayer. shape: the LayerShape (sizes, biases, q/k norm) that the weight map reads.
        layer_idx: the layer's index in the model (its slot in a KV cache).
    """

    gradient_checkpointing = False

    def __init__(self, config: Any, rope: RopeAngles, params_dtype: torch.dtype, device: torch.device | str | None,
                 fuse_wgrad_accumulation: bool = False, shape: LayerShape | None = None, layer_idx: int = 0) -> None:
        """Args:
            config: the Hugging Face config. rope: the model's RopeAngles (shared by its layers).
            params_dtype, device: of the new parameters. fuse_wgrad_accumulation: see TransformerLayer.
            shape: the layer's LayerShape (default: from config). layer_idx: the layer's index in the model.
        """
        super().__init__()
        self.shape = shape or LayerShape.from_config(config)
        self.layer_idx = layer_idx
        qk_norm = dict(qk_norm_type="RMSNorm", qk_norm_eps=config.rms_norm_eps, qk_norm_before_rope=True) \
            if self.shape.qk_norm else {}
        self.layer = TransformerLayer(
            config.hidden_size, config.intermediate_size, config.num_attention_heads,
            num_gqa_groups=self.shape.groups, kv_channels=self.shape.head_dim,
            layernorm_epsilon=config.rms_norm_eps, hidden_dropout=0.0, attention_dropout=0.0,
            init_method=_skip_init, output_layer_init_method=_skip_init, self_attn_mask_type="causal",
            params_dtype=params_dtype, fuse_qkv_params=True, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            zero_centered_gamma=False, qkv_weight_interleaved=False, bias=False, activation="swiglu",
            normalization="RMSNorm", device=device, attn_input_format="bshd", **qk_norm)
        if self.shape.qkv_bias:
            _add_bias(self.layer.self_attention.layernorm_qkv)
        if self.shape.o_bias:
            _add_bias(self.layer.self_attention.proj)
        self._rope = rope
        self._captured_kv = None  # (k, v) of the last core attention call while a prefill fills the cache
        self.layer.self_attention.core_attention.register_forward_pre_hook(self._capture_kv)
        self.register_load_state_dict_pre_hook(_fuse_hf_entries)

    def _capture_kv(self, module, args):
        """Forward pre-hook of the core attention: keep its k and v ([b, s, g, d], after RoPE) when asked."""
        if self._captured_kv is not None:
            self._captured_kv = args[1:3]

    @torch.no_grad()
    def load_hf_layer(self, hf_layer: nn.Module) -> None:
        """Copy the weights of the Hugging Face decoder layer this one replaces (layer_weight_map's mapping); each of
        our parameters takes requires_grad from its first Hugging Face part.

        Args:
            hf_layer: the Hugging Face decoder layer.
        Raises:
            NotImplementedError: the Hugging Face layer has parameters the mapping does not cover (e.g. MLP biases).
        """
        table = layer_weight_map(self.shape)
        hf_params = dict(hf_layer.named_parameters())
        unmapped = set(hf_params) - {part.hf_name for fused in table for part in fused.parts}
        if unmapped:
            raise NotImplementedError(f"{type(hf_layer).__name__}: parameters {sorted(unmapped)} have no place in "
                                      f"TransformerLayer")
        ours = dict(self.named_parameters())
        for name, tensor in fuse_hf_weights(hf_params, table).items():
            ours[name].copy_(tensor)
        for fused in table:
            ours[fused.name].requires_grad_(hf_params[fused.parts[0].hf_name].requires_grad)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: Any = None, use_cache: bool = False,
                position_embeddings: Any = None, is_first_microbatch: bool | None = None, cache: Any = None,
                cache_position: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """position_embeddings (Hugging Face's cos/sin) is not read: the angles come from position_ids and the
        config's RoPE parameters, the same numbers computed in float32. The KV cache arrives as `cache`
        (transformers >= 5.2x) or `past_key_values` (earlier, with cache_position): see the module docstring.

        Args:
            hidden_states: [batch, seq, hidden].
            attention_mask: transformers' mask (None, 2-D padding mask or 4-D mask).
            position_ids: [batch or 1, seq] token positions (default: 0, 1, ... or after the cached tokens).
            past_key_values: the KV cache (transformers < 5.2x), or None.
            use_cache: accepted for transformers; the cache is used whenever one is passed.
            position_embeddings: Hugging Face's (cos, sin); not read.
            is_first_microbatch: see transformer_fp8.Linear (FP8 weight caching over micro-batches).
            cache: the KV cache (transformers >= 5.2x), or None.
            cache_position: where the new tokens go in the cache (transformers < 5.2x), or None.
            **kwargs: other transformers arguments, ignored.

        Returns:
            The layer's output hidden states [batch, seq, hidden].
        """
        cache = pick_cache(cache, past_key_values)
        batch, seq_len = hidden_states.shape[:2]
        checkpointed = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        if cache is not None and checkpointed:  # the recompute would write the cache twice: transformers' rule
            _warn_once("gradient checkpointing in training: the KV cache is not filled (as transformers does)")
            cache = None
        if cache is not None and _is_first_dynamic_fill(cache, self.layer_idx):
            return self._prefill(hidden_states, attention_mask, position_ids, cache, cache_position,
                                 is_first_microbatch)
        if cache is not None:
            if position_ids is None:  # (transformers always passes them; this is for direct calls)
                start = cache.get_seq_length(self.layer_idx) if cache_position is None else cache_position[:1]
                position_ids = (torch.arange(seq_len, device=hidden_states.device) + start)[None]
            freqs = self._rope(position_ids, seq_len, hidden_states.device)
            return self._cached_forward(hidden_states, attention_mask, freqs, cache, cache_position,
                                        is_first_microbatch)
        mask, mask_type = _attention_args(attention_mask, batch, seq_len)
        freqs = self._rope(position_ids, seq_len, hidden_states.device)
        layer_args = dict(attention_mask=mask, self_attn_mask_type=mask_type, rotary_pos_emb=freqs,
                          is_first_microbatch=is_first_microbatch)
        if checkpointed:
            return checkpoint(self.layer, hidden_states, **layer_args)
        return self.layer(hidden_states, **layer_args)

    def _prefill(self, hidden_states, attention_mask, position_ids, cache, cache_position, is_first_microbatch):
        """The first tokens into an empty dynamic cache (a prompt; also a plain forward with use_cache=True): the
        fused TransformerLayer forward, as without a cache, whose attention inputs k and v then go to the cache."""
        self._captured_kv = ()
        try:
            out = self.forward(hidden_states, attention_mask, position_ids, is_first_microbatch=is_first_microbatch)
            k, v = self._captured_kv
        finally:
            self._captured_kv = None
        keys, _ = update_cache(cache, k.transpose(1, 2), v.transpose(1, 2), self.layer_idx, cache_position)
        if keys.shape[2] != hidden_states.shape[1]:
            raise RuntimeError(f"cache: layer {self.layer_idx} was empty, but after this prefill holds "
                               f"{keys.shape[2]} positions instead of {hidden_states.shape[1]}")
        return out

    def _cached_forward(self, hidden_states, attention_mask, freqs, cache, cache_position, is_first_microbatch):
        """The layer with its keys and values appended to `cache` (see the module docstring)."""
        attn = self.layer.self_attention
        batch, q_len = hidden_states.shape[:2]
        qkv = attn.layernorm_qkv(hidden_states, is_first_microbatch=is_first_microbatch)
        q, k, v = attn._split_qkv(qkv)  # [b, s, heads, d] views
        if attn.q_norm is not None and attn.qk_norm_before_rope:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rotary_pos_emb(q, freqs, "bshd"), apply_rotary_pos_emb(k, freqs, "bshd")  # (v: the cache copies)
        if attn.q_norm is not None and not attn.qk_norm_before_rope:
            q, k = attn.q_norm(q), attn.k_norm(k)
        past_len = None  # tokens cached before this step: a static cache's causal mask when transformers gives none
        if attention_mask is None and getattr(cache, "is_compileable", False):
            past_len = cache_position[:1] if cache_position is not None else cache.get_seq_length(self.layer_idx)
            if isinstance(past_len, torch.Tensor):
                past_len = past_len.clone()  # (a static cache's length counter, which the update advances in place)
        keys, values = update_cache(cache, k.transpose(1, 2), v.transpose(1, 2), self.layer_idx, cache_position)
        mask = cached_attention_mask(attention_mask, batch, q_len, keys.shape[2], past_len, hidden_states.device)
        context = cached_attention(q.transpose(1, 2), keys, values, mask, attn.core_attention.softmax_scale)
        context = context.transpose(1, 2).reshape(batch, q_len, -1)
        hidden = attn.proj(context, is_first_microbatch=is_first_microbatch, residual=hidden_states)
        return self.layer.layernorm_mlp(hidden, is_first_microbatch=is_first_microbatch, residual=hidden)


def _fuse_hf_entries(module, state_dict, prefix, *args):
    """Load-state-dict pre-hook of a converted layer: entries under the Hugging Face names (a checkpoint that
    save_pretrained / to_hf_state_dict wrote, e.g. one transformers' Trainer resumes from) are fused into ours, so
    that such a checkpoint loads into the converted model as into the Hugging Face one."""
    table = layer_weight_map(module.shape)
    if prefix + table[0].parts[0].hf_name not in state_dict:
        return
    hf_names = [part.hf_name for fused in table for part in fused.parts]
    hf_state = {name: state_dict.pop(prefix + name) for name in hf_names if prefix + name in state_dict}
    for name, tensor in fuse_hf_weights(hf_state, table).items():
        state_dict[prefix + name] = tensor


def _is_first_dynamic_fill(cache, layer_idx: int) -> bool:
    """Whether this layer's part of `cache` is empty and grows with what is appended (a dynamic cache: after the
    update it holds exactly this step's keys). Static caches (transformers marks them compileable) are not."""
    if getattr(cache, "is_compileable", False):
        return False
    return int(cache.get_seq_length(layer_idx)) == 0


def convert_llama(model: nn.Module, params_dtype: torch.dtype | None = None,
                  fuse_wgrad_accumulation: bool = False) -> nn.Module:
    """convert_model for a Llama-like model (kept for existing callers): every Llama, Mistral, Qwen2 or Qwen3
    decoder layer becomes a LlamaTransformerLayer, the final RMSNorm ours; in place.

    Args:
        model: a Hugging Face model of one of those families.
        params_dtype: dtype of the new parameters (default: each layer's own weight dtype).
        fuse_wgrad_accumulation: the GEMM weights' gradients accumulate into `weight.main_grad`.
    Returns:
        `model`.
    Raises:
        ValueError: no decoder layer of a supported family in `model`. NotImplementedError: a configuration the
        layer cannot compute exactly (see convert_model).
    """
    from .convert_model import convert_model  # (convert_model.py imports this module)
    return convert_model(model, params_dtype=params_dtype, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                         fallback=False)
