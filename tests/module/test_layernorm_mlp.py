"""LayerNormMLP vs a float64 plain-PyTorch reference (norm -> fc1 -> activation -> fc2)."""
import copy

import pytest
import torch

import transformer_fp8 as te
from tests.module.helpers import DEVICES, GRAD_TOL, RECIPES, RELU_GRAD_TOL, check_against_reference, fp8_steps, \
    params64, randomize_vectors, reference_forward, reference_grads
from tests.utils import rel_error


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("activation", ["gelu", "swiglu", "relu"])
@pytest.mark.parametrize("normalization,bias,lead_shape", [("LayerNorm", True, (32,)), ("RMSNorm", False, (3, 7))])
def test_fp8_matches_reference(device, recipe_name, activation, normalization, bias, lead_shape):
    m = te.LayerNormMLP(64, 96, bias=bias, normalization=normalization, activation=activation,
                        params_dtype=torch.bfloat16, device=device)
    randomize_vectors(m)
    x = torch.randn(*lead_shape, 64, dtype=torch.bfloat16, device=device)
    dy = torch.randn(*lead_shape, 64, dtype=torch.bfloat16, device=device)
    check_against_reference(m, x, dy, RECIPES[recipe_name], RELU_GRAD_TOL if activation == "relu" else GRAD_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ["gelu", "swiglu", "relu"])
def test_outside_autocast_matches_reference(device, activation):
    m = te.LayerNormMLP(64, 96, activation=activation, params_dtype=torch.float32, device=device)
    randomize_vectors(m)
    x = torch.randn(2, 9, 64, device=device)
    assert rel_error(m(x), reference_forward(m, x.double(), params64(m))) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_parameter_shapes_and_return_values(device):
    m = te.LayerNormMLP(64, 96, activation="swiglu", return_bias=True, return_layernorm_output=True,
                        params_dtype=torch.bfloat16, device=device)
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes == {"layer_norm_weight": (64,), "layer_norm_bias": (64,), "fc1_weight": (192, 64),
                      "fc1_bias": (192,), "fc2_weight": (64, 96), "fc2_bias": (64,)}
    x = torch.randn(16, 64, dtype=torch.bfloat16, device=device)
    with te.fp8_autocast():
        out, bias, ln_out = m(x)
    assert out.shape == x.shape and bias is m.fc2_bias and ln_out.shape == x.shape


@pytest.mark.parametrize("device", DEVICES)
def test_backward_frees_ffn_sized_tensors_after_their_last_use(device, monkeypatch):
    """The FP8 activation (FC2's wgrad input) is gone before the activation backward, and the [tokens, ffn] tensors
    of that (fc1 output, its gradient) before the FC1 GEMMs run (peak memory); a second backward through the same
    forward is a clear error."""
    import weakref

    from transformer_fp8.module import layernorm_mlp
    seen, alive_at_gemm, wgrad_inputs, alive_at_dact = [], [], [], []
    dact, gemm_grads = layernorm_mlp._dact_to_fp8, layernorm_mlp.gemm_grads

    def recording_dact(quantizer, activation, d_act, fc1_out, *flags):
        alive_at_dact.append([ref() is not None for ref in wgrad_inputs])
        seen.extend(weakref.ref(t) for t in (d_act, fc1_out))
        return dact(quantizer, activation, d_act, fc1_out, *flags)

    def checking_gemm_grads(dy, w_t, x_t, *args):  # (FP8Operands: x_t's data_t is the wgrad input)
        alive_at_gemm.append([ref() is not None for ref in seen])
        if x_t is not None:
            wgrad_inputs.append(weakref.ref(x_t.data_t))
        return gemm_grads(dy, w_t, x_t, *args)

    monkeypatch.setattr(layernorm_mlp, "_dact_to_fp8", recording_dact)
    monkeypatch.setattr(layernorm_mlp, "gemm_grads", checking_gemm_grads)
    mlp = te.LayerNormMLP(64, 256, params_dtype=torch.float32, device=device, fp8_min_gemm_size=0)
    x = torch.randn(32, 64, device=device, requires_grad=True)
    with te.fp8_autocast():
        y = mlp(x)
    y.backward(torch.randn_like(y), retain_graph=True)
    # calls: FC2 wgrad and FC2 dgrad (before the activation backward), FC1 dgrad, FC1 wgrad
    assert alive_at_gemm == [[], [], [False, False], [False, False]]
    assert alive_at_dact == [[False]]
    with pytest.raises(RuntimeError, match="retain_graph"):
        y.backward(torch.randn_like(y))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_delayed_scaling_makes_the_fp8_fc1_gradient_transpose_after_the_dgrad(device, monkeypatch, activation):
    """From the first step on (its scale from an amax pass there), the activation backward writes the FP8 d(fc1_out)
    row-major only (the backward's peak); its transpose for the FC1 wgrad comes later, and the weight gradients are
    finite (see test_fp8_matches_reference for the tolerances over two steps)."""
    from transformer_fp8.module import layernorm_mlp
    dact, transposes = layernorm_mlp._dact_to_fp8, []

    def recording_dact(*args):
        result = dact(*args)  # (FP8Operand, dbias)
        transposes.append(result[0].data_t is not None)
        return result

    monkeypatch.setattr(layernorm_mlp, "_dact_to_fp8", recording_dact)
    mlp = te.LayerNormMLP(64, 96, activation=activation, params_dtype=torch.bfloat16, device=device,
                          fp8_min_gemm_size=0)
    x = torch.randn(32, 64, dtype=torch.bfloat16, device=device)
    for _ in range(2):
        with te.fp8_autocast():
            y = mlp(x)
        y.backward(torch.randn_like(y))
    assert transposes == [False, False]
    assert mlp.fc1_weight.grad is not None and mlp.fc1_weight.grad.isfinite().all()


@pytest.mark.parametrize("device", DEVICES)
def test_gelu_rides_in_the_fc1_epilogue_after_the_first_update(device, monkeypatch):
    """Delayed scaling, BF16, gelu: from the second step FC1's GEMM applies GELU and emits the FP8 activation itself
    (no activation kernel); results as with the activation kernel, within an FP8 rounding of the activation."""
    from transformer_fp8.module import layernorm_mlp
    from transformer_fp8.quantization import gemm_ops as quantization_gemm
    torch.manual_seed(0)
    m = te.LayerNormMLP(64, 96, params_dtype=torch.bfloat16, device=device)
    randomize_vectors(m)
    twin = copy.deepcopy(m)
    x = torch.randn(32, 64, dtype=torch.bfloat16, device=device)
    dy = torch.randn(32, 64, dtype=torch.bfloat16, device=device)
    calls = []
    real_ops = layernorm_mlp.tfp8

    class Spy:
        def __getattr__(self, name):
            op = getattr(real_ops, name)
            return lambda *args, **kwargs: calls.append((name, kwargs.get("gelu", False))) or op(*args, **kwargs)
    monkeypatch.setattr(layernorm_mlp, "tfp8", Spy())
    monkeypatch.setattr(quantization_gemm, "tfp8", Spy())  # (the GEMMs on FP8 operands)
    recipe = te.recipe.DelayedScaling()
    out, grads = fp8_steps(m, x, dy, recipe)
    # (step 1 calibrates its scale from an amax pass, then the activation kernel writes FP8; step 2: the GEMM
    # epilogue, no kernel)
    assert calls.count(("fp8_gemm", True)) == 1 and calls.count(("activation_fwd", False)) == 1, calls
    monkeypatch.setattr(layernorm_mlp, "_gelu_in_fc1_epilogue", lambda *args: False)
    twin_out, twin_grads = fp8_steps(twin, x, dy, recipe)
    assert rel_error(out, twin_out) < 0.03
    for name, g in grads.items():
        assert rel_error(g, twin_grads[name]) < 0.06, name
    # the GEMM's amax fed the update (GELU of the float32 result, not of its BF16 rounding: amaxes differ a little)
    assert torch.allclose(m.fp8_fwd.scale, twin.fp8_fwd.scale, rtol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ["gelu", "swiglu", "relu"])
@pytest.mark.parametrize("fp8_format", ["HYBRID", "E4M3"])
def test_kept_fp8_activation_input_matches_reference_and_halves_what_the_backward_keeps(device, activation,
                                                                                          fp8_format):
    """keep_activation_input_in_fp8 (the default): under delayed scaling (its first step included),
    fc1's output is kept as its E4M3 1x128-tile copy instead of in bf16: the same forward bit for bit, gradients
    within the float64 reference's FP8 tolerances, FC2's gradients unchanged, fc1's within a few percent of the bf16
    path's; and the backward holds no bf16 fc1 output."""
    from transformer_fp8 import recipe
    from transformer_fp8.module import layernorm_mlp
    fp8_recipe = recipe.DelayedScaling(fp8_format=recipe.Format[fp8_format], amax_history_len=4)
    kept_seen = []
    dact = layernorm_mlp._dact_to_fp8

    def recording_dact(quantizer, activation_name, d_act, fc1_out, kept, *flags):
        kept_seen.append((fc1_out is None, kept[0] is not None))
        return dact(quantizer, activation_name, d_act, fc1_out, kept, *flags)

    ffn = 128
    torch.manual_seed(0)
    keep = te.LayerNormMLP(64, ffn, activation=activation, normalization="RMSNorm", bias=False,
                           params_dtype=torch.bfloat16, device=device, fp8_min_gemm_size=0)
    plain = copy.deepcopy(keep)
    plain.keep_activation_input_in_fp8 = False
    assert keep.keep_activation_input_in_fp8
    x = torch.randn(4, 32, 64, dtype=torch.bfloat16, device=device)
    dy = torch.randn(4, 32, 64, dtype=torch.bfloat16, device=device)
    ref_out, ref_grads = reference_grads(keep, x, dy)
    layernorm_mlp._dact_to_fp8 = recording_dact
    try:
        out, grads = fp8_steps(keep, x, dy, fp8_recipe)
    finally:
        layernorm_mlp._dact_to_fp8 = dact
    # the kept copy only, from the first step on (its scale from an amax pass there); GELU keeps bf16 (from the second
    # step it rides in FC1's epilogue, whose aux output is bf16: the first step keeps the same)
    assert kept_seen == 2 * [(False, False) if activation == "gelu" else (True, True)]
    plain_out, plain_grads = fp8_steps(plain, x, dy, fp8_recipe)
    assert torch.equal(out, plain_out)
    tol = RELU_GRAD_TOL if activation == "relu" else GRAD_TOL
    for name, ref in ref_grads.items():
        assert rel_error(grads[name], ref) <= tol, name
    for name in ("fc2_weight",):
        assert torch.equal(grads[name], plain_grads[name]), name
    for name in ("fc1_weight", "input", "layer_norm_weight"):  # no worse than the bf16-kept path's FP8 error
        assert rel_error(grads[name], ref_grads[name]) <= 1.2 * rel_error(plain_grads[name], ref_grads[name]) + 0.01, \
            name
