"""integrations.convert_model on every supported family, each a tiny random-init model built with transformers: the
converted model's logits and every parameter's gradient (read back under Hugging Face names through hf_mapping)
match the Hugging Face model's, in float32 and in BF16 (against float64); FP8 runs (CPU: FP8 reference kernels);
the weight mapping covers every Hugging Face tensor both ways; llama3 RoPE frequencies equal transformers'; Gemma 2/3
and unsupported options are refused naming what differs; other models fall back to convert_linear_layers (GPT-2's
Conv1D included)."""
import copy

import pytest
import torch

import transformer_fp8 as te
from tests.hf_compare import check_logits_and_gradients, randomize_norms_and_biases
from tests.utils import FP8_RTOL, rel_error
from transformer_fp8 import recipe
from transformer_fp8.integrations import LlamaTransformerLayer, convert_model, layer_weight_map
from transformer_fp8.integrations.hf_mapping import fuse_hf_weights, split_fused_weights
from transformer_fp8.integrations.rope_angles import inverse_frequencies
from transformer_fp8.module.norm import RMSNorm

transformers = pytest.importorskip("transformers")

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)
# name -> (config class, model class, config overrides)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3.1": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA3_ROPE)),
    "llama-attention-bias": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, head_dim=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),  # head_dim != hidden / heads
}


def tiny_config(family, **overrides):
    config_class, _, extra = FAMILIES[family]
    return getattr(transformers, config_class)(**{**COMMON, **extra, **overrides})


def tiny_model(family, dtype=torch.float32, **overrides):
    """A random-init model of `family`; norm weights and biases randomised too (they start at 1 and 0, where a
    wrong mapping would not show)."""
    model = getattr(transformers, FAMILIES[family][1])(tiny_config(family, **overrides))
    randomize_norms_and_biases(model)
    return model.to(dtype).eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_every_gradient_match_hugging_face_in_fp32(family):
    model = tiny_model(family)
    converted = convert_model(copy.deepcopy(model))
    assert converted.tfp8_conversion.family == model.config.model_type
    assert len(converted.tfp8_conversion.decoder_layers) == 2 and converted.tfp8_conversion.norms == ["model.norm"]
    assert all(isinstance(layer, LlamaTransformerLayer) for layer in converted.model.layers)
    assert isinstance(converted.model.norm, RMSNorm)
    # (40 tokens: longer than llama3's original_max_position_embeddings)
    check_logits_and_gradients(model, converted, torch.randint(0, VOCAB, (2, 40)))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_logits_as_close_to_float64_as_hugging_face_bf16_and_fp8_runs(family):
    model = tiny_model(family)
    ids = torch.randint(0, VOCAB, (2, 24))
    exact = copy.deepcopy(model).double()(input_ids=ids).logits
    model = model.to(torch.bfloat16)
    converted = convert_model(copy.deepcopy(model))
    hf_err = rel_error(model(input_ids=ids).logits, exact)
    our_err = rel_error(converted(input_ids=ids).logits, exact)
    assert our_err < 2 * hf_err + 1e-3, (our_err, hf_err)
    converted.train()
    for _ in range(2):  # the second step runs with the scales that delayed scaling set after the first
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling(amax_history_len=4)):
            out = converted(input_ids=ids, labels=ids)
        out.loss.backward()
    # a whole model's logits: the roundings of 8 FP8 GEMMs add up
    assert 0 < rel_error(out.logits, exact) < 2 * FP8_RTOL[torch.float8_e4m3fn]
    assert all(p.grad is not None and p.grad.isfinite().all() for p in converted.parameters() if p.requires_grad)


def test_qwen2_has_a_bias_on_the_qkv_gemm_only_and_qwen3_per_head_norms():
    qwen2 = convert_model(tiny_model("qwen2")).model.layers[0].layer
    assert qwen2.self_attention.layernorm_qkv.bias is not None
    assert qwen2.self_attention.proj.bias is None
    assert qwen2.layernorm_mlp.fc1_bias is None and qwen2.layernorm_mlp.fc2_bias is None
    assert qwen2.self_attention.q_norm is None
    qwen3 = convert_model(tiny_model("qwen3")).model.layers[0].layer
    assert qwen3.self_attention.q_norm.weight.shape == (32,) and qwen3.self_attention.qk_norm_before_rope
    assert qwen3.self_attention.layernorm_qkv.bias is None


@pytest.mark.parametrize("family", list(FAMILIES))
def test_weight_map_covers_every_hugging_face_tensor_both_ways(family):
    model = tiny_model(family)
    hf_state = model.model.layers[0].state_dict()
    table = layer_weight_map(model.config)
    ours = fuse_hf_weights(hf_state, table)
    converted = convert_model(copy.deepcopy(model)).model.layers[0]
    assert ours.keys() == dict(converted.named_parameters()).keys()
    for name, tensor in ours.items():
        assert torch.equal(dict(converted.named_parameters())[name], tensor), name
    back = split_fused_weights(ours, table)
    assert back.keys() == hf_state.keys()
    assert all(torch.equal(back[name], hf_state[name]) for name in hf_state)
    with pytest.raises(KeyError, match="self_attn.q_proj.weight"):
        fuse_hf_weights({k: v for k, v in hf_state.items() if k != "self_attn.q_proj.weight"}, table)


def test_llama3_rope_frequencies_equal_transformers_and_change_the_logits():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    config = tiny_config("llama3.1")
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = inverse_frequencies(config, 16)
    assert torch.allclose(ours, expected, rtol=1e-6, atol=0)
    plain = inverse_frequencies(tiny_config("llama", rope_parameters=dict(rope_type="default", rope_theta=500000.0)),
                                16)
    assert not torch.allclose(ours, plain)  # the scaling is not a no-op at these sizes


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gemma_is_refused_naming_what_differs(name):
    settings = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16)
    if name == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**settings))
    else:
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**settings))
    with pytest.raises(NotImplementedError, match="post-attention and post-feedforward norms"):
        convert_model(model)


@pytest.mark.parametrize("family, overrides, match", [
    ("mistral", dict(sliding_window=32), "sliding_window"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=32, max_window_layers=0), "sliding_window|layer_types"),
    ("llama", dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0)), "rope_type 'yarn'"),
    ("llama", dict(mlp_bias=True), "mlp_bias"),
    ("qwen3", dict(hidden_act="gelu"), "hidden_act"),
])
def test_unsupported_options_are_refused(family, overrides, match):
    with pytest.raises(NotImplementedError, match=match):
        convert_model(tiny_model(family, **overrides))


def test_other_models_fall_back_to_linear_layers_gpt2_conv1d_included():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    converted = convert_model(copy.deepcopy(model))
    conversion = converted.tfp8_conversion
    assert conversion.family is None and not conversion.decoder_layers
    assert sorted(conversion.linear_layers) == sorted(
        f"transformer.h.{i}.{name}" for i in range(2) for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                   "mlp.c_proj"))
    assert all(type(converted.get_submodule(n)) is te.Linear for n in conversion.linear_layers)
    ids = torch.randint(0, VOCAB, (2, 20))
    ref = model(input_ids=ids).logits
    assert rel_error(converted(input_ids=ids).logits, ref) < 1e-5
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe.Float8CurrentScaling()):
        assert 0 < rel_error(converted(input_ids=ids).logits, ref) < FP8_RTOL[torch.float8_e4m3fn]
    with pytest.raises(ValueError, match="model: no LlamaDecoderLayer"):
        convert_model(model, fallback=False)


def test_a_converted_model_is_not_converted_twice():
    converted = convert_model(tiny_model("llama"))
    with pytest.raises(ValueError, match="already converted"):
        convert_model(converted)


@pytest.mark.parametrize("before_rope", [False, True])
def test_multihead_attention_qk_norm_against_float64(before_rope):
    """MultiheadAttention(qk_norm_type="RMSNorm"): per-head RMSNorm of q and k after RoPE (TE's default) or before
    it, against a float64 reference written out here."""
    heads, groups, dim, hidden = 4, 2, 16, 64
    attn = te.MultiheadAttention(hidden, heads, num_gqa_groups=groups, kv_channels=dim, attention_dropout=0.0,
                                 bias=False, qkv_weight_interleaved=False, qk_norm_type="RMSNorm", qk_norm_eps=1e-6,
                                 qk_norm_before_rope=before_rope, attn_input_format="bshd", device="cpu",
                                 params_dtype=torch.float32)
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.k_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 10, hidden)
    freqs = te.RotaryPositionEmbedding(dim)(10)
    out = attn(x, rotary_pos_emb=freqs)

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()

    def rope(t):  # t [b, s, h, d]; rotate-half
        cos, sin = freqs[:, 0, 0].double().cos()[None, :, None], freqs[:, 0, 0].double().sin()[None, :, None]
        half = t.shape[-1] // 2
        return t * cos + torch.cat([-t[..., half:], t[..., :half]], dim=-1) * sin

    qkv = x.double() @ attn.qkv.weight.double().t()
    q, k, v = qkv.split([heads * dim, groups * dim, groups * dim], dim=-1)
    q, k, v = q.view(2, 10, heads, dim), k.view(2, 10, groups, dim), v.view(2, 10, groups, dim)
    if before_rope:
        q, k = rope(rms(q, attn.q_norm.weight)), rope(rms(k, attn.k_norm.weight))
    else:
        q, k = rms(rope(q), attn.q_norm.weight), rms(rope(k), attn.k_norm.weight)
    k, v = k.repeat_interleave(heads // groups, dim=2), v.repeat_interleave(heads // groups, dim=2)
    ctx = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           is_causal=True)
    ref = ctx.transpose(1, 2).reshape(2, 10, -1) @ attn.proj.weight.double().t()
    assert rel_error(out, ref) < 1e-5
    with pytest.raises(NotImplementedError, match="qk_norm_type"):
        te.MultiheadAttention(hidden, heads, qk_norm_type="L2Normalization", device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cuda_bf16_logits_match_and_fp8_trains(family):
    torch.manual_seed(0)
    settings = dict(hidden_size=256, intermediate_size=704, num_attention_heads=8, num_key_value_heads=2,
                    **(dict(head_dim=64) if family in ("qwen3", "mistral") else {}))  # (FAMILIES sets 16, 32)
    model = tiny_model(family, **settings).cuda()
    ids = torch.randint(0, VOCAB, (4, 128), device="cuda")
    exact = copy.deepcopy(model).double()(input_ids=ids).logits
    model = model.to(torch.bfloat16)
    converted = convert_model(copy.deepcopy(model)).train()
    hf_err = rel_error(model(input_ids=ids).logits, exact)
    our_err = rel_error(converted(input_ids=ids).logits, exact)
    assert our_err < 2 * hf_err + 1e-3, (our_err, hf_err)

    def train(model, fp8):  # one fixed batch, 10 AdamW steps: the losses
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(10):
            with te.fp8_autocast(enabled=fp8, fp8_recipe=recipe.DelayedScaling(amax_history_len=4)):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    bf16_losses, fp8_losses = train(copy.deepcopy(converted), False), train(converted, True)
    # FP8 training learns (the loss falls as in BF16) and tracks the BF16 run of the same model
    assert all(torch.isfinite(torch.tensor(fp8_losses))), fp8_losses
    assert fp8_losses[-1] < 0.9 * fp8_losses[0], fp8_losses
    assert abs(fp8_losses[-1] - bf16_losses[-1]) < 0.05 * bf16_losses[-1], (fp8_losses, bf16_losses)


@pytest.mark.parametrize("hooked_before", [False, True])
def test_output_hidden_states_include_the_converted_layers(hooked_before):
    """transformers collects output_hidden_states with hooks on its decoder-layer class: the converted layers report
    theirs too (whether or not the model had its hooks installed before the conversion)."""
    model = tiny_model("qwen3")
    ids = torch.randint(0, VOCAB, (2, 9))
    if hooked_before:
        model(input_ids=ids, output_hidden_states=True)
    ref = model(input_ids=ids, output_hidden_states=True).hidden_states
    out = convert_model(copy.deepcopy(model))(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(out) == len(ref) == 3
    for mine, theirs in zip(out, ref):
        assert rel_error(mine, theirs) < 1e-5
