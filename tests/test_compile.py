"""torch.compile of our modules gives the eager results bit for bit.

fullgraph=True, fp8_autocast entered outside the compiled module (the usual pattern): Linear, LayerNormLinear,
LayerNormMLP and TransformerLayer, DelayedScaling and Float8CurrentScaling, several training steps (outputs, input and
parameter gradients, every FP8 scaling state: amax histories, scales, scale_invs) and no_grad steps; no recompiling
from one step to the next. The FP8 state must exist before the first compiled call (one eager step makes it): without
it the compiled forward refuses to trace. Graph breaks allowed: fp8_autocast may sit inside the compiled function.
On the GPU (inductor) TransformerLayer is compared with a tolerance: inductor fuses its elementwise ops (residual
adds) and keeps float32 intermediates that eager rounds to BF16.
"""
import copy

import pytest
import torch

import transformer_fp8 as te
from tests.module.helpers import randomize_vectors
from tests.utils import rel_error

RECIPES = {"delayed": te.recipe.DelayedScaling(amax_history_len=4), "current": te.recipe.Float8CurrentScaling()}
HIDDEN, FFN, ROWS = 64, 128, 48
MODULES = {  # name -> (make(dtype, device), input shapes of the steps: the rows change once, dynamic shapes)
    "Linear": (lambda dtype, device: te.Linear(HIDDEN, 32, params_dtype=dtype, device=device),
               [(ROWS, HIDDEN), (ROWS, HIDDEN), (ROWS + 32, HIDDEN), (ROWS + 16, HIDDEN)]),
    "Linear-3d-nobias": (lambda dtype, device: te.Linear(HIDDEN, 32, bias=False, params_dtype=dtype, device=device),
                         [(2, 24, HIDDEN)] * 3),
    "LayerNormLinear": (lambda dtype, device: te.LayerNormLinear(HIDDEN, 32, params_dtype=dtype, device=device),
                        [(ROWS, HIDDEN)] * 3),
    "LayerNormMLP": (lambda dtype, device: te.LayerNormMLP(HIDDEN, FFN, params_dtype=dtype, device=device),
                     [(ROWS, HIDDEN)] * 3),
    "TransformerLayer": (lambda dtype, device: te.TransformerLayer(HIDDEN, FFN, 4, hidden_dropout=0.0,
                                                                   attention_dropout=0.0, params_dtype=dtype,
                                                                   device=device),
                         [(16, 2, HIDDEN)] * 3),
}


def _scaling_states(module):
    return {f"{name}.{which}.{t}": getattr(getattr(m, which), t)
            for name, m in module.named_modules() if getattr(m, "fp8_fwd", None) is not None
            for which in ("fp8_fwd", "fp8_bwd") for t in ("amax_history", "scale", "scale_inv")}


def _assert_same(pairs, tol):
    """tol None: bit for bit; else ||compiled - eager|| / ||eager|| <= tol."""
    for what, (eager, compiled) in pairs.items():
        if tol is None:
            assert torch.equal(eager, compiled), what
        else:
            assert rel_error(compiled, eager) <= tol, what


def _train_step(module, x, fp8_recipe, call=None):
    """One step of `call` (default: module) -> output, gradients and scaling states of `module` by name."""
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    with te.fp8_autocast(fp8_recipe=fp8_recipe):
        out = (module if call is None else call)(x)
    out.float().square().sum().backward()
    grads = {f"grad {n}": p.grad for n, p in module.named_parameters()}
    return {"out": out.detach(), "grad input": x.grad, **grads, **_scaling_states(module)}


def _compare_fullgraph(name, fp8_recipe, backend, device, dtype, tol):
    make, shapes = MODULES[name]
    torch._dynamo.reset()
    eager = make(dtype, device)
    randomize_vectors(eager)
    _train_step(eager, torch.randn(shapes[0], dtype=dtype, device=device), fp8_recipe)  # makes the FP8 state
    compiled_module = copy.deepcopy(eager)
    compiled = torch.compile(compiled_module, backend=backend, fullgraph=True)
    for step, shape in enumerate(shapes):
        x = torch.randn(shape, dtype=dtype, device=device) * (step + 1)
        ref, got = _train_step(eager, x, fp8_recipe), _train_step(compiled_module, x, fp8_recipe, compiled)
        _assert_same({k: (ref[k], got[k]) for k in ref}, tol)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    ref, got = _train_step(eager, x, fp8_recipe), _train_step(compiled_module, x, fp8_recipe, compiled)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "a step of the same shape recompiled"
    _assert_same({k: (ref[k], got[k]) for k in ref}, tol)
    if isinstance(fp8_recipe, te.recipe.DelayedScaling):  # the compiled backward's amaxes reached the update
        assert all(not torch.equal(s, torch.ones_like(s)) for k, s in got.items() if k.endswith("fp8_bwd.scale"))
    with torch.no_grad():
        for step in range(2):
            x = torch.randn(shapes[-1], dtype=dtype, device=device)
            with te.fp8_autocast(fp8_recipe=fp8_recipe):
                ref_out = eager(x)
            with te.fp8_autocast(fp8_recipe=fp8_recipe):
                got_out = compiled(x)
            _assert_same({"no_grad out": (ref_out, got_out), **{
                k: (v, _scaling_states(compiled_module)[k]) for k, v in _scaling_states(eager).items()}}, tol)


@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("name", MODULES)
def test_fullgraph_aot_eager_equals_eager_cpu(name, recipe_name):
    _compare_fullgraph(name, RECIPES[recipe_name], "aot_eager", "cpu", torch.float32, None)


@pytest.mark.parametrize("name, recipe_name", [("Linear", "delayed"), ("Linear", "current"),
                                               ("LayerNormMLP", "current")])
def test_fullgraph_inductor_equals_eager_cpu(name, recipe_name):
    _compare_fullgraph(name, RECIPES[recipe_name], "inductor", "cpu", torch.bfloat16, None)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("name", ["Linear", "LayerNormLinear", "LayerNormMLP", "TransformerLayer"])
def test_fullgraph_inductor_equals_eager_cuda(name, recipe_name):
    tol = 2e-2 if name == "TransformerLayer" else None
    _compare_fullgraph(name, RECIPES[recipe_name], "inductor", "cuda", torch.bfloat16, tol)


def test_fullgraph_needs_the_fp8_state_before_the_compiled_call():
    compiled = torch.compile(te.Linear(HIDDEN, 32, device="cpu"), backend="aot_eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="needs the module's FP8 scaling state before the compiled call"):
        with te.fp8_autocast():
            compiled(torch.randn(ROWS, HIDDEN))


def _step(module, x):
    with te.fp8_autocast():
        return module(x)


@pytest.mark.parametrize("make", [
    lambda: te.Linear(32, 16, device="cpu", params_dtype=torch.float32),
    lambda: te.LayerNormMLP(32, 64, device="cpu", params_dtype=torch.float32),
], ids=["Linear", "LayerNormMLP"])
def test_graph_breaks_allowed_autocast_inside_equals_eager(make):
    """No eager step first: the first compiled call makes the FP8 state eagerly (a graph break)."""
    torch._dynamo.reset()
    eager = make()
    compiled_module = copy.deepcopy(eager)
    compiled_step = torch.compile(_step, backend="aot_eager")
    for _ in range(3):
        x = torch.randn(24, 32)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        ye, yc = _step(eager, xe), compiled_step(compiled_module, xc)
        ye.square().sum().backward()
        yc.square().sum().backward()
        assert torch.equal(ye, yc)
        assert torch.equal(xe.grad, xc.grad)
        for name in ("fp8_fwd", "fp8_bwd"):
            assert torch.equal(getattr(eager, name).scale, getattr(compiled_module, name).scale)
    assert not torch.equal(eager.fp8_bwd.scale, torch.ones_like(eager.fp8_bwd.scale))  # the scales did move
