"""Seeing what FP8 does: the small-shape fallback's warning, threshold switch and call counters (module/base.py), and
transformer_fp8.debug (per-role stats against float64, fp8_disabled, zero cost until enabled, the report)."""
import math
import subprocess
import sys
import warnings

import pytest
import torch

import transformer_fp8 as te
from tests.module.helpers import DEVICES, RECIPES
from tests.utils import OpNames, checkout_env
from transformer_fp8 import debug
from transformer_fp8.module import base

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# half the smallest subnormal, written out independently of debug.FLUSH_BOUND: E4M3 2**-6 * 2**-3, E5M2 2**-14 * 2**-2
HALF_MIN_SUBNORMAL = {torch.float8_e4m3fn: 2.0 ** -9 / 2, torch.float8_e5m2: 2.0 ** -16 / 2}
# the max plus half the step below it: E4M3 1.75 * 2**8 + 2**(8 - 3) / 2, E5M2 1.75 * 2**15 + 2**(15 - 2) / 2
CLAMPED_ABOVE = {torch.float8_e4m3fn: 448.0 + 2.0 ** 5 / 2, torch.float8_e5m2: 57344.0 + 2.0 ** 13 / 2}
SMALL = {
    "Linear": lambda **kw: te.Linear(64, 48, **kw),
    "LayerNormLinear": lambda **kw: te.LayerNormLinear(64, 48, **kw),
    "LayerNormMLP": lambda **kw: te.LayerNormMLP(64, 96, **kw),
}


class CudaLooking(torch.Tensor):
    """A CPU tensor that says it is on CUDA: the small-shape path (CUDA inputs only) runs its real code on the CPU."""

    @property
    def is_cuda(self):
        return True


@pytest.fixture
def fresh_warning(monkeypatch):
    """The default threshold (conftest sets 0) and a process that has not warned yet."""
    monkeypatch.setattr(base, "FP8_MIN_GEMM_SIZE", 2 ** 35)
    monkeypatch.setattr(base, "_fallback_warned", False)


def small_input(device, dtype=torch.bfloat16, rows=8, features=64):
    x = torch.randn(rows, features, dtype=dtype, device=device)
    return x if device == "cuda" else x.as_subclass(CudaLooking)


def expected_stats(x, scale, fp8_dtype):
    """amax, flushed and saturated fractions of casting x with `scale` (float32), in float64: the product of two
    float32 numbers is exact in float64, then rounded to float32 as the cast kernels' float32 multiply rounds it.
    Saturated: clamped by more than rounding would move it (beyond the max by more than half a step)."""
    x64 = x.detach().double()
    scale = float(torch.as_tensor(scale).detach().float())
    scaled = (x64 * scale).float().double().abs()
    flushed = ((scaled <= HALF_MIN_SUBNORMAL[fp8_dtype]) & (x64 != 0)).double().mean().item()
    saturated = (scaled > CLAMPED_ABOVE[fp8_dtype]).double().mean().item()
    return x64.abs().max().item(), flushed, saturated


def own_scale(fp8_dtype, t):
    """fp8_max / amax(t) in float32, divided as the scaling update divides (a Python float over a tensor would
    multiply by the tensor's reciprocal: up to an ulp off)."""
    return torch.tensor(FP8_MAX[fp8_dtype]) / t.detach().abs().max().float().cpu()


def check_role(row, x, scale, fp8_dtype, numel_slack=0):
    """One role's recorded numbers against float64 (flushed / saturated within numel_slack elements)."""
    amax, flushed, saturated = expected_stats(x, scale, fp8_dtype)
    assert row["amax"] == pytest.approx(amax, rel=1e-5)
    assert row["scale"] == pytest.approx(float(scale), rel=1e-6)
    slack = numel_slack / x.numel() + 1e-9
    assert abs(row["flushed"] - flushed) <= slack, (row["flushed"], flushed)
    assert abs(row["saturated"] - saturated) <= slack, (row, saturated, float(scale))
    return flushed, saturated


# --- the small-shape fallback: warning, switch, counters ---

@pytest.mark.parametrize("name", sorted(SMALL))
def test_fallback_warns_once_naming_module_size_threshold_and_fix(name, fresh_warning):
    module = SMALL[name](params_dtype=torch.bfloat16, device="cpu")
    debug.enable(module)  # (names the module: its qualified name in the model, here the class)
    x = small_input("cpu")
    work = x.shape[0] * 64 * (48 if name != "LayerNormMLP" else 96 + 96)
    with pytest.warns(te.FP8FallbackWarning) as caught, te.fp8_autocast():
        module(x)
    text = str(caught[0].message)
    assert len(caught) == 1
    for part in (name, f"M*K*N = {work:.3g}", f"{2 ** 35:.3g}", "fp8_min_gemm_size=0", "set_fp8_min_gemm_size(0)",
                 "TFP8_MIN_GEMM_SIZE"):
        assert part in text, (part, text)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second fallback, of this or another module: no warning
        with te.fp8_autocast():
            module(x)
            SMALL["Linear"](params_dtype=torch.bfloat16, device="cpu")(small_input("cpu"))
    assert debug.call_counts(module) == {"fp8": 0, "high_precision": 2}


def test_warning_names_the_module_inside_its_model(fresh_warning):
    model = torch.nn.Sequential(torch.nn.Identity(), te.Linear(64, 48, params_dtype=torch.bfloat16, device="cpu"))
    debug.enable(model)
    with pytest.warns(te.FP8FallbackWarning, match=r"Linear '1' \(in_features=64, out_features=48"):
        with te.fp8_autocast():
            model(small_input("cpu"))


def test_no_warning_at_or_above_the_threshold_nor_outside_autocast(fresh_warning):
    module = te.Linear(64, 48, params_dtype=torch.bfloat16, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module(small_input("cpu"))  # outside fp8_autocast: neither warned nor counted
        te.set_fp8_min_gemm_size(8 * 64 * 48)  # (the fixture's monkeypatch restores the default)
        with te.fp8_autocast():
            module(small_input("cpu"))  # M*K*N == threshold: FP8
    assert debug.call_counts(module) == {"fp8": 1, "high_precision": 0}
    assert module.fp8_fwd is not None


def test_global_switch(fresh_warning):
    assert te.get_fp8_min_gemm_size() == 2 ** 35
    te.set_fp8_min_gemm_size(0)
    assert te.get_fp8_min_gemm_size() == 0 == base.FP8_MIN_GEMM_SIZE
    module = te.LayerNormMLP(64, 96, params_dtype=torch.bfloat16, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with te.fp8_autocast():
            module(small_input("cpu"))
    assert debug.call_counts(module) == {"fp8": 1, "high_precision": 0}
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="size: expected an int >= 0"):
            te.set_fp8_min_gemm_size(bad)


def test_threshold_from_environment(monkeypatch):
    monkeypatch.setenv("TFP8_MIN_GEMM_SIZE", "12345")
    assert base._threshold_from_env(7) == 12345
    monkeypatch.setenv("TFP8_MIN_GEMM_SIZE", "")
    assert base._threshold_from_env(7) == 7
    for bad in ("-3", "1e9", "lots"):
        monkeypatch.setenv("TFP8_MIN_GEMM_SIZE", bad)
        with pytest.raises(ValueError, match="TFP8_MIN_GEMM_SIZE: expected an int >= 0"):
            base._threshold_from_env(7)


def test_environment_variable_is_read_at_import():
    env = checkout_env(TFP8_MIN_GEMM_SIZE="4096")
    code = "import transformer_fp8 as te; print(te.get_fp8_min_gemm_size())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "4096"


@pytest.mark.parametrize("name", sorted(SMALL))
def test_counters_count_both_paths_per_role(name, fresh_warning):
    module = SMALL[name](params_dtype=torch.float32, device="cpu")
    session = debug.enable(module)
    for x in (torch.randn(8, 64), small_input("cpu", torch.float32), torch.randn(8, 64)):  # FP8, small, FP8
        with te.fp8_autocast():
            out = module(x.requires_grad_())
        out.as_subclass(torch.Tensor).sum().backward()
    debug.disable_fp8(module)
    with te.fp8_autocast():
        module(torch.randn(8, 64).requires_grad_()).sum().backward()
    module(torch.randn(8, 64))  # outside fp8_autocast: not counted
    session.close()
    assert debug.call_counts(module) == {"fp8": 2, "high_precision": 2}
    for role, row in debug.stats(module)[name].items():
        assert (row["fp8_calls"], row["high_precision_calls"]) == (2, 2), role


# --- debug stats against float64 ---

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe_name", ["delayed-HYBRID", "current-HYBRID"])
def test_linear_stats_match_float64(device, recipe_name):
    """Step 1 sets the scales; step 2 casts an input and an output gradient with planted huge values (saturated under
    delayed scaling), tiny ones (flushed), ones just above the flush bound (kept) and zeros (neither)."""
    recipe = RECIPES[recipe_name]
    module = te.Linear(64, 48, params_dtype=torch.float32, device=device)
    debug.enable(module)
    x1 = torch.randn(32, 64, device=device)
    with te.fp8_autocast(fp8_recipe=recipe):
        module(x1.requires_grad_()).backward(g1 := torch.randn(32, 48, device=device))
    fwd, bwd = module.fwd_dtype, module.bwd_dtype
    x2, g2 = torch.randn(32, 64, device=device), torch.randn(32, 48, device=device)
    scales = []
    for t, t1, big, fp8_dtype in ((x2, x1, 40.0, fwd), (g2, g1, 1e4, bwd)):
        t[0, :5], t[2, :3] = big, 0.0
        # delayed: the scale of step 1's amax; current: this cast's own amax (the planted big value)
        scale = own_scale(fp8_dtype, t1 if recipe_name.startswith("delayed") else t)
        smallest = 2 * HALF_MIN_SUBNORMAL[fp8_dtype] / scale.item()  # (x * scale = the smallest subnormal)
        t[1, :7], t[3, :6], t[4, :4] = 1e-3 * smallest, 0.4 * smallest, 0.7 * smallest  # flushed, flushed, kept
        if recipe_name.startswith("delayed"):  # just above the max (rounds onto it: kept), beyond rounding (clamped)
            top, clamped = FP8_MAX[fp8_dtype], CLAMPED_ABOVE[fp8_dtype]
            t[5, :3], t[6, :2] = (top + clamped) / 2 / scale.item(), 1.01 * clamped / scale.item()
        scales.append(scale)
    with te.fp8_autocast(fp8_recipe=recipe):
        module(x2.requires_grad_()).backward(g2)
    rows = debug.stats(module)["Linear"]
    x_scale, g_scale = scales
    flushed, saturated = check_role(rows["input"], x2, x_scale, fwd)
    assert flushed >= 13 / x2.numel()
    assert (saturated >= 5 / x2.numel()) == recipe_name.startswith("delayed")
    flushed, saturated = check_role(rows["grad_output"], g2, g_scale, bwd)
    assert flushed >= 13 / g2.numel()
    assert (saturated >= 5 / g2.numel()) == recipe_name.startswith("delayed")
    w_scale = module.fp8_fwd.scale[1]
    check_role(rows["weight"], module.weight, w_scale, fwd)
    assert rows["weight"]["amax"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_norm_module_stats_match_float64(device):
    """LayerNormLinear's input role is the normalised input (recomputed by the stats hook), LayerNormMLP's fc1 roles
    likewise, its fc2 output gradient the module's; the roles inside its fused kernels are counted only."""
    recipe = RECIPES["current-E4M3"]
    lnl = te.LayerNormLinear(64, 48, params_dtype=torch.float32, device=device)
    mlp = te.LayerNormMLP(48, 96, params_dtype=torch.float32, device=device)
    with torch.no_grad():
        for p in (lnl.layer_norm_weight, lnl.layer_norm_bias, mlp.layer_norm_weight, mlp.layer_norm_bias):
            p.uniform_(0.5, 2.0)
    model = torch.nn.Sequential(lnl, mlp)
    debug.enable(model)
    x = torch.randn(32, 64, device=device) * 3 + 1
    x[0, :4] = 1e3
    g = torch.randn(32, 48, device=device)
    with te.fp8_autocast(fp8_recipe=recipe):
        y = model(x.requires_grad_())
    y.backward(g)
    rows = debug.stats(model)
    x64 = x.detach().double()
    normed = torch.nn.functional.layer_norm(x64, (64,), lnl.layer_norm_weight.double(),
                                            lnl.layer_norm_bias.double(), lnl.eps)
    check_role(rows["0"]["input"], normed, own_scale(lnl.fwd_dtype, normed), lnl.fwd_dtype, 1)
    check_role(rows["0"]["weight"], lnl.weight, own_scale(lnl.fwd_dtype, lnl.weight), lnl.fwd_dtype)
    for role in ("fc1_weight", "fc2_weight"):
        w = getattr(mlp, role)
        check_role(rows["1"][role], w, own_scale(mlp.fwd_dtype, w), mlp.fwd_dtype)
    check_role(rows["1"]["fc2_grad_output"], g, own_scale(mlp.bwd_dtype, g), mlp.bwd_dtype)
    for role in ("fc2_input", "fc1_grad_output"):
        row = rows["1"][role]
        assert row["fp8_calls"] == 1 and all(row[k] != row[k] for k in debug.STAT_NAMES), role  # NaN: not seen
    report = debug.report(model)
    assert "fc1_grad_output" in report and "0 " in report and "1 " in report


# --- block scaling: tile scales ---

def block_reference(x, block_dim, fp8_dtype, power_2_scale=True, amax_epsilon=0.0):
    """(amax, smallest and largest tile scale, flushed, saturated) of a block cast of x (2-D as the module casts it)
    in float64, one tile at a time: scale = fp8_max / max(amax, epsilon) divided in float32, rounded down to a power
    of two by log2 (not by the implementation's bit mask), 1 for an all-zero tile."""
    x64 = x.detach().double().reshape(-1, x.shape[-1]).cpu()
    rows, cols = x64.shape
    tile_rows = 1 if block_dim == 1 else 128
    scale = torch.empty_like(x64)
    for i in range(0, rows, tile_rows):
        for j in range(0, cols, 128):
            amax = max(x64[i:i + tile_rows, j:j + 128].abs().max().item(), amax_epsilon)
            s = (torch.tensor(FP8_MAX[fp8_dtype]) / torch.tensor(amax, dtype=torch.float32)).item() if amax else 1.0
            scale[i:i + tile_rows, j:j + 128] = 2.0 ** math.floor(math.log2(s)) if power_2_scale and amax else s
    scaled = (x64 * scale).float().double().abs()
    flushed = ((scaled <= HALF_MIN_SUBNORMAL[fp8_dtype]) & (x64 != 0)).double().mean().item()
    saturated = (scaled > CLAMPED_ABOVE[fp8_dtype]).double().mean().item()
    return x64.abs().max().item(), scale.min().item(), scale.max().item(), flushed, saturated


def check_block_role(row, x, block_dim, fp8_dtype, qparams, numel_slack=0):
    amax, scale_min, scale_max, flushed, saturated = block_reference(x, block_dim, fp8_dtype, qparams.power_2_scale,
                                                                     qparams.amax_epsilon)
    assert row["layout"] == ("block_1x128" if block_dim == 1 else "block_128x128")
    assert math.isnan(row["scale"])  # (no single scale)
    assert row["amax"] == pytest.approx(amax, rel=1e-5)
    assert row["scale_min"] == pytest.approx(scale_min, rel=1e-6)
    assert row["scale_max"] == pytest.approx(scale_max, rel=1e-6)
    slack = numel_slack / x.numel() + 1e-9
    assert abs(row["flushed"] - flushed) <= slack, (row["flushed"], flushed)
    assert abs(row["saturated"] - saturated) <= slack, (row["saturated"], saturated)
    return flushed


def plant_tiles(t, big, tiny):
    """Row 0's first tile: one huge value and tiny ones (flushed by that tile's scale); row 1's first tile: only tiny
    values (kept by its own scale; one per-tensor scale from `big` would flush them); zeros."""
    t[0, 0], t[0, 1:9], t[2, :3] = big, tiny, 0.0
    t[1, :128] = torch.linspace(tiny, 2 * tiny, 128, dtype=t.dtype, device=t.device)


BLOCK_DEBUG_RECIPES = {
    "E4M3": te.recipe.Float8BlockScaling(),
    "HYBRID-fp32-scales": te.recipe.Float8BlockScaling(
        fp8_format=te.recipe.Format.HYBRID, fp8_quant_fwd_inp=te.recipe.QParams(power_2_scale=False),
        fp8_quant_fwd_weight=te.recipe.QParams(power_2_scale=False),
        fp8_quant_bwd_grad=te.recipe.QParams(power_2_scale=False, amax_epsilon=1e-3)),
    "x-128x128-w-1x128": te.recipe.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe_name", sorted(BLOCK_DEBUG_RECIPES))
def test_block_scaling_stats_use_the_tile_scales(device, recipe_name):
    """Under Float8BlockScaling every element is judged with its own tile's scale (float64 reference above), for a
    Linear and a LayerNormMLP: the planted tiny values count as flushed in the huge value's tile only."""
    recipe = BLOCK_DEBUG_RECIPES[recipe_name]
    x_dim, w_dim, g_dim = recipe.x_block_scaling_dim, recipe.w_block_scaling_dim, recipe.grad_block_scaling_dim
    linear = te.Linear(256, 160, params_dtype=torch.float32, device=device)
    mlp = te.LayerNormMLP(160, 192, params_dtype=torch.float32, device=device)
    model = torch.nn.Sequential(linear, mlp)
    debug.enable(model)
    x, g = torch.randn(40, 256, device=device), torch.randn(40, 160, device=device)
    plant_tiles(x, 1e4, 1e-4)  # (a range of 1e8: beyond E4M3's 2**18.8 from max to half the smallest subnormal)
    plant_tiles(g, 1e3, 1e-8)  # (1e11: beyond E5M2's 2**32.8)
    with te.fp8_autocast(fp8_recipe=recipe):
        hidden = linear(x.requires_grad_())
        h = hidden.detach().requires_grad_()  # (h.grad: the Linear's output gradient)
        y = mlp(h)
    y.backward(g)
    hidden.backward(h.grad)
    rows = debug.stats(model)
    fwd, bwd = linear.fwd_dtype, linear.bwd_dtype
    flushed = check_block_role(rows["0"]["input"], x, x_dim, fwd, recipe.fp8_quant_fwd_inp)
    assert flushed >= 8 / x.numel() if x_dim == 1 else flushed > 0  # (a 128x128 block of x holds the huge value)
    check_block_role(rows["0"]["weight"], linear.weight, w_dim, fwd, recipe.fp8_quant_fwd_weight)
    normed = torch.nn.functional.layer_norm(hidden.detach().double(), (160,), mlp.layer_norm_weight.double(),
                                            mlp.layer_norm_bias.double(), mlp.eps)
    check_block_role(rows["1"]["fc1_input"], normed, x_dim, fwd, recipe.fp8_quant_fwd_inp, numel_slack=1)
    for role in ("fc1_weight", "fc2_weight"):
        check_block_role(rows["1"][role], getattr(mlp, role), w_dim, fwd, recipe.fp8_quant_fwd_weight)
    flushed = check_block_role(rows["1"]["fc2_grad_output"], g, g_dim, bwd, recipe.fp8_quant_bwd_grad)
    assert flushed >= 8 / g.numel()
    per_tensor = expected_stats(g, own_scale(bwd, g), bwd)[1]
    assert per_tensor > flushed + 100 / g.numel()  # (one scale would flush row 1's tiny tile too)
    check_block_role(rows["0"]["grad_output"], h.grad, g_dim, bwd, recipe.fp8_quant_bwd_grad)
    report = debug.report(model)
    assert "block_1x128" in report and "block_128x128" in report and ".." in report


# --- disable_fp8 ---

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(SMALL))
def test_disable_fp8_runs_the_high_precision_path(device, name):
    module = SMALL[name](params_dtype=torch.bfloat16, device=device)
    x = torch.randn(16, 64, dtype=torch.bfloat16, device=device)
    g = torch.randn_like(module(x))

    def step(fp8):
        xi = x.clone().requires_grad_()
        with te.fp8_autocast(enabled=fp8):
            out = module(xi)
        out.backward(g)
        grads = [xi.grad] + [p.grad.clone() for p in module.parameters()]
        module.zero_grad(set_to_none=True)
        return out.detach(), grads

    ref_out, ref_grads = step(False)
    debug.disable_fp8(torch.nn.Sequential(module))  # (a container: every FP8 module inside)
    out, grads = step(True)
    assert module.fp8_disabled and module.fp8_fwd is None
    assert torch.equal(out, ref_out)
    for got, want in zip(grads, ref_grads):
        assert torch.equal(got, want)
    debug.disable_fp8(module, disabled=False)
    fp8_out, _ = step(True)
    assert module.fp8_fwd is not None and not torch.equal(fp8_out, ref_out)
    report = debug.report(module)
    assert name in report and "fp8 disabled" not in report


def test_disable_fp8_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="module: expected an FP8 module"):
        debug.disable_fp8(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="disabled: expected a bool"):
        debug.disable_fp8(te.Linear(16, 16, device="cpu"), disabled="yes")
    with te.fp8_model_init():
        fp8_weights = te.Linear(16, 16, params_dtype=torch.bfloat16, device="cpu")
    with pytest.raises(ValueError, match="Float8Tensor weights"):
        debug.disable_fp8(fp8_weights)
    with pytest.raises(ValueError, match="model: expected a module containing"):
        debug.enable(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="module: expected a Linear"):
        debug.call_counts(torch.nn.Linear(4, 4))


# --- cost ---



@pytest.mark.parametrize("name", sorted(SMALL))
def test_no_extra_ops_unless_enabled(name):
    """A training step records the same ops before `enable` and after `disable`; while enabled, more (the stats)."""
    module = SMALL[name](params_dtype=torch.float32, device="cpu")
    x = torch.randn(16, 64)

    def step_ops():
        with OpNames() as ops:
            with te.fp8_autocast():
                out = module(x.clone().requires_grad_())
            out.sum().backward()
        return ops.names

    step_ops(), step_ops()  # (the first steps calibrate the scales: different ops)
    before = step_ops()
    with debug.enable(module):
        enabled = step_ops()
    after = step_ops()
    assert after == before
    assert len(enabled) > len(before)
    assert debug.stats(module)[name][module.forward_roles[0].value]["fp8_calls"] == 1


# --- GPU ---

@pytest.mark.gpu
def test_gpu_fallback_warns_once_and_counts(fresh_warning):
    model = torch.nn.Sequential(te.Linear(64, 48, params_dtype=torch.bfloat16, device="cuda"),
                                te.LayerNormMLP(48, 96, params_dtype=torch.bfloat16, device="cuda"))
    debug.enable(model)
    x = torch.randn(8, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.warns(te.FP8FallbackWarning, match=r"Linear '0'.*M\*K\*N = 2.46e\+04") as caught:
        with te.fp8_autocast():
            out = model(x)
    assert len(caught) == 1
    assert torch.equal(out, model(x))  # the high-precision path: BF16's result
    model[1].fp8_min_gemm_size = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with te.fp8_autocast():
            model(x.requires_grad_()).sum().backward()
    assert debug.call_counts(model[0]) == {"fp8": 0, "high_precision": 2}
    assert debug.call_counts(model[1]) == {"fp8": 1, "high_precision": 1}
    rows = debug.stats(model)["1"]
    assert rows["fc2_grad_output"]["fp8_calls"] == 1 and rows["fc1_input"]["amax"] > 0
    assert "high prec." in debug.report(model)


@pytest.mark.gpu
def test_gpu_bf16_stats_match_float64():
    recipe = RECIPES["delayed-E4M3"]
    module = te.Linear(256, 128, params_dtype=torch.bfloat16, device="cuda")
    debug.enable(module)
    x1 = torch.randn(64, 256, dtype=torch.bfloat16, device="cuda")
    with te.fp8_autocast(fp8_recipe=recipe):
        module(x1)
    x2 = torch.randn(64, 256, dtype=torch.bfloat16, device="cuda")
    smallest = 2 * HALF_MIN_SUBNORMAL[torch.float8_e4m3fn] / own_scale(torch.float8_e4m3fn, x1).item()
    x2[0, :9], x2[1, :11], x2[2, :5], x2[3, :4] = 50.0, 1e-3 * smallest, 0.4 * smallest, 0.7 * smallest
    with te.fp8_autocast(fp8_recipe=recipe):
        module(x2)
    torch.cuda.synchronize()
    row = debug.stats(module)["Linear"]["input"]
    flushed, saturated = check_role(row, x2, own_scale(torch.float8_e4m3fn, x1), torch.float8_e4m3fn)
    assert flushed >= 16 / x2.numel() and saturated >= 9 / x2.numel()


@pytest.mark.gpu
def test_gpu_fallback_inside_torch_compile_fullgraph(fresh_warning):
    """While Dynamo traces, the fallback's warning (it cannot trace one) and the counters (a counter changed in the
    graph would be a guarded constant: a recompile at every call) are skipped; eager calls count as before."""
    module = te.Linear(64, 48, params_dtype=torch.bfloat16, device="cuda")
    compiled = torch.compile(module, fullgraph=True, backend="eager")
    x = torch.randn(8, 64, dtype=torch.bfloat16, device="cuda")
    with te.fp8_autocast():
        out = compiled(x)
        compiled(x)
    assert torch.equal(out, module(x))
    assert debug.call_counts(module) == {"fp8": 0, "high_precision": 0}
    with te.fp8_autocast():
        module(x)
    assert debug.call_counts(module) == {"fp8": 0, "high_precision": 1}
