"""grouped_fp8_gemm / grouped_fp8_gemm_wgrad and our kernel's ops grouped_fp8_gemm_sm90 / grouped_fp8_gemm_wgrad_sm90:
CPU reference vs float64 formulas (uneven and empty groups, per-tensor and per-group scales), CUDA (both backends:
torch._scaled_grouped_mm and our CUTLASS kernel, each tile configuration and accumulation) vs float64, opcheck, bad
inputs, no host sync; padded_groups."""
import pytest
import torch

import transformer_fp8  # noqa: F401  (registers the ops)
from tests.utils import assert_close_rel
from transformer_fp8 import grouped_gemm
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
        ("grouped_fp8_gemm_sm90", (a, sa, b, sb, offsets(splits, device))),
        ("grouped_fp8_gemm_sm90", (a, sa, b, sa, offsets(splits, device), True, 2)),
        ("grouped_fp8_gemm_wgrad_sm90", (fp8(16, 48, device=device), sa, fp8(32, 48, device=device), sa,
                                         offsets(splits, device), False, 1)),
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


def test_sm90_ops_cpu_reference_matches_grouped_ops():
    """The CPU kernels of our kernel's ops are the references of grouped_fp8_gemm(_wgrad) with a bfloat16 output."""
    splits = [16, 0, 32, 5]
    a, b = fp8(53, 32), fp8(4, 16, 32)
    sa, sb = torch.tensor([0.5]), torch.rand(4) + 0.5
    offs = offsets(splits)
    assert torch.equal(ops.grouped_fp8_gemm_sm90(a, sa, b, sb, offs),
                       ops.grouped_fp8_gemm(a, sa, b, sb, offs, torch.bfloat16))
    a_t, b_t = fp8(16, 53), fp8(32, 53)
    out = ops.grouped_fp8_gemm_wgrad_sm90(a_t, sa, b_t, sa, offs, True, 2)
    assert out.dtype == torch.bfloat16 and out.shape == (4, 16, 32)
    assert torch.equal(out, ops.grouped_fp8_gemm_wgrad(a_t, sa, b_t, sa, offs, torch.bfloat16))
    for tile in range(7):  # (every tile configuration is the same float32-summed reference here)
        assert torch.equal(ops.grouped_fp8_gemm_sm90(a, sa, b, sb, offs, tile % 2 == 0, tile),
                           ops.grouped_fp8_gemm(a, sa, b, sb, offs, torch.bfloat16))
    with pytest.raises(ValueError, match="tile: expected 0"):
        ops.grouped_fp8_gemm_sm90(a, sa, b, sb, offs, False, 8)


def test_cutlass_tile_per_form(monkeypatch):
    """CUTLASS_TILE as one tile for every call, or per (form, accumulation) with 0 (the kernel's choice) elsewhere."""
    monkeypatch.setattr(grouped_gemm, "CUTLASS_TILE", {("rows", True): 4, ("contraction", False): 3})
    assert grouped_gemm.cutlass_tile("rows", True) == 4 and grouped_gemm.cutlass_tile("rows", False) == 0
    assert grouped_gemm.cutlass_tile("contraction", False) == 3 and grouped_gemm.cutlass_tile("contraction", True) == 0
    monkeypatch.setattr(grouped_gemm, "CUTLASS_TILE", 5)
    assert all(grouped_gemm.cutlass_tile(form, fast) == 5 for form in ("rows", "contraction") for fast in (False, True))


def test_backend_flag_is_checked():
    grouped_gemm.BACKEND = "cublas"
    try:
        with pytest.raises(ValueError, match="BACKEND: expected one of"):
            grouped_gemm.use_cutlass(torch.device("cpu"))
    finally:
        grouped_gemm.BACKEND = "auto"


@pytest.mark.parametrize("case", range(len(_bad("cpu"))))
def test_cpu_bad_inputs_raise(case):
    call, match = _bad("cpu")[case]
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# ------------------------------------------------------------------------------------------------------------- CUDA
BACKENDS = ("torch", "cutlass")


def cutlass_built():
    return torch._C._dispatch_has_kernel_for_dispatch_key("transformer_fp8::grouped_fp8_gemm_sm90", "CUDA")


def set_backend(monkeypatch, backend):
    if backend == "cutlass" and not cutlass_built():
        pytest.skip("the extension was built without the CUTLASS headers (no grouped family)")
    monkeypatch.setattr(grouped_gemm, "BACKEND", backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("per_group_scale", (False, True))
@pytest.mark.parametrize("transposed_b", (False, True))
def test_cuda_grouped_gemm(backend, splits, per_group_scale, transposed_b, monkeypatch):
    set_backend(monkeypatch, backend)
    test_grouped_gemm_matches_formula(splits, per_group_scale, transposed_b, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("splits", ([16, 48, 0, 32, 64], [0, 0, 0, 16], [32]))
@pytest.mark.parametrize("kernel", ("fp8", "bf16 on fp8 values"))
def test_cuda_grouped_wgrad(backend, splits, kernel, monkeypatch):
    set_backend(monkeypatch, backend)
    threshold = 0 if kernel == "fp8" else 1 << 30  # (small groups choose the BF16 kernel, see grouped_gemm.py)
    monkeypatch.setattr(grouped_gemm, "WGRAD_BF16_BELOW_ROWS_PER_GROUP", threshold)
    monkeypatch.setattr(grouped_gemm, "CUTLASS_WGRAD_BF16_BELOW_ROWS_PER_GROUP", threshold)
    test_grouped_wgrad_matches_formula(splits, device="cuda")


def random_splits(groups, rows, multiple, generator):
    """Uneven group sizes (multiples of `multiple`, some groups empty) summing to `rows`."""
    weights = torch.rand(groups, generator=generator) ** 3
    weights[torch.randperm(groups, generator=generator)[: max(1, groups // 4)]] = 0  # a quarter of them empty
    sizes = (weights / weights.sum() * rows / multiple).floor().long() * multiple
    sizes[int(weights.argmax())] += rows - int(sizes.sum())
    return sizes.tolist()


# every (tile, accumulation) pair our kernel is built with
TILE_CONFIGS = [(tile, fast) for tile in (0, 1, 2, 3, 4, 5, 6, 7) for fast in (False, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("tile,fast_accumulation", TILE_CONFIGS)
@pytest.mark.parametrize("groups,rows,n,k", ((8, 1000, 384, 1024), (33, 700, 160, 272), (3, 5, 16, 16),
                                             (64, 3000, 2816, 256)))
def test_cuda_sm90_grouped_gemm_every_config(tile, fast_accumulation, groups, rows, n, k):
    """Our kernel, each tile configuration and accumulation, on several CTA tiles per group, K-loops longer than the
    promotion interval, ragged edges (N, K not multiples of the tiles) and empty groups, against float64."""
    if not cutlass_built():
        pytest.skip("the extension was built without the CUTLASS headers (no grouped family)")
    gen = torch.Generator().manual_seed(groups * 7 + tile)
    splits = random_splits(groups, rows, 1, gen)
    a = (torch.randn(rows, k, generator=gen) * 2).to(E4M3).cuda()
    b = torch.randn(groups, n, k, generator=gen).to(E4M3).cuda()
    sa, sb = torch.tensor([0.75], device="cuda"), torch.rand(groups, device="cuda") + 0.25
    out = ops.grouped_fp8_gemm_sm90(a, sa, b, sb, offsets(splits, "cuda"), fast_accumulation, tile)
    ref = fprop_ref(a.cpu(), sa.cpu(), b.cpu(), sb.cpu(), splits)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    assert_close_rel(out.cpu(), ref, 8e-3)
    # every row of every group (a row from a wrong group or left unwritten is off by the order of the largest values)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=2 ** -7, atol=1e-2 * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("tile,fast_accumulation", TILE_CONFIGS)
@pytest.mark.parametrize("groups,rows,n,k", ((8, 4096, 384, 272), (17, 1024, 160, 256)))
def test_cuda_sm90_grouped_wgrad_every_config(tile, fast_accumulation, groups, rows, n, k):
    if not cutlass_built():
        pytest.skip("the extension was built without the CUTLASS headers (no grouped family)")
    gen = torch.Generator().manual_seed(groups + 100 * tile)
    splits = random_splits(groups, rows, 16, gen)
    a_t = torch.randn(n, rows, generator=gen).to(E4M3).cuda()
    b_t = torch.randn(k, rows, generator=gen).to(E4M3).cuda()
    sa, sb = torch.tensor([0.5], device="cuda"), torch.tensor([1.5], device="cuda")
    junk = torch.full((groups, n, k), 7.0, dtype=torch.bfloat16, device="cuda")
    del junk  # (its block goes back to the cache and likely becomes out: empty groups' zeros must be written)
    out = ops.grouped_fp8_gemm_wgrad_sm90(a_t, sa, b_t, sb, offsets(splits, "cuda"), fast_accumulation, tile)
    assert out.dtype == torch.bfloat16 and out.shape == (groups, n, k)
    start = 0
    for g, size in enumerate(splits):
        ref = (a_t[:, start:start + size].cpu().double() * 0.5) @ (b_t[:, start:start + size].cpu().double() * 1.5).T
        if size:
            assert_close_rel(out[g].cpu(), ref, 1e-2 if fast_accumulation else 8e-3, f"group {g} ({size} rows)")
        else:
            assert torch.count_nonzero(out[g]) == 0, f"empty group {g} not zero"
        start += size


@pytest.mark.gpu
@pytest.mark.parametrize("tile", (0, 7))
def test_cuda_sm90_own_kernel_group_ends_and_strided_weights(tile):
    """Our own forward kernel (tile 7, and auto's choice for groups of < 1024 rows): groups ending in the first or
    second 64 rows of a 128-row tile (the tile's second half of MMAs skipped or not), a single row, an empty group,
    weights that are a strided view (rows and groups padded), per-group scales; every row against float64."""
    if not cutlass_built():
        pytest.skip("the extension was built without the CUTLASS headers (no grouped family)")
    gen = torch.Generator().manual_seed(11 + tile)
    splits = [64, 65, 1, 0, 127, 128, 129, 200, 63]
    rows, n, k = sum(splits), 352, 384
    a = torch.randn(rows, k, generator=gen).to(E4M3).cuda()
    padded = torch.randn(len(splits), n + 48, k + 32, generator=gen).to(E4M3).cuda()
    b = padded[:, :n, :k]  # stride(1) = k + 32, stride(0) = (n + 48) * (k + 32)
    sa, sb = torch.tensor([1.25], device="cuda"), torch.rand(len(splits), device="cuda") + 0.5
    out = ops.grouped_fp8_gemm_sm90(a, sa, b, sb, offsets(splits, "cuda"), True, tile)
    ref = fprop_ref(a.cpu(), sa.cpu(), b.cpu(), sb.cpu(), splits)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=2 ** -7, atol=1e-2 * ref.abs().max().item())


@pytest.mark.gpu
def test_cuda_sm90_no_host_sync():
    """Group sizes stay on the device: the ops launch without a device-to-host copy."""
    if not cutlass_built():
        pytest.skip("the extension was built without the CUTLASS headers (no grouped family)")
    a, b, s = fp8(64, 32, device="cuda"), fp8(4, 16, 32, device="cuda"), torch.ones(1, device="cuda")
    offs = offsets([16, 0, 32, 16], "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.grouped_fp8_gemm_sm90(a, s, b, s, offs)
        ops.grouped_fp8_gemm_wgrad_sm90(fp8(16, 64, device="cuda"), s, fp8(32, 64, device="cuda"), s, offs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_cuda_sm90_bad_inputs_raise():
    if not cutlass_built():
        pytest.skip("the extension was built without the CUTLASS headers (no grouped family)")
    a, b, s = fp8(32, 32, device="cuda"), fp8(2, 16, 32, device="cuda"), torch.ones(1, device="cuda")
    offs = offsets([16, 16], "cuda")
    with pytest.raises(RuntimeError, match="N: expected a multiple of 16"):
        ops.grouped_fp8_gemm_sm90(a, s, fp8(2, 24, 32, device="cuda"), s, offs)
    with pytest.raises(RuntimeError, match="a: expected a 16-byte aligned"):
        ops.grouped_fp8_gemm_sm90(fp8(33 * 32 + 8, device="cuda")[8:].view(33, 32)[:32], s, b, s, offs)
    with pytest.raises(RuntimeError, match="b_scale_inv: expected a contiguous 1-D tensor of 1 or 2"):
        ops.grouped_fp8_gemm_sm90(a, s, b, torch.ones(3, device="cuda"), offs)
    with pytest.raises(RuntimeError, match="M: expected a multiple of 16"):
        ops.grouped_fp8_gemm_wgrad_sm90(fp8(16, 40, device="cuda"), s, fp8(16, 40, device="cuda"), s, offs)
    with pytest.raises(RuntimeError, match="a: expected a torch.float8_e4m3fn"):
        ops.grouped_fp8_gemm_sm90(a.to(torch.float8_e5m2), s, b, s, offs)


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
