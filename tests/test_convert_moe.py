"""convert_model on the mixture-of-experts families (Mixtral, Qwen2-MoE with its shared expert and dense layers,
Qwen3-MoE), each a tiny random-init model built with transformers: logits and every parameter's gradient (read back
under Hugging Face names) match the Hugging Face model's in float32; transformers' output_router_logits / aux loss
work on the converted model; greedy generate() gives the same tokens; the weight map covers every Hugging Face tensor
both ways; save_pretrained writes a checkpoint that plain transformers loads; the expert layouts of other transformers
versions (per-expert w1/w3/w2 or gate/up/down modules, transposed fused tensors) convert and export; FP8 runs (CPU
reference kernels; GPU: BF16); unsupported options are refused naming them."""
import copy

import pytest
import torch
import torch.nn as nn

import transformer_fp8 as te
from tests.hf_compare import check_logits_and_gradients, randomize_norms_and_biases
from tests.utils import FP8_RTOL, rel_error
from transformer_fp8 import recipe
from transformer_fp8.integrations import (convert_model, gradient_checkpointing_enable, layer_weight_map,
                                          to_hf_state_dict)
from transformer_fp8.integrations.hf_mapping import fuse_hf_weights, split_fused_weights
from transformer_fp8.integrations.moe_decoder import MoETransformerLayer
from transformer_fp8.integrations.moe_mapping import expert_layout
from transformer_fp8.moe import LayerNormMoE

transformers = pytest.importorskip("transformers")

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, rms_norm_eps=1e-5)
QWEN_MOE = dict(intermediate_size=96, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2)
# name -> (config class, model class, config overrides, kinds of its two decoder layers)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2), ("moe", "moe")),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(QWEN_MOE, shared_expert_intermediate_size=48, mlp_only_layers=[1]), ("moe", "dense")),
    "qwen2_moe-sparse-step": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                              dict(QWEN_MOE, shared_expert_intermediate_size=48, decoder_sparse_step=2,
                                   norm_topk_prob=True, qkv_bias=False), ("dense", "moe")),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(QWEN_MOE, num_experts_per_tok=3, head_dim=32, norm_topk_prob=True), ("moe", "moe")),
    "qwen3_moe-unnormalised": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(QWEN_MOE, norm_topk_prob=False),
                               ("moe", "moe")),
}


def tiny_model(family, dtype=torch.float32, **overrides):
    """A random-init model of `family`; norm weights and biases randomised too (they start at 1 and 0, where a
    wrong mapping would not show), the router scaled up so that the routing is decisive."""
    config_class, model_class, extra, _ = FAMILIES[family]
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**{**COMMON, **extra, **overrides}))
    randomize_norms_and_biases(model, router_std=0.5)
    return model.to(dtype).eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_every_gradient_match_hugging_face_in_fp32(family):
    model = tiny_model(family)
    converted = convert_model(copy.deepcopy(model))
    assert converted.tfp8_conversion.family == model.config.model_type
    kinds = tuple("moe" if isinstance(layer, MoETransformerLayer) else "dense" for layer in converted.model.layers)
    assert kinds == FAMILIES[family][3]
    for layer, kind in zip(converted.model.layers, kinds):
        assert isinstance(layer.layer.layernorm_mlp, LayerNormMoE) == (kind == "moe")
    check_logits_and_gradients(model, converted, torch.randint(0, VOCAB, (2, 40)))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("padded", [False, True])
def test_output_router_logits_gives_transformers_aux_loss(family, padded):
    model = tiny_model(family, router_aux_loss_coef=0.1)
    converted = convert_model(copy.deepcopy(model))
    ids = torch.randint(1, VOCAB, (2, 12))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :5] = 0
    labels = ids.clone()
    labels[0, :6] = -100 if padded else labels[0, :6]  # (a padding position's logits predict the next label)
    kwargs = dict(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
    ref, out = model(**kwargs), converted(**kwargs)
    moe_layers = sum(kind == "moe" for kind in FAMILIES[family][3])
    assert len(out.router_logits) == len(ref.router_logits) == moe_layers
    real = mask.reshape(-1).bool()  # (padding rows differ: ours attend to every key there; the loss skips them)
    for ours, theirs in zip(out.router_logits, ref.router_logits):
        assert rel_error(ours[real], theirs[real]) < 1e-5
    assert abs(out.aux_loss.item() - ref.aux_loss.item()) < 1e-5 * ref.aux_loss.item()
    assert abs(out.loss.item() - ref.loss.item()) < 1e-5 * ref.loss.item()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_greedy_generation_gives_the_hugging_face_tokens_in_fp32(family, cache):
    model = tiny_model(family)
    converted = convert_model(copy.deepcopy(model))
    ids = torch.randint(1, VOCAB, (3, 7))
    extra = dict(cache_implementation="static") if cache == "static" else {}
    ref = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0, **extra)
    assert ref.shape == (3, 17)
    assert torch.equal(converted.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0, **extra), ref)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_weight_map_covers_every_hugging_face_tensor_both_ways(family):
    model = tiny_model(family)
    converted = convert_model(copy.deepcopy(model))
    for index in range(2):
        hf_state = model.model.layers[index].state_dict()
        ours_layer = converted.model.layers[index]
        table = layer_weight_map(ours_layer)
        ours = fuse_hf_weights(hf_state, table)
        params = dict(ours_layer.named_parameters())
        assert ours.keys() == params.keys()
        assert all(torch.equal(params[name], tensor) for name, tensor in ours.items())
        back = split_fused_weights(ours, table)
        assert back.keys() == hf_state.keys()
        assert all(torch.equal(back[name], hf_state[name]) for name in hf_state)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_save_pretrained_round_trip_through_plain_transformers(family, tmp_path):
    model = tiny_model(family)
    converted = convert_model(copy.deepcopy(model))
    with torch.no_grad():  # (a change, so that a copy of the original would not pass)
        for p in converted.parameters():
            p.mul_(1.01)
    state = to_hf_state_dict(converted)
    assert state.keys() == model.state_dict().keys()
    converted.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(loaded) is type(model)
    loaded_state = loaded.state_dict()
    assert all(torch.equal(loaded_state[k], v) for k, v in state.items())
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        assert rel_error(converted(input_ids=ids).logits, loaded(input_ids=ids).logits) < 1e-5
    fresh = convert_model(tiny_model(family))  # a Hugging Face state dict loads into a converted model
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert not unexpected and all(key.endswith("_extra_state") for key in missing), (missing, unexpected)
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, converted(input_ids=ids).logits)


def test_fp8_model_init_weights_export_dequantized(tmp_path):
    model = tiny_model("qwen2_moe")
    with te.fp8_model_init(enabled=True):
        converted = convert_model(copy.deepcopy(model))
    moe = converted.model.layers[0].layer.layernorm_mlp
    weights = [moe.experts.linear_fc1.weight0, moe.experts.linear_fc2.weight5, moe.shared_experts.linear_fc1.weight]
    assert all(isinstance(w, te.Float8Tensor) for w in weights)
    state = to_hf_state_dict(converted)
    assert all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in state.values())
    gate_up = state["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(gate_up[0], weights[0].dequantize())
    assert 0 < rel_error(gate_up, model.model.layers[0].mlp.experts.gate_up_proj) < 0.05  # (one FP8 rounding)
    converted.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        assert rel_error(loaded(input_ids=ids).logits, converted(input_ids=ids).logits) < 1e-5


class _ListExpert(nn.Module):
    """One expert as transformers 4.x kept it: three nn.Linear without bias."""

    def __init__(self, names, gate, up, down):
        super().__init__()
        self.names = names
        for name, weight in zip(names, (gate, up, down)):
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            linear.weight = nn.Parameter(weight.clone())
            setattr(self, name, linear)


def _with_expert_layout(model, layout):
    """model with each MoE block's fused experts rewritten in another transformers version's layout (same values)."""
    for layer in model.model.layers:
        experts = layer.mlp.experts
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        if layout == "fused_transposed":
            experts.gate_up_proj = nn.Parameter(gate_up.transpose(1, 2).contiguous())
            experts.down_proj = nn.Parameter(down.transpose(1, 2).contiguous())
            experts.is_transposed = True
            continue
        names = ("w1", "w3", "w2") if layout == "w1w3w2" else ("gate_proj", "up_proj", "down_proj")
        layer.mlp.experts = nn.ModuleList(_ListExpert(names, *g.chunk(2), d) for g, d in zip(gate_up, down))
    return model


@pytest.mark.parametrize("layout", ["w1w3w2", "gate_up_down", "fused_transposed"])
def test_other_transformers_versions_expert_layouts_convert_and_export(layout):
    model = tiny_model("mixtral")
    ids = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    other = _with_expert_layout(copy.deepcopy(model), layout)
    assert expert_layout(other.model.layers[0].mlp.experts) == layout
    hf_state = {k: v.clone() for k, v in other.state_dict().items()}
    converted = convert_model(other)
    assert converted.model.layers[0].shape.moe.layout == layout
    with torch.no_grad():
        assert rel_error(converted(input_ids=ids).logits, ref) < 1e-5
    state = to_hf_state_dict(converted)
    assert state.keys() == hf_state.keys()
    assert all(torch.equal(state[k], v) for k, v in hf_state.items())


@pytest.mark.parametrize("fp8_recipe", [recipe.DelayedScaling(), recipe.Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_fp8_training_steps_on_cpu_stay_close(fp8_recipe):
    model = tiny_model("qwen2_moe")
    ids = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        exact = model(input_ids=ids).logits  # (float32: transformers' grouped experts refuse float64)
    converted = convert_model(copy.deepcopy(model)).train()
    for _ in range(2):  # the second step runs with the scales that delayed scaling set after the first
        with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
            out = converted(input_ids=ids, labels=ids)
        out.loss.backward()
    assert 0 < rel_error(out.logits, exact) < 2 * FP8_RTOL[torch.float8_e4m3fn]
    assert all(p.grad is None or p.grad.isfinite().all() for p in converted.parameters())


def test_gradient_checkpointing_gives_the_same_fp8_step():
    model = tiny_model("mixtral")
    plain, checkpointed = (convert_model(copy.deepcopy(model)).train() for _ in range(2))
    gradient_checkpointing_enable(checkpointed)
    ids = torch.randint(0, VOCAB, (2, 16))
    for converted in (plain, checkpointed):
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe.Float8CurrentScaling()):
            out = converted(input_ids=ids, labels=ids, output_router_logits=True)
        assert len(out.router_logits) == 2  # (the recompute records nothing more)
        out.loss.backward()
    grads = {n: p.grad for n, p in plain.named_parameters()}
    for name, p in checkpointed.named_parameters():
        assert (p.grad is None) == (grads[name] is None), name
        assert p.grad is None or torch.equal(p.grad, grads[name]), name


@pytest.mark.parametrize("family, overrides, match", [
    ("mixtral", dict(sliding_window=32), "sliding_window"),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=32), "sliding_window"),
    ("qwen2_moe", dict(hidden_act="gelu"), "hidden_act"),
])
def test_unsupported_options_are_refused(family, overrides, match):
    with pytest.raises(NotImplementedError, match=match):
        convert_model(tiny_model(family, **overrides))


def test_experts_with_biases_are_refused_naming_them():
    model = _with_expert_layout(tiny_model("mixtral"), "w1w3w2")
    for layer in model.model.layers:
        for expert in layer.mlp.experts:
            expert.w2.bias = nn.Parameter(torch.zeros(64))
    with pytest.raises(NotImplementedError, match="w2.bias"):
        convert_model(model)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_gpu_fp8_training_and_generation(family):
    model = tiny_model(family, torch.bfloat16).cuda()
    ids = torch.randint(1, VOCAB, (4, 32), device="cuda")
    with torch.no_grad():
        exact = copy.deepcopy(model).float()(input_ids=ids).logits
    converted = convert_model(copy.deepcopy(model)).train()
    for _ in range(2):
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling()):
            out = converted(input_ids=ids, labels=ids, output_router_logits=True)
        out.loss.backward()
    assert 0 < rel_error(out.logits, exact) < 2 * FP8_RTOL[torch.float8_e4m3fn]
    assert all(p.grad is None or p.grad.isfinite().all() for p in converted.parameters())
    converted.eval()
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling()):
        tokens = converted.generate(ids[:, :8], max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert tokens.shape == (4, 16)
