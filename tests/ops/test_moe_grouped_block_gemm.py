"""The block-scaled grouped GEMM ops (recipe Float8BlockScaling): grouped_block_fp8_gemm (fprop / dgrad: 1x128 tiles x
128x128 blocks) and grouped_block_fp8_gemm_wgrad (1x128 x 1x128 along the grouped rows), and our CUTLASS kernel's
ops behind them. CPU reference vs float64 formulas over operands cast by block_cast from inputs whose tiles have very
different magnitudes (a wrong tile-to-scale pairing shows), uneven and empty groups, the dgrad's transposed weights
(strided scales); CUDA (our kernel and the BF16 fallback) vs float64; opcheck; bad inputs; no host sync."""
import pytest
import torch

import transformer_fp8  # noqa: F401  (registers the ops)
from tests.utils import assert_close_rel
from transformer_fp8 import grouped_gemm

ops = torch.ops.transformer_fp8
E4M3 = torch.float8_e4m3fn
OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
FPROP_SPLITS = ([16, 48, 0, 32, 64], [5, 37, 0, 1, 61, 200], [0, 0, 0, 9], [0, 0])
WGRAD_SPLITS = ([128, 0, 256, 48], [0, 0, 0, 16], [0, 0], [384], [128, 128, 0, 96])
# E4M3 operands (2**-4 per rounding) times varied tile scales, the output rounded to bfloat16.
TOL = 4e-3  # against the formula on the same FP8 values: only the bfloat16 output's rounding (and the sums)


def offsets(splits, device="cpu"):
    return torch.tensor(splits, device=device).cumsum(0).to(torch.int32)


def varied(rows, cols, device="cpu"):
    """A float32 [rows, cols] whose rows and 128-column strips differ in magnitude by up to 2**±6."""
    x = torch.randn(rows, cols, device=device)
    row_scale = torch.exp2(torch.randint(-6, 7, (rows, 1), device=device).float())
    col_scale = torch.exp2(torch.randint(-6, 7, (1, -(-cols // 128)), device=device).float())
    return x * row_scale * col_scale.repeat_interleave(128, dim=1)[:, :cols]


def tiles(x):
    """x [M, K] -> (q, scale_inv [cdiv(K, 128), pad4(M)], q_t [K, M], scale_inv_t [cdiv(M, 128), pad4(K)])."""
    return ops.block_cast(x.contiguous(), E4M3, 1, True, True, 0.0, False)


def blocks(w):
    """w [G, N, K] -> (q [G, N, K], scale_inv [G, cdiv(N, 128), cdiv(K, 128)]) cast per expert (128x128 blocks)."""
    qs, scales = [], []
    for wg in w:
        q, s, _, _ = ops.block_cast(wg.contiguous(), E4M3, 2, True, False, 0.0, False)
        qs.append(q)
        scales.append(s[:, :-(-wg.shape[1] // 128)])
    return torch.stack(qs), torch.stack(scales)


def tile_values(q, scale_inv):
    rows, cols = q.shape
    return q.double() * scale_inv[:, :rows].t().double().repeat_interleave(128, dim=1)[:, :cols]


def block_values(q, scale_inv):
    rows, cols = q.shape
    return q.double() * scale_inv.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]


def fprop_case(splits, n, k, device, transposed_b=False):
    """(a, a_scale_inv, b, b_scale_inv, offs, float64 reference). transposed_b: b as the dgrad takes Wᵀ (a strided
    view [G, N, K] of the FP8 transpose of [G*K, N] weights with the scales transposed)."""
    a, sa, _, _ = tiles(varied(sum(splits), k, device))
    g = len(splits)
    if transposed_b:  # the forward's weights are [G, K, N]; the dgrad multiplies by their transpose
        w, sw = blocks(varied(g * k, n, device).view(g, k, n))
        b = w.reshape(g * k, n).t().contiguous().view(n, g, k).permute(1, 0, 2)  # ([G, N, K], K contiguous)
        sb = sw.transpose(1, 2)
        values = [block_values(w[i], sw[i]).T for i in range(g)]
    else:
        b, sb = blocks(varied(g * n, k, device).view(g, n, k))
        values = [block_values(b[i], sb[i]) for i in range(g)]
    av = tile_values(a, sa)
    ref, start = [], 0
    for i, m in enumerate(splits):
        ref.append(av[start:start + m] @ values[i].T)
        start += m
    return a, sa, b, sb, offsets(splits, device), torch.cat(ref).cpu()


def wgrad_case(splits, n, k, device):
    """(a_t, a_scale_inv, b_t, b_scale_inv, offs, float64 reference [G, N, K])."""
    _, _, dy_t, s_dy = tiles(varied(sum(splits), n, device))
    _, _, x_t, s_x = tiles(varied(sum(splits), k, device))
    dv, xv = tile_values(dy_t, s_dy), tile_values(x_t, s_x)
    ref, start = [], 0
    for m in splits:
        ref.append(dv[:, start:start + m] @ xv[:, start:start + m].T)
        start += m
    return dy_t, s_dy, x_t, s_x, offsets(splits, device), torch.stack(ref).cpu()


@pytest.mark.parametrize("splits", FPROP_SPLITS)
@pytest.mark.parametrize("transposed_b", (False, True))
@pytest.mark.parametrize("shape", ((256, 160), (48, 384)), ids=("n256_k160", "n48_k384"))
def test_grouped_block_gemm_matches_formula(splits, transposed_b, shape, device="cpu"):
    n, k = shape
    a, sa, b, sb, offs, ref = fprop_case(splits, n, k, device, transposed_b)
    out = ops.grouped_block_fp8_gemm(a, sa, b, sb, offs, torch.float32)
    assert out.shape == (sum(splits), n) and out.dtype == torch.float32
    assert_close_rel(out.cpu(), ref, TOL)
    assert ops.grouped_block_fp8_gemm(a, sa, b, sb, offs, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("splits", WGRAD_SPLITS)
def test_grouped_block_wgrad_matches_formula(splits, device="cpu"):
    a_t, sa, b_t, sb, offs, ref = wgrad_case(splits, 48, 160, device)
    out = ops.grouped_block_fp8_gemm_wgrad(a_t, sa, b_t, sb, offs, torch.float32)
    assert out.shape == (len(splits), 48, 160)
    for g, m in enumerate(splits):
        if m == 0:
            assert torch.count_nonzero(out[g]) == 0, f"group {g} is empty: zeros expected"
    assert_close_rel(out.cpu(), ref, TOL)


def test_wgrad_refuses_groups_not_on_tile_boundaries():
    a_t, sa, b_t, sb, _, _ = wgrad_case([100, 60], 16, 16, "cpu")
    with pytest.raises(ValueError, match="multiple of 128 rows"):
        ops.grouped_block_fp8_gemm_wgrad(a_t, sa, b_t, sb, offsets([100, 60]), torch.float32)


def test_sm90_ops_cpu_reference_matches_block_ops():
    a, sa, b, sb, offs, _ = fprop_case([16, 0, 48], 128, 128, "cpu")
    torch.testing.assert_close(ops.grouped_block_fp8_gemm_sm90(a, sa, b, sb, offs),
                               ops.grouped_block_fp8_gemm(a, sa, b, sb, offs, torch.bfloat16))
    a_t, sa, b_t, sb, offs, _ = wgrad_case([128, 0, 32], 32, 16, "cpu")
    torch.testing.assert_close(ops.grouped_block_fp8_gemm_wgrad_sm90(a_t, sa, b_t, sb, offs),
                               ops.grouped_block_fp8_gemm_wgrad(a_t, sa, b_t, sb, offs, torch.bfloat16))


def opcheck_cases(device):
    a, sa, b, sb, offs, _ = fprop_case([16, 0, 48], 128, 160, device)
    a_t, sat, b_t, sbt, offs_t, _ = wgrad_case([128, 0, 32], 32, 16, device)
    cases = [("grouped_block_fp8_gemm", (a, sa, b, sb, offs, torch.float32)),
             ("grouped_block_fp8_gemm_wgrad", (a_t, sat, b_t, sbt, offs_t, torch.bfloat16))]
    if device == "cpu" or cutlass_built():
        cases += [("grouped_block_fp8_gemm_sm90", (a, sa, b, sb, offs)),
                  ("grouped_block_fp8_gemm_wgrad_sm90", (a_t, sat[:, :32].contiguous(), b_t,
                                                         sbt[:, :16].contiguous(), offs_t))]
    return cases


def test_opcheck_cpu():
    for name, args in opcheck_cases("cpu"):
        torch.library.opcheck(getattr(ops, name).default, args, test_utils=OPCHECK_UTILS)


def _bad(device):
    a, sa, b, sb, offs, _ = fprop_case([16, 16], 128, 128, device)
    a_t, sat, b_t, sbt, offs_t, _ = wgrad_case([128], 16, 16, device)
    f32 = torch.float32
    return [
        (lambda: ops.grouped_block_fp8_gemm(a.float(), sa, b, sb, offs, f32), "a: expected a torch.float8_e4m3fn"),
        (lambda: ops.grouped_block_fp8_gemm(a, sa, b.to(torch.float8_e5m2), sb, offs, f32),
         "b: expected a torch.float8_e4m3fn"),
        (lambda: ops.grouped_block_fp8_gemm(a, sa[:, :8], b, sb, offs, f32), r"a_scale_inv: expected 1x128 tile"),
        (lambda: ops.grouped_block_fp8_gemm(a, sa, b, sb[:, :, :0], offs, f32), "b_scale_inv: expected"),
        (lambda: ops.grouped_block_fp8_gemm(a, sa, b, sb.double(), offs, f32), "b_scale_inv: expected"),
        (lambda: ops.grouped_block_fp8_gemm(a, sa, b, sb, offs[:1], f32), "offs: expected 2 elements"),
        (lambda: ops.grouped_block_fp8_gemm(a, sa, b, sb, offs.long(), f32), "offs: expected a non-empty 1-D int32"),
        (lambda: ops.grouped_block_fp8_gemm(a, sa, b, sb, offs, E4M3), "out_dtype: expected torch.float32"),
        (lambda: ops.grouped_block_fp8_gemm_wgrad(a_t, sat, b_t[:, :64].contiguous(), sbt, offs_t, f32),
         r"b_t: expected \[K, 128\]"),
        (lambda: ops.grouped_block_fp8_gemm_wgrad(a_t, sat[:, :4], b_t, sbt, offs_t, f32),
         "a_scale_inv: expected 1x128 tile"),
    ]


@pytest.mark.parametrize("case", range(len(_bad("cpu"))))
def test_cpu_bad_inputs_raise(case):
    call, message = _bad("cpu")[case]
    with pytest.raises((ValueError, TypeError), match=message):
        call()


# --- CUDA ---
BACKENDS = ("torch", "cutlass")


def cutlass_built():
    return torch._C._dispatch_has_kernel_for_dispatch_key("transformer_fp8::grouped_block_fp8_gemm_sm90", "CUDA")


def set_backend(monkeypatch, backend):
    if backend == "cutlass" and not cutlass_built():
        pytest.skip("the extension was built without the CUTLASS headers (no grouped family)")
    monkeypatch.setattr(grouped_gemm, "BACKEND", backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("splits", FPROP_SPLITS)
@pytest.mark.parametrize("transposed_b", (False, True))
@pytest.mark.parametrize("shape", ((256, 160), (48, 384)), ids=("n256_k160", "n48_k384"))
def test_cuda_grouped_block_gemm(backend, splits, transposed_b, shape, monkeypatch):
    set_backend(monkeypatch, backend)
    test_grouped_block_gemm_matches_formula(splits, transposed_b, shape, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("splits", WGRAD_SPLITS)
def test_cuda_grouped_block_wgrad(backend, splits, monkeypatch):
    set_backend(monkeypatch, backend)
    test_grouped_block_wgrad_matches_formula(splits, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("groups, rows, n, k", ((8, 4096, 512, 384), (64, 8192, 256, 512)))
def test_cuda_sm90_large_uneven_groups(groups, rows, n, k):
    if not cutlass_built():
        pytest.skip("the extension was built without the CUTLASS headers (no grouped family)")
    torch.manual_seed(groups)
    cuts = torch.sort(torch.randint(0, rows, (groups - 1,))).values.tolist()
    splits = [e - s for s, e in zip([0] + cuts, cuts + [rows])]
    splits[1] = 0  # (an empty group)
    splits[-1] += rows - sum(splits)
    a, sa, b, sb, offs, ref = fprop_case(splits, n, k, "cuda")
    assert_close_rel(ops.grouped_block_fp8_gemm_sm90(a, sa, b, sb, offs).cpu(), ref, TOL)
    aligned = [-(-m // 128) * 128 for m in splits]
    a_t, sat, b_t, sbt, offs_t, ref_t = wgrad_case(aligned, n, k, "cuda")
    assert_close_rel(ops.grouped_block_fp8_gemm_wgrad_sm90(a_t, sat, b_t, sbt, offs_t).cpu(), ref_t, TOL)


@pytest.mark.gpu
def test_cuda_sm90_no_host_sync():
    if not cutlass_built():
        pytest.skip("the extension was built without the CUTLASS headers (no grouped family)")
    a, sa, b, sb, offs, _ = fprop_case([16, 0, 48], 128, 128, "cuda")
    a_t, sat, b_t, sbt, offs_t, _ = wgrad_case([128, 0, 32], 32, 16, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.grouped_block_fp8_gemm(a, sa, b, sb, offs, torch.bfloat16)
        ops.grouped_block_fp8_gemm_wgrad(a_t, sat, b_t, sbt, offs_t, torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_opcheck_cuda():
    for name, args in opcheck_cases("cuda"):
        torch.library.opcheck(getattr(ops, name).default, args, test_utils=OPCHECK_UTILS)


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(_bad("cpu"))))
def test_cuda_bad_inputs_raise(case):
    call, message = _bad("cuda")[case]
    with pytest.raises((ValueError, TypeError, RuntimeError), match=message):
        call()
