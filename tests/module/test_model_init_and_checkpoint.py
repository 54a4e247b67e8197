"""fp8_model_init (Float8Tensor weights), checkpoints (FP8 state round trip, nn.Linear state dicts), device moves,
nested autocast and bad arguments."""
import io

import pytest
import torch
import torch.nn as nn

import transformer_fp8 as te
from tests.module.helpers import DEVICES, RECIPES
from tests.utils import OpCalls, rel_error


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_model_init_weights_are_float8_tensors(device, monkeypatch):
    with te.fp8_model_init():
        m = te.LayerNormMLP(128, 256, params_dtype=torch.bfloat16, device=device)
    weights = {n: p for n, p in m.named_parameters() if p.dim() == 2}
    assert all(isinstance(p, te.Float8Tensor) and isinstance(p, nn.Parameter) for p in weights.values())
    assert not any(isinstance(p, te.Float8Tensor) for p in m.parameters() if p.dim() == 1)
    fp8_bytes = sum(p._data.numel() * p._data.element_size() + p._scale_inv.numel() * 4 for p in weights.values())
    bf16_bytes = sum(p.numel() * 2 for p in weights.values())
    assert fp8_bytes <= 0.55 * bf16_bytes
    x = torch.randn(32, 128, dtype=torch.bfloat16, device=device, requires_grad=True)
    with OpCalls("cast_transpose", lambda arguments: arguments["input"].shape) as casts, te.fp8_autocast():
        out = m(x)
    assert all(shape[0] == 32 for shape in casts.seen)  # the weights were not cast: their FP8 data was used
    out.float().pow(2).sum().backward()
    assert m.fc1_weight.grad.dtype == torch.bfloat16 and m.fc1_weight.grad.shape == (256, 128)
    plain = m(x.detach())  # outside autocast: high precision on the dequantized weights
    assert rel_error(out, plain) < 0.1


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_model_init_preserves_the_high_precision_init_values(device):
    torch.manual_seed(0)
    plain = te.Linear(64, 32, params_dtype=torch.bfloat16, device=device)
    torch.manual_seed(0)
    with te.fp8_model_init(recipe=te.recipe.DelayedScaling(), preserve_high_precision_init_val=True):
        m = te.Linear(64, 32, params_dtype=torch.bfloat16, device=device)
    init = m.weight.get_high_precision_init_val()
    assert init.device.type == "cpu" and torch.equal(init, plain.weight.detach().cpu())
    assert rel_error(m.weight.dequantize().cpu(), init) < 0.06  # (E4M3)
    m.weight.clear_high_precision_init_val()
    assert m.weight.get_high_precision_init_val() is None
    with te.fp8_model_init():
        assert te.Linear(64, 32, device=device).weight.get_high_precision_init_val() is None


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_model_init_trains_with_an_optimizer(device):
    with te.fp8_model_init():
        m = te.Linear(64, 32, params_dtype=torch.bfloat16, device=device)
    before = m.weight.dequantize().clone()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with te.fp8_autocast():
        m(torch.randn(16, 64, dtype=torch.bfloat16, device=device)).float().pow(2).sum().backward()
    expected = before.float() - 0.1 * m.weight.grad.float()
    opt.step()
    assert isinstance(m.weight, te.Float8Tensor)
    assert rel_error(m.weight.dequantize(), expected) < 0.05
    assert rel_error(m.weight.dequantize(), before) > 1e-3


def train_steps(m, xs, recipe):
    outs = []
    for x in xs:
        with te.fp8_autocast(fp8_recipe=recipe):
            out = m(x)
        out.float().pow(2).mean().backward()
        outs.append(out.detach())
    return outs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["Linear", "LayerNormMLP"])
@pytest.mark.parametrize("model_init", [False, True])
def test_checkpoint_round_trip_is_bit_identical(device, name, model_init):
    recipe = RECIPES["delayed-HYBRID"]
    make = {"Linear": lambda: te.Linear(64, 32, params_dtype=torch.bfloat16, device=device),
            "LayerNormMLP": lambda: te.LayerNormMLP(64, 96, params_dtype=torch.bfloat16, device=device)}[name]
    with te.fp8_model_init(enabled=model_init):
        m, restored = make(), make()
    xs = [torch.randn(24, 64, dtype=torch.bfloat16, device=device) * (i + 1) for i in range(5)]
    train_steps(m, xs[:3], recipe)
    buffer = io.BytesIO()
    torch.save(m.state_dict(), buffer)
    buffer.seek(0)
    restored.load_state_dict(torch.load(buffer), strict=True)
    m.zero_grad()
    assert torch.equal(restored.fp8_fwd.amax_history, m.fp8_fwd.amax_history)
    for a, b in zip(train_steps(m, xs[3:], recipe), train_steps(restored, xs[3:], recipe)):
        assert torch.equal(a, b)
    for (n, p), q in zip(m.named_parameters(), restored.parameters()):
        assert torch.equal(p.grad, q.grad), n
    assert torch.equal(m.fp8_bwd.scale, restored.fp8_bwd.scale)


@pytest.mark.parametrize("device", DEVICES)
def test_plain_state_dicts_load_strictly(device):
    m = te.Linear(64, 32, params_dtype=torch.float32, device=device)
    with te.fp8_autocast():
        m(torch.randn(16, 64, device=device))
    ref = nn.Linear(64, 32, device=device)
    m.load_state_dict(ref.state_dict(), strict=True)  # keeps the FP8 state it has
    assert torch.equal(m.weight, ref.weight) and m.fp8_fwd is not None
    ln = te.LayerNorm(64, device=device)
    ln.load_state_dict(nn.LayerNorm(64, device=device).state_dict(), strict=True)


def test_dtype_and_device_moves_keep_the_fp8_state_float32():
    m = te.Linear(64, 32, params_dtype=torch.float32, device="cpu")
    with te.fp8_autocast():
        m(torch.randn(16, 64))
    m.to(torch.bfloat16)
    assert m.weight.dtype == torch.bfloat16 and m.fp8_fwd.scale.dtype == torch.float32
    if torch.cuda.is_available():
        m.cuda()
        assert m.fp8_fwd.scales[0].device.type == "cuda" and m.fp8_fwd.amaxes[1].device.type == "cuda"


def test_nested_autocast_inner_settings_win_and_outer_ones_return():
    m = te.Linear(64, 32, params_dtype=torch.float32, device="cpu")
    x = torch.randn(16, 64)
    e4m3 = RECIPES["delayed-E4M3"]
    with te.fp8_autocast(fp8_recipe=e4m3):
        with te.fp8_autocast(enabled=False):
            assert not te.is_fp8_enabled()
            assert torch.equal(m(x), nn.functional.linear(x, m.weight, m.bias))
        with te.fp8_autocast(fp8_recipe=RECIPES["current-HYBRID"]):
            m(x)
            assert m.bwd_dtype == torch.float8_e5m2 and m.fp8_fwd.history_len == 1
        assert te.is_fp8_enabled() and te.get_fp8_recipe() is e4m3
        m(x)
        assert m.bwd_dtype == torch.float8_e4m3fn and m.fp8_fwd.history_len == 4
    assert not te.is_fp8_enabled()


@pytest.mark.parametrize("make,error,match", [
    (lambda: te.LayerNormLinear(8, 8, normalization="BatchNorm", device="cpu"), ValueError, "normalization"),
    (lambda: te.LayerNormMLP(8, 8, activation="tanh", device="cpu"), ValueError, "activation"),
    (lambda: te.Linear(8, 8, params_dtype=torch.int32, device="cpu"), TypeError, "params_dtype"),
    (lambda: te.Linear(8, 8, params_dtype=torch.float8_e4m3fn, device="cpu"), TypeError, "params_dtype"),
    (lambda: te.Linear(0, 8, device="cpu"), ValueError, "in_features"),
    (lambda: te.LayerNormMLP(8, -1, device="cpu"), ValueError, "ffn_hidden_size"),
    (lambda: te.RMSNorm(2.5, device="cpu"), ValueError, "hidden_size"),
    (lambda: te.Linear(8, 4, device="cpu")(torch.randn(3, 6)), ValueError, "inp"),
    (lambda: te.LayerNorm(8, device="cpu")(torch.randn(3, 6)), ValueError, "inp"),
    (lambda: te.fp8_autocast(fp8_recipe="delayed"), TypeError, "fp8_recipe"),
    (lambda: te.fp8_autocast(enabled=1), TypeError, "enabled"),
    (lambda: te.fp8_model_init(recipe="delayed").__enter__(), TypeError, "recipe"),
    (lambda: te.fp8_model_init(preserve_high_precision_init_val=1).__enter__(), TypeError,
     "preserve_high_precision_init_val"),
])
def test_bad_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_fp8_input_last_dim_checked_inside_autocast():
    m = te.LayerNormMLP(8, 16, device="cpu")
    with pytest.raises(ValueError, match="inp"), te.fp8_autocast():
        m(torch.randn(4, 9))
