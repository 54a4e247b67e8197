"""The lean hot path: scale_invs that stay valid for saved and cached FP8 tensors across scaling updates, the cached
update plan, and the small-shape automatic path (high precision below fp8_min_gemm_size on CUDA)."""
import copy

import pytest
import torch

import transformer_fp8 as te
from tests.module.helpers import DEVICES, RECIPES, randomize_vectors
from tests.utils import rel_error
from transformer_fp8 import autocast, recipe
from transformer_fp8.module import base

DELAYED = RECIPES["delayed-HYBRID"]
MOST_RECENT = recipe.DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent")
MODULES = {
    "Linear": lambda **kw: te.Linear(64, 48, **kw),
    "LayerNormLinear": lambda **kw: te.LayerNormLinear(64, 48, **kw),
    "LayerNormMLP": lambda **kw: te.LayerNormMLP(64, 96, **kw),
}


def grads_of(module, x):
    return [x.grad] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(MODULES))
def test_backward_after_a_later_forward_update_uses_the_scales_of_its_forward(device, name):
    """Microbatch 1's backward runs after microbatch 2's forward has updated the forward scales: it must still
    dequantize with the scale_inv its FP8 tensors were cast with (same grads as running it right away)."""
    late = MODULES[name](params_dtype=torch.bfloat16, device=device)
    randomize_vectors(late)
    early = copy.deepcopy(late)
    x = torch.randn(40, 64, dtype=torch.bfloat16, device=device) * 3
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    with te.fp8_autocast(fp8_recipe=MOST_RECENT):
        out_early = early(x1)
    out_early.float().square().sum().backward()
    with te.fp8_autocast(fp8_recipe=MOST_RECENT):
        out_late = late(x2)
    scale_before = late.fp8_fwd.scale.clone()
    with te.fp8_autocast(fp8_recipe=MOST_RECENT):
        late(torch.randn_like(x))  # microbatch 2: its exit updates the forward scales
    assert not torch.equal(late.fp8_fwd.scale, scale_before)  # the update did change them
    out_late.float().square().sum().backward()
    assert torch.equal(out_late, out_early)
    for got, want in zip(grads_of(late, x2), grads_of(early, x1)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_cached_weight_keeps_its_scale_inv_across_updates(device):
    m = te.Linear(64, 48, params_dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        m.weight.mul_(5)
    x = torch.randn(16, 64, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        with te.fp8_autocast(fp8_recipe=DELAYED):
            first = m(x, is_first_microbatch=True)
        for _ in range(2):  # the exits update the weight's scale; the cache keeps the old cast and its scale_inv
            with te.fp8_autocast(fp8_recipe=DELAYED):
                later = m(x, is_first_microbatch=False)
    assert m.fp8_fwd.scale[1] != 1  # the weight slot's scale moved away from the one the cache was cast with
    ref = torch.nn.functional.linear(x.double(), m.weight.double(), m.bias.double())
    assert rel_error(first, ref) < 0.05 and rel_error(later, ref) < 0.05


@pytest.mark.parametrize("device", DEVICES)
def test_update_plan_is_reused_and_rebuilt_when_the_states_change(device):
    m1 = te.Linear(64, 48, params_dtype=torch.bfloat16, device=device)
    m2 = te.Linear(48, 32, params_dtype=torch.bfloat16, device=device)
    x = torch.randn(8, 64, dtype=torch.bfloat16, device=device)
    with te.fp8_autocast(fp8_recipe=DELAYED):
        m1(x)
    plan = autocast._plans[True]
    assert plan.states == [m1.fp8_fwd]
    with te.fp8_autocast(fp8_recipe=DELAYED):
        m1(x)
    assert autocast._plans[True] is plan
    with te.fp8_autocast(fp8_recipe=DELAYED):
        m2(m1(x))
    assert autocast._plans[True] is not plan and autocast._plans[True].states == [m1.fp8_fwd, m2.fp8_fwd]
    assert torch.equal(m2.fp8_fwd.scale_inv, 1 / m2.fp8_fwd.scale)
    for state in (m1.fp8_fwd, m2.fp8_fwd, m1.fp8_bwd):  # new snapshots (forward), 16-byte aligned for cuBLASLt
        assert all(s.data_ptr() % 16 == 0 and s.shape == (1,) for s in state.scale_invs)
    snapshots = m1.fp8_fwd.scale_invs
    with te.fp8_autocast(fp8_recipe=DELAYED):
        m2(m1(x))
    assert m1.fp8_fwd.scale_invs[0].data_ptr() != snapshots[0].data_ptr()


def test_bad_fp8_min_gemm_size():
    for bad in (-1, 1.5, True, "big"):
        with pytest.raises(ValueError, match="fp8_min_gemm_size"):
            te.Linear(16, 16, device="cpu", fp8_min_gemm_size=bad)


def test_cpu_inputs_always_run_fp8(monkeypatch):
    """The automatic path is about GPU launch overhead: the CPU (reference) path keeps FP8 at every size."""
    monkeypatch.setattr(base, "FP8_MIN_GEMM_SIZE", 2 ** 40)
    m = te.Linear(64, 48, params_dtype=torch.bfloat16, device="cpu")
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    with te.fp8_autocast(fp8_recipe=DELAYED):
        out = m(x)
    assert m.fp8_fwd is not None and not torch.equal(out, m(x))


def run_step(module, x, fp8):
    xi = x.clone().requires_grad_()
    with te.fp8_autocast(enabled=fp8, fp8_recipe=DELAYED):
        out = module(xi)
    out.float().square().sum().backward()
    return out.detach(), grads_of(module, xi)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(MODULES))
def test_small_gemms_run_high_precision_and_leave_the_fp8_state_alone(name, monkeypatch):
    monkeypatch.setattr(base, "FP8_MIN_GEMM_SIZE", 2 ** 35)
    auto = MODULES[name](params_dtype=torch.bfloat16, device="cuda")
    randomize_vectors(auto)
    plain, forced = copy.deepcopy(auto), copy.deepcopy(auto)
    forced.fp8_min_gemm_size = 0
    x = torch.randn(40, 64, dtype=torch.bfloat16, device="cuda")
    out, grads = run_step(auto, x, fp8=True)
    ref_out, ref_grads = run_step(plain, x, fp8=False)
    assert torch.equal(out, ref_out)
    for got, want in zip(grads, ref_grads):
        assert torch.equal(got, want)
    assert auto.fp8_fwd is None and not autocast.STATE.forward_states
    fp8_out, _ = run_step(forced, x, fp8=True)  # fp8_min_gemm_size=0: FP8 at this size
    assert forced.fp8_fwd is not None and not torch.equal(fp8_out, ref_out)
    history = forced.fp8_fwd.amax_history.clone()
    forced.fp8_min_gemm_size = None  # back to the default threshold: high precision, the FP8 state untouched
    run_step(forced, x, fp8=True)
    assert torch.equal(forced.fp8_fwd.amax_history, history)


@pytest.mark.gpu
def test_threshold_counts_the_gemm_work(monkeypatch):
    """M*K*N at the threshold runs FP8, one row less runs high precision."""
    m = te.Linear(64, 48, params_dtype=torch.bfloat16, device="cuda")
    monkeypatch.setattr(base, "FP8_MIN_GEMM_SIZE", 32 * 64 * 48)
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=DELAYED):
        m(torch.randn(2, 15, 64, dtype=torch.bfloat16, device="cuda"))
        assert m.fp8_fwd is None
        m(torch.randn(2, 16, 64, dtype=torch.bfloat16, device="cuda"))
        assert m.fp8_fwd is not None


@pytest.mark.gpu
def test_float8_weights_always_run_fp8(monkeypatch):
    monkeypatch.setattr(base, "FP8_MIN_GEMM_SIZE", 2 ** 40)
    with te.fp8_model_init():
        m = te.Linear(64, 48, params_dtype=torch.bfloat16, device="cuda")
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=DELAYED):
        m(torch.randn(16, 64, dtype=torch.bfloat16, device="cuda"))
    assert m.fp8_fwd is not None
