"""A tiny model trained 300 steps in FP8 tracks the same model trained in FP32 (same init, same data): the mean loss
of every 50 steps within 5% (measured on CPU: at most 1.3%)."""
import pytest
import torch
import torch.nn as nn

import transformer_fp8 as te
from transformer_fp8 import recipe


class TinyModel(nn.Module):
    def __init__(self, device):
        super().__init__()
        self.mlp = te.LayerNormMLP(32, 64, params_dtype=torch.float32, device=device)
        self.head = te.Linear(32, 1, params_dtype=torch.float32, device=device)

    def forward(self, x):
        return self.head(x + self.mlp(x))


def train(fp8_recipe, device, steps=300):
    torch.manual_seed(0)
    model = TinyModel(device)
    teacher = torch.randn(32, 1, device=device)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 32, device=device)
        target = torch.tanh(x @ teacher) + 0.5 * x[:, :1] * x[:, 1:2]
        with te.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
            loss = (model(x) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fp8_recipe", [recipe.DelayedScaling(amax_history_len=16), recipe.Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_fp8_tracks_the_fp32_loss_curve(device, fp8_recipe):
    reference, fp8 = train(None, device), train(fp8_recipe, device)
    assert reference[-50:].mean() < 0.35 * reference[:10].mean()  # the task is learned (1.2 -> 0.29)
    windows = lambda losses: losses.view(6, 50).mean(dim=1)  # noqa: E731  (mean loss per 50 steps)
    gap = (windows(fp8) - windows(reference)).abs() / windows(reference)
    assert gap.max() < 0.05, f"FP8 vs FP32 loss per 50 steps differs by {gap.tolist()}"
