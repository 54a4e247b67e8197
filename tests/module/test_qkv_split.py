"""split_qkv equals autograd's own slicing of the fused QKV output, forward and backward, bit for bit."""
import weakref

import pytest
import torch

from transformer_fp8.module.qkv_split import split_qkv


def reference_split(qkv, h, g, d, interleaved):
    lead = qkv.shape[:-1]
    if interleaved:
        per_group = qkv.view(*lead, g, h // g + 2, d)
        return per_group[..., :-2, :].reshape(*lead, h, d), per_group[..., -2, :], per_group[..., -1, :]
    q, k, v = qkv.split([h * d, g * d, g * d], dim=-1)
    return q.view(*lead, h, d), k.view(*lead, g, d), v.view(*lead, g, d)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("heads,groups", [(4, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("used", ["qkv", "k", "qv"])
def test_split_matches_autograd_slicing(interleaved, heads, groups, used):
    d = 16
    qkv = torch.randn(5, 3, (heads + 2 * groups) * d, dtype=torch.float64, requires_grad=True)
    ref_in = qkv.detach().clone().requires_grad_()
    ours, ref = split_qkv(qkv, heads, groups, d, interleaved), reference_split(ref_in, heads, groups, d, interleaved)
    weights = [torch.randn_like(t) for t in ref]
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
    pick = ["qkv".index(c) for c in used]
    sum((ours[i] * weights[i]).sum() for i in pick).backward()
    sum((ref[i] * weights[i]).sum() for i in pick).backward()
    assert torch.equal(qkv.grad, ref_in.grad)


def test_no_grad_returns_views_of_input():
    qkv = torch.randn(2, 6 * 8)
    q, k, v = split_qkv(qkv, 4, 1, 8, False)
    assert q.data_ptr() == qkv.data_ptr() and k._base is qkv and v._base is qkv


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("interleaved,heads,groups", [(True, 8, 2), (True, 4, 4), (False, 8, 2)])
def test_qkv_freed_only_when_no_output_is_a_view(grad, interleaved, heads, groups):
    """Interleaved GQA: q, k and v are copies, so nothing keeps the fused QKV output alive; otherwise they are views."""
    leaf = torch.randn(5, 3, (heads + 2 * groups) * 8, requires_grad=grad)
    qkv = leaf * 2.0  # a non-leaf, as a QKV GEMM's output (the multiply saves no tensor)
    alive = weakref.ref(qkv)
    with torch.set_grad_enabled(grad):
        q, k, v = split_qkv(qkv, heads, groups, 8, interleaved)
    del qkv
    assert (alive() is None) == (interleaved and heads != groups)
    assert q.shape == (5, 3, heads, 8) and k.shape == v.shape == (5, 3, groups, 8)


@pytest.mark.parametrize("heads,groups", [(8, 2), (4, 1), (6, 3)])
@pytest.mark.parametrize("used", ["qkv", "k", "qv"])
def test_folded_split_is_views_and_matches_autograd_slicing(heads, groups, used):
    """fold=True: q [s, b*g, h/g, d], k, v [s, b*g, 1, d], views of qkv; unfolded they equal the plain split, and the
    qkv gradient (copied from separate dq, dk, dv) equals autograd's own."""
    s, b, d = 5, 3, 16
    qkv = torch.randn(s, b, (heads + 2 * groups) * d, dtype=torch.float64, requires_grad=True)
    ref_in = qkv.detach().clone().requires_grad_()
    ours, ref = split_qkv(qkv, heads, groups, d, True, fold=True), reference_split(ref_in, heads, groups, d, True)
    assert [tuple(t.shape) for t in ours] == [(s, b * groups, heads // groups, d), (s, b * groups, 1, d),
                                              (s, b * groups, 1, d)]
    assert all(t._base is qkv for t in ours)
    unfolded = [t.reshape(s, b, -1, d) for t in ours]
    for a, r in zip(unfolded, ref):
        assert torch.equal(a, r)
    weights = [torch.randn_like(t) for t in ref]
    pick = ["qkv".index(c) for c in used]
    sum((unfolded[i] * weights[i]).sum() for i in pick).backward()
    sum((ref[i] * weights[i]).sum() for i in pick).backward()
    assert torch.equal(qkv.grad, ref_in.grad)


def test_folded_split_bad_arguments():
    qkv = torch.randn(2, 3, 4, 8 * 8)
    with pytest.raises(ValueError, match="fold"):
        split_qkv(qkv, 4, 2, 8, True, fold=True)  # (4-D: no [s, b] lead)
    with pytest.raises(ValueError, match="fold"):
        split_qkv(qkv[0], 4, 2, 8, False, fold=True)  # (not the interleaved layout)
