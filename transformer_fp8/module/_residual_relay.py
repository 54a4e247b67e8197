"""A residual's gradient handed from one FP8 autograd Function to another, instead of autograd summing it with a
separate add.

MultiheadAttention(input_layernorm=True) with forward(x, residual=x) (TransformerLayer's first residual): the
projection's GEMM adds x in its epilogue, so x's gradient is the output gradient dy (from the projection's backward)
plus dx from the QKV LayerNormLinear's norm backward. With a relay, the projection's backward stores dy in it and
returns no residual gradient; the LayerNormLinear's backward, which autograd runs after it (it feeds the projection
through attention), passes dy to its norm backward kernel as dx_add. One [tokens, hidden] add less per step.
The LayerNormLinear's FP8 forward arms the relay (it will consume the gradient); the projection hands its gradient
over only to an armed relay, so any mix of FP8 and high-precision paths stays correct. Not under torch.compile
(a Python object passed between backward functions does not trace).
"""


class ResidualGradRelay:
    __slots__ = ("armed", "grad")

    def __init__(self):
        self.armed, self.grad = False, None

    def take(self):
        """The handed-over gradient (then cleared), or None."""
        grad, self.grad = self.grad, None
        return grad
