"""Activation checkpointing (transformer_fp8.checkpoint): FP8 modules recomputed in the backward give the gradients
and the FP8 scaling state of an uncheckpointed run bit for bit; the region keeps only its inputs; torch's own
checkpoint of an FP8 module is refused with a clear error; bad arguments are clear errors."""
import contextlib
import copy

import pytest
import torch
import torch.utils.checkpoint

import transformer_fp8 as te
from tests.module.helpers import DEVICES, RECIPES, randomize_vectors
from transformer_fp8 import recipe

DT = torch.bfloat16


def make(name, device):
    if name == "TransformerLayer":
        module = te.TransformerLayer(64, 128, 4, num_gqa_groups=2, hidden_dropout=0.0, attention_dropout=0.0,
                                     params_dtype=DT, device=device)
    else:
        module = getattr(te, name)(64, 96, params_dtype=DT, device=device)
    randomize_vectors(module)
    return module


def fp8_states(module):
    """Every FP8 scaling tensor of the module and its submodules (amax histories, scales, scale_invs)."""
    out = []
    for sub in module.modules():
        for holder, names in ((sub, ("fp8_fwd", "fp8_bwd")), (getattr(sub, "fp8_scaling", None), ("fwd", "bwd"))):
            for name in names:
                state = getattr(holder, name, None)
                if state is not None:
                    out += [state.amax_history, state.scale, state.scale_inv]
    return out


def train(module, x0, fp8_recipe, checkpointed, steps=3, seed=0):
    """`steps` training steps (fp8_autocast, then the backward outside it); the last step's input and parameter
    gradients, the FP8 states after the steps, and how many times the forward ran per step."""
    calls = [0]

    def forward(x):
        calls[0] += 1
        return module(x)

    torch.manual_seed(seed)
    for _ in range(steps):
        x = x0.clone().requires_grad_()
        module.zero_grad(set_to_none=True)
        with te.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
            y = te.checkpoint(forward, x) if checkpointed else forward(x)
        y.float().pow(2).sum().backward()
    grads = [x.grad] + [p.grad for p in module.parameters()]
    return grads, fp8_states(module), calls[0] / steps


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["Linear", "LayerNormLinear", "LayerNormMLP", "TransformerLayer"])
@pytest.mark.parametrize("recipe_name", ["delayed-HYBRID", "current-E4M3", None])
def test_checkpointed_steps_equal_uncheckpointed_ones(device, name, recipe_name):
    module = make(name, device)
    x0 = torch.randn(16, 2, 64, dtype=DT, device=device)
    fp8_recipe = RECIPES[recipe_name] if recipe_name else None
    ref_grads, ref_states, ref_calls = train(copy.deepcopy(module), x0, fp8_recipe, checkpointed=False)
    grads, states, calls = train(module, x0, fp8_recipe, checkpointed=True)
    assert (ref_calls, calls) == (1, 2)  # (the checkpointed forward is recomputed in the backward)
    assert len(grads) == len(ref_grads) and len(states) == len(ref_states)
    assert all(g is not None for g in grads)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads)), "gradients differ"
    assert all(torch.equal(a, b) for a, b in zip(states, ref_states)), "FP8 scaling states differ"


@contextlib.contextmanager
def deterministic():
    """Deterministic kernels (cuDNN attention's backward accumulates dq with atomics otherwise)."""
    saved = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["dropout", "fp8_attention"])
def test_dropout_masks_and_fp8_attention_repeat_in_the_recompute(device, case):
    """Hidden and attention dropout (torch's RNG state restored for the recompute), or FP8 attention (its scaling
    state replayed): the same gradients and FP8 states as without checkpointing."""
    if case == "dropout":
        fp8_recipe, dropout, heads, x0 = RECIPES["delayed-HYBRID"], 0.1, 4, torch.randn(16, 2, 64)
    elif device == "cuda":  # (cuDNN's FP8 attention backward takes head dim 128 only)
        fp8_recipe, dropout, heads, x0 = recipe.DelayedScaling(fp8_dpa=True), 0.0, 2, torch.randn(128, 2, 256)
    else:
        fp8_recipe, dropout, heads, x0 = recipe.DelayedScaling(fp8_dpa=True), 0.0, 4, torch.randn(16, 2, 64)
    hidden = x0.shape[-1]
    module = te.TransformerLayer(hidden, 2 * hidden, heads, hidden_dropout=dropout, attention_dropout=dropout,
                                 params_dtype=DT, device=device)
    x0 = x0.to(device, DT)
    with deterministic():
        ref_grads, ref_states, _ = train(copy.deepcopy(module), x0, fp8_recipe, checkpointed=False)
        grads, states, _ = train(module, x0, fp8_recipe, checkpointed=True)
    if case == "fp8_attention":
        assert module.self_attention.core_attention.fp8_scaling.fwd is not None  # (FP8 attention ran)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert all(torch.equal(a, b) for a, b in zip(states, ref_states))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["nested", "autocast_inside"])
def test_nested_regions_and_autocast_inside_the_region(device, layout):
    """Nested te.checkpoint regions, or fp8_autocast entered inside the checkpointed function: the same gradients
    and FP8 states as without checkpointing."""
    fp8_recipe = RECIPES["delayed-HYBRID"]
    stack = torch.nn.Sequential(make("LayerNormMLP", device), make("LayerNormMLP", device))
    x0 = torch.randn(16, 2, 64, dtype=DT, device=device)

    def run(module, checkpointed):
        for _ in range(3):
            module.zero_grad(set_to_none=True)
            x = x0.clone().requires_grad_()
            if layout == "nested":
                with te.fp8_autocast(fp8_recipe=fp8_recipe):
                    inner = (lambda h: te.checkpoint(module[1], te.checkpoint(module[0], h))) if checkpointed \
                        else module
                    y = te.checkpoint(inner, x) if checkpointed else inner(x)
            else:
                def autocast_inside(h):
                    with te.fp8_autocast(fp8_recipe=fp8_recipe):
                        return module(h)
                y = te.checkpoint(autocast_inside, x) if checkpointed else autocast_inside(x)
            y.float().pow(2).sum().backward()
        return [x.grad] + [p.grad for p in module.parameters()], fp8_states(module)

    ref_grads, ref_states = run(copy.deepcopy(stack), False)
    grads, states = run(stack, True)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads)), "gradients differ"
    assert all(torch.equal(a, b) for a, b in zip(states, ref_states)), "FP8 scaling states differ"


@pytest.mark.parametrize("device", DEVICES)
def test_weight_caching_and_main_grad_fusion_under_checkpoint(device):
    """Two micro-batches (is_first_microbatch True, then False) of a Linear with fuse_wgrad_accumulation, each under
    te.checkpoint: main_grad and the input gradients equal the uncheckpointed micro-batches'."""
    base = te.Linear(64, 96, params_dtype=DT, device=device, fuse_wgrad_accumulation=True)
    x0 = torch.randn(2, 16, 64, dtype=DT, device=device)
    results = []
    for checkpointed in (False, True):
        module = copy.deepcopy(base)
        module.weight.main_grad = torch.zeros(96, 64, device=device)
        grads = []
        for micro in range(2):
            x = x0[micro].clone().requires_grad_()
            with te.fp8_autocast(fp8_recipe=RECIPES["delayed-HYBRID"]):
                args = (module, x) if checkpointed else (x,)
                y = (te.checkpoint if checkpointed else module)(*args, is_first_microbatch=micro == 0)
            y.float().pow(2).sum().backward()
            grads.append(x.grad)
        assert module.weight.grad is None
        results.append(grads + [module.weight.main_grad, module.bias.grad])
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["Linear", "LayerNormLinear", "LayerNormMLP", "TransformerLayer"])
def test_torch_checkpoint_of_an_fp8_forward_is_refused(device, name):
    module = make(name, device)
    x = torch.randn(16, 2, 64, dtype=DT, device=device, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=RECIPES["delayed-HYBRID"]):
        y = torch.utils.checkpoint.checkpoint(module, x, use_reentrant=False)
    with pytest.raises(RuntimeError, match="transformer_fp8.checkpoint"):
        y.float().sum().backward()
    # without fp8_autocast, torch's checkpoint works as for any module
    module.zero_grad(set_to_none=True)
    torch.utils.checkpoint.checkpoint(module, x, use_reentrant=False).float().sum().backward()
    assert all(p.grad is not None for p in module.parameters())


@pytest.mark.gpu
def test_checkpoint_keeps_only_the_inputs():
    """A stack of 4 LayerNormMLPs: between forward and backward the checkpointed run holds less than a tenth of the
    uncheckpointed run's activations."""
    stack = torch.nn.Sequential(*[te.LayerNormMLP(1024, 4096, params_dtype=DT, device="cuda") for _ in range(4)])
    x = torch.randn(2048, 1024, dtype=DT, device="cuda", requires_grad=True)

    def held(checkpointed):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with te.fp8_autocast():
            y = te.checkpoint(stack, x) if checkpointed else stack(x)
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated()
        y.float().sum().backward()
        return after - before

    held(False), held(True)  # (calibration steps)
    full, checkpointed = held(False), held(True)
    assert checkpointed < 0.1 * full, (checkpointed, full)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("which", ["default", "given"])
def test_rng_tracker_states_are_replayed(device, which):
    """Dropout drawn from a named state of the RNG tracker (as tensor-parallel attention dropout is) repeats its
    masks in the recompute: the tracker's states are restored for it (the package's tracker, or the one that
    get_rng_state_tracker returns)."""
    tracker = te.distributed.get_rng_state_tracker() if which == "default" else te.distributed.RNGStatesTracker()
    saved = tracker.get_states()
    tracker.add("checkpoint-test", 1234)
    initial = tracker.get_states()
    module = make("LayerNormLinear", device)
    x0 = torch.randn(16, 2, 64, dtype=DT, device=device)

    def forward(x):
        with tracker.fork("checkpoint-test"):
            return torch.nn.functional.dropout(module(x), 0.5)

    grads = []
    try:
        for checkpointed in (False, True):
            tracker.set_states(initial)  # (both runs draw the same masks)
            module.zero_grad(set_to_none=True)
            x = x0.clone().requires_grad_()
            with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
                y = te.checkpoint(forward, x, get_rng_state_tracker=None if which == "default" else lambda: tracker) \
                    if checkpointed else forward(x)
            y.float().pow(2).sum().backward()
            grads.append([x.grad] + [p.grad for p in module.parameters()])
    finally:
        tracker.set_states(saved)
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe_name", ["delayed-HYBRID", None])
def test_checkpoint_core_attention(device, recipe_name):
    """TransformerLayer.forward(checkpoint_core_attention=True) (TE's argument): the attention core is recomputed
    in the backward, with the gradients of the plain steps."""
    layer = make("TransformerLayer", device)
    x0 = torch.randn(16, 2, 64, dtype=DT, device=device)
    fp8_recipe = RECIPES[recipe_name] if recipe_name else None
    results = []
    for checkpointed in (False, True):
        module = copy.deepcopy(layer)
        calls = []
        module.self_attention.core_attention.register_forward_pre_hook(lambda *_: calls.append(1))
        for _ in range(2):
            module.zero_grad(set_to_none=True)
            x = x0.clone().requires_grad_()
            with te.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
                y = module(x, checkpoint_core_attention=checkpointed)
            y.float().pow(2).sum().backward()
        results.append(([x.grad] + [p.grad for p in module.parameters()], len(calls)))
    (ref, ref_calls), (grads, calls) = results
    assert (ref_calls, calls) == (2, 4)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref))


def test_a_compiled_caller_runs_the_region_eagerly():
    """torch.compile cannot trace te.checkpoint (its recompute context): the region runs eagerly inside the compiled
    function (a graph break), with the eager gradients."""
    module = make("LayerNormLinear", "cpu")
    x0 = torch.randn(16, 2, 64, dtype=DT)
    compiled = torch.compile(lambda x: te.checkpoint(module, x).float().pow(2).sum(), backend="eager")
    grads = []
    for step in (lambda x: te.checkpoint(module, x).float().pow(2).sum(), compiled):
        module.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):  # (current scaling: no state changes)
            loss = step(x)
        loss.backward()
        grads.append([x.grad] + [p.grad for p in module.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_bad_arguments_are_clear_errors():
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(TypeError, match="function: expected a callable"):
        te.checkpoint(x, x)
    with pytest.raises(ValueError, match="distribute_saved_activations"):
        te.checkpoint(torch.sin, x, distribute_saved_activations=True)
    with pytest.raises(TypeError, match="get_rng_state_tracker"):
        te.checkpoint(torch.sin, x, get_rng_state_tracker=lambda: None)
    with pytest.raises(TypeError, match="get_rng_state_tracker"):
        te.checkpoint(torch.sin, x, get_rng_state_tracker=te.distributed.get_rng_state_tracker())
    with pytest.raises(TypeError, match="use_reentrant"):
        te.checkpoint(torch.sin, x, use_reentrant="no")
    assert torch.equal(te.checkpoint(torch.sin, x, use_reentrant=True), torch.sin(x))
    assert torch.equal(te.distributed.checkpoint(torch.sin, x), torch.sin(x))  # (TE's other name for it)
