"""The delayed-scaling updates through C++ (quantization/update.py NATIVE_UPDATES, csrc/delayed_update_queue.cpp)
against the Python path: the same outputs, gradients, FP8 states and flags bit for bit, over steps that take both the
C++ Linear node and the Python Functions, with a module called twice in one forward; and the backward queues' life."""
import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import transformer_fp8 as te
from tests.module.helpers import DEVICES, RECIPES, randomize_vectors
from transformer_fp8 import _C, recipe
from transformer_fp8.recipe import FP8_MAX
from transformer_fp8.quantization import update


class Block(nn.Module):
    """A Linear taken twice in one forward (its gradient state registered twice in one backward), a LayerNormMLP
    (Python Function) and a Linear fed a residual (Python Function)."""

    def __init__(self, device):
        super().__init__()
        kw = dict(params_dtype=torch.bfloat16, device=device)
        self.shared = te.Linear(64, 64, **kw)
        self.mlp = te.LayerNormMLP(64, 96, **kw)
        self.out = te.Linear(64, 32, **kw)
        randomize_vectors(self)

    def forward(self, x):
        h = self.shared(self.shared(x))
        h = self.mlp(h)
        return self.out(h)


def states_of(block):
    return [(t.clone(), s.calibrated, s.pending) for m in (block.shared, block.mlp, block.out)
            for s in (m.fp8_fwd, m.fp8_bwd) for t in s.state_dict().values()]


def run(monkeypatch, native, device, fp8_recipe, steps=4):
    with monkeypatch.context() as patch:
        return _run(patch, native, device, fp8_recipe, steps)


def _run(monkeypatch, native, device, fp8_recipe, steps):
    monkeypatch.setattr(update, "NATIVE_UPDATES", native)
    torch.manual_seed(3)
    block = Block(device)
    if native:  # (the Python queue and the Python path's update call must not be used at all)
        monkeypatch.setattr(update, "_new_backward_queue", lambda task: pytest.fail("the Python queue was used"))
        monkeypatch.setattr(update, "tfp8", None)
    out = []
    for step in range(steps):
        x = (torch.randn(12, 64, dtype=torch.bfloat16, device=device) * (step + 1)).requires_grad_()
        with te.fp8_autocast(fp8_recipe=fp8_recipe):
            y = block(x)
        y.backward(torch.randn_like(y) * 10 ** -step)
        out.append((y.detach(), x.grad, [p.grad.clone() for p in block.parameters()], states_of(block),
                    y.grad_fn.name()))
        block.zero_grad(set_to_none=True)
    assert _C.backward_queues_alive() == 0
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe_name", ["delayed-E4M3", "delayed-HYBRID"])
def test_native_updates_match_the_python_path(monkeypatch, device, recipe_name):
    native, python = (run(monkeypatch, flag, device, RECIPES[recipe_name]) for flag in (True, False))
    for (y_n, dx_n, grads_n, states_n, fn_n), (y_p, dx_p, grads_p, states_p, fn_p) in zip(native, python):
        assert fn_n == fn_p
        torch.testing.assert_close(y_n, y_p, rtol=0, atol=0)
        torch.testing.assert_close(dx_n, dx_p, rtol=0, atol=0)
        for a, b in zip(grads_n, grads_p):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for (t_n, cal_n, pend_n), (t_p, cal_p, pend_p) in zip(states_n, states_p):
            torch.testing.assert_close(t_n, t_p, rtol=0, atol=0)
            assert (cal_n, pend_n) == (cal_p, pend_p)
    # the C++ node ran from the second step on (its states calibrated by the first step's update)
    assert native[0][4] == "_FP8LinearBackward" and native[-1][4] == "FP8LinearBackward"
    for _, _, _, states, _ in native[1:]:
        assert all(calibrated and not pending for _, calibrated, pending in states)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_update_renews_aligned_snapshots(device):
    """Each forward update through C++ gives the forward slots new scale_inv snapshots (16-byte aligned, one buffer),
    so that an FP8 tensor cast before it keeps its scale."""
    m = te.Linear(32, 32, params_dtype=torch.bfloat16, device=device)
    x = torch.randn(8, 32, dtype=torch.bfloat16, device=device)
    seen, held = [], []
    for _ in range(3):
        with te.fp8_autocast(fp8_recipe=RECIPES["delayed-E4M3"]):
            m(x)
        snapshots = m.fp8_fwd.scale_invs
        assert len(snapshots) == len(m.fp8_fwd.scale_inv_slots)
        assert all(s.shape == (1,) and s.data_ptr() % 16 == 0 for s in snapshots)
        assert len({s.untyped_storage().data_ptr() for s in snapshots}) == 1
        seen.append(snapshots[0].untyped_storage().data_ptr())
        held.append(snapshots)  # (kept alive: a freed buffer's address may come back)
    assert len(set(seen)) == 3


def test_queue_backward_update_outside_a_backward_is_refused():
    t = torch.zeros(1, 1)
    with pytest.raises(RuntimeError, match="running backward"):
        _C.queue_backward_update(t, torch.ones(1), torch.ones(1), 448.0, 0.0, True, None)


def test_forward_scaling_update_checks_its_count():
    with pytest.raises(RuntimeError, match="snapshots"):
        _C.forward_scaling_update([torch.zeros(1, 1)], [torch.ones(1)], [torch.ones(1)], 448.0, 0.0, True, -1)


class CountUpdates(TorchDispatchMode):
    """Records (states, fp8_max) of every delayed_scaling_update the dispatcher sees, from Python or C++."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.transformer_fp8.delayed_scaling_update.default:
            self.calls.append((len(args[0]), args[3]))
        return func(*args, **(kwargs or {}))


def test_one_native_update_after_the_forward_and_one_after_the_backward():
    """Three modules, one called in a nested autocast and twice per module in two microbatches: one fused launch at
    the outermost exit and one at the end of the backward, through C++ from the second step on as on the first."""
    assert update.NATIVE_UPDATES
    modules = [te.Linear(32, 32, device="cpu"), te.LayerNormLinear(32, 32, device="cpu"),
               te.LayerNormMLP(32, 64, device="cpu")]
    r = recipe.DelayedScaling(amax_history_len=5)
    e4m3, e5m2 = FP8_MAX[torch.float8_e4m3fn], FP8_MAX[torch.float8_e5m2]
    for step in range(2):
        x = torch.randn(8, 32, requires_grad=True)
        with CountUpdates() as mode:
            with te.fp8_autocast(fp8_recipe=r):
                with te.fp8_autocast(fp8_recipe=r):
                    y = modules[0](x)
                for _ in range(2):
                    for m in modules:
                        y = m(y)
                assert mode.calls == []
            assert mode.calls == [(3, e4m3)]
            y.sum().backward()
        assert mode.calls == [(3, e4m3), (3, e5m2)], step
        assert _C.backward_queues_alive() == 0
