"""Checks shared by the CUDA-graph tests: a graphed model against its eager twin after a step."""
import torch

from tests.utils import rel_error
from transformer_fp8.module.base import FP8ModuleBase


def fp8_states(model):
    """The forward and backward ScalingStates of every FP8 module in `model`, in module order."""
    return [s for m in model.modules() if isinstance(m, FP8ModuleBase) for s in (m.fp8_fwd, m.fp8_bwd) if s]


def check_same(got, want, exact, what):
    """Bitwise for Linear; within 1% (norm) otherwise (the fused attention backward may accumulate in another order
    from run to run, and FP8 rounding can amplify one ulp)."""
    if exact:
        assert torch.equal(got, want), what
    else:
        assert rel_error(got, want) < 0.01, what


def compare(eager, graphed, out_e, out_g, x_e, x_g, exact):
    """Outputs, input and parameter gradients, and every FP8 state tensor of the two models."""
    check_same(out_g, out_e, exact, "output")
    check_same(x_g.grad, x_e.grad, exact, "input grad")
    for (name, p_g), p_e in zip(graphed.named_parameters(), eager.parameters()):
        check_same(p_g.grad, p_e.grad, exact, name)
    for s_g, s_e in zip(fp8_states(graphed), fp8_states(eager)):
        for what in ("amax_history", "scale", "scale_inv"):
            check_same(getattr(s_g, what), getattr(s_e, what), exact, what)
