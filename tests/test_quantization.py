"""transformer_fp8.quantization: roles, quantizers, FP8Operand and the GEMM helpers, against float64 references.

Tolerances: a per-tensor cast rounds each element to E4M3 (3 mantissa bits: relative error <= 2**-4 per element) or
E5M2 (2**-3); a GEMM over K = 64 of such elements has a relative error of a few per cent (the rounding errors add up
like a random walk against the sum), so 0.06 (E4M3 operands) bounds it; a mixed-up scale is off by factors.
"""
import pytest
import torch

from transformer_fp8 import recipe
from transformer_fp8.quantization import (GEMM_ROLES, MLP_ROLES, QUANTIZER_FOR_RECIPE, CurrentScalingQuantizer,
                                          DelayedScalingQuantizer, FP8Operand, QuantizerSet, Role, ScalingState, gemm,
                                          gemm_accumulate, quantizer_class)
from transformer_fp8.quantization import update
from tests.utils import rel_error

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
RECIPES = {"delayed": recipe.DelayedScaling(amax_history_len=4), "current": recipe.Float8CurrentScaling()}


def dequantize(data, scale_inv):
    return data.double() * scale_inv.double()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", RECIPES)
def test_cast_gives_both_layouts_within_fp8_rounding(device, name):
    qset = QuantizerSet(RECIPES[name], *GEMM_ROLES, device)
    x = torch.randn(32, 64, device=device) * 3
    op = qset[Role.INPUT].cast(x, transpose=True)
    assert isinstance(op, FP8Operand) and op.layout == "tensor" and op.fp8_dtype == torch.float8_e4m3fn
    assert op.data.shape == (32, 64) and op.data_t.shape == (64, 32) and op.scale_inv_t is op.scale_inv
    assert torch.equal(op.data_t.view(torch.uint8), op.data.t().contiguous().view(torch.uint8))
    assert rel_error(dequantize(op.data, op.scale_inv), x.double()) < 2 ** -4
    # the scale comes from x's own amax (current scaling; delayed scaling's first step calibrates the same way)
    assert torch.allclose(qset[Role.INPUT].scale, 448.0 / x.abs().max(), rtol=1e-6)
    rowwise_only = qset[Role.WEIGHT].cast(x)
    assert rowwise_only.data_t is None and rowwise_only.with_transpose().data_t.shape == (64, 32)
    transposed_only = qset[Role.WEIGHT].cast(x, rowwise=False, transpose=True)
    assert transposed_only.data is None and transposed_only.data_t.shape == (64, 32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", RECIPES)
def test_gemm_on_operands_matches_float64(device, name):
    qset = QuantizerSet(RECIPES[name], *GEMM_ROLES, device)
    x, w, dy = (torch.randn(*shape, device=device) for shape in ((32, 64), (48, 64), (32, 48)))
    x_op = qset[Role.INPUT].cast(x, transpose=True)
    w_op = qset[Role.WEIGHT].cast(w, transpose=True)
    dy_op = qset[Role.GRAD_OUTPUT].cast(dy, transpose=True)
    assert dy_op.fp8_dtype == torch.float8_e5m2  # (HYBRID: gradients in E5M2)
    assert rel_error(gemm(x_op, w_op, torch.float32), x.double() @ w.double().t()) < 0.06
    assert rel_error(gemm(dy_op, w_op, torch.float32, transpose_b=True), dy.double() @ w.double()) < 0.12
    dw = gemm(dy_op, x_op, torch.float32, transpose_a=True, transpose_b=True)
    assert rel_error(dw, dy.double().t() @ x.double()) < 0.12
    main_grad = torch.ones(48, 64, device=device)
    gemm_accumulate(dy_op, x_op, main_grad, transpose_a=True, transpose_b=True)
    assert torch.allclose(main_grad, dw + 1, rtol=1e-5, atol=1e-5)


def test_gemm_refuses_a_missing_side_and_another_layout():
    qset = QuantizerSet(RECIPES["current"], *GEMM_ROLES, "cpu")
    x_op = qset[Role.INPUT].cast(torch.randn(8, 16))
    w_op = qset[Role.WEIGHT].cast(torch.randn(4, 16))
    with pytest.raises(ValueError, match="b: the operand has no data_t"):
        gemm(x_op, w_op, torch.float32, transpose_b=True)
    blocked = FP8Operand(w_op.data, None, w_op.scale_inv, w_op.fp8_dtype, layout="block_128x128")
    with pytest.raises(ValueError, match="layouts 'tensor' and 'block_128x128' do not mix"):
        gemm(x_op, blocked, torch.float32)
    unknown = FP8Operand(w_op.data, None, w_op.scale_inv, w_op.fp8_dtype, layout="block_32x32")
    with pytest.raises(NotImplementedError, match="FP8 GEMM of layout 'block_32x32'"):
        gemm(unknown, unknown, torch.float32)


def test_delayed_quantizer_calibrates_then_uses_the_updated_scale():
    """Before the first update a delayed cast scales from the tensor's own amax (known_scale False); the update turns
    the amax history into the scale (fp8_max / amax / 2**margin) and later casts use it (known_scale True)."""
    fp8_recipe = recipe.DelayedScaling(margin=1, amax_history_len=2)
    qset = QuantizerSet(fp8_recipe, *GEMM_ROLES, "cpu")
    quantizer = qset[Role.INPUT]
    assert isinstance(quantizer, DelayedScalingQuantizer) and not quantizer.known_scale
    x = torch.randn(16, 32) * 5
    quantizer.cast(x)
    assert torch.allclose(quantizer.scale, 448.0 / x.abs().max(), rtol=1e-6)  # (calibrated: no margin)
    assert torch.equal(quantizer.amax, x.abs().max().reshape(1))
    queue = []
    update.register_forward(queue, qset.fwd_state, fp8_recipe, None)
    update.update_scaling_states(queue, forward=True)
    assert quantizer.known_scale and qset.uncalibrated_states() == [qset.bwd_state]
    assert torch.allclose(quantizer.scale, 448.0 / x.abs().max() / 2, rtol=1e-6)
    op = quantizer.cast(torch.randn(16, 32) * 100)  # (saturates: the scale is the history's, not this amax's)
    assert op.scale_inv is quantizer.scale_inv and torch.allclose(op.scale_inv, 1 / quantizer.scale)
    assert quantizer.output_args()[1] == torch.float8_e4m3fn


def test_current_quantizer_has_no_known_scale_and_no_history():
    qset = QuantizerSet(RECIPES["current"], *MLP_ROLES, "cpu")
    assert isinstance(qset[Role.FC2_WEIGHT], CurrentScalingQuantizer)
    assert qset.fwd_state.history_len == 1 and qset.fwd_state.scale.numel() == 4 and qset.bwd_state.scale.numel() == 2
    assert not qset[Role.FC1_INPUT].known_scale and not qset.updates_by_history and qset.fused_per_tensor
    assert qset.same_scale_on_every_rank() and qset.uncalibrated_states() == []
    first, second = torch.randn(8, 8), torch.randn(8, 8) * 1000
    quantizer = qset[Role.FC1_INPUT]
    a, b = quantizer.cast(first), quantizer.cast(second)
    assert a.scale_inv is not b.scale_inv  # (each cast keeps its own scale: the first may be read later)
    assert torch.allclose(a.scale_inv, first.abs().max() / 448.0, rtol=1e-6)
    assert torch.allclose(b.scale_inv, second.abs().max() / 448.0, rtol=1e-6)


def test_roles_map_to_their_slots_and_unknown_roles_and_recipes_are_refused():
    qset = QuantizerSet(RECIPES["delayed"], *MLP_ROLES, "cpu")
    assert [qset[r].slot for r in MLP_ROLES[0]] == [0, 1, 2, 3] and [qset[r].slot for r in MLP_ROLES[1]] == [0, 1]
    assert qset[Role.FC2_GRAD_OUTPUT].state is qset.bwd_state and qset[Role.FC2_WEIGHT].state is qset.fwd_state
    assert Role.FC1_INPUT == "fc1_input" and str(Role.FC1_INPUT) == "fc1_input"
    with pytest.raises(KeyError, match="input: not a role of this module"):
        qset[Role.INPUT]
    with pytest.raises(TypeError, match="recipe: expected one of"):
        quantizer_class(object())
    assert set(QUANTIZER_FOR_RECIPE) == {recipe.DelayedScaling, recipe.Float8CurrentScaling, recipe.Float8BlockScaling}


def test_swapping_a_state_rebinds_the_quantizers_and_states_are_kept_across_recipes():
    """A checkpoint region's recompute swaps a state (fwd_state = ...): the quantizers follow it. A new set for
    another recipe keeps the states when the history length suits it, and makes new ones otherwise."""
    first = QuantizerSet(RECIPES["delayed"], *GEMM_ROLES, "cpu")
    replay = ScalingState(2, 4, "cpu")
    first.fwd_state = replay
    assert first[Role.WEIGHT].state is replay and first[Role.GRAD_OUTPUT].state is first.bwd_state
    same_len = QuantizerSet(recipe.DelayedScaling(amax_history_len=4, margin=2), *GEMM_ROLES, "cpu",
                            states=(first.fwd_state, first.bwd_state))
    assert same_len.fwd_state is replay
    other_len = QuantizerSet(RECIPES["current"], *GEMM_ROLES, "cpu", states=(first.fwd_state, first.bwd_state))
    assert other_len.fwd_state is not replay and other_len.fwd_state.history_len == 1
    loaded = QuantizerSet.from_states(*GEMM_ROLES, replay, first.bwd_state)
    with pytest.raises(KeyError, match="no recipe yet"):
        loaded[Role.INPUT]
