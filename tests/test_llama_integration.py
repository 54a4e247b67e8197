"""integrations.convert_llama: Hugging Face LlamaDecoderLayers -> our TransformerLayer. Same logits and gradients as
the Hugging Face model outside fp8_autocast (fp32 on the CPU, bf16 on the GPU), FP8 inside it; GQA, head_dim, padding
masks, per-sequence position ids, linear RoPE scaling; local checkpoints; state dicts; refused configurations;
causal_lm_loss (the chunked head + loss) against the model's own loss."""
import copy

import pytest
import torch

import transformer_fp8 as te
from tests.utils import FP8_RTOL, rel_error
from transformer_fp8 import integrations, recipe
from transformer_fp8.integrations import LlamaTransformerLayer, causal_lm_loss, convert_llama, microbatch
from transformer_fp8.integrations.gradient_checkpointing import hf_enable
from transformer_fp8.module import base
from transformer_fp8.module.norm import RMSNorm

transformers = pytest.importorskip("transformers")

FP8_RECIPE = recipe.DelayedScaling(amax_history_len=4)


@pytest.fixture(autouse=True)
def always_fp8(monkeypatch):
    """These models are small: without this, CUDA runs would take the modules' small-shape high-precision path."""
    monkeypatch.setattr(base, "FP8_MIN_GEMM_SIZE", 0, raising=False)
VOCAB = 96
CONFIGS = {  # GQA; plain multi-head; head_dim != hidden / heads
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "head_dim": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32),
}


def llama_config(**overrides):
    settings = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
    return transformers.LlamaConfig(**{**settings, **overrides})


def random_llama(config, dtype=torch.float32, device="cpu"):
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # norm weights start at 1: randomise them so that a wrong mapping shows
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
    return model.to(device, dtype)


def converted_copy(model, **kwargs):
    return convert_llama(copy.deepcopy(model), **kwargs)


def test_every_decoder_layer_is_replaced_with_its_weights_mapped():
    model = random_llama(llama_config())
    hf_layer = model.model.layers[1]
    converted = converted_copy(model)
    assert all(isinstance(layer, LlamaTransformerLayer) for layer in converted.model.layers)
    ours = converted.model.layers[1].layer
    attn, mlp = hf_layer.self_attn, hf_layer.mlp
    q, k, v = ours.self_attention.layernorm_qkv.weight.split([64, 32, 32])
    for mine, theirs in ((q, attn.q_proj.weight), (k, attn.k_proj.weight), (v, attn.v_proj.weight),
                         (ours.self_attention.proj.weight, attn.o_proj.weight),
                         (ours.layernorm_mlp.fc1_weight[:176], mlp.gate_proj.weight),
                         (ours.layernorm_mlp.fc1_weight[176:], mlp.up_proj.weight),
                         (ours.layernorm_mlp.fc2_weight, mlp.down_proj.weight),
                         (ours.self_attention.layernorm_qkv.layer_norm_weight, hf_layer.input_layernorm.weight),
                         (ours.layernorm_mlp.layer_norm_weight, hf_layer.post_attention_layernorm.weight)):
        assert torch.equal(mine, theirs)
    assert converted.config.use_cache == model.config.use_cache  # (left as it was: the layers keep a KV cache)
    assert not any(name.endswith("_proj.weight") for name, _ in converted.model.layers.named_parameters())
    assert type(converted.model.norm) is RMSNorm and torch.equal(converted.model.norm.weight, model.model.norm.weight)
    assert converted.model.norm.eps == model.model.norm.variance_epsilon


@pytest.mark.parametrize("name", list(CONFIGS))
def test_same_logits_and_gradients_as_hugging_face_in_fp32(name):
    model = random_llama(llama_config(**CONFIGS[name]))
    converted = converted_copy(model)
    ids = torch.randint(0, VOCAB, (3, 17))  # odd sequence length
    ref, out = model(input_ids=ids, labels=ids), converted(input_ids=ids, labels=ids)
    assert rel_error(out.logits, ref.logits) < 1e-5
    ref.loss.backward()
    out.loss.backward()
    hf_layer, ours = model.model.layers[0], converted.model.layers[0].layer
    hf_qkv = torch.cat([hf_layer.self_attn.q_proj.weight.grad, hf_layer.self_attn.k_proj.weight.grad,
                        hf_layer.self_attn.v_proj.weight.grad])
    hf_fc1 = torch.cat([hf_layer.mlp.gate_proj.weight.grad, hf_layer.mlp.up_proj.weight.grad])
    for mine, theirs in ((ours.self_attention.layernorm_qkv.weight.grad, hf_qkv),
                         (ours.layernorm_mlp.fc1_weight.grad, hf_fc1),
                         (ours.layernorm_mlp.fc2_weight.grad, hf_layer.mlp.down_proj.weight.grad),
                         (ours.self_attention.layernorm_qkv.layer_norm_weight.grad,
                          hf_layer.input_layernorm.weight.grad),
                         (converted.model.embed_tokens.weight.grad, model.model.embed_tokens.weight.grad)):
        assert rel_error(mine, theirs) < 1e-4


def test_mistral_is_converted_and_its_sliding_window_refused():
    """A MistralForCausalLM (Llama's layer) converts, with the Hugging Face model's logits and gradients; a sliding
    window (Mistral 7B v0.1) is refused."""
    settings = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, head_dim=16)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**settings, sliding_window=None))
    converted = converted_copy(model)
    assert all(isinstance(layer, LlamaTransformerLayer) for layer in converted.model.layers)
    assert isinstance(converted.model.norm, RMSNorm)
    ids = torch.randint(0, VOCAB, (2, 17))
    ref, out = model(input_ids=ids, labels=ids), converted(input_ids=ids, labels=ids)
    assert rel_error(out.logits, ref.logits) < 1e-5
    ref.loss.backward()
    out.loss.backward()
    assert rel_error(converted.model.embed_tokens.weight.grad, model.model.embed_tokens.weight.grad) < 1e-4
    windowed = transformers.MistralForCausalLM(transformers.MistralConfig(**settings, sliding_window=32))
    with pytest.raises(NotImplementedError, match="sliding_window"):
        convert_llama(windowed)


def test_bf16_logits_as_close_to_float64_as_hugging_face_bf16():
    model = random_llama(llama_config())
    ids = torch.randint(0, VOCAB, (2, 24))
    exact = copy.deepcopy(model).double()(input_ids=ids).logits
    model = model.to(torch.bfloat16)
    hf_err = rel_error(model(input_ids=ids).logits, exact)
    our_err = rel_error(converted_copy(model)(input_ids=ids).logits, exact)
    assert our_err < 2 * hf_err + 1e-3, (our_err, hf_err)


def test_padding_mask_and_per_sequence_positions_match_hugging_face():
    model = random_llama(llama_config())
    converted = converted_copy(model)
    ids = torch.randint(0, VOCAB, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    mask[2, 9:] = 0  # right padding
    positions = (mask.cumsum(-1) - 1).clamp_min(0)  # what generate() passes for left padding
    ref = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    out = converted(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    assert out.isfinite().all()
    real = mask.bool()
    assert rel_error(out[real], ref[real]) < 1e-5
    plain = converted(input_ids=ids).logits  # no mask: causal, and the padding changes the answer
    assert rel_error(plain[real], ref[real]) > 1e-2


def test_eager_mask_builder_is_switched_to_sdpa():
    model = random_llama(llama_config(attn_implementation="eager"))
    ids = torch.randint(0, VOCAB, (2, 10))
    ref = model(input_ids=ids).logits
    converted = converted_copy(model)
    assert converted.config._attn_implementation == "sdpa"
    assert rel_error(converted(input_ids=ids).logits, ref) < 1e-5


def test_linear_rope_scaling_matches_hugging_face():
    config = llama_config(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0})
    model = random_llama(config)
    ids = torch.randint(0, VOCAB, (2, 20))
    assert rel_error(converted_copy(model)(input_ids=ids).logits, model(input_ids=ids).logits) < 1e-5


def test_fp8_autocast_runs_the_layers_in_fp8():
    model = random_llama(llama_config())
    converted = converted_copy(model)
    ids = torch.randint(0, VOCAB, (2, 32))
    ref = model(input_ids=ids).logits
    for _ in range(2):  # the second pass uses the scales delayed scaling set after the first
        with te.fp8_autocast(enabled=True, fp8_recipe=FP8_RECIPE):
            out = converted(input_ids=ids).logits
    assert 0 < rel_error(out, ref) < FP8_RTOL[torch.float8_e4m3fn]


@pytest.mark.parametrize("conversion", ["convert_llama", "convert_linear_layers"])
def test_gradient_checkpointing_recomputes_in_fp8_with_the_same_gradients(conversion):
    """Gradient checkpointing of a converted model (transformers' own for convert_llama's layers; through
    integrations.gradient_checkpointing_enable for convert_linear_layers): FP8 training steps give the gradients of
    the same steps without checkpointing, bit for bit."""
    converted = getattr(integrations, conversion)(random_llama(llama_config()))
    checkpointed = copy.deepcopy(converted)
    if conversion == "convert_llama":
        hf_enable(checkpointed)
    else:
        integrations.gradient_checkpointing_enable(checkpointed)
    assert all(layer.gradient_checkpointing for layer in checkpointed.model.layers)
    ids = torch.randint(0, VOCAB, (2, 32))
    calls = []
    for model in (converted, checkpointed):
        model.train()
        layer = model.model.layers[0]
        hooked = layer.layer if conversion == "convert_llama" else layer.mlp.down_proj
        hooked.register_forward_pre_hook(lambda *_: calls.append(model))
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with te.fp8_autocast(enabled=True, fp8_recipe=FP8_RECIPE):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
    assert (calls.count(converted), calls.count(checkpointed)) == (2, 4)  # (two steps; recomputed in the backward)
    for (name, p), q in zip(converted.named_parameters(), checkpointed.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_transformers_own_checkpointing_of_fp8_linear_layers_is_refused_clearly():
    """transformers' activation checkpointing (torch.utils.checkpoint) of convert_linear_layers' FP8 layers: the
    recompute is refused, naming the integration that checkpoints them in FP8."""
    model = integrations.convert_linear_layers(random_llama(llama_config()))
    hf_enable(model)
    model.train()
    ids = torch.randint(0, VOCAB, (2, 32))
    with te.fp8_autocast(enabled=True, fp8_recipe=FP8_RECIPE):
        loss = model(input_ids=ids, labels=ids).loss
    with pytest.raises(RuntimeError, match="integrations.gradient_checkpointing_enable"):
        loss.backward()


def test_local_checkpoint_directory(tmp_path):
    model = random_llama(llama_config())
    model.save_pretrained(tmp_path / "ckpt")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (2, 16))
    ref = model(input_ids=ids).logits
    assert rel_error(convert_llama(loaded)(input_ids=ids).logits, ref) < 1e-5


def test_state_dict_round_trip_with_fp8_state(tmp_path):
    converted = converted_copy(random_llama(llama_config()))
    ids = torch.randint(0, VOCAB, (2, 16))
    with te.fp8_autocast(enabled=True, fp8_recipe=FP8_RECIPE):
        converted(input_ids=ids, labels=ids).loss.backward()  # FP8 scaling state, saved as extra state
    torch.save(converted.state_dict(), tmp_path / "model.pt")

    torch.manual_seed(99)
    restored = converted_copy(random_llama(llama_config()))
    restored.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=False))
    assert torch.equal(restored(input_ids=ids).logits, converted(input_ids=ids).logits)
    with te.fp8_autocast(enabled=True, fp8_recipe=FP8_RECIPE):
        assert torch.equal(restored(input_ids=ids).logits, converted(input_ids=ids).logits)


def test_fused_wgrad_and_microbatch_weight_cache():
    converted = converted_copy(random_llama(llama_config()), fuse_wgrad_accumulation=True)
    layer = converted.model.layers[0].layer
    weights = [layer.self_attention.layernorm_qkv.weight, layer.self_attention.proj.weight,
               layer.layernorm_mlp.fc1_weight, layer.layernorm_mlp.fc2_weight]
    for block in converted.model.layers:
        for module in block.modules():
            for p in module.parameters(recurse=False):
                if p.dim() == 2:
                    p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (2, 16))
    current = recipe.Float8CurrentScaling()  # activation scales from the activations alone: runs repeat exactly
    with te.fp8_autocast(enabled=True, fp8_recipe=current), microbatch(converted, is_first=True):
        first = converted(input_ids=ids, labels=ids)
    first.loss.backward()
    assert all(w.grad is None and w.main_grad.abs().sum() > 0 for w in weights)
    with torch.no_grad():
        for w in weights:
            w.mul_(2)  # not seen by the next micro-batch: it reuses the FP8 weights cached by the first
    with te.fp8_autocast(enabled=True, fp8_recipe=current), microbatch(converted, is_first=False):
        cached = converted(input_ids=ids).logits
    with te.fp8_autocast(enabled=True, fp8_recipe=current):
        recast = converted(input_ids=ids).logits
    assert torch.equal(cached, first.logits)
    assert rel_error(recast, first.logits) > 0.1


def loss_and_grads(model, loss_fn):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("convert", [False, True])
def test_causal_lm_loss_equals_the_models_loss_and_gradients(convert):
    model = random_llama(llama_config())
    model = converted_copy(model) if convert else model
    ids = torch.randint(0, VOCAB, (3, 17))
    labels = ids.clone()
    labels[0, :5] = -100  # e.g. a prompt that is not trained on
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ref, ref_grads = loss_and_grads(model, lambda m: m(input_ids=ids, labels=labels, attention_mask=mask).loss)
    loss, grads = loss_and_grads(model, lambda m: causal_lm_loss(m, ids, labels, chunk_size=8, attention_mask=mask))
    assert rel_error(loss, ref) < 1e-6
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert rel_error(grad, ref_grads[name]) < 1e-5, name


@pytest.mark.parametrize("convert", [False, True])
def test_causal_lm_loss_skips_the_mask_builders_packed_sequence_read_only_where_no_mask_can_be_needed(
        convert, monkeypatch):
    """Without mask inputs the decoder runs with no mask built (causal SDPA; no host read of the position ids), the
    same loss and gradients as the model's own; config._attn_implementation is "sdpa" again after; a padding mask,
    explicit position ids or a sliding window take transformers' mask builder as before."""
    from transformer_fp8.integrations import causal_lm
    masking_utils = pytest.importorskip("transformers.masking_utils")
    model = random_llama(llama_config(use_cache=False), dtype=torch.float32)  # (a cache also skips the packed check)
    model.config._attn_implementation = "sdpa"
    model = converted_copy(model) if convert else model
    ids = torch.randint(0, VOCAB, (2, 16))
    ref, ref_grads = loss_and_grads(model, lambda m: m(input_ids=ids, labels=ids).loss)
    calls = []
    real = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda *a, **k: calls.append(1) or real(*a, **k))
    loss, grads = loss_and_grads(model, lambda m: causal_lm_loss(m, ids, chunk_size=8))
    assert calls == [] and model.config._attn_implementation == "sdpa"
    assert rel_error(loss, ref) < 1e-6
    for name, grad in grads.items():
        assert rel_error(grad, ref_grads[name]) < 1e-5, name
    positions = torch.arange(16)[None].expand(2, 16)
    causal_lm_loss(model, ids, chunk_size=8, position_ids=positions)
    assert calls == [1]
    model.config.sliding_window = 8
    assert not causal_lm._mask_free(model.config, {})
    model.config.sliding_window = None
    model.config._attn_implementation = "eager"
    assert not causal_lm._mask_free(model.config, {})


def test_causal_lm_loss_in_fp8_and_refused_logit_transforms():
    converted = converted_copy(random_llama(llama_config()))
    ids = torch.randint(0, VOCAB, (2, 16))
    current = recipe.Float8CurrentScaling()  # scales from the tensors alone: both calls compute the same FP8 layers
    with te.fp8_autocast(enabled=True, fp8_recipe=current):
        ref = converted(input_ids=ids, labels=ids).loss
        loss = causal_lm_loss(converted, ids)
    assert rel_error(loss, ref) < 1e-6
    converted.config.final_logit_softcapping = 30.0
    with pytest.raises(NotImplementedError, match="final_logit_softcapping"):
        causal_lm_loss(converted, ids)


@pytest.mark.parametrize("overrides, match", [
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), "rope_type 'dynamic'"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_unsupported_configs_are_refused(overrides, match):
    with pytest.raises(NotImplementedError, match=match):
        convert_llama(random_llama(llama_config(**overrides)))


def test_models_without_llama_layers_are_refused():
    with pytest.raises(ValueError, match="model: no LlamaDecoderLayer"):
        convert_llama(torch.nn.Sequential(torch.nn.Linear(16, 16)))


@pytest.mark.gpu
def test_cuda_bf16_logits_match_and_fp8_training_learns():
    torch.manual_seed(0)
    config = llama_config(hidden_size=256, intermediate_size=704, num_attention_heads=8, num_key_value_heads=2)
    model = random_llama(config, torch.bfloat16, "cuda")
    converted = converted_copy(model)
    ids = torch.randint(0, VOCAB, (4, 128), device="cuda")
    exact = copy.deepcopy(model).double()(input_ids=ids).logits
    hf_err = rel_error(model(input_ids=ids).logits, exact)
    our_err = rel_error(converted(input_ids=ids).logits, exact)
    assert our_err < 2 * hf_err + 1e-3, (our_err, hf_err)

    optimizer = torch.optim.AdamW(converted.parameters(), lr=1e-3, fused=True)
    batch = torch.randint(0, VOCAB, (4, 128), device="cuda")
    losses = []
    for _ in range(20):  # one fixed batch: the loss must fall
        with te.fp8_autocast(enabled=True, fp8_recipe=FP8_RECIPE):
            loss = converted(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.7 * losses[0], losses
    with te.fp8_autocast(enabled=True, fp8_recipe=FP8_RECIPE):
        fp8_logits = converted(input_ids=ids).logits
    with torch.no_grad():
        hp_logits = converted(input_ids=ids).logits
    # the logits of a whole trained model: the FP8 roundings of 8 GEMMs add up (0.065 measured on an H100)
    assert 0 < rel_error(fp8_logits, hp_logits) < 2 * FP8_RTOL[torch.float8_e4m3fn]


@pytest.mark.gpu
def test_cuda_bf16_causal_lm_loss_matches_the_models_loss():
    config = llama_config(hidden_size=256, intermediate_size=704, num_attention_heads=8, num_key_value_heads=2,
                          vocab_size=4000)
    converted = converted_copy(random_llama(config, torch.bfloat16, "cuda"))
    ids = torch.randint(0, 4000, (4, 128), device="cuda")
    ref, ref_grads = loss_and_grads(converted, lambda m: m(input_ids=ids, labels=ids).loss)
    loss, grads = loss_and_grads(converted, lambda m: causal_lm_loss(m, ids, chunk_size=128))  # 4 chunks
    assert rel_error(loss, ref) < 1e-3
    for name, grad in grads.items():
        assert rel_error(grad, ref_grads[name]) < 2e-2, name
