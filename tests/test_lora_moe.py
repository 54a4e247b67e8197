"""LoRA on converted MoE models: the experts (GroupedLinear) take no adapters, and saying otherwise is loud
(target_modules naming an expert weight raise, "all-linear" warns naming them); frozen expert weights are stored in
FP8 by cast_frozen_weights_to_fp8 / add_lora(fp8_weights=True), each with its own scale, and the FP8 grouped GEMMs
read them (CPU reference kernels) against float64."""
import pytest
import torch

import transformer_fp8 as te
from tests.utils import assert_close_rel
from transformer_fp8.float8_tensor import Float8Tensor
from transformer_fp8.integrations import convert_model
from transformer_fp8.lora import (add_lora, cast_frozen_weights_to_fp8, find_expert_weights, find_projections,
                                  lora_adapters, lora_parameters)

transformers = pytest.importorskip("transformers")
FWD_TOL, GRAD_TOL = 0.06, 0.08  # (E4M3 operands, as tests/test_grouped_linear.py)


def converted(family):
    from tests.test_convert_moe import tiny_model

    return convert_model(tiny_model(family))


def expert_modules(model):
    return [m for m in model.modules() if isinstance(m, te.GroupedLinear)]


def test_expert_weights_are_listed_apart_from_the_projections():
    model = converted("qwen2_moe")  # (layer 0: experts and a shared expert; layer 1: a dense MLP)
    experts = find_expert_weights(model)
    assert experts and all(name.startswith("model.layers.0.mlp.experts") for name in experts)
    assert len(experts) == len(set(experts))
    projections = {p.hf_name for p in find_projections(model)}
    assert not projections & set(experts)
    assert "model.layers.0.mlp.shared_expert.down_proj" in projections
    assert "model.layers.1.mlp.down_proj" in projections
    assert find_expert_weights(converted("mixtral"))  # (every layer MoE, no shared expert)


@pytest.mark.parametrize("family, targets", [
    ("qwen2_moe", ["q_proj", "down_proj"]),  # (down_proj: shared expert and dense layer, and the experts')
    ("mixtral", ["down_proj"]),  # (no other down_proj: before, "matches no projection")
    ("mixtral", r".*\.experts\..*"),
])
def test_targets_naming_expert_weights_are_refused(family, targets):
    model = converted(family)
    with pytest.raises(ValueError, match="names the MoE expert weights .*not supported"):
        add_lora(model, target_modules=targets)
    assert not lora_adapters(model)


def test_all_linear_warns_naming_the_experts_and_adapts_the_rest():
    model = converted("qwen2_moe")
    with pytest.warns(UserWarning, match=r"the MoE expert weights \['model\.layers\.0\.mlp\.experts"):
        add_lora(model, target_modules="all-linear")
    adapted = set(lora_adapters(model))
    assert "model.layers.0.mlp.shared_expert.gate_proj" in adapted and "model.layers.1.mlp.up_proj" in adapted
    assert not any(".mlp.experts" in name for name in adapted)


@pytest.mark.parametrize("recipe", [te.recipe.DelayedScaling(), te.recipe.Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_frozen_grouped_linear_weights_are_cast_to_fp8_and_used(recipe):
    from tests.test_grouped_linear import reference

    splits = [16, 0, 40]
    module = te.GroupedLinear(3, 32, 48, bias=False, device="cpu")
    with torch.no_grad():
        for g, w in enumerate(module.weights):
            w.mul_(4.0 ** g)  # (amaxes far apart: one scale per expert, not one for all)
    weights64 = [w.detach().double() for w in module.weights]
    for w in module.weights:
        w.requires_grad_(False)
    assert cast_frozen_weights_to_fp8(module) == 3
    assert all(isinstance(w, Float8Tensor) and not w.requires_grad for w in module.weights)
    scales = torch.stack([w._scale_inv.reshape(()) for w in module.weights])
    assert scales[2] > 8 * scales[0]
    for w, w64 in zip(module.weights, weights64):  # (each weight rounded once to E4M3 with its own scale)
        assert_close_rel(w.dequantize(), w64, 2 ** -4)
    x = torch.randn(56, 32, requires_grad=True)
    for _ in range(2):  # (delayed scaling: the first step calibrates)
        x.grad = None
        with te.fp8_autocast(fp8_recipe=recipe):
            out = module(x, splits)
        grad = torch.randn_like(out)
        out.backward(grad)
    x64 = x.detach().double().requires_grad_()
    ref = reference(x64, weights64, [], splits)
    ref.backward(grad.double())
    assert_close_rel(out, ref, FWD_TOL)
    assert_close_rel(x.grad, x64.grad, GRAD_TOL, "dx")
    assert cast_frozen_weights_to_fp8(module) == 0  # (FP8 already)


def test_grouped_linear_with_frozen_and_trainable_weights_is_refused():
    module = te.GroupedLinear(2, 32, 32, bias=False, device="cpu")
    module.weight0.requires_grad_(False)
    with pytest.raises(ValueError, match="GroupedLinear '' has frozen and trainable expert weights"):
        cast_frozen_weights_to_fp8(module)
    assert not any(isinstance(w, Float8Tensor) for w in module.weights)


def test_add_lora_fp8_weights_stores_the_experts_in_fp8_and_trains_the_adapters():
    model = converted("mixtral")
    ids = torch.randint(0, 96, (2, 24))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    add_lora(model, target_modules=["q_proj", "v_proj"], fp8_weights=True)
    experts = expert_modules(model)
    assert experts and all(isinstance(w, Float8Tensor) for m in experts for w in m.weights)
    with torch.no_grad():
        dequantized = model(input_ids=ids).logits  # (outside fp8_autocast: the dequantized weights)
    assert_close_rel(dequantized, before, 0.06)
    for _ in range(2):
        with te.fp8_autocast(fp8_recipe=te.recipe.DelayedScaling()):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    assert_close_rel(out.logits, before, 0.15)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_parameters(model)[1::2])  # (the B's)
