"""Shared test helpers: relative error, FP8 tolerances, a recorder of our op calls."""
import os
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# One rounding to FP8 has a relative error of at most 2**-4 (E4M3) or 2**-3 (E5M2); ||err||/||ref|| of random data
# lands near a third of that. Tolerances of products and sums of a few such roundings:
FP8_RTOL = {torch.float8_e4m3fn: 0.06, torch.float8_e5m2: 0.12}


def rel_error(out, ref):
    """||out - ref|| / ||ref|| in float64 (NaN if out has a NaN)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close_rel(out, ref, tol, what="output"):
    err = rel_error(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def check_against_float64(out, inputs, reference, tol, grad_tol, names="qkv"):
    """out (computed from `inputs`, leaf tensors that require grad) against reference(*float64 copies of inputs):
    the output within tol and, for one random output gradient, each input's gradient within grad_tol (relative
    error by norm)."""
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    ref = reference(*inputs64)
    assert_close_rel(out, ref, tol)
    grad = torch.randn_like(ref)
    out.backward(grad.to(out.dtype))
    for name, ours, want in zip(names, [t.grad for t in inputs], torch.autograd.grad(ref, inputs64, grad)):
        assert_close_rel(ours, want, grad_tol, f"d{name}")


def scalar(value, device="cpu"):
    return torch.tensor([value], dtype=torch.float32, device=device)


class OpNames(TorchDispatchMode):
    """Inside `with OpNames() as ops:`, ops.names lists the name of every op dispatched (aten's and ours)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


class OpCalls(TorchDispatchMode):
    """Inside `with OpCalls(name, keep) as calls:`, calls.seen lists keep(arguments) for every call of
    torch.ops.transformer_fp8.<name>, also those a composite op (fp8_linear_fwd, ...) makes from C++. arguments:
    a dict by the schema's argument names; keep defaults to the dict itself."""

    def __init__(self, name, keep=None):
        super().__init__()
        self.name, self.keep, self.seen = f"transformer_fp8::{name}", keep or (lambda arguments: arguments), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.name == self.name:
            arguments = {a.name: args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
                         for i, a in enumerate(func._schema.arguments)}
            self.seen.append(self.keep(arguments))
        return func(*args, **kwargs)


def checkout_env(**extra: str) -> dict:
    """The environment for a Python subprocess of a test: this checkout first on PYTHONPATH (so the subprocess tests
    this tree's transformer_fp8, whichever checkout pip's editable install points at), plus `extra`.

    Args:
        extra: more variables to set.
    Returns:
        a copy of os.environ with those changes.
    """
    root = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}
