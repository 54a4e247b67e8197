"""Linear's C++ autograd node (module/linear.py NATIVE_NODE, csrc/autograd_linear.cpp) against its Python
autograd.Function: the same outputs, gradients and FP8 scaling states bit for bit, and the cases that stay in Python."""
import pytest
import torch
import torch.nn as nn

import transformer_fp8 as te
from transformer_fp8 import recipe
from tests.module.helpers import DEVICES, RECIPES, randomize_vectors
from transformer_fp8.module import linear

NODE_RECIPES = ["delayed-E4M3", "delayed-HYBRID", "current-E4M3", "current-HYBRID"]
NATIVE, PYTHON = "FP8LinearBackward", "_FP8LinearBackward"


def make_stack(device, bias, **kwargs):
    torch.manual_seed(7)
    stack = nn.Sequential(te.Linear(64, 48, bias=bias, params_dtype=torch.bfloat16, device=device, **kwargs),
                          te.Linear(48, 32, bias=bias, params_dtype=torch.bfloat16, device=device, **kwargs))
    randomize_vectors(stack)
    return stack


def run_steps(monkeypatch, native, stack, xs, dys, fp8_recipe, x_grad=True):
    """Three training steps; per step the output, its grad_fn's name and the gradients, then the FP8 states."""
    monkeypatch.setattr(linear, "NATIVE_NODE", native)
    steps = []
    for x, dy in zip(xs, dys):
        x = x.clone().requires_grad_(x_grad)
        with te.fp8_autocast(fp8_recipe=fp8_recipe):
            y = stack(x)
        y.backward(dy)
        grads = [p.grad.clone() if p.grad is not None else None for p in stack.parameters()]
        steps.append((y.detach(), y.grad_fn.name(), x.grad, grads))
        stack.zero_grad(set_to_none=True)
    states = [t for m in stack for s in (m.fp8_fwd, m.fp8_bwd) for t in s.state_dict().values()]
    return steps, states


def assert_identical(a, b):
    if a is None or b is None:
        assert a is None and b is None
    else:
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe_name", NODE_RECIPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead_shape", [(24,), (3, 5)])
@pytest.mark.parametrize("x_grad,frozen", [(True, False), (False, False), (True, True)])
def test_native_node_matches_function(monkeypatch, device, recipe_name, bias, lead_shape, x_grad, frozen):
    xs = [torch.randn(*lead_shape, 64, dtype=torch.bfloat16, device=device) for _ in range(3)]
    dys = [torch.randn(*lead_shape, 32, dtype=torch.bfloat16, device=device) for _ in range(3)]
    runs = []
    for native in (True, False):
        stack = make_stack(device, bias)
        if frozen:  # the first layer's weight frozen: its node makes no xᵀ and no dW
            stack[0].weight.requires_grad_(False)
        runs.append(run_steps(monkeypatch, native, stack, xs, dys, RECIPES[recipe_name], x_grad))
    (native_steps, native_states), (python_steps, python_states) = runs
    # delayed scaling: the first step calibrates the scales in Python, from the second on the native node runs;
    # current scaling: the node from the first step (each scale from its tensor's amax, as the quantizers compute it)
    first = PYTHON if recipe_name.startswith("delayed") else NATIVE
    assert [s[1] for s in native_steps] == [first, NATIVE, NATIVE]
    assert [s[1] for s in python_steps] == [PYTHON] * 3
    for (y, _, dx, grads), (y_ref, _, dx_ref, grads_ref) in zip(native_steps, python_steps):
        assert_identical(y, y_ref)
        assert_identical(dx, dx_ref)
        for g, g_ref in zip(grads, grads_ref):
            assert_identical(g, g_ref)
    for s, s_ref in zip(native_states, python_states):
        assert_identical(s, s_ref)


def grad_fn_name_at_step_two(monkeypatch, module, device, call=lambda m, x: m(x), fp8_recipe=None, native=True):
    monkeypatch.setattr(linear, "NATIVE_NODE", native)
    x = torch.randn(16, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
    for _ in range(2):
        with te.fp8_autocast(fp8_recipe=fp8_recipe):
            y = call(module, x)
        y = y[0] if isinstance(y, tuple) else y
        y.sum().backward()
    return y.grad_fn.name()


@pytest.mark.parametrize("device", DEVICES)
def test_other_cases_keep_the_function(monkeypatch, device):
    def linear_(**kwargs):
        return te.Linear(64, 32, params_dtype=torch.bfloat16, device=device, **kwargs)

    assert grad_fn_name_at_step_two(monkeypatch, linear_(), device) == NATIVE
    assert grad_fn_name_at_step_two(monkeypatch, linear_(), device,
                                    fp8_recipe=RECIPES["current-HYBRID"]) == NATIVE
    assert grad_fn_name_at_step_two(monkeypatch, linear_(), device,
                                    fp8_recipe=recipe.Float8BlockScaling()) == PYTHON
    assert grad_fn_name_at_step_two(monkeypatch, linear_(), device,
                                    lambda m, x: m(x, is_first_microbatch=True)) == PYTHON
    residual = torch.randn(16, 32, dtype=torch.bfloat16, device=device)
    assert grad_fn_name_at_step_two(monkeypatch, linear_(), device, lambda m, x: m(x, residual=residual)) == PYTHON
    assert grad_fn_name_at_step_two(monkeypatch, linear_(return_bias=True), device) == PYTHON
    fused = linear_(fuse_wgrad_accumulation=True)
    fused.weight.main_grad = torch.zeros(32, 64, device=device)
    assert grad_fn_name_at_step_two(monkeypatch, fused, device) == PYTHON
    assert grad_fn_name_at_step_two(monkeypatch, linear_(), device, native=False) == PYTHON


@pytest.mark.parametrize("device", DEVICES)
def test_native_node_backward_twice(monkeypatch, device):
    m = te.Linear(64, 32, params_dtype=torch.bfloat16, device=device)
    grad_fn_name_at_step_two(monkeypatch, m, device)  # (calibrated: the next call takes the node)
    x = torch.randn(16, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
    with te.fp8_autocast():
        y = m(x)
    assert y.grad_fn.name() == NATIVE
    y.sum().backward(retain_graph=True)
    first = x.grad.clone()
    y.sum().backward()  # (retained: runs again, accumulating)
    torch.testing.assert_close(x.grad, 2 * first, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_native_node_no_grad(monkeypatch, device):
    x = torch.randn(16, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
    outs = []
    for native in (True, False):
        torch.manual_seed(3)
        m = te.Linear(64, 32, params_dtype=torch.bfloat16, device=device)
        grad_fn_name_at_step_two(monkeypatch, m, device, native=native)
        with torch.no_grad(), te.fp8_autocast():
            outs.append(m(x))
        assert outs[-1].grad_fn is None and not outs[-1].requires_grad
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def saved_tensor_packs(monkeypatch, native, device, weight_numel_limit):
    """Per forward of a calibrated Linear under saved-tensor hooks: the dtypes packed, and whether the backward ran."""
    monkeypatch.setattr("transformer_fp8.module.base.MIN_RECAST_WEIGHT_NUMEL", weight_numel_limit)
    torch.manual_seed(5)
    m = te.Linear(64, 32, params_dtype=torch.bfloat16, device=device)
    grad_fn_name_at_step_two(monkeypatch, m, device, native=native)
    packed = []

    def pack(t):
        packed.append(t.dtype)
        return t

    x = torch.randn(16, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), te.fp8_autocast():
        y = m(x)
    y.sum().backward()
    return sorted(map(str, packed)), x.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weight_numel_limit", [2 ** 22, 1])  # Wᵀ kept from the forward / cast in the backward
def test_native_node_saves_through_saved_tensor_hooks(monkeypatch, device, weight_numel_limit):
    """Saved-tensor hooks (activation offloading, checkpointing) see what the node saves: the same FP8 tensors as the
    Function's save_for_backward."""
    native, native_grad = saved_tensor_packs(monkeypatch, True, device, weight_numel_limit)
    function, function_grad = saved_tensor_packs(monkeypatch, False, device, weight_numel_limit)
    assert native == function and native and all("float8" in d for d in native)
    torch.testing.assert_close(native_grad, function_grad, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_native_node_backward_error_reaches_the_caller(monkeypatch, device):
    """A Python exception in the backward's registration call (the path of an amax reduction over a process group,
    forced here by update.NATIVE_UPDATES = False) surfaces from backward() as itself."""
    from transformer_fp8 import _C, autocast
    from transformer_fp8.quantization import update

    monkeypatch.setattr(update, "NATIVE_UPDATES", False)

    m = te.Linear(64, 32, params_dtype=torch.bfloat16, device=device)
    grad_fn_name_at_step_two(monkeypatch, m, device)

    def failing_registrar(*args):
        raise ValueError("registrar failed on purpose")

    x = torch.randn(16, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
    with te.fp8_autocast():
        y = m(x)
    _C.set_backward_registrar(failing_registrar)
    try:
        with pytest.raises(ValueError, match="registrar failed on purpose"):
            y.sum().backward()
    finally:
        _C.set_backward_registrar(autocast.register_backward)
