"""integrations.convert_linear_layers and integrations.microbatch: which layers are swapped, that the swapped model
computes the same thing outside fp8_autocast (and nearly the same inside), state dicts, the is_first_microbatch hook."""
import pytest
import torch
import torch.nn as nn

import transformer_fp8 as te
from tests.utils import FP8_RTOL, rel_error
from transformer_fp8 import recipe
from transformer_fp8.integrations import convert_linear_layers, microbatch
from transformer_fp8.module import base

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
FP8_RECIPE = recipe.DelayedScaling(amax_history_len=4)


@pytest.fixture(autouse=True)
def always_fp8(monkeypatch):
    """These models are small: without this, CUDA runs would take the modules' small-shape high-precision path."""
    monkeypatch.setattr(base, "FP8_MIN_GEMM_SIZE", 0, raising=False)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 48)
        self.mlp = nn.Sequential(nn.Linear(48, 64, bias=False), nn.GELU(), nn.Linear(64, 32))
        self.odd = nn.Linear(32, 10)  # 10 is not a multiple of 16: stays nn.Linear

    def forward(self, x):
        x = x + self.mlp(self.proj(x))
        return x, self.odd(x)


class TinyModel(nn.Module):
    """Two blocks and an lm_head; layer names like a transformer's."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.lm_head = nn.Linear(32, 64)

    def forward(self, x):
        extras = []
        for block in self.blocks:
            x, extra = block(x)
            extras.append(extra)
        return torch.cat([self.lm_head(x), *extras], dim=-1)


def converted_copy(model, **kwargs):
    clone = TinyModel().to(next(model.parameters()).device, next(model.parameters()).dtype)
    clone.load_state_dict(model.state_dict())
    return convert_linear_layers(clone, **kwargs)


def linear_names(model, cls):
    return sorted(name for name, m in model.named_modules() if type(m) is cls)


def test_swaps_every_aligned_linear_but_the_excluded():
    model = convert_linear_layers(TinyModel())
    assert linear_names(model, te.Linear) == [f"blocks.{i}.{n}" for i in (0, 1) for n in ("mlp.0", "mlp.2", "proj")]
    assert linear_names(model, nn.Linear) == ["blocks.0.odd", "blocks.1.odd", "lm_head"]


@pytest.mark.parametrize("exclude, kept", [
    ("*.mlp.*", ["blocks.0.mlp.0", "blocks.0.mlp.2", "blocks.1.mlp.0", "blocks.1.mlp.2"]),
    (("proj", "blocks.1.*"), ["blocks.0.proj", "blocks.1.mlp.0", "blocks.1.mlp.2", "blocks.1.proj"]),
    ((), []),
])
def test_exclude_patterns_match_full_names_and_last_components(exclude, kept):
    model = convert_linear_layers(TinyModel(), exclude=exclude)
    unaligned = ["blocks.0.odd", "blocks.1.odd"]
    assert linear_names(model, nn.Linear) == sorted(kept + unaligned)


def test_copies_weights_bias_dtype_and_flags():
    model = TinyModel().to(torch.bfloat16).eval()
    model.blocks[0].proj.weight.requires_grad_(False)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    convert_linear_layers(model, fuse_wgrad_accumulation=True)
    proj, fc1 = model.blocks[0].proj, model.blocks[0].mlp[0]
    assert isinstance(proj, te.Linear) and proj.bias is not None and fc1.bias is None
    assert proj.weight.dtype == torch.bfloat16 and not proj.training
    assert not proj.weight.requires_grad and proj.bias.requires_grad
    assert proj.fuse_wgrad_accumulation
    for name, value in model.state_dict().items():
        if name in reference:
            assert torch.equal(value, reference[name]), name


def test_params_dtype_casts_the_converted_weights():
    model = convert_linear_layers(TinyModel(), params_dtype=torch.bfloat16)
    assert model.blocks[0].proj.weight.dtype == torch.bfloat16
    assert model.lm_head.weight.dtype == torch.float32  # excluded: untouched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_outputs_and_grads_outside_fp8_autocast(device, dtype):
    model = TinyModel().to(device, dtype)
    converted = converted_copy(model)
    x = torch.randn(7, 32, device=device, dtype=dtype)  # odd row count
    x_ref, x_new = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out_new = model(x_ref), converted(x_new)
    torch.testing.assert_close(out_new, out_ref)
    out_ref.square().sum().backward()
    out_new.square().sum().backward()
    torch.testing.assert_close(x_new.grad, x_ref.grad)
    for (name, p_ref), (_, p_new) in zip(model.named_parameters(), converted.named_parameters()):
        torch.testing.assert_close(p_new.grad, p_ref.grad, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_autocast_runs_the_converted_layers_in_fp8(device):
    model = TinyModel().to(device, torch.bfloat16)
    converted = converted_copy(model)
    x = torch.randn(64, 32, device=device, dtype=torch.bfloat16)
    ref = model(x).double()
    for _ in range(2):  # the second step uses the scales delayed scaling computed from the first
        with te.fp8_autocast(enabled=True, fp8_recipe=FP8_RECIPE):
            out = converted(x)
    err = rel_error(out, ref)
    assert 0 < err < FP8_RTOL[torch.float8_e4m3fn], err  # FP8 rounding shows, and stays small


def test_state_dict_round_trip():
    model = TinyModel()
    converted = converted_copy(model)
    x = torch.randn(5, 32)
    with te.fp8_autocast(enabled=True, fp8_recipe=FP8_RECIPE):
        converted(x)  # creates FP8 scaling state, saved as each layer's extra state
    state = converted.state_dict()
    for name, value in model.state_dict().items():  # the nn.Linear names and values are all there
        assert torch.equal(state[name], value), name

    torch.manual_seed(99)
    restored = convert_linear_layers(TinyModel())
    restored.load_state_dict(state)
    torch.testing.assert_close(restored(x), converted(x), rtol=0, atol=0)
    with te.fp8_autocast(enabled=True, fp8_recipe=FP8_RECIPE):
        torch.testing.assert_close(restored(x), converted(x), rtol=0, atol=0)

    plain = convert_linear_layers(TinyModel())
    plain.load_state_dict(model.state_dict())  # an unconverted checkpoint loads (fresh FP8 state)
    torch.testing.assert_close(plain(x), model(x), rtol=0, atol=0)


def test_microbatch_passes_the_flag_to_fp8_layers_only_inside_the_block():
    model = convert_linear_layers(TinyModel())
    seen = []

    def record(module, args, kwargs, out):
        seen.append((type(module), kwargs.get("is_first_microbatch", "absent")))

    for module in model.modules():
        module.register_forward_hook(record, with_kwargs=True)
    x = torch.randn(3, 32)
    with microbatch(model, is_first=False):
        model(x)
    flags = {(cls, flag) for cls, flag in seen if cls in (te.Linear, nn.Linear)}
    assert flags == {(te.Linear, False), (nn.Linear, "absent")}
    seen.clear()
    model(x)
    assert {flag for cls, flag in seen if cls is te.Linear} == {"absent"}


def test_microbatch_reuses_the_weight_cast_of_the_first_microbatch():
    layer = convert_linear_layers(nn.Sequential(nn.Linear(32, 32, bias=False)), exclude=())
    x = torch.randn(16, 32)
    for _ in range(2):  # the second step runs with the scales the first one set (they stay: same x, same weight)
        with te.fp8_autocast(enabled=True, fp8_recipe=FP8_RECIPE), microbatch(layer, is_first=True):
            first = layer(x)
    with torch.no_grad():
        layer[0].weight.mul_(2)  # not seen by the next micro-batch: it reuses the cached FP8 weight
    with te.fp8_autocast(enabled=True, fp8_recipe=FP8_RECIPE), microbatch(layer, is_first=False):
        cached = layer(x)
    with te.fp8_autocast(enabled=True, fp8_recipe=FP8_RECIPE):
        recast = layer(x)  # no flag: the weight is cast again
    torch.testing.assert_close(cached, first, rtol=0, atol=0)
    assert rel_error(recast, first) > 0.5


def test_fused_wgrad_accumulates_into_main_grad():
    model = convert_linear_layers(TinyModel(), fuse_wgrad_accumulation=True)
    proj = model.blocks[0].proj
    for block in model.blocks:
        for layer in (block.mlp[0], block.mlp[2], block.proj):
            layer.weight.main_grad = torch.zeros_like(layer.weight)
    with te.fp8_autocast(enabled=True, fp8_recipe=FP8_RECIPE):
        out = model(torch.randn(16, 32))
    out.square().mean().backward()
    assert proj.weight.grad is None and proj.weight.main_grad.abs().sum() > 0
    assert model.lm_head.weight.grad is not None


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def test_tiny_llama_converts_and_keeps_its_logits():
    model = tiny_llama()
    ids = torch.randint(0, 96, (2, 24))
    ref = model(input_ids=ids).logits
    convert_linear_layers(model)
    per_layer = ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.o_proj",
                 "self_attn.q_proj", "self_attn.v_proj"]
    assert linear_names(model, te.Linear) == [f"model.layers.{i}.{n}" for i in (0, 1) for n in per_layer]
    assert linear_names(model, nn.Linear) == ["lm_head"]
    torch.testing.assert_close(model(input_ids=ids).logits, ref, rtol=0, atol=0)
    with te.fp8_autocast(enabled=True, fp8_recipe=FP8_RECIPE):
        fp8_logits = model(input_ids=ids).logits
    assert 0 < rel_error(fp8_logits, ref) < FP8_RTOL[torch.float8_e4m3fn]
