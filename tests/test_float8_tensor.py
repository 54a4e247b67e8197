"""Float8Tensor: FP8 data + scale_inv behaving as a tensor of its high-precision dtype."""
import copy
import io

import pytest
import torch
import torch.nn as nn

import transformer_fp8 as te
from tests.utils import rel_error

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def make(device, shape=(8, 16), dtype=torch.bfloat16, fp8_dtype=torch.float8_e4m3fn):
    hp = (torch.randn(*shape, device=device) * 3).to(dtype)
    return hp, te.Float8Tensor.from_hp(hp, fp8_dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype,tol", [(torch.float8_e4m3fn, 0.04), (torch.float8_e5m2, 0.08)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantizes_with_its_own_amax_and_dequantizes(device, fp8_dtype, tol, dtype):
    hp, t = make(device, dtype=dtype, fp8_dtype=fp8_dtype)
    assert (t.dtype, t.shape, t.device.type, t._data.dtype) == (dtype, hp.shape, torch.device(device).type, fp8_dtype)
    fp8_max = 448.0 if fp8_dtype == torch.float8_e4m3fn else 57344.0
    torch.testing.assert_close(t._scale_inv, hp.float().abs().max().reshape(1) / fp8_max)
    assert t.dequantize().dtype == dtype and 1e-4 < rel_error(t.dequantize(), hp) < tol


def test_prints_as_its_values():
    hp, t = make("cpu", shape=(2, 3))
    text = repr(t)
    assert text.startswith("Float8Tensor(") and "float8_e4m3fn" in text and "tensor(" in text
    assert str(t.dequantize()) in text


def test_to_float_detach_and_device_moves():
    hp, t = make("cpu")
    f = t.float()
    assert type(f) is torch.Tensor and f.dtype == torch.float32 and torch.equal(f, t.dequantize().float())
    assert type(t.to(torch.float16)) is torch.Tensor
    d = t.detach()
    assert isinstance(d, te.Float8Tensor) and d._data is t._data
    c = copy.deepcopy(t)
    assert isinstance(c, te.Float8Tensor) and c._data is not t._data and torch.equal(c.dequantize(), t.dequantize())
    same = t.to("cpu")
    assert isinstance(same, te.Float8Tensor) and torch.equal(same._data.view(torch.uint8), t._data.view(torch.uint8))
    if torch.cuda.is_available():
        moved = t.to("cuda")
        assert isinstance(moved, te.Float8Tensor) and moved._scale_inv.device.type == "cuda"


def test_other_ops_run_on_the_dequantized_value():
    hp, t = make("cpu")
    deq = t.dequantize()
    for got, expected in [(t + 1, deq + 1), (t @ deq.t(), deq @ deq.t()), (t.sum(), deq.sum()), (t[1:3], deq[1:3])]:
        assert type(got) is torch.Tensor
        torch.testing.assert_close(got, expected)


def test_copy_and_in_place_ops_requantize():
    hp, t = make("cpu")
    new = torch.randn_like(hp) * 10
    t.copy_(new)
    assert isinstance(t, te.Float8Tensor)
    torch.testing.assert_close(t._scale_inv, new.float().abs().max().reshape(1) / 448)
    assert rel_error(t.dequantize(), new) < 0.04
    before = t.dequantize()
    t.add_(torch.ones_like(hp))
    assert isinstance(t, te.Float8Tensor) and rel_error(t.dequantize(), before + 1) < 0.04
    other = te.Float8Tensor.from_hp(hp)
    t.copy_(other)  # FP8 -> FP8 of the same format: the bytes and scale_inv, exactly
    assert torch.equal(t._data.view(torch.uint8), other._data.view(torch.uint8))
    assert torch.equal(t._scale_inv, other._scale_inv)


def test_torch_save_and_load_round_trip():
    hp, t = make("cpu")
    buffer = io.BytesIO()
    torch.save({"w": t}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)["w"]  # weights_only (the default) works: Float8Tensor is an allowed global
    assert isinstance(loaded, te.Float8Tensor) and loaded.dtype == t.dtype
    assert torch.equal(loaded._data.view(torch.uint8), t._data.view(torch.uint8))
    assert torch.equal(loaded._scale_inv, t._scale_inv)


def test_as_a_parameter_in_state_dicts():
    hp, t = make("cpu")
    module = nn.Module()
    module.weight = nn.Parameter(t)
    assert isinstance(module.weight, te.Float8Tensor) and module.weight.requires_grad
    state = module.state_dict()
    assert isinstance(state["weight"], te.Float8Tensor)
    module.load_state_dict({"weight": hp * 2})  # a high-precision state dict re-quantizes into it
    assert isinstance(module.weight, te.Float8Tensor) and rel_error(module.weight.dequantize(), hp * 2) < 0.04


def test_bad_construction():
    with pytest.raises(TypeError, match="data"):
        te.Float8Tensor(torch.zeros(2), torch.ones(1), torch.bfloat16)
    with pytest.raises(TypeError, match="dtype"):
        te.Float8Tensor(torch.zeros(2, dtype=torch.float8_e4m3fn), torch.ones(1), torch.float8_e5m2)
