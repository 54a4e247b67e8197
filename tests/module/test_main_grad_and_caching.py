"""fuse_wgrad_accumulation (wgrad into weight.main_grad) and is_first_microbatch weight caching."""
import pytest
import torch

import transformer_fp8 as te
from tests.module.helpers import DEVICES, RECIPES, randomize_vectors
from tests.utils import OpCalls, rel_error
from transformer_fp8.module import base
from transformer_fp8.module import linear as linear_module

MODULES = {
    "Linear": lambda **kw: te.Linear(64, 32, **kw),
    "LayerNormLinear": lambda **kw: te.LayerNormLinear(64, 32, **kw),
    "LayerNormMLP": lambda **kw: te.LayerNormMLP(64, 96, **kw),
}


def weight_names(m):
    return [n for n, p in m.named_parameters() if p.dim() == 2]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(MODULES))
@pytest.mark.parametrize("fp8", [True, False])
def test_main_grad_accumulates_over_microbatches(device, name, fp8):
    kw = dict(params_dtype=torch.bfloat16, device=device)
    fused, plain = MODULES[name](fuse_wgrad_accumulation=True, **kw), MODULES[name](**kw)
    randomize_vectors(plain)
    fused.load_state_dict(plain.state_dict())
    for n in weight_names(fused):
        fused.get_parameter(n).main_grad = torch.zeros(fused.get_parameter(n).shape, device=device)
    recipe = RECIPES["current-HYBRID"]  # same scales in both modules at every step
    for _ in range(2):
        x = torch.randn(24, 64, dtype=torch.bfloat16, device=device)
        for m in (fused, plain):
            with te.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
                out = m(x)
            out.float().pow(2).sum().backward()
    for n in weight_names(fused):
        weight = fused.get_parameter(n)
        assert weight.grad is None
        assert weight.main_grad.dtype == torch.float32
        assert rel_error(weight.main_grad, plain.get_parameter(n).grad) < (0.02 if fp8 else 1e-2), n
    for n, p in fused.named_parameters():
        if p.dim() == 1:
            assert p.grad is not None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", [True, False])
def test_missing_main_grad_is_a_clear_error(device, fp8):
    m = te.Linear(64, 32, fuse_wgrad_accumulation=True, params_dtype=torch.bfloat16, device=device)
    x = torch.randn(16, 64, dtype=torch.bfloat16, device=device)
    with pytest.raises(RuntimeError, match="main_grad"):
        with te.fp8_autocast(enabled=fp8):
            out = m(x)
        out.sum().backward()


class WeightCasts(OpCalls):
    """Counts (count()) the casts, also those inside composite ops, whose input is one of the module's weights."""

    def __init__(self, module):
        ptrs = {p.data_ptr() for n, p in module.named_parameters() if p.dim() == 2}
        super().__init__("cast_transpose", lambda arguments: arguments["input"].data_ptr() in ptrs)

    def count(self):
        return sum(self.seen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(MODULES))
@pytest.mark.parametrize("recipe_name", ["delayed-HYBRID", "current-E4M3"])
def test_first_microbatch_caches_the_fp8_weight(monkeypatch, device, name, recipe_name):
    # (the Function path: the C++ Linear node, which an uncached call under current scaling takes, casts inside
    # fp8_linear_fwd where a CUDA build's dispatch mode does not see the cast; the node is checked against the
    # Function bit for bit in test_linear_native_node.py)
    monkeypatch.setattr(linear_module, "NATIVE_NODE", False)
    m = MODULES[name](params_dtype=torch.bfloat16, device=device)
    n_weights = len(weight_names(m))
    x = torch.randn(20, 64, dtype=torch.bfloat16, device=device)
    with WeightCasts(m) as casts, te.fp8_autocast(fp8_recipe=RECIPES[recipe_name]):
        first = m(x, is_first_microbatch=True)
        assert casts.count() == n_weights
        with torch.no_grad():
            m.get_parameter(weight_names(m)[0]).mul_(2)  # a cached weight ignores this until the next True
        second = m(x, is_first_microbatch=False)
        assert casts.count() == n_weights
        third = m(x)
        assert casts.count() == 2 * n_weights
    if recipe_name.startswith("delayed"):  # the input's scale did not move inside the autocast: same bytes
        assert torch.equal(first, second)
    assert rel_error(second, first) < 0.05 and rel_error(third, first) > 0.1
    (second.float().sum() + first.float().sum()).backward()  # backward through the cached copies (with transpose)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(MODULES))
@pytest.mark.parametrize("recipe_name", ["delayed-HYBRID", "current-E4M3"])
@pytest.mark.parametrize("min_recast", [0, 2 ** 22])
def test_backward_casts_big_weight_transposes_unless_cached(device, name, recipe_name, min_recast, monkeypatch):
    """Without a cache the forward keeps no Wᵀ of a weight with >= MIN_RECAST_WEIGHT_NUMEL elements: the backward
    casts it once per weight (with the forward's scale); smaller weights keep the forward's Wᵀ, and with
    is_first_microbatch=True the cached Wᵀ serves the backward. Under current scaling (the same scales in every step)
    the input gradients agree (the cast of the weight with 1 / scale_inv may round a rare element apart)."""
    monkeypatch.setattr(base, "MIN_RECAST_WEIGHT_NUMEL", min_recast)
    m = MODULES[name](params_dtype=torch.bfloat16, device=device)
    n_weights = len(weight_names(m))
    x = torch.randn(20, 64, dtype=torch.bfloat16, device=device)
    grads = []
    for first_microbatch in (True, None):
        inp = x.clone().requires_grad_()
        with te.fp8_autocast(fp8_recipe=RECIPES[recipe_name]):
            out = m(inp, is_first_microbatch=first_microbatch)
        with WeightCasts(m) as casts:
            out.float().square().sum().backward()
        assert casts.count() == (n_weights if first_microbatch is None and min_recast == 0 else 0)
        grads.append(inp.grad)
    if recipe_name.startswith("current"):
        assert rel_error(grads[1], grads[0]) < 1e-3
