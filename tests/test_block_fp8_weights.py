"""Block-scaled FP8 weights: Float8Tensor with one float32 scale per 128x128 block (layout "block_128x128"), made by
fp8_model_init(recipe=Float8BlockScaling()) or from a block-FP8 checkpoint's bytes.

The reference quantizer below loops over the blocks in plain torch (scale = fp8_max / amax in float32, 1 for an
all-zero block, power-of-2 rounding by frexp); the implementation must give the same bytes and scales.
"""
import copy
import io
import math

import pytest
import torch
import torch.nn as nn

import transformer_fp8 as te
from transformer_fp8 import Float8Tensor
from transformer_fp8.float8_block import block_scale_shape, quantize_blocks
from tests.utils import FP8_RTOL, OpCalls, rel_error

BLOCK_RECIPE = te.recipe.Float8BlockScaling
SHAPES = [(256, 384), (300, 200), (128, 640), (1, 5)]  # (128, 640): 5 column blocks, scale rows padded to 8


def reference_quantize(w, fp8_dtype=torch.float8_e4m3fn, power_2_scale=False):
    """(data [N, K], scale_inv [cdiv(N, 128), pad4(cdiv(K, 128))] with padding 1.0), one block at a time."""
    fp8_max = 448.0 if fp8_dtype == torch.float8_e4m3fn else 57344.0
    rows, cols = w.shape
    nb, kb = -(-rows // 128), -(-cols // 128)
    data = torch.empty(rows, cols, dtype=fp8_dtype)
    scale_inv = torch.ones(nb, -(-kb // 4) * 4)
    for i in range(nb):
        for j in range(kb):
            tile = w[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)].float()
            amax = tile.abs().max().item()
            scale = torch.tensor(fp8_max, dtype=torch.float32) / torch.tensor(amax, dtype=torch.float32) \
                if amax > 0 else torch.tensor(1.0)
            if power_2_scale and amax > 0:
                scale = torch.tensor(2.0 ** (math.frexp(scale.item())[1] - 1))
            data[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)] = (tile * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)
            scale_inv[i, j] = torch.reciprocal(scale)
    return data, scale_inv


def as_bytes(t):
    return t.contiguous().view(torch.uint8)


def block_weight(shape=(300, 200), dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    hp = (torch.randn(*shape) * 2).to(dtype)
    hp[:min(128, shape[0]), :min(128, shape[1])] *= 50  # blocks of very different ranges
    return hp, Float8Tensor.from_hp(hp, layout="block_128x128")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("power_2_scale", [False, True])
def test_block_quantize_matches_the_reference(shape, fp8_dtype, power_2_scale):
    hp = torch.randn(*shape, dtype=torch.bfloat16) * 3
    if shape[0] > 128:
        hp[128:256, :128] = 0  # an all-zero block: scale 1
    t = Float8Tensor.from_hp(hp, fp8_dtype, layout="block_128x128", power_2_scale=power_2_scale)
    data, scale_inv = reference_quantize(hp, fp8_dtype, power_2_scale)
    assert t.layout == "block_128x128" and t._scale_inv.shape == block_scale_shape(shape) == scale_inv.shape
    assert torch.equal(as_bytes(t._data), as_bytes(data)) and torch.equal(t._scale_inv, scale_inv)
    assert t.dtype == torch.bfloat16 and t.shape == hp.shape
    assert rel_error(t.dequantize(), hp) < FP8_RTOL[fp8_dtype] / 2
    expanded = scale_inv.repeat_interleave(128, 0)[:shape[0]].repeat_interleave(128, 1)[:, :shape[1]]
    torch.testing.assert_close(t.dequantize(torch.float32), data.float() * expanded, rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("power_2_scale", [False, True])
def test_block_quantize_is_the_block_cast_op(device, fp8_dtype, power_2_scale):
    """quantize_blocks runs block_cast (128x128, rowwise) on the weight's device: on the GPU its CUDA kernel gives the
    reference's bytes; float64, strided, extreme and empty weights too, and meta weights get shapes."""
    hp = torch.randn(200, 300, dtype=torch.float64).t() * torch.logspace(-6, 6, 200, dtype=torch.float64)
    hp[0, 0], hp[130, 1], hp[:128, 128:] = 1e38, -3e-39, 0.0  # (a huge value, a float32 subnormal, a zero block)
    with OpCalls("block_cast", lambda arguments: (arguments["block_dim"], arguments["input"].dtype)) as casts:
        data, scale_inv = quantize_blocks(hp.to(device), fp8_dtype, power_2_scale)
    assert casts.seen == [(2, torch.float32)]
    want_data, want_scale_inv = reference_quantize(hp, fp8_dtype, power_2_scale)
    assert torch.equal(as_bytes(data.cpu()), as_bytes(want_data)) and torch.equal(scale_inv.cpu(), want_scale_inv)
    for shape in ((0, 300), (130, 0)):
        data, scale_inv = quantize_blocks(torch.empty(shape, device=device), fp8_dtype)
        assert data.shape == shape and data.dtype == fp8_dtype and scale_inv.shape == block_scale_shape(shape)
    data, scale_inv = quantize_blocks(torch.empty(300, 200, device="meta"), fp8_dtype)
    assert data.is_meta and data.dtype == fp8_dtype and scale_inv.shape == (3, 4)


def test_blocks_keep_small_values_that_one_scale_loses():
    hp, t = block_weight((256, 256), torch.float32)
    per_tensor = Float8Tensor.from_hp(hp)
    small = (slice(128, 256), slice(128, 256))  # a block 50x smaller than the largest
    assert rel_error(t.dequantize()[small], hp[small]) < 0.04
    assert rel_error(t.dequantize()[small], hp[small]) < rel_error(per_tensor.dequantize()[small], hp[small])


def test_from_block_scaled_keeps_the_bytes_and_pads_the_scales():
    data, padded = reference_quantize(torch.randn(300, 640))
    t = Float8Tensor.from_block_scaled(data, padded[:, :5], torch.bfloat16)  # a checkpoint's [3, 5] scales
    assert t._data is data and t._scale_inv.shape == (3, 8) and torch.equal(t._scale_inv, padded)
    assert t.transpose_scale_inv().shape == (5, 4)
    assert torch.equal(t.transpose_scale_inv()[:, :3], padded[:, :5].t())
    with pytest.raises(ValueError, match=r"scale_inv: expected \[3, 5\] block scales"):
        Float8Tensor.from_block_scaled(data, padded[:2], torch.bfloat16)
    with pytest.raises(ValueError, match=r"scale_inv: block scales of a 2-D weight .* must be float32 \(3, 8\)"):
        Float8Tensor(data, padded[:, :5].contiguous(), torch.bfloat16)
    with pytest.raises(ValueError, match="layout: expected 'tensor' or 'block_128x128'"):
        Float8Tensor.from_hp(torch.randn(4, 4), layout="block_1x128")


def test_detach_clone_deepcopy_to_and_save_keep_the_blocks():
    hp, t = block_weight()
    for other in (t.detach(), t.clone(), copy.deepcopy(t), t.to("cpu"), t.to(torch.bfloat16)):
        assert isinstance(other, Float8Tensor) and other.layout == "block_128x128"
        assert torch.equal(as_bytes(other._data), as_bytes(t._data)) and torch.equal(other._scale_inv, t._scale_inv)
    assert type(t.to(torch.float32)) is torch.Tensor and torch.equal(t.to(torch.float32), t.dequantize().float())
    buffer = io.BytesIO()
    torch.save({"w": t}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["w"]
    assert loaded.layout == "block_128x128" and torch.equal(as_bytes(loaded._data), as_bytes(t._data))
    assert "per 128x128 block" in repr(t)


def test_other_ops_run_on_the_dequantized_value():
    hp, t = block_weight()
    deq = t.dequantize()
    for got, expected in [(t + 1, deq + 1), (t.sum(), deq.sum()), (t[3:5], deq[3:5]), (t.t() @ deq, deq.t() @ deq)]:
        assert type(got) is torch.Tensor
        torch.testing.assert_close(got, expected)


def test_row_views_and_cat_keep_bytes_on_block_boundaries():
    hp, t = block_weight((300, 200))
    pieces = torch.split(t, [128, 172])
    assert [p.layout for p in pieces] == ["block_128x128"] * 2 and pieces[1]._scale_inv.shape == (2, 4)
    assert torch.equal(pieces[1].dequantize(), t.dequantize()[128:])
    assert torch.equal(t.narrow(0, 256, 44).dequantize(), t.dequantize()[256:])
    joined = torch.cat(pieces)
    assert isinstance(joined, Float8Tensor) and torch.equal(as_bytes(joined._data), as_bytes(t._data))
    assert torch.equal(joined._scale_inv, t._scale_inv)
    assert t.view(-1, 200).layout == "block_128x128"  # (a view of the same shape)
    for refused in (lambda: torch.split(t, 100), lambda: t.narrow(0, 64, 128), lambda: t.narrow(1, 0, 128),
                    lambda: t.view(-1)):
        with pytest.raises(NotImplementedError, match="block"):
            refused()
    unaligned = torch.cat([t.narrow(0, 256, 44), pieces[0]])  # 44 rows first: blocks would straddle
    assert type(unaligned) is torch.Tensor
    assert torch.equal(unaligned, torch.cat([t.dequantize()[256:], pieces[0].dequantize()]))


def test_view_refusal_names_fsdp2():
    _, t = block_weight((256, 256))
    with pytest.raises(NotImplementedError, match=r"FSDP2 \(fully_shard\) cannot shard block-scaled"):
        t.view(-1)
    with pytest.raises(NotImplementedError, match="FSDP2"):
        t.fsdp_pre_all_gather(None, t.shape, t.stride(), None, None)


def test_copy_keeps_bytes_between_blocks_and_requantizes_otherwise():
    hp, t = block_weight()
    _, other = block_weight(seed=1)
    dst = other.clone()
    dst.copy_(t)
    assert torch.equal(as_bytes(dst._data), as_bytes(t._data)) and torch.equal(dst._scale_inv, t._scale_inv)
    per_tensor = Float8Tensor.from_hp(hp)
    dst.copy_(per_tensor)  # another layout: re-quantized in blocks from its value
    data, scale_inv = reference_quantize(per_tensor.dequantize())
    assert dst.layout == "block_128x128" and torch.equal(as_bytes(dst._data), as_bytes(data))
    dst.copy_(hp)
    assert torch.equal(as_bytes(dst._data), as_bytes(t._data))


def test_in_place_updates_requantize_per_block_and_keep_power_of_2_scales():
    for power_2_scale in (False, True):
        hp = torch.randn(300, 200)
        t = Float8Tensor.from_hp(hp, layout="block_128x128", power_2_scale=power_2_scale)
        start = t.dequantize()
        torch._foreach_add_([t], [torch.full_like(hp, 0.5)])
        data, scale_inv = reference_quantize(start + 0.5, power_2_scale=power_2_scale)
        assert t.layout == "block_128x128"
        assert torch.equal(as_bytes(t._data), as_bytes(data)) and torch.equal(t._scale_inv, scale_inv)


@pytest.mark.parametrize("power_2_scale", [False, True])
def test_fp8_model_init_with_block_scaling_makes_block_weights(power_2_scale):
    qparams = te.recipe.QParams(power_2_scale=power_2_scale)
    torch.manual_seed(0)
    plain = te.LayerNormMLP(256, 384, params_dtype=torch.bfloat16, device="cpu")
    torch.manual_seed(0)
    with te.fp8_model_init(recipe=BLOCK_RECIPE(fp8_quant_fwd_weight=qparams), preserve_high_precision_init_val=True):
        m = te.LayerNormMLP(256, 384, params_dtype=torch.bfloat16, device="cpu")
    for name in ("fc1_weight", "fc2_weight"):
        weight, init = getattr(m, name), getattr(plain, name).detach()
        assert isinstance(weight, Float8Tensor) and isinstance(weight, nn.Parameter)
        assert weight.layout == "block_128x128" and weight.requires_grad
        data, scale_inv = reference_quantize(init, power_2_scale=power_2_scale)
        assert torch.equal(as_bytes(weight._data), as_bytes(data)) and torch.equal(weight._scale_inv, scale_inv)
        assert torch.equal(weight.get_high_precision_init_val(), init)
    assert not any(isinstance(p, Float8Tensor) for p in m.parameters() if p.dim() == 1)
    with te.fp8_model_init(recipe=BLOCK_RECIPE()):
        layer = te.TransformerLayer(256, 384, 2, params_dtype=torch.bfloat16, device="cpu")
    weights = [p for p in layer.parameters() if p.dim() == 2]
    assert len(weights) == 4 and all(p.layout == "block_128x128" for p in weights)
    with te.fp8_model_init(recipe=te.recipe.DelayedScaling()):
        assert te.Linear(256, 128, device="cpu").weight.layout == "tensor"


def test_fp8_model_init_refuses_what_it_cannot_make():
    with pytest.raises(TypeError, match="recipe: expected None, DelayedScaling, Float8CurrentScaling or "
                                        "Float8BlockScaling"):
        with te.fp8_model_init(recipe="block"):
            pass
    with pytest.raises(NotImplementedError, match="w_block_scaling_dim=2"):
        with te.fp8_model_init(recipe=BLOCK_RECIPE(w_block_scaling_dim=1)):
            pass


def test_block_weights_outside_autocast_compute_with_the_dequantized_weights():
    with te.fp8_model_init(recipe=BLOCK_RECIPE()):
        m = te.Linear(256, 384, params_dtype=torch.float32, device="cpu")
    x = torch.randn(8, 256)
    torch.testing.assert_close(m(x), x @ m.weight.dequantize().t() + m.bias, rtol=0, atol=0)


def test_state_dict_round_trip_is_bit_identical():
    with te.fp8_model_init(recipe=BLOCK_RECIPE()):
        a = te.LayerNormMLP(256, 384, params_dtype=torch.bfloat16, device="cpu")
        torch.manual_seed(1)
        b = te.LayerNormMLP(256, 384, params_dtype=torch.bfloat16, device="cpu")
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    before = b.fc1_weight._data.data_ptr()
    b.load_state_dict(torch.load(buffer, weights_only=True))
    for name in ("fc1_weight", "fc2_weight"):
        assert torch.equal(as_bytes(getattr(b, name)._data), as_bytes(getattr(a, name)._data))
        assert torch.equal(getattr(b, name)._scale_inv, getattr(a, name)._scale_inv)
    assert b.fc1_weight._data.data_ptr() == before  # copied into the parameter, not replaced
    plain = te.LayerNormMLP(256, 384, params_dtype=torch.bfloat16, device="cpu")
    plain.load_state_dict(a.state_dict())  # into high-precision weights: the dequantized values
    assert torch.equal(plain.fc1_weight, a.fc1_weight.dequantize())


def test_fp8_operand_is_the_weight_without_a_cast():
    pytest.importorskip("transformer_fp8.quantization.operand")
    hp, t = block_weight((300, 200))
    op = t.fp8_operand(transpose=True)
    assert op.layout == "block_128x128" and op.data is t._data and op.scale_inv is t._scale_inv
    assert torch.equal(as_bytes(op.data_t), as_bytes(t._data.t())) and op.scale_inv_t.shape == (2, 4)
    assert torch.equal(op.scale_inv_t[:, :3], t._scale_inv[:, :2].t())
    per_tensor = Float8Tensor.from_hp(hp).fp8_operand()
    assert per_tensor.layout == "tensor" and per_tensor.data_t is None


def test_block_weights_run_under_block_scaling_on_cpu():
    with te.fp8_model_init(recipe=BLOCK_RECIPE()):
        m = te.Linear(256, 384, params_dtype=torch.float32, device="cpu")
    x = torch.randn(32, 256, dtype=torch.float64)
    with OpCalls("block_cast", lambda arguments: tuple(arguments["input"].shape)) as casts:
        with te.fp8_autocast(fp8_recipe=BLOCK_RECIPE()):
            out = m(x.float().requires_grad_())
        want = x @ m.weight.dequantize(torch.float32).double().t() + m.bias.double()
        assert 1e-4 < rel_error(out, want) < FP8_RTOL[torch.float8_e4m3fn]
        out.sum().backward()
    assert m.weight.grad.shape == (384, 256)
    assert casts.seen and (384, 256) not in casts.seen  # the weight's own bytes, forward and backward: no cast


@pytest.mark.parametrize("recipe", [te.recipe.DelayedScaling(), te.recipe.Float8CurrentScaling()])
def test_block_weights_under_a_per_tensor_recipe_are_refused(recipe):
    with te.fp8_model_init(recipe=BLOCK_RECIPE()):
        m = te.Linear(256, 384, device="cpu")
    with pytest.raises(ValueError, match="layouts 'tensor' and 'block_128x128' do not mix"):
        with te.fp8_autocast(fp8_recipe=recipe):
            m(torch.randn(8, 256))


@pytest.mark.gpu
@pytest.mark.parametrize("module", ["Linear", "LayerNormMLP", "TransformerLayer"])
def test_block_weights_run_under_block_scaling_on_gpu(module):
    torch.manual_seed(0)
    build = {"Linear": lambda: te.Linear(1024, 2048, params_dtype=torch.bfloat16, device="cuda"),
             "LayerNormMLP": lambda: te.LayerNormMLP(1024, 2048, params_dtype=torch.bfloat16, device="cuda"),
             "TransformerLayer": lambda: te.TransformerLayer(1024, 2048, 8, params_dtype=torch.bfloat16,
                                                             device="cuda", hidden_dropout=0.0,
                                                             attention_dropout=0.0)}[module]
    with te.fp8_model_init(recipe=BLOCK_RECIPE()):
        m = build()
    reference = build()
    with torch.no_grad():  # the same (dequantized) weights in BF16
        for (name, p), (_, r) in zip(m.named_parameters(), reference.named_parameters()):
            r.copy_(p.dequantize() if isinstance(p, Float8Tensor) else p)
    x = torch.randn(2, 256, 1024, device="cuda", dtype=torch.bfloat16) if module == "TransformerLayer" \
        else torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)  # (512 tokens: no weight has 512 rows)
    x.requires_grad_()
    with OpCalls("block_cast", lambda arguments: tuple(arguments["input"].shape)) as casts:
        with te.fp8_autocast(fp8_recipe=BLOCK_RECIPE()):
            out = m(x)
        out.float().pow(2).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    want = reference(x_ref)
    want.float().pow(2).sum().backward()
    assert 1e-4 < rel_error(out, want) < 0.08
    assert rel_error(x.grad, x_ref.grad) < 0.15  # (FP8 gradients, 1x128 tiles)
    weights = {tuple(p.shape) for p in m.parameters() if isinstance(p, Float8Tensor)}
    assert casts.seen and not weights & set(casts.seen)  # the weights' own bytes went to the GEMMs
    assert all(p.grad is not None for p in m.parameters() if p.requires_grad)
