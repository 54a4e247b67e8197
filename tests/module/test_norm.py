"""LayerNorm / RMSNorm modules on our kernels vs float64 plain PyTorch."""
import pytest
import torch

import transformer_fp8 as te
from tests.module.helpers import DEVICES, params64, randomize_vectors, reference_forward
from tests.utils import rel_error


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", [te.LayerNorm, te.RMSNorm])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_matches_reference(device, cls, dtype, tol, zero_centered_gamma):
    m = cls(96, eps=1e-5, zero_centered_gamma=zero_centered_gamma, params_dtype=dtype, device=device)
    randomize_vectors(m)
    x = (torch.randn(3, 11, 96, device=device) * 2 + 0.5).to(dtype).requires_grad_()
    dy = torch.randn(3, 11, 96, device=device).to(dtype)
    out = m(x)
    out.backward(dy)
    p = params64(m)
    x64 = x.detach().double().requires_grad_()
    ref = reference_forward(m, x64, p)
    ref.backward(dy.double())
    assert out.dtype == dtype and rel_error(out, ref) < tol
    assert rel_error(x.grad, x64.grad) < tol
    for name, param in m.named_parameters():
        assert rel_error(param.grad, p[name].grad) < tol, name


def test_parameter_names():
    assert [n for n, _ in te.LayerNorm(8, device="cpu").named_parameters()] == ["weight", "bias"]
    assert [n for n, _ in te.RMSNorm(8, device="cpu").named_parameters()] == ["weight"]
