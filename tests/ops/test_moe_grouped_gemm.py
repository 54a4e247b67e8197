"""grouped_fp8_gemm / grouped_fp8_gemm_wgrad: CPU reference vs float64 formulas (uneven and empty groups, per-tensor
and per-group scales), CUDA (torch._scaled_grouped_mm) vs the CPU reference, opcheck, bad inputs; padded_groups."""
import pytest
import torch

import transformer_fp8  # noqa: F401  (registers the ops)
from tests.utils import assert_close_rel
from transformer_fp8.grouped_gemm import padded_groups, padded_rows_bound

ops = torch.ops.transformer_fp8
E4M3 = torch.float8_e4m3fn
SPLITS = ([16, 48, 0, 32, 64], [5, 37, 0, 1, 61], [0, 0, 0, 9], [0, 0])


def fp8(*shape, device="cpu"):
    return torch.randn(*shape, device=device).to(E4M3)


def offsets(splits, device="cpu"):
    return torch.tensor(splits, device=device).cumsum(0).to(torch.int32)


def fprop_ref(a, sa, b, sb, splits):
    """float64 per-group (a_g * sa) (b_g * sb_g)ᵀ."""
    out, start = [], 0
    sb = sb.double().expand(b.shape[0])
    for g, m in enumerate(splits):
        out.append(a[start:start + m].double() * sa.double() @ (b[g].double() * sb[g]).T)
        start += m
    return torch.cat(out)


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("per_group_scale", (False, True))
@pytest.mark.parametrize("transposed_b", (False, True))
def test_grouped_gemm_matches_formula(splits, per_group_scale, transposed_b, device="cpu"):
    g, n, k = len(splits), 48, 32
    a = fp8(sum(splits), k, device=device)
    sa = torch.tensor([0.5], device=device)
    sb = (torch.rand(g, device=device) + 0.5) if per_group_scale else torch.tensor([2.0], device=device)
    if transposed_b:  # b [G, N, K] as the dgrad takes Wᵀ: a strided view of one [K, G*N] tensor
        b = fp8(n, g * k, device=device).view(n, g, k).permute(1, 0, 2)
        assert b.stride(2) == 1 and not b.is_contiguous()
    else:
        b = fp8(g, n, k, device=device)
    out = ops.grouped_fp8_gemm(a, sa, b, sb, offsets(splits, device), torch.float32)
    ref = fprop_ref(a.cpu(), sa.cpu(), b.cpu(), sb.cpu(), splits)
    assert out.shape == (sum(splits), n) and out.dtype == torch.float32
    # (the output is rounded to bfloat16, 2**-9 relative; the CUDA kernel's FP8 accumulation (Hopper's tensor cores
    # keep fewer bits than float32) moves a few near-cancelling sums by more, hence a norm-wise bound there)
    if device == "cpu":
        torch.testing.assert_close(out.double(), ref, rtol=2 ** -8, atol=1e-6)
    assert_close_rel(out.cpu(), ref, 4e-3)
    out_bf16 = ops.grouped_fp8_gemm(a, sa, b, sb, offsets(splits, device), torch.bfloat16, False)
    assert out_bf16.dtype == torch.bfloat16
    assert_close_rel(out_bf16.cpu(), ref, 2e-2)


@pytest.mark.parametrize("splits", ([16, 48, 0, 32, 64], [0, 0, 0, 16], [32]))
def test_grouped_wgrad_matches_formula(splits, device="cpu"):
    n, k, m = 48, 32, sum(splits)
    a_t, b_t = fp8(n, m, device=device), fp8(k, m, device=device)
    sa, sb = torch.tensor([0.25], device=device), torch.tensor([3.0], device=device)
    out = ops.grouped_fp8_gemm_wgrad(a_t, sa, b_t, sb, offsets(splits, device), torch.float32)
    assert out.shape == (len(splits), n, k)
    start = 0
    for g, size in enumerate(splits):
        ref = (a_t[:, start:start + size].cpu().double() * 0.25) @ (b_t[:, start:start + size].cpu().double() * 3).T
        if device == "cpu":
            torch.testing.assert_close(out[g].double(), ref, rtol=2 ** -8, atol=1e-6)
        if size:
            assert_close_rel(out[g].cpu(), ref, 4e-3)
        else:
            assert torch.count_nonzero(out[g]) == 0
        start += size


def test_padded_groups():
    splits = torch.tensor([5, 0, 16, 17, 1], dtype=torch.int32)
    rows = int(splits.sum())
    source, offs = padded_groups(splits, rows)
    total = padded_rows_bound(rows, 5)
    assert total % 16 == 0 and source.shape == (total,) and source.dtype == torch.int32
    assert offs.tolist() == [16, 16, 32, 64, total]
    expected = [-1] * total
    starts, padded_starts = [0, 5, 5, 21, 38], [0, 16, 16, 32, 64]
    for size, start, pstart in zip(splits.tolist(), starts, padded_starts):
        for i in range(size):
            expected[pstart + i] = start + i
    assert source.tolist() == expected


def opcheck_cases(device):
    splits = [16, 0, 32]
    a, b, sa, sb = fp8(48, 32, device=device), fp8(3, 16, 32, device=device), torch.ones(1, device=device), \
        torch.rand(3, device=device)
    return [
        ("grouped_fp8_gemm", (a, sa, b, sb, offsets(splits, device), torch.bfloat16)),
        ("grouped_fp8_gemm", (a, sa, b, sa, offsets(splits, device), torch.float32, False)),
        ("grouped_fp8_gemm_wgrad", (fp8(16, 48, device=device), sa, fp8(32, 48, device=device), sa,
                                    offsets(splits, device), torch.float32)),
    ]


OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def test_opcheck_cpu():
    for name, args in opcheck_cases("cpu"):
        torch.library.opcheck(getattr(ops, name).default, args, test_utils=OPCHECK_UTILS)


def _bad(device):
    a, b, s = fp8(32, 32, device=device), fp8(2, 16, 32, device=device), torch.ones(1, device=device)
    offs = offsets([16, 16], device)
    return [
        (lambda: ops.grouped_fp8_gemm(a.float(), s, b, s, offs, torch.bfloat16), "a: expected a torch.float8_e4m3fn"),
        (lambda: ops.grouped_fp8_gemm(a, s, b.to(torch.float8_e5m2), s, offs, torch.bfloat16),
         "b: expected a torch.float8_e4m3fn"),
        (lambda: ops.grouped_fp8_gemm(a, s, b[:, :, :16], s, offs, torch.bfloat16), r"b: expected \[G, N, 32\]"),
        (lambda: ops.grouped_fp8_gemm(a, s, b, s, offs[:1], torch.bfloat16), "offs: expected 2 elements"),
        (lambda: ops.grouped_fp8_gemm(a, s, b, s, offs.long(), torch.bfloat16), "offs: expected a non-empty 1-D int32"),
        (lambda: ops.grouped_fp8_gemm(a, s, b, torch.ones(3, device=device), offs, torch.bfloat16),
         "b_scale_inv: expected a 1-D tensor of 1 or 2 elements"),
        (lambda: ops.grouped_fp8_gemm(a, s, b, s, offs, torch.float8_e4m3fn), "out_dtype: expected torch.float32"),
        (lambda: ops.grouped_fp8_gemm_wgrad(a, s, fp8(16, 16, device=device), s, offs, torch.bfloat16),
         r"b_t: expected \[K, 32\]"),
    ]


@pytest.mark.parametrize("case", range(len(_bad("cpu"))))
def test_cpu_bad_inputs_raise(case):
    call, match = _bad("cpu")[case]
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# ------------------------------------------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("per_group_scale", (False, True))
@pytest.mark.parametrize("transposed_b", (False, True))
def test_cuda_grouped_gemm(splits, per_group_scale, transposed_b):
    test_grouped_gemm_matches_formula(splits, per_group_scale, transposed_b, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("splits", ([16, 48, 0, 32, 64], [0, 0, 0, 16], [32]))
@pytest.mark.parametrize("kernel", ("fp8", "bf16 on fp8 values"))
def test_cuda_grouped_wgrad(splits, kernel, monkeypatch):
    threshold = 0 if kernel == "fp8" else 1 << 30  # (small groups choose the BF16 kernel, see grouped_gemm.py)
    monkeypatch.setattr("transformer_fp8.grouped_gemm.WGRAD_BF16_BELOW_ROWS_PER_GROUP", threshold)
    test_grouped_wgrad_matches_formula(splits, device="cuda")


@pytest.mark.gpu
def test_cuda_padded_groups_match_cpu():
    splits = torch.tensor([5, 0, 16, 17, 1, 300], dtype=torch.int32)
    for ours, ref in zip(padded_groups(splits.cuda(), 339), padded_groups(splits, 339)):
        assert torch.equal(ours.cpu(), ref)


@pytest.mark.gpu
def test_opcheck_cuda():
    for name, args in opcheck_cases("cuda"):
        torch.library.opcheck(getattr(ops, name).default, args, test_utils=OPCHECK_UTILS)


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(_bad("cpu"))))
def test_cuda_bad_inputs_raise(case):
    call, match = _bad("cuda")[case]
    with pytest.raises((ValueError, TypeError), match=match):
        call()
