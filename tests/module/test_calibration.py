"""fp8_autocast(enabled=False, calibrating=True) (TE's calibration): the modules give their high-precision outputs,
record the amaxes of the tensors their FP8 path would cast, and the exit turns them into delayed scales; FP8 then
runs with those scales."""
import pytest
import torch
import torch.nn.functional as F

import transformer_fp8 as te
from tests.module.helpers import DEVICES, FWD_TOL, randomize_vectors
from tests.utils import rel_error
from transformer_fp8 import recipe
from transformer_fp8.recipe import FP8_MAX

DT = torch.bfloat16
CALIBRATION = recipe.DelayedScaling(amax_history_len=4, amax_compute_algo="max")


def make(name, device):
    module = getattr(te, name)(64, 96, params_dtype=DT, device=device)
    randomize_vectors(module)
    return module


def cast_tensors(module, x):
    """The tensors the module's FP8 forward casts, in slot order, computed in float32."""
    x = x.float()
    if isinstance(module, te.Linear):
        return [x, module.weight]
    ln = F.layer_norm(x, (64,), module.layer_norm_weight.float(), module.layer_norm_bias.float(), module.eps)
    if isinstance(module, te.LayerNormLinear):
        return [ln, module.weight]
    act = F.gelu(F.linear(ln, module.fc1_weight.float(), module.fc1_bias.float()), approximate="tanh")
    return [ln, module.fc1_weight, act, module.fc2_weight]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_calibration_records_amaxes_then_fp8_uses_their_scales(device, name):
    module = make(name, device)
    xs = [torch.randn(32, 64, dtype=DT, device=device) * scale for scale in (1.0, 3.0, 0.5)]
    expected = None
    for x in xs:
        ref = module(x)
        with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=CALIBRATION):
            out = module(x)
        assert torch.equal(out, ref)  # (the high-precision path)
        amaxes = torch.stack([t.detach().abs().max().float() for t in cast_tensors(module, x)])
        expected = amaxes if expected is None else torch.maximum(expected, amaxes)
    state = module.fp8_fwd
    assert state.calibrated
    recorded = state.amax_history.max(dim=0).values
    assert rel_error(recorded, expected) < 1e-2, (recorded, expected)
    assert rel_error(state.scale, FP8_MAX[torch.float8_e4m3fn] / recorded) < 1e-6
    # FP8 with the calibrated scales (no first-step calibration from the tensors themselves)
    x = xs[1]
    with te.fp8_autocast(fp8_recipe=CALIBRATION):
        out = module(x)
    assert 0 < rel_error(out, module(x)) < FWD_TOL


@pytest.mark.parametrize("device", DEVICES)
def test_a_transformer_layer_is_calibrated_and_current_scaling_has_nothing_to_calibrate(device):
    layer = te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=DT,
                                device=device)
    x = torch.randn(16, 2, 64, dtype=DT, device=device)
    with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe.Float8CurrentScaling()):
        layer(x)
    fp8_modules = [m for m in layer.modules() if isinstance(m, te.Linear | te.LayerNormLinear | te.LayerNormMLP)]
    assert len(fp8_modules) == 3 and all(m.fp8_fwd is None for m in fp8_modules)
    with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=CALIBRATION):
        out = layer(x)
    assert torch.equal(out, layer(x))
    assert all(m.fp8_fwd.calibrated and (m.fp8_fwd.amax_history > 0).any() for m in fp8_modules)


def test_calibrating_must_be_a_bool():
    with pytest.raises(TypeError, match="calibrating: expected a bool"):
        te.fp8_autocast(enabled=False, calibrating="yes")
