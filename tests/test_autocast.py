"""fp8_autocast: delayed scaling over several steps (history rolling, margin, both algos), NaN steps, one fused
update per step for the forward and one for the backward, amax reduction over a group, current scaling."""
import pytest
import torch

import transformer_fp8 as te
from transformer_fp8 import autocast, recipe
from tests.utils import OpCalls

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def with_amax(shape, amax):
    x = torch.randn(*shape)
    return x / x.abs().max() * amax


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 1])
def test_scales_follow_the_amax_history(algo, margin):
    r = recipe.DelayedScaling(margin=margin, amax_history_len=3, amax_compute_algo=algo)
    m = te.Linear(16, 8, params_dtype=torch.float32, device="cpu")
    w_amax = m.weight.detach().abs().max().item()
    x_amaxes, dy_amaxes = [1.0, 4.0, 2.0, 0.5, 3.0], [0.25, 8.0, 1.0, 2.0, 0.5]
    for k, (a, b) in enumerate(zip(x_amaxes, dy_amaxes)):
        with te.fp8_autocast(fp8_recipe=r):
            out = m(with_amax((12, 16), a))
        window = x_amaxes[max(0, k - 2):k + 1]  # the update's amax: over this step's and the 2 kept in the history
        assert m.fp8_fwd.amax_history[0].eq(0).all()  # rolled: rows 1, 2 now hold the newest two, newest first
        kept = window[::-1][:2]
        torch.testing.assert_close(m.fp8_fwd.amax_history[1:1 + len(kept), 0], torch.tensor(kept))
        expected = max(window) if algo == "max" else a
        torch.testing.assert_close(m.fp8_fwd.scale[0], torch.tensor(E4M3_MAX / expected / 2 ** margin))
        torch.testing.assert_close(m.fp8_fwd.scale[1], torch.tensor(E4M3_MAX / w_amax / 2 ** margin))
        torch.testing.assert_close(m.fp8_fwd.scale_inv, 1 / m.fp8_fwd.scale)
        out.backward(with_amax(out.shape, b))
        grad_window = dy_amaxes[max(0, k - 2):k + 1]
        expected = max(grad_window) if algo == "max" else b
        torch.testing.assert_close(m.fp8_bwd.scale[0], torch.tensor(E5M2_MAX / expected / 2 ** margin))


def test_a_nan_step_does_not_poison_the_scales():
    r = recipe.DelayedScaling(amax_history_len=2)
    m = te.Linear(16, 8, params_dtype=torch.float32, device="cpu")
    with te.fp8_autocast(fp8_recipe=r):
        m(with_amax((8, 16), 2.0))
    scale = m.fp8_fwd.scale.clone()
    bad = with_amax((8, 16), 2.0)
    bad[3, 5] = float("nan")
    with te.fp8_autocast(fp8_recipe=r):
        assert m(bad).isnan().any()
    assert torch.equal(m.fp8_fwd.scale, scale) and torch.isfinite(m.fp8_fwd.amax_history).all()
    with te.fp8_autocast(fp8_recipe=r):
        out = m(with_amax((8, 16), 1.0))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(m.fp8_fwd.scale[0], torch.tensor(E4M3_MAX / 1.0))  # history: [1.0, 0 (the NaN step)]


def spy_updates(monkeypatch):
    """Records the Python path's update calls (update.NATIVE_UPDATES off; tests/test_native_updates.py counts the C++
    path's launches)."""
    from transformer_fp8.quantization import update

    monkeypatch.setattr(update, "NATIVE_UPDATES", False)
    calls = []
    original = te.ops.tfp8.delayed_scaling_update

    def spy(histories, scales, scale_invs, fp8_max, margin, algo):
        calls.append((len(histories), fp8_max, histories[0].shape[0]))
        return original(histories, scales, scale_invs, fp8_max, margin, algo)

    monkeypatch.setattr(te.ops.tfp8, "delayed_scaling_update", spy)
    return calls


def three_modules():
    return [te.Linear(32, 32, device="cpu"), te.LayerNormLinear(32, 32, device="cpu"),
            te.LayerNormMLP(32, 64, device="cpu")]


def test_one_fused_update_after_the_forward_and_one_after_the_backward(monkeypatch):
    calls = spy_updates(monkeypatch)
    modules = three_modules()
    x = torch.randn(8, 32)
    r = recipe.DelayedScaling(amax_history_len=5)
    with te.fp8_autocast(fp8_recipe=r):
        with te.fp8_autocast(fp8_recipe=r):  # nested: the update waits for the outermost exit
            y = modules[0](x)
        for _ in range(2):  # two microbatches: each state is registered once
            for m in modules:
                y = m(y)
        assert calls == []
    assert calls == [(3, E4M3_MAX, 5)]
    y.sum().backward()
    assert calls == [(3, E4M3_MAX, 5), (3, E5M2_MAX, 5)]


def test_current_scaling_scales_each_cast_and_queues_nothing(monkeypatch):
    calls = spy_updates(monkeypatch)
    m = te.Linear(32, 16, device="cpu")
    x = with_amax((8, 32), 7.0)
    with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        out = m(x)
        assert calls == [(1, E4M3_MAX, 1)] * 2  # input and weight, each from its own amax
        torch.testing.assert_close(m.fp8_fwd.scale[0], torch.tensor(E4M3_MAX / 7.0))
    assert len(calls) == 2 and not autocast.STATE.forward_states
    out.backward(with_amax(out.shape, 3.0))
    assert calls[2:] == [(1, E5M2_MAX, 1)]
    torch.testing.assert_close(m.fp8_bwd.scale[0], torch.tensor(E5M2_MAX / 3.0))
    assert m.fp8_fwd.amax_history.eq(0).all() and m.fp8_bwd.amax_history.eq(0).all()


def fake_two_ranks(monkeypatch):
    """torch.distributed as seen by one of 2 ranks whose other rank saw an amax of 10 everywhere; returns the list
    of (numel, op, group) of the all-reduces."""
    dist, collectives = torch.distributed, []

    def fake_all_reduce(t, op, group):
        collectives.append((t.numel(), op, group))
        torch.maximum(t, torch.full_like(t, 10.0), out=t)

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    return collectives


@pytest.mark.parametrize("reduce_amax", [True, False])
def test_amaxes_are_max_reduced_over_the_group_in_one_collective(monkeypatch, reduce_amax):
    dist, collectives = torch.distributed, fake_two_ranks(monkeypatch)
    modules, group = three_modules(), object()
    for step in range(2):  # (the first step calibrates its scales, with one reduction per cast: see the next test)
        collectives.clear()
        with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(reduce_amax=reduce_amax), fp8_group=group):
            y = with_amax((8, 32), 1.0)
            for m in modules:
                y = m(y)
    if reduce_amax:
        assert collectives == [(2 + 2 + 4, dist.ReduceOp.MAX, group)]
        for m in modules:
            torch.testing.assert_close(m.fp8_fwd.scale, torch.full_like(m.fp8_fwd.scale, E4M3_MAX / 10))
    else:
        assert collectives == [] and modules[0].fp8_fwd.scale[0] == E4M3_MAX


@pytest.mark.parametrize("reduce_amax", [True, False])
def test_first_step_calibrates_scales_from_its_tensors(monkeypatch, reduce_amax):
    """Before a state's first update each delayed-scaling cast takes its scale from its tensor's amax (MAX-reduced
    over the group when the recipe reduces amaxes), not the initial 1; the update then proceeds as usual."""
    dist, collectives = torch.distributed, fake_two_ranks(monkeypatch)
    m, group = te.Linear(32, 16, bias=False, params_dtype=torch.float32, device="cpu", fp8_min_gemm_size=0), object()
    x = with_amax((8, 32), 1.0)
    assert m.fp8_fwd is None  # (made by the first FP8 call, uncalibrated)
    with OpCalls("cast_transpose", lambda arguments: arguments["scale"].item()) as scales:
        with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(reduce_amax=reduce_amax), fp8_group=group):
            m(x)
    expected_x = E4M3_MAX / (10.0 if reduce_amax else 1.0)
    expected_w = E4M3_MAX / 10.0 if reduce_amax else E4M3_MAX / m.weight.detach().abs().max().item()
    assert scales.seen == pytest.approx([expected_x, expected_w], rel=1e-6)
    per_cast = [(1, dist.ReduceOp.MAX, group)] * 2
    assert collectives == (per_cast + [(2, dist.ReduceOp.MAX, group)] if reduce_amax else [])
    assert m.fp8_fwd.calibrated and not m.fp8_bwd.calibrated


def test_fp8_autocast_works_as_a_decorator_and_restores_on_error():
    @te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling())
    def inside():
        return te.is_fp8_enabled(), te.get_fp8_recipe()

    assert inside() == (True, recipe.Float8CurrentScaling())
    with pytest.raises(RuntimeError):
        with te.fp8_autocast():
            raise RuntimeError("boom")
    assert not te.is_fp8_enabled() and autocast.STATE.depth == 0


def test_a_failed_backward_does_not_block_later_updates(monkeypatch):
    calls = spy_updates(monkeypatch)
    m = te.Linear(32, 16, fuse_wgrad_accumulation=True, device="cpu")
    x = torch.randn(8, 32)
    with te.fp8_autocast():
        out = m(x)
    with pytest.raises(RuntimeError, match="main_grad"):  # dies after registering its state, before the callback
        out.sum().backward()
    m.weight.main_grad = torch.zeros(16, 32)
    with te.fp8_autocast():
        out = m(x)
    out.sum().backward()
    assert calls[-1] == (1, E5M2_MAX, 1024) and not m.fp8_bwd.pending
