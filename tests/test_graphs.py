"""A whole FP8 training step (forward, backward, delayed-scaling updates) captured in one CUDA graph
(torch.cuda.graph): replays give the same outputs, gradients, amax histories and scales as eager steps, step after
step, so the scaling state is updated inside the graph."""
import copy

import pytest
import torch

import transformer_fp8 as te
from tests.graph_checks import compare, fp8_states
from transformer_fp8 import recipe

FP8_RECIPE = recipe.DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent")


def make_step(model, x, dy):
    """Zero the gradients, forward in fp8_autocast, backward: every kernel reads or writes fixed tensors."""
    params = [p for p in model.parameters()]

    def step():
        for t in params + [x]:
            if t.grad is not None:
                t.grad.zero_()
        with te.fp8_autocast(fp8_recipe=FP8_RECIPE):
            out = model(x)
        out.backward(dy)
        return out
    return step


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["Linear", "TransformerLayer"])
def test_graphed_step_matches_eager_steps(which):
    if which == "Linear":
        eager = te.Linear(128, 96, params_dtype=torch.bfloat16, device="cuda")
        shape, out_shape = (64, 128), (64, 96)
    else:
        eager = te.TransformerLayer(128, 256, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                    params_dtype=torch.bfloat16, device="cuda")
        shape = out_shape = (32, 2, 128)
    graphed = copy.deepcopy(eager)
    inputs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) * (1 + i) for i in range(8)]
    grads = [torch.randn(out_shape, device="cuda", dtype=torch.bfloat16) * (3 - i % 3) for i in range(8)]
    x_e, dy_e = inputs[0].clone().requires_grad_(), grads[0].clone()
    x_g, dy_g = inputs[0].clone().requires_grad_(), grads[0].clone()
    eager_step, graphed_step = make_step(eager, x_e, dy_e), make_step(graphed, x_g, dy_g)

    side = torch.cuda.Stream()  # warm-up (allocations, library handles) off the capture stream, as CUDA graphs need
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            graphed_step()
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(2):
        eager_step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = graphed_step()

    scales_seen = []
    for x, dy in zip(inputs[1:], grads[1:]):
        for static, value in ((x_e, x), (dy_e, dy), (x_g, x), (dy_g, dy)):
            with torch.no_grad():
                static.copy_(value)
        out_e = eager_step()
        graph.replay()
        compare(eager, graphed, out_e, out_g, x_e, x_g, exact=which == "Linear")
        scales_seen.append(torch.cat([s.scale for s in fp8_states(graphed)]))
    assert len(fp8_states(graphed)) >= 2
    assert not all(torch.equal(scales_seen[0], s) for s in scales_seen[1:])  # the replays did update the scales
