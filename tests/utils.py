"""Shared test helpers: relative error and FP8 tolerances."""
import torch

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
