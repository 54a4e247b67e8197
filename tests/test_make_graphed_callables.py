"""make_graphed_callables: graphed modules (forward and backward CUDA graphs, FP8 scaling updates inside them) give
the same outputs, gradients, amax histories and scales as eager steps, step after step, with changing inputs and
weights updated in place between steps (as an optimizer does). Bad arguments are rejected before CUDA is touched."""
import copy

import pytest
import torch
from torch import nn

import transformer_fp8 as te
from tests.graph_checks import compare, fp8_states
from tests.utils import rel_error
from transformer_fp8 import recipe
from transformer_fp8.module.base import FP8ModuleBase

FP8_RECIPE = recipe.DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent")
BF16 = torch.bfloat16
STEPS = 6


def make_model(which):
    """(model, input shape, output shape)."""
    if which == "Linear":
        return te.Linear(128, 96, params_dtype=BF16, device="cuda"), (64, 128), (64, 96)
    if which == "LayerNormMLP":
        return te.LayerNormMLP(128, 256, params_dtype=BF16, device="cuda"), (64, 128), (64, 128)
    return (te.TransformerLayer(128, 256, 4, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=BF16,
                                device="cuda"), (32, 2, 128), (32, 2, 128))


def zero_grads(*models):
    for model in models:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()  # in place: a .grad aliasing a graph's static buffer would then come out doubled


def nudge_weights(eager, graphed, step):
    """The same in-place change of both models' parameters (an optimizer step)."""
    gen = torch.Generator(device="cuda").manual_seed(step)
    with torch.no_grad():
        for p_e, p_g in zip(eager.parameters(), graphed.parameters()):
            delta = torch.randn(p_e.shape, generator=gen, device="cuda", dtype=p_e.dtype) * 0.05 * p_e.float().std()
            p_e.add_(delta)
            p_g.add_(delta)


def step_inputs(step, shape, out_shape):
    x = torch.randn(shape, device="cuda", dtype=BF16) * (1 + step)
    dy = torch.randn(out_shape, device="cuda", dtype=BF16) * (3 - step % 3)
    return x, dy


def train_and_compare(eager, graphed, eager_forward, shape, out_shape, exact, flags=(None,) * STEPS,
                      check_step=None):
    """One step per flag (is_first_microbatch) of both models with the same inputs and weight updates, compared
    after each step (then check_step(step, flag) if given); returns the graphed model's scales after each step."""
    scales_seen = []
    for step, flag in enumerate(flags):
        kwargs = {} if flag is None else {"is_first_microbatch": flag}
        x, dy = step_inputs(step, shape, out_shape)
        x_e, x_g = x.clone().requires_grad_(), x.clone().requires_grad_()
        zero_grads(eager, graphed)
        out_e = eager_forward(x_e, **kwargs)
        out_e.backward(dy)
        out_g = graphed(x_g, **kwargs)  # no fp8_autocast: the graphs carry their own
        out_g.backward(dy)
        compare(eager, graphed, out_e, out_g, x_e, x_g, exact)
        if check_step is not None:
            check_step(step, flag)
        if fp8_states(graphed):
            scales_seen.append(torch.cat([s.scale for s in fp8_states(graphed)]))
        nudge_weights(eager, graphed, step)
    return scales_seen


def fp8_forward(model):
    def forward(x, **kwargs):
        with te.fp8_autocast(fp8_recipe=FP8_RECIPE):
            return model(x, **kwargs)
    return forward


def assert_scales_changed(scales_seen):
    assert scales_seen and not all(torch.equal(scales_seen[0], s) for s in scales_seen[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["Linear", "LayerNormMLP", "TransformerLayer"])
def test_graphed_module_matches_eager(which):
    eager, shape, out_shape = make_model(which)
    graphed = copy.deepcopy(eager)
    sample = torch.randn(shape, device="cuda", dtype=BF16, requires_grad=True)
    returned = te.make_graphed_callables(graphed, (sample,), fp8_enabled=True, fp8_recipe=FP8_RECIPE)
    assert returned is graphed and isinstance(returned, nn.Module)
    scales_seen = train_and_compare(eager, graphed, fp8_forward(eager), shape, out_shape, which == "Linear")
    assert len(fp8_states(graphed)) >= 2
    assert_scales_changed(scales_seen)  # the replays did update the scales


@pytest.mark.gpu
def test_tuple_of_two_chained_modules():
    first, second = (te.Linear(128, 96, params_dtype=BF16, device="cuda"),
                     te.Linear(96, 64, params_dtype=BF16, device="cuda"))
    eager = nn.Sequential(first, second)
    graphed = copy.deepcopy(eager)
    samples = ((torch.randn(64, 128, device="cuda", dtype=BF16, requires_grad=True),),
               (torch.randn(64, 96, device="cuda", dtype=BF16, requires_grad=True),))
    g_first, g_second = te.make_graphed_callables((graphed[0], graphed[1]), samples, fp8_enabled=True,
                                                  fp8_recipe=FP8_RECIPE)
    assert g_first is graphed[0] and g_second is graphed[1]
    scales_seen = train_and_compare(eager, graphed, fp8_forward(eager), (64, 128), (64, 64), exact=True)
    assert_scales_changed(scales_seen)


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["Linear", "TransformerLayer"])
def test_weight_caching_matches_eager(which):
    """First microbatch True, then False: the reusing graph reads the FP8 weights the casting graph cached (the
    weights change in place between steps, so a re-cast would differ) and casts no weight (the weight slots record
    no amax)."""
    eager, shape, out_shape = make_model(which)
    graphed = copy.deepcopy(eager)
    sample = torch.randn(shape, device="cuda", dtype=BF16, requires_grad=True)
    te.make_graphed_callables(graphed, (sample,), fp8_enabled=True, fp8_recipe=FP8_RECIPE, fp8_weight_caching=True)

    def weights_cast_iff_first(step, flag):
        for module in (m for m in graphed.modules() if isinstance(m, FP8ModuleBase)):
            weight_amaxes = module.fp8_fwd.amax_history[1, 1::2]  # this step's amaxes; odd slots are the weights
            cast = (weight_amaxes > 0).all() if flag else (weight_amaxes == 0).all()
            assert cast, f"step {step}, is_first_microbatch={flag}: weight amaxes {weight_amaxes.tolist()}"

    train_and_compare(eager, graphed, fp8_forward(eager), shape, out_shape, which == "Linear",
                      flags=[True, False, False, True, False, False], check_step=weights_cast_iff_first)


@pytest.mark.gpu
def test_fp8_disabled_runs_high_precision():
    eager, shape, out_shape = make_model("Linear")
    graphed = copy.deepcopy(eager)
    sample = torch.randn(shape, device="cuda", dtype=BF16, requires_grad=True)
    te.make_graphed_callables(graphed, (sample,))
    for step in range(STEPS):
        x, dy = step_inputs(step, shape, out_shape)
        x_e, x_g = x.clone().requires_grad_(), x.clone().requires_grad_()
        zero_grads(eager, graphed)
        out_e, out_g = eager(x_e), graphed(x_g)
        out_e.backward(dy)
        out_g.backward(dy)
        assert rel_error(out_g, out_e) < 1e-3 and rel_error(x_g.grad, x_e.grad) < 1e-3
        assert rel_error(graphed.weight.grad, eager.weight.grad) < 1e-3
        nudge_weights(eager, graphed, step)
    assert graphed.fp8_fwd is None  # no FP8 state was ever made


@pytest.mark.gpu
def test_falls_back_to_eager_forward():
    """Grad mode off, eval mode, or inputs unlike the sample: the original forward runs (here without fp8_autocast:
    high precision, which a replay of the FP8 graph would not give)."""
    eager, shape, _ = make_model("Linear")
    graphed = copy.deepcopy(eager)
    te.make_graphed_callables(graphed, (torch.randn(shape, device="cuda", dtype=BF16, requires_grad=True),),
                              fp8_enabled=True, fp8_recipe=FP8_RECIPE)
    x = torch.randn(shape, device="cuda", dtype=BF16)
    with torch.no_grad():
        assert torch.equal(graphed(x), eager(x))
    graphed.eval()
    assert torch.equal(graphed(x.requires_grad_()), eager(x))
    graphed.train()
    other = torch.randn(8, 128, device="cuda", dtype=BF16, requires_grad=True)
    assert torch.equal(graphed(other), eager(other))
    replayed = graphed(x)  # FP8 replay: close to, not equal to, the high-precision output
    assert 0 < rel_error(replayed, eager(x)) < 0.1


def cpu_linear():
    return nn.Linear(4, 4)


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(modules=42), TypeError, "modules"),
    (dict(modules=()), ValueError, "modules"),
    (dict(sample_args=[torch.zeros(2, 4)]), TypeError, "sample_args"),
    (dict(sample_args=(torch.zeros(2, 4), 3)), TypeError, "sample_args"),
    (dict(sample_args=(torch.zeros(2, 4),)), ValueError, "sample_args"),  # a CPU tensor
    (dict(sample_kwargs={"mask": torch.zeros(2)}, sample_args=()), ValueError, "sample_kwargs"),  # a CPU tensor
    (dict(sample_kwargs=[{}]), TypeError, "sample_kwargs"),
    (dict(num_warmup_iters=0), ValueError, "num_warmup_iters"),
    (dict(num_warmup_iters=True), ValueError, "num_warmup_iters"),
    (dict(allow_unused_input=1), TypeError, "allow_unused_input"),
    (dict(fp8_enabled="yes"), TypeError, "fp8_enabled"),
    (dict(fp8_recipe="delayed"), TypeError, "fp8_recipe"),
    (dict(fp8_weight_caching=True), ValueError, "fp8_weight_caching"),
    (dict(fp8_weight_caching=None), TypeError, "fp8_weight_caching"),
])
def test_bad_arguments_name_the_argument(kwargs, error, name):
    args = dict(modules=cpu_linear(), sample_args=(torch.zeros(2, 4, device="meta"),))
    args.update(kwargs)
    with pytest.raises(error, match=name):
        te.make_graphed_callables(args.pop("modules"), args.pop("sample_args"), **args)


def test_bad_tuple_arguments_name_the_argument():
    modules, meta = (cpu_linear(), cpu_linear()), torch.zeros(2, 4, device="meta")
    with pytest.raises(ValueError, match="sample_args"):
        te.make_graphed_callables(modules, ((meta,),))  # one tuple for two modules
    with pytest.raises(ValueError, match="sample_args"):
        te.make_graphed_callables(modules, (meta, meta))  # tensors, not tuples
    with pytest.raises(TypeError, match="sample_kwargs"):
        te.make_graphed_callables(modules, ((meta,), (meta,)), sample_kwargs=({},))
    with pytest.raises(ValueError, match="sample_kwargs"):
        te.make_graphed_callables(modules, ((meta,), (meta,)), fp8_enabled=True, fp8_weight_caching=True,
                                  sample_kwargs=({"is_first_microbatch": True}, {}))


def test_module_with_hooks_or_inside_fp8_autocast_is_rejected():
    meta = torch.zeros(2, 4, device="meta")
    hooked = cpu_linear()
    hooked.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="modules"):
        te.make_graphed_callables(hooked, (meta,))
    with te.fp8_autocast(), pytest.raises(RuntimeError, match="outside fp8_autocast"):
        te.make_graphed_callables(cpu_linear(), (meta,))
