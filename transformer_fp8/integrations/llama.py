"""Run a Hugging Face Llama model (LlamaForCausalLM, LlamaModel; Mistral too) on transformer_fp8.TransformerLayer.

`convert_llama(model)` replaces every `LlamaDecoderLayer` (or `MistralDecoderLayer`: the same layer, without a
sliding window) inside `model` by a `LlamaTransformerLayer`: the same call
and return as the Hugging Face layer, computed by our TransformerLayer (RMSNorm, SwiGLU, GQA, RoPE, no bias, bshd),
with the weights mapped from the Hugging Face layer:
    input_layernorm.weight            -> self_attention.layernorm_qkv.layer_norm_weight
    q_proj | k_proj | v_proj weights  -> self_attention.layernorm_qkv.weight   (rows [all q | all k | all v])
    o_proj.weight                     -> self_attention.proj.weight
    post_attention_layernorm.weight   -> layernorm_mlp.layer_norm_weight
    gate_proj | up_proj weights       -> layernorm_mlp.fc1_weight              (rows [gate | up], as our swiglu)
    down_proj.weight                  -> layernorm_mlp.fc2_weight
(each under `<layer>.layer.`). The final LlamaRMSNorm (outside the decoder layers) becomes our RMSNorm, same `weight`
(fused kernels instead of Hugging Face's float32 chain of elementwise ops, which also saves float32 copies for the
backward). Outside fp8_autocast the converted model computes what the Hugging Face one does; inside it every GEMM of
the decoder layers runs in FP8. Nothing here imports transformers.
For training, `causal_lm_loss(model, input_ids)` gives the loss without the [tokens, vocab] logits.
"""
import torch
import torch.nn as nn

from ..checkpoint import checkpoint
from ..module.norm import RMSNorm
from ..module.transformer import TransformerLayer

HF_LAYER_CLASSES = ("LlamaDecoderLayer", "MistralDecoderLayer")
HF_NORM_CLASSES = ("LlamaRMSNorm", "MistralRMSNorm")


def _skip_init(weight):
    """No random init: the weights are overwritten with the Hugging Face layer's right after."""


def _rope_settings(config):
    """(rope_theta, position interpolation factor or None) from a Llama config; refuses RoPE scalings we lack."""
    params = getattr(config, "rope_parameters", None)  # transformers >= 5
    if params is None:  # older transformers: rope_theta and rope_scaling attributes
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(params["rope_theta"]), None
    if rope_type == "linear":
        return float(params["rope_theta"]), float(params["factor"])
    raise NotImplementedError(f"config.rope_parameters: rope_type {rope_type!r} is not supported by convert_llama "
                              f"(supported: 'default', 'linear')")


def _check_config(config):
    """Refuse Llama variants TransformerLayer cannot compute exactly."""
    unsupported = {"hidden_act": (getattr(config, "hidden_act", "silu"), "silu"),
                   "attention_bias": (getattr(config, "attention_bias", False), False),
                   "mlp_bias": (getattr(config, "mlp_bias", False), False),
                   "pretraining_tp": (getattr(config, "pretraining_tp", 1) or 1, 1),
                   "sliding_window": (getattr(config, "sliding_window", None), None)}  # (Mistral's)
    for name, (got, expected) in unsupported.items():
        if got != expected:
            raise NotImplementedError(f"config.{name}: convert_llama supports {expected!r} only, got {got!r}")
    _rope_settings(config)


def head_dim(config):
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class _RopeAngles:
    """RoPE angles for position ids, shared by the layers of one model and cached for the last position_ids tensor
    (the model passes the same tensor to every layer). -> freqs [s, b or 1, 1, head_dim] float32, the layout
    MultiheadAttention's rotary_pos_emb takes (one row of positions per sequence)."""

    def __init__(self, config):
        theta, self.interpolation = _rope_settings(config)
        dim = head_dim(config)
        self.inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        self._last = (None, None)

    def __call__(self, position_ids, seq_len, device):
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=device)[None]
        if position_ids is self._last[0]:
            return self._last[1]
        if self.inv_freq.device != device:
            self.inv_freq = self.inv_freq.to(device)
        positions = position_ids.to(device=device, dtype=torch.float32)
        if self.interpolation is not None:
            positions = positions / self.interpolation
        angles = positions[..., None] * self.inv_freq  # [b or 1, s, dim / 2]
        freqs = torch.cat((angles, angles), dim=-1).transpose(0, 1)[:, :, None, :]
        self._last = (position_ids, freqs)
        return freqs


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


class LlamaTransformerLayer(nn.Module):
    """Drop-in for a Hugging Face LlamaDecoderLayer: forward(hidden_states [b, s, hidden], attention_mask,
    position_ids, ...) -> hidden_states, through `self.layer`, a TransformerLayer. Not supported: KV caches
    (generation with use_cache), and transformers' output_hidden_states / output_attentions (not recorded).
    transformers' model.gradient_checkpointing_enable() sets `gradient_checkpointing`: in training the layer is then
    checkpointed with transformer_fp8.checkpoint (FP8 recompute), whatever checkpoint function transformers passes."""

    gradient_checkpointing = False

    def __init__(self, config, rope, params_dtype, device, fuse_wgrad_accumulation=False):
        super().__init__()
        self.layer = TransformerLayer(
            config.hidden_size, config.intermediate_size, config.num_attention_heads,
            num_gqa_groups=config.num_key_value_heads, kv_channels=head_dim(config),
            layernorm_epsilon=config.rms_norm_eps, hidden_dropout=0.0, attention_dropout=0.0,
            init_method=_skip_init, output_layer_init_method=_skip_init, self_attn_mask_type="causal",
            params_dtype=params_dtype, fuse_qkv_params=True, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            zero_centered_gamma=False, qkv_weight_interleaved=False, bias=False, activation="swiglu",
            normalization="RMSNorm", device=device, attn_input_format="bshd")
        self._rope = rope

    @torch.no_grad()
    def load_hf_layer(self, hf_layer):
        """Copy the weights of a Hugging Face LlamaDecoderLayer (see the module docstring for the mapping)."""
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        qkv, proj, ffn = self.layer.self_attention.layernorm_qkv, self.layer.self_attention.proj, \
            self.layer.layernorm_mlp
        qkv.layer_norm_weight.copy_(hf_layer.input_layernorm.weight)
        qkv.weight.copy_(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        proj.weight.copy_(attn.o_proj.weight)
        ffn.layer_norm_weight.copy_(hf_layer.post_attention_layernorm.weight)
        ffn.fc1_weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        ffn.fc2_weight.copy_(mlp.down_proj.weight)
        for param, hf_param in ((qkv.weight, attn.q_proj.weight), (proj.weight, attn.o_proj.weight),
                                (ffn.fc1_weight, mlp.gate_proj.weight), (ffn.fc2_weight, mlp.down_proj.weight),
                                (qkv.layer_norm_weight, hf_layer.input_layernorm.weight),
                                (ffn.layer_norm_weight, hf_layer.post_attention_layernorm.weight)):
            param.requires_grad_(hf_param.requires_grad)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, is_first_microbatch=None, cache=None, **kwargs):
        """position_embeddings (Hugging Face's cos/sin) is not read: the angles come from position_ids and the
        config's rope_theta, the same numbers computed in float32. The KV cache arrives as `cache` (transformers
        >= 5.2x) or `past_key_values` (older); either is refused while the layer keeps no cache."""
        for name, value in (("cache", cache), ("past_key_values", past_key_values)):
            if value is not None:
                raise NotImplementedError(f"{name}: the converted Llama layers keep no KV cache; call the model "
                                          f"with use_cache=False (convert_llama sets config.use_cache = False)")
        batch, seq_len = hidden_states.shape[:2]
        mask, mask_type = _attention_args(attention_mask, batch, seq_len)
        freqs = self._rope(position_ids, seq_len, hidden_states.device)
        layer_args = dict(attention_mask=mask, self_attn_mask_type=mask_type, rotary_pos_emb=freqs,
                          is_first_microbatch=is_first_microbatch)
        if self.gradient_checkpointing and self.training:
            return checkpoint(self.layer, hidden_states, **layer_args)
        return self.layer(hidden_states, **layer_args)


def convert_llama(model, params_dtype=None, fuse_wgrad_accumulation=False):
    """Replace every Hugging Face LlamaDecoderLayer (or MistralDecoderLayer) inside `model` by a
    LlamaTransformerLayer with its weights, and the RMSNorm left outside them (the final norm) by ours; in place,
    returns `model`.

    params_dtype: dtype of the new parameters (default: each layer's own weight dtype); they go on the layer's device.
    fuse_wgrad_accumulation: the GEMM weights' gradients accumulate into `weight.main_grad` (FP32, to be attached).
    The config is checked (SiLU, no biases, RoPE "default" or "linear", no sliding window). `config.use_cache` is set to False (no KV
    cache) and the mask builder to "sdpa" (which passes no mask for causal attention without padding).
    Checkpoints: save and load the converted model's state_dict (load it into a converted model of the same config).
    """
    layers = [(name, m) for name, m in model.named_modules() if type(m).__name__ in HF_LAYER_CLASSES]
    if not layers:
        raise ValueError(f"model: no {' or '.join(HF_LAYER_CLASSES)} found in {type(model).__name__}")
    config = layers[0][1].self_attn.config
    _check_config(config)
    rope = _RopeAngles(config)
    for name, hf_layer in layers:
        weight = hf_layer.self_attn.q_proj.weight
        new = LlamaTransformerLayer(config, rope, params_dtype or weight.dtype, weight.device,
                                    fuse_wgrad_accumulation)
        new.load_hf_layer(hf_layer)
        new.train(hf_layer.training)
        parent_name, _, child_name = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child_name, new)
    for name, hf_norm in [(name, m) for name, m in model.named_modules() if type(m).__name__ in HF_NORM_CLASSES]:
        parent_name, _, child_name = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child_name, _converted_norm(hf_norm, config, params_dtype))
    config.use_cache = False
    config._attn_implementation = "sdpa"
    return model


def _converted_norm(hf_norm, config, params_dtype):
    """Our RMSNorm with the weight (and epsilon) of a Hugging Face LlamaRMSNorm, on its device."""
    weight = hf_norm.weight
    norm = RMSNorm(weight.shape[0], eps=getattr(hf_norm, "variance_epsilon", config.rms_norm_eps),
                   params_dtype=params_dtype or weight.dtype, device=weight.device)
    with torch.no_grad():
        norm.weight.copy_(weight)
    norm.weight.requires_grad_(weight.requires_grad)
    return norm.train(hf_norm.training)
