"""Block-scaling ops (block_cast, block_dequantize, block_fp8_gemm, block_fp8_gemm_accumulate): the CPU reference
against a float64 model of the layout written here from the contract, the CUDA kernels against the CPU reference
(casts bit for bit), opcheck, and the errors of bad input."""
import math

import pytest
import torch

import transformer_fp8  # noqa: F401  (registers the CPU reference and fake kernels)
from tests.utils import FP8_DTYPES, FP8_MAX, FP8_RTOL, assert_close_rel
from transformer_fp8.cpu.activation import act_forward

tfp8 = torch.ops.transformer_fp8
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SHAPES = [(1, 1), (7, 33), (128, 128), (129, 257), (300, 80), (256, 384)]
BAD = (RuntimeError, ValueError, TypeError)


def _data(shape, dtype, device="cpu"):
    """Values over many binades (tiles with very different amaxes), so per-tile scales matter."""
    x = torch.randn(shape, dtype=torch.float64) * torch.exp2(torch.randint(-6, 7, shape, dtype=torch.float64))
    return x.to(dtype).to(device)


def _model_scale(amax, fp8_dtype, power_2, epsilon=0.0):
    """float64 model of a tile's scale (the contract in csrc/ops.cpp)."""
    amax = max(amax, epsilon)
    if amax == 0 or not math.isfinite(amax):
        return 1.0
    scale = float(torch.tensor(FP8_MAX[fp8_dtype], dtype=torch.float32) / torch.tensor(amax, dtype=torch.float32))
    return 2.0 ** math.floor(math.log2(scale)) if power_2 else scale


def _inverse(scale):
    """1 / scale rounded to float32 (scale_inv is float32)."""
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(scale, dtype=torch.float32))


def _model_1x128(x, fp8_dtype, power_2):
    """x [M, K] -> (per-element scale [M, K], scale_inv layout [ceil(K/128), pad4(M)]) in float64."""
    m, k = x.shape
    kb, pad_m = -(-k // 128), -(-m // 4) * 4
    scale = torch.empty(m, k, dtype=torch.float64)
    layout = torch.ones(kb, pad_m, dtype=torch.float64)
    for j in range(kb):
        for row in range(m):
            s = _model_scale(x[row, 128 * j:128 * j + 128].abs().max().item(), fp8_dtype, power_2)
            scale[row, 128 * j:128 * j + 128] = s
            layout[j, row] = _inverse(s)
    return scale, layout


def _assert_quantized(q, x, scale, fp8_dtype):
    """q == saturate(x * scale) to a nearest FP8 value (half an FP8 ulp relative, or half the smallest subnormal)."""
    ref = (x.double() * scale).clamp(-FP8_MAX[fp8_dtype], FP8_MAX[fp8_dtype])
    rel, absolute = {E4M3: (2.0**-4, 2.0**-10), E5M2: (2.0**-3, 2.0**-17)}[fp8_dtype]
    err = (q.double() - ref).abs()
    assert (err <= rel * ref.abs() + absolute).all(), f"max rounding error {err.max().item():.3e}"


# ---------------------------------------------------------------- CPU reference vs the float64 model


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("power_2", [True, False])
def test_cast_1x128_matches_model(shape, fp8_dtype, power_2):
    x = _data(shape, torch.float32)
    q, scale_inv, qt, scale_inv_t = tfp8.block_cast(x, fp8_dtype, 1, True, True, 0.0, power_2)
    scale, layout = _model_1x128(x.double(), fp8_dtype, power_2)
    assert q.shape == shape and q.dtype == fp8_dtype and scale_inv.dtype == torch.float32
    torch.testing.assert_close(scale_inv.double(), layout, rtol=0, atol=0)
    _assert_quantized(q, x, scale, fp8_dtype)
    # the transposed copy: its own 1x128 tiles along M, i.e. the 1x128 layout of xᵀ
    scale_t, layout_t = _model_1x128(x.double().t(), fp8_dtype, power_2)
    assert qt.shape == shape[::-1]
    torch.testing.assert_close(scale_inv_t.double(), layout_t, rtol=0, atol=0)
    _assert_quantized(qt, x.t(), scale_t, fp8_dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_cast_128x128_matches_model(shape, fp8_dtype):
    x = _data(shape, torch.bfloat16)
    q, scale_inv, qt, scale_inv_t = tfp8.block_cast(x, fp8_dtype, 2, True, True)
    m, k = shape
    mb, kb = -(-m // 128), -(-k // 128)
    assert scale_inv.shape == (mb, -(-kb // 4) * 4) and scale_inv_t.shape == (kb, -(-mb // 4) * 4)
    scale = torch.empty(m, k, dtype=torch.float64)
    for i in range(mb):
        for j in range(kb):
            s = _model_scale(x[128 * i:128 * i + 128, 128 * j:128 * j + 128].abs().max().item(), fp8_dtype, True)
            scale[128 * i:128 * i + 128, 128 * j:128 * j + 128] = s
            assert scale_inv[i, j].item() == 1.0 / s and scale_inv_t[j, i].item() == 1.0 / s
    assert (scale_inv[:, kb:] == 1).all() and (scale_inv_t[:, mb:] == 1).all()  # padding
    _assert_quantized(q, x, scale, fp8_dtype)
    assert torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))  # same scales: same bytes


def test_cast_rowwise_only_and_transpose_only():
    x = _data((64, 256), torch.bfloat16)
    full = tfp8.block_cast(x, E4M3, 1, True, True)
    q, s, qt, st = tfp8.block_cast(x, E4M3, 1, True, False)
    assert torch.equal(q.view(torch.uint8), full[0].view(torch.uint8)) and torch.equal(s, full[1])
    assert qt.numel() == 0 and st.numel() == 0
    q, s, qt, st = tfp8.block_cast(x, E4M3, 1, False, True)
    assert q.numel() == 0 and s.numel() == 0 and torch.equal(st, full[3])


@pytest.mark.parametrize("block_dim", [1, 2])
def test_zero_nan_and_epsilon_tiles(block_dim):
    x = torch.zeros(128, 384)
    x[:, 128:256] = 1e-12
    x[:, 256:] = torch.randn(128, 128)
    x[5, 300] = float("nan")
    q, scale_inv, _, _ = tfp8.block_cast(x, E4M3, block_dim, True, False, 0.0, True)
    assert scale_inv[0, 0].item() == 1.0 and (q[:, :128].float() == 0).all()  # zero tile: scale 1
    assert scale_inv[0, 1 if block_dim == 2 else 0].item() != 0
    if block_dim == 1:
        assert scale_inv[2, 5].item() == 1.0 and math.isnan(q[5, 300].float().item())  # a NaN tile keeps scale 1
        floored, _, _, _ = tfp8.block_cast(x, E4M3, 1, True, False, 1e-3, True)
        s = tfp8.block_cast(x, E4M3, 1, True, False, 1e-3, True)[1]
        assert s[1, 0].item() == 1.0 / _model_scale(1e-12, E4M3, True, 1e-3)  # amax floored at epsilon
        assert (floored[:, 128:256].float() == 0).all()  # 1e-12 * 448 / 1e-3 is below E4M3's smallest subnormal


@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("shape", [(7, 33), (129, 257)])
def test_dequantize_inverts_cast(block_dim, shape):
    x = _data(shape, torch.float32)
    q, scale_inv, _, _ = tfp8.block_cast(x, E4M3, block_dim)
    out = tfp8.block_dequantize(q, scale_inv, block_dim, torch.float32)
    assert out.dtype == torch.float32
    assert_close_rel(out, x, FP8_RTOL[E4M3])


@pytest.mark.parametrize("activation", ["gelu", "relu", "swiglu"])
@pytest.mark.parametrize("shape", [(7, 66), (130, 512)])
def test_activation_cast_matches_model(activation, shape):
    """block_activation_cast = the 1x128 cast (rowwise and own transposed tiles) of act(x) computed in float32 (the
    activation reference's float32 math, tested against float64 in test_activation.py; float64 math here would
    differ where float32 underflows: GELU of a large negative value is 0 in float32, ~1e-18 in float64)."""
    x = _data(shape, torch.bfloat16) / 8
    q, scale_inv, qt, scale_inv_t = tfp8.block_activation_cast(x, activation, E4M3, True, True)
    act = act_forward(x.float(), activation).double()
    scale, layout = _model_1x128(act, E4M3, True)
    assert q.shape == act.shape and qt.shape == act.t().shape
    torch.testing.assert_close(scale_inv.double(), layout, rtol=0, atol=0)
    _assert_quantized(q, act, scale, E4M3)
    scale_t, layout_t = _model_1x128(act.t(), E4M3, True)
    torch.testing.assert_close(scale_inv_t.double(), layout_t, rtol=0, atol=0)
    _assert_quantized(qt, act.t(), scale_t, E4M3)


def _reference_gemm(x, w):
    return x.double() @ w.double().t()


@pytest.mark.parametrize("m,k,n", [(64, 256, 96), (33, 200, 40), (130, 384, 256)])
def test_gemm_directions_match_float64(m, k, n):
    """fprop (x 1x128, w 128x128), dgrad (dy 1x128, wᵀ 128x128) and wgrad (dyᵀ, xᵀ 1x128) of one Linear."""
    x, w, dy = _data((m, k), torch.bfloat16), _data((n, k), torch.bfloat16), _data((m, n), torch.bfloat16)
    xq, xs, xqt, xst = tfp8.block_cast(x, E4M3, 1, True, True)
    wq, ws, wqt, wst = tfp8.block_cast(w, E4M3, 2, True, True)
    dq, ds, dqt, dst = tfp8.block_cast(dy, E5M2, 1, True, True)
    y = tfp8.block_fp8_gemm(xq, xs, 1, wq, ws, 2, torch.float32)
    assert_close_rel(y, _reference_gemm(x, w), FP8_RTOL[E4M3])
    dx = tfp8.block_fp8_gemm(dq, ds, 1, wqt, wst, 2, torch.bfloat16)
    assert dx.dtype == torch.bfloat16 and dx.shape == (m, k)
    assert_close_rel(dx, dy.double() @ w.double(), FP8_RTOL[E5M2])
    dw = tfp8.block_fp8_gemm(dqt, dst, 1, xqt, xst, 1, torch.float32)
    assert_close_rel(dw, dy.double().t() @ x.double(), FP8_RTOL[E5M2])
    acc = torch.randn(n, k)
    expected = acc + dw
    tfp8.block_fp8_gemm_accumulate(dqt, dst, 1, xqt, xst, 1, acc)
    torch.testing.assert_close(acc, expected)


def test_gemm_bias_and_dtypes():
    x, w = _data((32, 128), torch.float32), _data((48, 128), torch.float32)
    xq, xs, _, _ = tfp8.block_cast(x, E4M3, 1)
    wq, ws, _, _ = tfp8.block_cast(w, E4M3, 2)
    exact = tfp8.block_fp8_gemm(xq, xs, 1, wq, ws, 2, torch.float32)
    bias = torch.randn(48, dtype=torch.bfloat16)
    out = tfp8.block_fp8_gemm(xq, xs, 1, wq, ws, 2, torch.bfloat16, bias)
    torch.testing.assert_close(out, (exact + bias.float()).bfloat16())
    half = tfp8.block_fp8_gemm(xq, xs, 1, wq, ws, 2, torch.float16, bias.half())
    assert half.dtype == torch.float16
    residual = torch.randn(32, 48, dtype=torch.bfloat16) * 10
    with_residual = tfp8.block_fp8_gemm(xq, xs, 1, wq, ws, 2, torch.bfloat16, bias, residual)
    # one rounding of the float32 sum, not (product + bias) rounded, then + residual rounded again
    torch.testing.assert_close(with_residual, (exact.double() + bias.double() + residual.double()).bfloat16(),
                               rtol=2**-8, atol=0)
    assert torch.equal(with_residual, (exact + bias.float() + residual.float()).bfloat16())


# ---------------------------------------------------------------- opcheck and bad input


def opcheck_cases(device):
    x = _data((40, 160), torch.bfloat16, device)
    w = _data((48, 160), torch.bfloat16, device)
    xq, xs, xqt, xst = tfp8.block_cast(x, E4M3, 1, True, True)
    wq, ws, _, _ = tfp8.block_cast(w, E4M3, 2)
    return [
        (tfp8.block_cast.default, (x, E4M3, 1), {"transpose": True}),
        (tfp8.block_cast.default, (x.float(), E5M2, 2), {"transpose": True, "power_2_scale": False}),
        (tfp8.block_dequantize.default, (xq, xs, 1, torch.bfloat16), {}),
        (tfp8.block_activation_cast.default, (x, "swiglu", E4M3), {"transpose": True}),
        (tfp8.block_fp8_gemm.default, (xq, xs, 1, wq, ws, 2, torch.bfloat16), {}),
        (tfp8.block_fp8_gemm_accumulate.default, (xqt, xst, 1, xqt, xst, 1, torch.zeros(160, 160, device=device)), {}),
        (tfp8.block_fp8_gemm.default, (xq, xs, 1, wq, ws, 2, torch.bfloat16),
         {"residual": torch.randn(40, 48, device=device, dtype=torch.bfloat16)}),
    ]


# opcheck's test_schema compares inputs with torch.allclose, which has no float8 kernel: skip that one.
OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("case", range(7))
def test_opcheck_cpu(case):
    op, args, kwargs = opcheck_cases("cpu")[case]
    torch.library.opcheck(op, args, kwargs, test_utils=OPCHECK_UTILS)


def bad_calls(device):
    """(match, callable): each call must raise an error naming the argument."""
    x = _data((32, 128), torch.bfloat16, device)
    xq, xs, _, _ = tfp8.block_cast(x, E4M3, 1)
    wq, ws, _, _ = tfp8.block_cast(x, E4M3, 2)
    return [
        ("block_dim: expected 1", lambda: tfp8.block_cast(x, E4M3, 3)),
        ("input: expected a 2-D", lambda: tfp8.block_cast(x[0], E4M3, 1)),
        ("input: expected a contiguous", lambda: tfp8.block_cast(x.t(), E4M3, 1)),
        ("fp8_dtype: expected", lambda: tfp8.block_cast(x, torch.bfloat16, 1)),
        ("amax_epsilon: expected a finite", lambda: tfp8.block_cast(x, E4M3, 1, True, False, -1.0)),
        ("scale_inv: expected shape", lambda: tfp8.block_dequantize(xq, ws, 1, torch.float32)),
        ("128x128 x 128x128", lambda: tfp8.block_fp8_gemm(wq, ws, 2, wq, ws, 2, torch.float32)),
        ("b_scale_inv: expected shape", lambda: tfp8.block_fp8_gemm(xq, xs, 1, wq, xs, 2, torch.float32)),
        ("b: expected K = 128", lambda: tfp8.block_fp8_gemm(xq, xs, 1, xq[:, :64].contiguous(),
                                                             xs[:1, :].contiguous(), 1, torch.float32)),
        ("out_dtype: expected", lambda: tfp8.block_fp8_gemm(xq, xs, 1, wq, ws, 2, E4M3)),
        ("bias: expected dtype", lambda: tfp8.block_fp8_gemm(xq, xs, 1, wq, ws, 2, torch.bfloat16,
                                                              torch.zeros(32, device=device))),
        ("out: expected a float32", lambda: tfp8.block_fp8_gemm_accumulate(xq, xs, 1, wq, ws, 2,
                                                                            torch.zeros(32, 32, device=device).half())),
        ("activation: expected one of", lambda: tfp8.block_activation_cast(x, "tanh", E4M3)),
        ("swiglu expects an even", lambda: tfp8.block_activation_cast(x[:, :127].contiguous(), "swiglu", E4M3)),
        ("residual: expected dtype", lambda: tfp8.block_fp8_gemm(xq, xs, 1, wq, ws, 2, torch.bfloat16, None,
                                                                  torch.zeros(32, 32, device=device))),
        ("residual: expected shape", lambda: tfp8.block_fp8_gemm(xq, xs, 1, wq, ws, 2, torch.float32, None,
                                                                  torch.zeros(32, 31, device=device))),
    ]


@pytest.mark.parametrize("case", range(16))
def test_bad_inputs_cpu(case):
    match, call = bad_calls("cpu")[case]
    with pytest.raises(BAD, match=match):
        call()


# ---------------------------------------------------------------- CUDA kernels vs the CPU reference


def _same_bytes(a, b):
    return torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES + [(1000, 4096), (4096, 130)])
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("block_dim", [1, 2])
def test_cast_cuda_matches_cpu(shape, dtype, fp8_dtype, block_dim):
    x = _data(shape, dtype)
    power_2 = block_dim == 1  # both settings, one per layout
    cpu = tfp8.block_cast(x, fp8_dtype, block_dim, True, True, 0.0, power_2)
    cuda = tfp8.block_cast(x.cuda(), fp8_dtype, block_dim, True, True, 0.0, power_2)
    assert _same_bytes(cuda[0], cpu[0]) and _same_bytes(cuda[2], cpu[2])
    torch.testing.assert_close(cuda[1].cpu(), cpu[1], rtol=0, atol=0)
    torch.testing.assert_close(cuda[3].cpu(), cpu[3], rtol=0, atol=0)
    deq = tfp8.block_dequantize(cuda[0], cuda[1], block_dim, dtype)
    torch.testing.assert_close(deq.cpu(), tfp8.block_dequantize(cpu[0], cpu[1], block_dim, dtype), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["gelu", "relu", "swiglu"])
@pytest.mark.parametrize("shape", [(7, 66), (1000, 2048), (256, 384)])
@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_activation_cast_cuda_matches_cpu(activation, shape, dtype):
    """The fused kernel against the CPU reference: the CUDA activation math (expf, tanhf) may differ from torch's in
    the last float32 bit, so a few values may round to the neighbouring FP8 value and a tile's power-of-2 scale may
    differ where its amax sits on a power of two: values within one FP8 step, scales almost all equal."""
    x = _data(shape, dtype) / 8
    cpu = tfp8.block_activation_cast(x, activation, E4M3, True, True)
    cuda = tfp8.block_activation_cast(x.cuda(), activation, E4M3, True, True)
    for (q, s), (q_ref, s_ref) in (((cuda[0], cuda[1]), cpu[:2]), ((cuda[2], cuda[3]), cpu[2:])):
        assert (s.cpu() != s_ref).float().mean().item() <= 0.01
        out = tfp8.block_dequantize(q, s, 1, torch.float32).cpu()
        ref = tfp8.block_dequantize(q_ref, s_ref, 1, torch.float32)
        assert ((out - ref).abs() <= 2.0**-3 * ref.abs() + 1e-6 * ref.abs().max()).all()
        assert (q.cpu().view(torch.uint8) != q_ref.view(torch.uint8)).float().mean().item() <= 0.01


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # (bfloat16 takes the wide kernel)
def test_cast_cuda_special_values(dtype):
    x = torch.zeros(256, 384)
    x[:, 128:256] = 1e-30
    x[:, 256:] = torch.randn(256, 128) * 1e4
    x[7, 300] = float("nan")
    x[200, 10] = float("inf")
    x = x.to(dtype)
    for block_dim in (1, 2):
        for eps in (0.0, 1e-6):
            cpu = tfp8.block_cast(x, E4M3, block_dim, True, True, eps, True)
            cuda = tfp8.block_cast(x.cuda(), E4M3, block_dim, True, True, eps, True)
            for ours, ref in zip(cuda, cpu):
                assert torch.equal(_nan_positive(ours.cpu()), _nan_positive(ref))


def _nan_positive(t):
    """t's bytes with E4M3's two NaN encodings (0x7F, 0xFF) made one: the sign of a NaN carries nothing (the CPU
    reference writes 0xFF for a bfloat16 NaN, the kernels 0x7F)."""
    raw = t.view(torch.uint8).clone()
    if t.dtype == E4M3:
        raw[raw == 0xFF] = 0x7F
    return raw


def _same_outputs(a, b):
    """Two casts' (q, scale_inv, qt, scale_inv_t): same shapes, dtypes and bytes."""
    for x, y in zip(a, b):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(128, 128), (384, 640), (2048, 4096)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("rowwise,transpose", [(True, True), (True, False), (False, True)])
def test_wide_kernel_matches_generic(monkeypatch, shape, dtype, fp8_dtype, block_dim, rowwise, transpose):
    """The wide block cast kernel (interior 16-bit problems, csrc/quantize_block_wide.cuh) writes the very bytes and
    scales of the generic one (TFP8_BLOCK_WIDE=0): plain casts (1x128 and 128x128) and the SwiGLU forward cast."""
    x = _data(shape, dtype, "cuda")
    swiglu_x = _data((shape[0], 2 * shape[1]), dtype, "cuda") / 8
    wide = [tfp8.block_cast(x, fp8_dtype, block_dim, rowwise, transpose, 0.0, block_dim == 1)]
    if block_dim == 1:
        wide.append(tfp8.block_activation_cast(swiglu_x, "swiglu", fp8_dtype, rowwise, transpose))
    monkeypatch.setenv("TFP8_BLOCK_WIDE", "0")
    generic = [tfp8.block_cast(x, fp8_dtype, block_dim, rowwise, transpose, 0.0, block_dim == 1)]
    if block_dim == 1:
        generic.append(tfp8.block_activation_cast(swiglu_x, "swiglu", fp8_dtype, rowwise, transpose))
    for a, b in zip(wide, generic):
        _same_outputs(a, b)
        assert any(t.view(torch.uint8).any() for t in (a[0], a[2]) if t.numel())  # (not all zeros)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(256, 512, 384), (100, 256, 128), (128, 200, 72), (8, 4096, 1024), (21, 256, 160)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_gemm_cuda_matches_cpu(m, k, n, out_dtype):
    x, w, dy = _data((m, k), torch.bfloat16), _data((n, k), torch.bfloat16), _data((m, n), torch.bfloat16)
    if out_dtype == torch.float16:  # (products of values up to ~2**8 summed over K overflow float16's 65504)
        x, w, dy = x / 64, w / 64, dy / 64
    # Hopper's FP8 MMA accumulates with fewer bits than float32 between the 128-K promotions: ~1e-4 relative
    tol = 1e-3 if out_dtype == torch.float32 else 1e-2
    xq, xs, xqt, xst = tfp8.block_cast(x, E4M3, 1, True, True)
    wq, ws, wqt, wst = tfp8.block_cast(w, E4M3, 2, True, True)
    dq, ds, dqt, dst = tfp8.block_cast(dy, E5M2, 1, True, True)
    cases = [(xq, xs, 1, wq, ws, 2), (dq, ds, 1, wqt, wst, 2), (dqt, dst, 1, xqt, xst, 1), (wq, ws, 2, xq, xs, 1)]
    for a, sa, da, b, sb, db in cases:
        ref = tfp8.block_fp8_gemm(a, sa, da, b, sb, db, out_dtype)
        out = tfp8.block_fp8_gemm(a.cuda(), sa.cuda(), da, b.cuda(), sb.cuda(), db, out_dtype)
        assert_close_rel(out.cpu(), ref, tol, f"a {da} x b {db}")
    bias_dtype = torch.float16 if out_dtype == torch.float16 else torch.bfloat16
    bias = torch.randn(n, dtype=bias_dtype)
    ref = tfp8.block_fp8_gemm(xq, xs, 1, wq, ws, 2, out_dtype, bias)
    out = tfp8.block_fp8_gemm(xq.cuda(), xs.cuda(), 1, wq.cuda(), ws.cuda(), 2, out_dtype, bias.cuda())
    assert_close_rel(out.cpu(), ref, tol, "with bias")
    residual = (torch.randn(m, n) * ref.float().abs().mean()).to(out_dtype)
    ref = tfp8.block_fp8_gemm(xq, xs, 1, wq, ws, 2, out_dtype, bias, residual)
    out = tfp8.block_fp8_gemm(xq.cuda(), xs.cuda(), 1, wq.cuda(), ws.cuda(), 2, out_dtype, bias.cuda(),
                              residual.cuda())
    assert_close_rel(out.cpu(), ref, tol, "with bias and residual")
    acc = torch.randn(n, k)
    ref_acc = acc.clone()
    tfp8.block_fp8_gemm_accumulate(dqt, dst, 1, xqt, xst, 1, ref_acc)
    acc_cuda = acc.cuda()
    tfp8.block_fp8_gemm_accumulate(dqt.cuda(), dst.cuda(), 1, xqt.cuda(), xst.cuda(), 1, acc_cuda)
    assert_close_rel(acc_cuda.cpu(), ref_acc, 1e-3, "accumulate")


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(7))
def test_opcheck_cuda(case):
    op, args, kwargs = opcheck_cases("cuda")[case]
    torch.library.opcheck(op, args, kwargs, test_utils=OPCHECK_UTILS)


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(16))
def test_bad_inputs_cuda(case):
    match, call = bad_calls("cuda")[case]
    with pytest.raises(BAD, match=match):
        call()
