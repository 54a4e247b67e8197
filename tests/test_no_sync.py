"""No host-device synchronisation in an FP8 training step: forward, backward, the scaling updates (delayed scaling)
and an optimizer step, for Linear and TransformerLayer, under torch.cuda.set_sync_debug_mode("error")."""
import pytest
import torch

import transformer_fp8 as te
from transformer_fp8 import recipe

RECIPES = {"delayed": recipe.DelayedScaling(amax_history_len=16), "current": recipe.Float8CurrentScaling()}


def linear_case():
    model = te.Linear(256, 128, params_dtype=torch.bfloat16, device="cuda")
    return model, torch.randn(4, 48, 256, dtype=torch.bfloat16, device="cuda")


def transformer_layer_case():
    model = te.TransformerLayer(256, 512, 4, params_dtype=torch.bfloat16, device="cuda")
    return model, torch.randn(64, 2, 256, dtype=torch.bfloat16, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("case", [linear_case, transformer_layer_case], ids=["Linear", "TransformerLayer"])
def test_training_step_never_syncs(case, recipe_name):
    model, x = case()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    fp8_recipe = RECIPES[recipe_name]

    def step():
        optimizer.zero_grad(set_to_none=False)
        xi = x.clone().requires_grad_()
        with te.fp8_autocast(fp8_recipe=fp8_recipe):
            out = model(xi)
        out.float().square().mean().backward()
        optimizer.step()

    step()  # first call: library handles, plans, lazy state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):  # the mode is on: a sync would raise
            torch.ones(1, device="cuda").item()
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    scales = model.fp8_fwd.scale if isinstance(model, te.Linear) else model.layernorm_mlp.fp8_fwd.scale
    assert torch.isfinite(scales).all() and all(torch.isfinite(p).all() for p in model.parameters())
    if recipe_name == "delayed":
        assert (scales != 1).any()  # the updates ran
