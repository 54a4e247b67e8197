"""GroupedLinear: TE's parameter names, high-precision and FP8 paths (delayed and current scaling, E4M3 and HYBRID
formats) against a float64 per-expert reference, values and gradients, with uneven, empty, 16-aligned splits given
as lists or device tensors; fuse_wgrad_accumulation, bias and return_bias, fp8_model_init, checkpoints, calibration
(fp8_autocast(calibrating=True)), the FP8 weight cache (is_first_microbatch), bad input.
The FP8 path runs on the CPU through the ops' reference kernels, and on the GPU (marked gpu) through the CUDA ones."""
import warnings

import pytest
import torch

import transformer_fp8 as te
from tests.utils import assert_close_rel
from transformer_fp8.recipe import DelayedScaling, Float8CurrentScaling, Format

RECIPES = {"delayed": lambda: DelayedScaling(), "current": lambda: Float8CurrentScaling(),
           "delayed_e4m3": lambda: DelayedScaling(fp8_format=Format.E4M3)}
SPLITS = {"uneven_empty": [37, 0, 100, 5, 0, 50], "aligned": [16, 64, 0, 32, 48, 16]}
# FP8 tolerances (||err|| / ||ref||): E4M3 operands (2**-4 per rounding), outputs rounded to bf16.
FWD_TOL, GRAD_TOL = 0.06, 0.08


def reference(x, weights, biases, splits):
    """float64 per-expert y_g = x_g W_gᵀ + b_g."""
    outs, start = [], 0
    for g, m in enumerate(splits):
        y = x[start:start + m] @ weights[g].T
        outs.append(y + biases[g] if biases else y)
        start += m
    return torch.cat(outs)


def activate64(y, activation):
    """float64 formulas of the output activations."""
    if activation is None:
        return y
    if activation == "swiglu":
        gate, up = y.chunk(2, dim=-1)
        return gate * torch.sigmoid(gate) * up
    if activation == "relu":
        return y.clamp(min=0)
    return 0.5 * y * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (y + 0.044715 * y ** 3)))


def assert_weight_grads(weights, refs, splits, tol):
    """Each non-empty group's weight gradient against its float64 reference's."""
    for g, (w, w_ref) in enumerate(zip(weights, refs)):
        if splits[g]:
            assert_close_rel(w.grad, w_ref.grad, tol, f"dW{g}")


def run_against_reference(module, splits, device, dtype, fp8_recipe, tensor_splits, tol, grad_tol, main_grad=False,
                          splits_aligned=False, output_activation=None):
    k = module.in_features
    x = torch.randn(sum(splits), k, device=device, dtype=dtype, requires_grad=True)
    m_splits = torch.tensor(splits, device=device) if tensor_splits else splits
    weights, biases = module.weights, module.biases
    for step in range(2):  # (delayed scaling: the first step calibrates, the second runs on updated scales)
        if main_grad:
            for w in weights:
                w.main_grad = torch.full(w.shape, 0.5, dtype=torch.float32, device=device)
        x.grad = None
        for p in module.parameters():
            p.grad = None
        with te.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
            out = module(x, m_splits, splits_aligned=splits_aligned, output_activation=output_activation)
        grad = torch.randn_like(out)
        out.backward(grad)
    x64 = x.detach().double().requires_grad_()
    w64 = [w.detach().double().requires_grad_() for w in weights]
    b64 = [b.detach().double().requires_grad_() for b in biases]
    ref = activate64(reference(x64, w64, b64, splits), output_activation)
    ref.backward(grad.double())
    assert out.dtype == dtype and out.shape == ref.shape
    assert_close_rel(out, ref, tol)
    assert_close_rel(x.grad, x64.grad, grad_tol, "dx")
    for g, (w, w_ref) in enumerate(zip(weights, w64)):
        got = w.main_grad - 0.5 if main_grad else w.grad  # (accumulated into 0.5)
        if splits[g] == 0:
            assert got is None or torch.count_nonzero(got) == 0, f"dW{g} of an empty group"
        elif main_grad:
            assert w.grad is None
        else:
            assert_close_rel(got, w_ref.grad, grad_tol, f"dW{g}")
    for g, (b, b_ref) in enumerate(zip(biases, b64)):
        if splits[g]:
            assert_close_rel(b.grad, b_ref.grad, grad_tol, f"db{g}")


def test_parameters_have_te_names():
    module = te.GroupedLinear(3, 32, 16, device="cpu")
    names = [n for n, _ in module.named_parameters()]
    assert names == ["weight0", "bias0", "weight1", "bias1", "weight2", "bias2"]
    assert module.weight1.shape == (16, 32) and module.bias2.shape == (16,)
    assert [n for n, _ in te.GroupedLinear(2, 32, 16, bias=False, device="cpu").named_parameters()] == \
        ["weight0", "weight1"]


@pytest.mark.parametrize("splits", SPLITS.values(), ids=SPLITS.keys())
@pytest.mark.parametrize("tensor_splits", (False, True))
def test_high_precision_matches_float64(splits, tensor_splits):
    module = te.GroupedLinear(len(splits), 32, 48, device="cpu", params_dtype=torch.float64)
    for b in module.biases:
        torch.nn.init.normal_(b)
    run_against_reference(module, splits, "cpu", torch.float64, None, tensor_splits, 1e-12, 1e-12)


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPES.keys())
@pytest.mark.parametrize("splits", SPLITS.values(), ids=SPLITS.keys())
@pytest.mark.parametrize("tensor_splits", (False, True))
def test_fp8_cpu_matches_float64(recipe, splits, tensor_splits):
    module = te.GroupedLinear(len(splits), 64, 48, device="cpu")
    for b in module.biases:
        torch.nn.init.normal_(b, std=0.1)
    run_against_reference(module, splits, "cpu", torch.float32, RECIPES[recipe](), tensor_splits, FWD_TOL, GRAD_TOL)


def forbid_padded_copies(monkeypatch):
    """Make the padded-copy weight gradient fail: a test then proves the aligned path ran."""
    def refuse(*args):
        raise AssertionError("padded copy made for aligned groups")
    monkeypatch.setattr("transformer_fp8.module.grouped_linear.padded_groups", refuse)


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPES.keys())
def test_fp8_cpu_aligned_device_splits_skip_padded_copies(recipe, monkeypatch):
    forbid_padded_copies(monkeypatch)
    splits = SPLITS["aligned"]
    module = te.GroupedLinear(len(splits), 64, 48, device="cpu")
    run_against_reference(module, splits, "cpu", torch.float32, RECIPES[recipe](), True, FWD_TOL, GRAD_TOL,
                          splits_aligned=True)


class CallCounter:
    """Wraps the ops namespace grouped_linear calls, counting the calls of one op."""

    def __init__(self, ops, name):
        self.ops, self.name, self.calls = ops, name, 0

    def __getattr__(self, attr):
        if attr == self.name:
            self.calls += 1
        return getattr(self.ops, attr)


# (the gradients through an activation also carry the FP8 forward's error in the activation's derivative; relu's
# derivative jumps at 0, where that error flips it: relu is checked in high precision only)
ACTIVATION_GRAD_TOL = 0.12


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPES.keys())
@pytest.mark.parametrize("activation", ("swiglu", "gelu"))
@pytest.mark.parametrize("bias", (False, True))
def test_fp8_cpu_output_activation_matches_float64(recipe, activation, bias, monkeypatch, device="cpu",
                                                   tensor_splits=True):
    from transformer_fp8.module import grouped_linear

    counter = CallCounter(grouped_linear.tfp8, "dact_cast_transpose")
    monkeypatch.setattr(grouped_linear, "tfp8", counter)
    splits = SPLITS["aligned"]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    module = te.GroupedLinear(len(splits), 64, 96, bias=bias, device=device, params_dtype=dtype)
    for b in module.biases:
        torch.nn.init.normal_(b, std=0.1)
    run_against_reference(module, splits, device, dtype, RECIPES[recipe](), tensor_splits, FWD_TOL,
                          ACTIVATION_GRAD_TOL, splits_aligned=True, output_activation=activation)
    # the fused d(activation) + cast: delayed scaling's two steps (the first with the scale of an amax pass), no biases
    assert counter.calls == (2 if recipe.startswith("delayed") and not bias else 0)


@pytest.mark.parametrize("activation", ("swiglu", "gelu"))
def test_first_delayed_step_fused_dact_matches_float64(activation, monkeypatch):
    """Delayed scaling's first step, before any scale exists: the output gradient's scale comes from an amax pass over
    act'(x) * dy (the fused d(activation) cast then writes FP8 directly, no 16-bit d(x) made), and the step's
    gradients match float64 within FP8 tolerance; the role's amax is that of the exact d(x)."""
    from transformer_fp8.module import grouped_linear

    counter = CallCounter(grouped_linear.tfp8, "dact_cast_transpose")
    monkeypatch.setattr(grouped_linear, "tfp8", counter)
    torch.manual_seed(7)
    splits = SPLITS["aligned"]
    module = te.GroupedLinear(len(splits), 64, 96, bias=False, device="cpu", params_dtype=torch.float32)
    x = torch.randn(sum(splits), 64, requires_grad=True)
    m_splits = torch.tensor(splits)
    with te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling()):
        out = module(x, m_splits, splits_aligned=True, output_activation=activation)
    grad = torch.randn_like(out)
    out.backward(grad)
    assert counter.calls == 1
    x64 = x.detach().double().requires_grad_()
    w64 = [w.detach().double().requires_grad_() for w in module.weights]
    pre = reference(x64, w64, [], splits)
    pre.retain_grad()
    ref = activate64(pre, activation)
    ref.backward(grad.double())
    assert_close_rel(out, ref, FWD_TOL)
    assert_close_rel(x.grad, x64.grad, ACTIVATION_GRAD_TOL, "dx")
    assert_weight_grads(module.weights, w64, splits, ACTIVATION_GRAD_TOL)
    # the amax the pass found: that of d(pre) (pre from the FP8 forward's GEMM, hence the tolerance)
    quantizer = module.quantizers[grouped_linear.Role.GRAD_OUTPUT]
    amax, exact = float(quantizer.state.amax_history[:, quantizer.slot].max()), float(pre.grad.abs().max())
    assert abs(amax - exact) <= 0.15 * exact, (amax, exact)


@pytest.mark.parametrize("activation", ("swiglu", "gelu", "relu"))
def test_high_precision_output_activation_matches_float64(activation):
    splits = SPLITS["uneven_empty"]
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        module = te.GroupedLinear(len(splits), 32, 48, device="cpu", params_dtype=dtype)
        run_against_reference(module, splits, "cpu", dtype, None, True, tol, tol, output_activation=activation)


def test_fp8_fuse_wgrad_accumulation_and_no_bias():
    splits = [20, 0, 44]
    module = te.GroupedLinear(3, 32, 32, bias=False, fuse_wgrad_accumulation=True, device="cpu")
    run_against_reference(module, splits, "cpu", torch.float32, DelayedScaling(), True, FWD_TOL, GRAD_TOL,
                          main_grad=True)
    assert all(w.grad is None for w in module.weights)


def test_weights_are_views_of_one_tensor():
    from transformer_fp8.module.grouped_linear import _stacked_view

    module = te.GroupedLinear(3, 32, 16, device="cpu")
    stacked = _stacked_view(module.weights)
    assert stacked is not None and torch.equal(stacked[2], module.weight2)
    module.double()  # (a cast makes separate tensors: packed again)
    assert module.weight0.dtype == torch.float64 and _stacked_view(module.weights) is not None
    module.weight1 = torch.nn.Parameter(torch.randn(16, 32, dtype=torch.float64))  # (a user's own tensor: stacked)
    assert _stacked_view(module.weights) is None
    x = torch.randn(6, 32, dtype=torch.float64)
    torch.testing.assert_close(module(x, [1, 2, 3]), reference(x, module.weights, module.biases, [1, 2, 3]))


def test_return_bias():
    module = te.GroupedLinear(2, 16, 16, return_bias=True, device="cpu")
    x = torch.randn(5, 16)
    out, biases = module(x, [2, 3])
    assert len(biases) == 2 and biases[0] is module.bias0
    torch.testing.assert_close(out, reference(x, module.weights, [], [2, 3]))


def test_fp8_changes_nothing_outside_the_groups_and_checkpoints():
    module = te.GroupedLinear(2, 32, 32, device="cpu")
    x = torch.randn(48, 32)
    with te.fp8_autocast(fp8_recipe=DelayedScaling()):
        module(x, [16, 32])
    state = module.state_dict()
    assert "_extra_state" in state and state["_extra_state"]["fwd"]["scale"].shape == (2,)
    other = te.GroupedLinear(2, 32, 32, device="cpu")
    other.load_state_dict(state)
    with te.fp8_autocast(fp8_recipe=DelayedScaling()):
        torch.testing.assert_close(other(x, [16, 32]), module(x, [16, 32]))


def test_fp8_model_init_weights():
    splits = [16, 0, 40]
    with te.fp8_model_init():
        module = te.GroupedLinear(3, 32, 32, bias=False, device="cpu")
    assert all(isinstance(w, te.Float8Tensor) for w in module.weights)
    x = torch.randn(56, 32, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=Float8CurrentScaling()):
        out = module(x, splits)
    ref = reference(x.detach().double(), [w.dequantize().double() for w in module.weights], [], splits)
    assert_close_rel(out, ref, FWD_TOL)
    out.sum().backward()
    assert x.grad is not None


def test_bad_inputs():
    module = te.GroupedLinear(2, 16, 16, device="cpu")
    x = torch.randn(5, 16)
    with pytest.raises(ValueError, match="m_splits: expected 2 non-negative ints summing to 5"):
        module(x, [2, 2])
    with pytest.raises(ValueError, match="m_splits: expected 2 non-negative ints"):
        module(x, [6, -1])
    with pytest.raises(ValueError, match="m_splits: expected an integer tensor of 2 elements"):
        module(x, torch.tensor([5]))
    with pytest.raises(ValueError, match="inp: expected a tensor with last dim 16"):
        module(torch.randn(5, 8), [2, 3])
    with pytest.raises(ValueError, match="multiples of 16"), te.fp8_autocast():
        te.GroupedLinear(2, 24, 16, device="cpu")(torch.randn(5, 24), [2, 3])
    with pytest.raises(ValueError, match="splits_aligned=True expects multiples of 16"):
        te.GroupedLinear(2, 16, 16, device="cpu")(torch.randn(37, 16), [16, 21], splits_aligned=True)
    with pytest.raises(ValueError, match="output_activation"):
        module(x, [2, 3], output_activation="tanh")
    with pytest.raises(ValueError, match="output_activation: not with return_bias"):
        te.GroupedLinear(2, 16, 16, device="cpu", return_bias=True)(x, [2, 3], output_activation="swiglu")
    with pytest.raises(ValueError, match="output_activation: swiglu needs an even out_features"):
        te.GroupedLinear(2, 16, 15, device="cpu")(x, [2, 3], output_activation="swiglu")
    with pytest.raises(ValueError, match="num_gemms: expected a positive int"):
        te.GroupedLinear(0, 16, 16, device="cpu")


def test_calibration_records_input_and_weight_amaxes_then_fp8_uses_them():
    calibration = DelayedScaling(amax_history_len=4, amax_compute_algo="max")
    splits = [16, 0, 40]
    module = te.GroupedLinear(3, 32, 48, device="cpu")
    xs = [torch.randn(56, 32) * scale for scale in (1.0, 3.0, 0.5)]
    for x in xs:
        with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=calibration):
            out = module(x, torch.tensor(splits))
        assert torch.equal(out, module(x, splits))  # (the high-precision path)
    state = module.fp8_fwd
    assert state.calibrated
    # INPUT: the largest input seen; WEIGHT: all the weights together (the FP8 path casts them with one scale)
    expected = torch.stack([max(x.abs().max() for x in xs), torch.stack(module.weights).detach().abs().max()])
    recorded = state.amax_history.max(dim=0).values
    torch.testing.assert_close(recorded, expected, rtol=0, atol=0)
    torch.testing.assert_close(state.scale, 448.0 / recorded)
    x = xs[1]
    with te.fp8_autocast(fp8_recipe=calibration):
        out = module(x, splits)
    ref = reference(x.double(), [w.detach().double() for w in module.weights],
                    [b.detach().double() for b in module.biases], splits)
    assert_close_rel(out, ref, FWD_TOL)


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPES.keys())
def test_fp8_weight_cache_follows_is_first_microbatch(recipe):
    splits = [16, 0, 40]
    module = te.GroupedLinear(3, 32, 48, bias=False, device="cpu")
    old = [w.detach().double().clone() for w in module.weights]
    x = torch.randn(56, 32, requires_grad=True)
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=RECIPES[recipe]()):  # (no dgrad: the cache still keeps Wᵀ)
        first = module(x, splits, is_first_microbatch=True)
    with torch.no_grad():
        for w in module.weights:
            w.mul_(0.5)  # (the kept FP8 copy is the first microbatch's: the next call does not see this; halved,
            # not doubled: delayed scaling's scale, from the old amax, then does not saturate the fresh cast)
    with te.fp8_autocast(fp8_recipe=RECIPES[recipe]()):
        cached = module(x, splits, is_first_microbatch=False)
        fresh = module(x.detach(), splits)
    assert torch.equal(cached, first)
    assert_close_rel(fresh, reference(x.detach().double(), [0.5 * w for w in old], [], splits), FWD_TOL)
    grad = torch.randn_like(cached)
    cached.backward(grad)
    x64 = x.detach().double().requires_grad_()
    w64 = [w.clone().requires_grad_() for w in old]
    ref = reference(x64, w64, [], splits)
    ref.backward(grad.double())
    assert_close_rel(cached, ref, FWD_TOL)
    assert_close_rel(x.grad, x64.grad, GRAD_TOL, "dx (through the cached weights)")
    assert_weight_grads(module.weights, w64, splits, GRAD_TOL)
    with te.fp8_autocast(fp8_recipe=RECIPES[recipe]()):  # (True casts again: the halved weights now)
        again = module(x.detach(), splits, is_first_microbatch=True)
    assert_close_rel(again, 0.5 * ref.detach(), FWD_TOL)


# ------------------------------------------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPES.keys())
@pytest.mark.parametrize("splits", SPLITS.values(), ids=SPLITS.keys())
@pytest.mark.parametrize("tensor_splits", (False, True, "list, grouped kernel"))
def test_cuda_fp8_matches_float64(recipe, splits, tensor_splits, monkeypatch):
    if tensor_splits == "list, grouped kernel":  # (host sizes, but the grouped kernel instead of the dense loop)
        monkeypatch.setattr("transformer_fp8.module.grouped_linear.LOOP_MAX_GROUPS", 0)
        tensor_splits = False
    module = te.GroupedLinear(len(splits), 256, 128, params_dtype=torch.bfloat16)
    for b in module.biases:
        torch.nn.init.normal_(b, std=0.1)
    run_against_reference(module, splits, "cuda", torch.bfloat16, RECIPES[recipe](), tensor_splits, FWD_TOL,
                          GRAD_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("tensor_splits", (False, True))
def test_cuda_fp8_close_to_bf16_and_fused_wgrad(tensor_splits):
    splits = [300, 0, 17, 211, 0, 500, 1, 7]
    module = te.GroupedLinear(8, 512, 256, bias=False, params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True)
    run_against_reference(module, splits, "cuda", torch.bfloat16, Float8CurrentScaling(), tensor_splits, FWD_TOL,
                          GRAD_TOL, main_grad=True)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPES.keys())
def test_cuda_fp8_aligned_device_splits_skip_padded_copies(recipe, monkeypatch):
    forbid_padded_copies(monkeypatch)
    splits = [160, 0, 16, 512, 0, 48, 16, 32]
    module = te.GroupedLinear(len(splits), 256, 128, params_dtype=torch.bfloat16)
    run_against_reference(module, splits, "cuda", torch.bfloat16, RECIPES[recipe](), True, FWD_TOL, GRAD_TOL,
                          splits_aligned=True)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPES.keys())
@pytest.mark.parametrize("bias", (False, True))
@pytest.mark.parametrize("tensor_splits", (True, False))  # (a host list on CUDA: the dense per-group loop)
def test_cuda_fp8_output_swiglu_matches_float64(recipe, bias, tensor_splits, monkeypatch):
    test_fp8_cpu_output_activation_matches_float64(recipe, "swiglu", bias, monkeypatch, device="cuda",
                                                   tensor_splits=tensor_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("splits_aligned", (False, True))
def test_cuda_fp8_step_never_syncs(splits_aligned):
    module = te.GroupedLinear(8, 256, 256, params_dtype=torch.bfloat16)
    sizes = [96, 0, 32, 304, 16, 0, 48, 16] if splits_aligned else [100, 0, 28, 300, 12, 0, 60, 12]
    m_splits = torch.tensor(sizes, device="cuda")
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for recipe in (DelayedScaling(), Float8CurrentScaling()):
        for step in range(3):
            if step == 2:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                with te.fp8_autocast(fp8_recipe=recipe):
                    module(x, m_splits, splits_aligned=splits_aligned, output_activation="swiglu").sum().backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_cuda_fp8_model_init():
    with te.fp8_model_init():
        module = te.GroupedLinear(4, 128, 128, bias=False, params_dtype=torch.bfloat16)
    splits = [64, 0, 33, 31]
    x = torch.randn(128, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=DelayedScaling()):
        out = module(x, torch.tensor(splits, device="cuda"))
    ref = reference(x.detach().double(), [w.dequantize().double() for w in module.weights], [], splits)
    assert_close_rel(out, ref, FWD_TOL)
    out.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.gpu
def test_cuda_fp8_at_every_size_whatever_fp8_min_gemm_size():
    """GroupedLinear has no small-shape path: inside fp8_autocast it runs FP8 however small its GEMMs (and
    fp8_min_gemm_size, accepted for the other modules' API, changes nothing)."""
    module = te.GroupedLinear(2, 16, 16, params_dtype=torch.bfloat16, device="cuda", fp8_min_gemm_size=2 ** 40)
    x = torch.randn(32, 16, device="cuda", dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", te.FP8FallbackWarning)
        with te.fp8_autocast(fp8_recipe=Float8CurrentScaling()):
            out = module(x, [16, 16])
    assert module._fp8_call_counts == [1, 0]
    ref = reference(x.double(), [w.detach().double() for w in module.weights],
                    [b.detach().double() for b in module.biases], [16, 16])
    assert_close_rel(out, ref, FWD_TOL)
