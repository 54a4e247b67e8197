"""The fused block casts (norm_block_cast, dact_block_cast): the CPU reference against float64 models written here
(norm / activation gradient in float64, then the 1x128 tile layout), the CUDA kernels against the CPU reference,
opcheck, and the errors of bad input."""
import pytest
import torch

import transformer_fp8  # noqa: F401  (registers the CPU reference and fake kernels)
from transformer_fp8.cpu.block import expand_scales

tfp8 = torch.ops.transformer_fp8
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BAD = (RuntimeError, ValueError, TypeError)
# Half an FP8 step relative to the value (rounding to nearest), and half the smallest subnormal times the tile's
# scale_inv for values that round to a subnormal or to zero.
HALF_STEP = {E4M3: (2.0**-4, 2.0**-10), E5M2: (2.0**-3, 2.0**-17)}
OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _data(shape, dtype, device="cpu", spread=3):
    """Values over a few binades, rows with different magnitudes (so that 1x128 tiles get different scales)."""
    x = torch.randn(shape, dtype=torch.float64) * torch.exp2(torch.randint(-spread, spread + 1, shape[:1] + (1,),
                                                                           dtype=torch.float64))
    return x.to(dtype).to(device)


def _assert_tiles_hold(q, scale_inv, ref, fp8_dtype, slack=1e-5):
    """Each element of q * scale_inv is ref (float64) rounded to its tile's FP8 grid: within half a step (plus a
    slack for the float32 math the kernels use: relative, and absolute where float32 cancels, as GELU's 1 + tanh
    near -1, ~2**-24 of the largest value)."""
    rows, cols = q.shape
    s = expand_scales(scale_inv.cpu(), rows, cols, 1).double()
    deq = q.cpu().double() * s
    rel, absolute = HALF_STEP[fp8_dtype]
    err = (deq - ref).abs()
    bound = (rel + slack) * ref.abs() + absolute * s + 2.0**-22 * ref.abs().max() + 1e-30
    assert (err <= bound).all(), f"worst error / bound {(err / bound).max().item():.3f}"


def _bytes(t):
    """FP8 tensors as uint8 (torch.equal has no float8 kernel), others as they are."""
    return t.view(torch.uint8) if t.dtype in (E4M3, E5M2) else t


def _norm64(x, weight, bias, layernorm, eps, zero_centered_gamma):
    x = x.double()
    mean = x.mean(dim=1) if layernorm else torch.zeros(x.shape[0], dtype=torch.float64)
    xc = x - mean[:, None]
    rstd = 1.0 / torch.sqrt((xc * xc).mean(dim=1) + eps)
    gamma = weight.double() + (1.0 if zero_centered_gamma else 0.0)
    y = xc * rstd[:, None] * gamma
    return (y + bias.double() if bias is not None else y), mean, rstd


def _dact64(dy, x, activation):
    dy, x = dy.double(), x.double()
    if activation == "gelu":
        k, c = (2.0 / torch.pi) ** 0.5, 0.044715
        t = torch.tanh(k * (x + c * x**3))
        return dy * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * c * x * x))
    if activation == "relu":
        return torch.where(x > 0, dy, torch.zeros_like(dy))
    gate, up = x.chunk(2, dim=1)
    sig = torch.sigmoid(gate)
    return torch.cat([dy * up * sig * (1 + gate * (1 - sig)), dy * gate * sig], dim=1)


NORM_CASES = [  # (shape, normalization, with bias, zero_centered_gamma)
    ((7, 33), "LayerNorm", True, False), ((130, 256), "LayerNorm", False, True), ((129, 300), "RMSNorm", False, False),
    ((256, 384), "RMSNorm", False, True), ((1, 1), "LayerNorm", True, False),
]


def _norm_inputs(shape, normalization, with_bias, dtype, device="cpu", weight_dtype=None):
    weight_dtype = weight_dtype or dtype
    x = _data(shape, dtype, device)
    weight = (torch.rand(shape[1], dtype=torch.float64) + 0.5).to(weight_dtype).to(device)
    bias = (torch.randn(shape[1], dtype=torch.float64) * 0.1).to(weight_dtype).to(device) if with_bias else None
    return x, weight, bias


# ---------------------------------------------------------------- CPU reference vs float64


@pytest.mark.parametrize("shape,normalization,with_bias,zero_centered", NORM_CASES)
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_norm_block_cast_matches_float64(shape, normalization, with_bias, zero_centered, fp8_dtype):
    x, weight, bias = _norm_inputs(shape, normalization, with_bias, torch.float32)
    q, s, qt, st, mean, rstd = tfp8.norm_block_cast(x, weight, bias, normalization, 1e-5, zero_centered, fp8_dtype,
                                                    True, True)
    y, mean64, rstd64 = _norm64(x, weight, bias, normalization == "LayerNorm", 1e-5, zero_centered)
    assert q.shape == shape and qt.shape == shape[::-1] and q.dtype == qt.dtype == fp8_dtype
    _assert_tiles_hold(q, s, y, fp8_dtype)
    _assert_tiles_hold(qt, st, y.t(), fp8_dtype)  # the transposed copy: its own 1x128 tiles along M
    torch.testing.assert_close(rstd.double(), rstd64, rtol=1e-5, atol=0)
    if normalization == "LayerNorm":
        torch.testing.assert_close(mean.double(), mean64, rtol=1e-5, atol=1e-6)
    else:
        assert mean.numel() == 0


def test_norm_block_cast_is_norm_then_cast():
    """The fused op = layernorm_fwd's float32 output cast by block_cast (the same float32 math on the CPU), with the
    same statistics; the scales power-of-2 or not."""
    x, weight, bias = _norm_inputs((96, 640), "LayerNorm", True, torch.float32)
    y, mean, rstd = tfp8.layernorm_fwd(x, weight, bias, 1e-6)
    for power_2 in (True, False):
        fused = tfp8.norm_block_cast(x, weight, bias, "LayerNorm", 1e-6, False, E4M3, True, True, 0.0, power_2)
        unfused = tfp8.block_cast(y, E4M3, 1, True, True, 0.0, power_2)
        for a, b in zip(fused[:4], unfused):
            assert torch.equal(_bytes(a), _bytes(b))
        assert torch.equal(fused[4], mean) and torch.equal(fused[5], rstd)


def test_norm_block_cast_rowwise_or_transpose_only():
    x, weight, _ = _norm_inputs((64, 256), "RMSNorm", False, torch.bfloat16)
    full = tfp8.norm_block_cast(x, weight, None, "RMSNorm", 1e-5, False, E4M3, True, True)
    q, s, qt, st, _, rstd = tfp8.norm_block_cast(x, weight, None, "RMSNorm", 1e-5, False, E4M3, True, False)
    assert torch.equal(q.view(torch.uint8), full[0].view(torch.uint8)) and qt.numel() == 0 and st.numel() == 0
    q, s, qt, st, _, _ = tfp8.norm_block_cast(x, weight, None, "RMSNorm", 1e-5, False, E4M3, False, True)
    assert q.numel() == 0 and s.numel() == 0 and torch.equal(st, full[3]) and torch.equal(rstd, full[5])


DACT_CASES = [("gelu", (7, 66)), ("relu", (130, 256)), ("swiglu", (129, 2 * 200)), ("swiglu", (256, 2 * 384)),
              ("swiglu", (5, 2 * 3)), ("gelu", (300, 128))]


def _dact_inputs(activation, shape, dtype, device="cpu"):
    x = _data(shape, dtype, device, spread=1)
    f = shape[1] // 2 if activation == "swiglu" else shape[1]
    return _data((shape[0], f), dtype, device), x


@pytest.mark.parametrize("activation,shape", DACT_CASES)
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_dact_block_cast_matches_float64(activation, shape, fp8_dtype):
    dy, x = _dact_inputs(activation, shape, torch.float32)
    q, s, qt, st, dbias = tfp8.dact_block_cast(dy, x, activation, fp8_dtype, True, True, compute_dbias=True)
    ref = _dact64(dy, x, activation)
    assert q.shape == shape and qt.shape == shape[::-1]
    _assert_tiles_hold(q, s, ref, fp8_dtype)
    _assert_tiles_hold(qt, st, ref.t(), fp8_dtype)
    assert dbias.dtype == dy.dtype
    torch.testing.assert_close(dbias.double(), ref.sum(dim=0), rtol=1e-5, atol=1e-5 * ref.abs().sum(dim=0).max())
    assert tfp8.dact_block_cast(dy, x, activation, fp8_dtype)[4].numel() == 0


def test_dact_block_cast_is_activation_bwd_then_cast():
    dy, x = _dact_inputs("swiglu", (64, 512), torch.float32)
    fused = tfp8.dact_block_cast(dy, x, "swiglu", E5M2, True, True, compute_dbias=True)
    d_input = tfp8.activation_bwd(dy, x, "swiglu")
    unfused = tfp8.block_cast(d_input, E5M2, 1, True, True)
    torch.testing.assert_close(fused[4], d_input.sum(dim=0))
    assert torch.equal(fused[0].view(torch.uint8), unfused[0].view(torch.uint8))
    assert torch.equal(fused[2].view(torch.uint8), unfused[2].view(torch.uint8))
    assert torch.equal(fused[1], unfused[1]) and torch.equal(fused[3], unfused[3])


# ---------------------------------------------------------------- opcheck and bad input


def opcheck_cases(device):
    x, weight, bias = _norm_inputs((40, 160), "LayerNorm", True, torch.bfloat16, device)
    dy, xs = _dact_inputs("swiglu", (40, 320), torch.bfloat16, device)
    dy_g, xg = _dact_inputs("gelu", (40, 160), torch.float32, device)
    return [
        (tfp8.norm_block_cast.default, (x, weight, bias, "LayerNorm", 1e-5, False, E4M3), {"transpose": True}),
        (tfp8.norm_block_cast.default, (x.float(), weight.float(), None, "RMSNorm", 1e-6, True, E5M2),
         {"power_2_scale": False}),
        (tfp8.dact_block_cast.default, (dy, xs, "swiglu", E5M2), {"transpose": True, "compute_dbias": True}),
        (tfp8.dact_block_cast.default, (dy_g, xg, "gelu", E4M3), {"rowwise": False, "transpose": True}),
    ]


@pytest.mark.parametrize("case", range(4))
def test_opcheck_cpu(case):
    op, args, kwargs = opcheck_cases("cpu")[case]
    torch.library.opcheck(op, args, kwargs, test_utils=OPCHECK_UTILS)


def bad_calls(device):
    """(match, callable): each call must raise an error naming the argument."""
    x, weight, bias = _norm_inputs((32, 128), "LayerNorm", True, torch.bfloat16, device)
    dy, xs = _dact_inputs("swiglu", (32, 256), torch.bfloat16, device)
    norm = tfp8.norm_block_cast
    return [
        ("normalization: expected", lambda: norm(x, weight, bias, "BatchNorm", 1e-5, False, E4M3)),
        ("bias: RMSNorm takes no bias", lambda: norm(x, weight, bias, "RMSNorm", 1e-5, False, E4M3)),
        ("weight: expected shape", lambda: norm(x, weight[:64], None, "RMSNorm", 1e-5, False, E4M3)),
        ("weight: expected dtype", lambda: norm(x, weight.half(), None, "RMSNorm", 1e-5, False, E4M3)),
        ("input: expected a 2-D", lambda: norm(x[0], weight, None, "RMSNorm", 1e-5, False, E4M3)),
        ("fp8_dtype: expected", lambda: norm(x, weight, None, "RMSNorm", 1e-5, False, torch.bfloat16)),
        ("eps: expected a finite", lambda: norm(x, weight, None, "RMSNorm", -1.0, False, E4M3)),
        ("activation: expected one of", lambda: tfp8.dact_block_cast(dy, xs, "tanh", E4M3)),
        ("grad_out: expected shape", lambda: tfp8.dact_block_cast(dy[:, :64].contiguous(), xs, "swiglu", E4M3)),
        ("grad_out: expected dtype", lambda: tfp8.dact_block_cast(dy.float(), xs, "swiglu", E4M3)),
        ("swiglu expects an even", lambda: tfp8.dact_block_cast(dy, xs[:, :255].contiguous(), "swiglu", E4M3)),
        ("input: expected a contiguous", lambda: tfp8.dact_block_cast(dy, xs.t(), "gelu", E4M3)),
    ]


@pytest.mark.parametrize("case", range(12))
def test_bad_inputs_cpu(case):
    match, call = bad_calls("cpu")[case]
    with pytest.raises(BAD, match=match):
        call()


# ---------------------------------------------------------------- CUDA kernels vs the CPU reference


def _assert_close_to_cpu(cuda, cpu, fp8_dtype, max_differing=0.01):
    """The CUDA casts against the CPU reference's: the kernels' float32 math (summation order of the statistics,
    expf / tanhf) may differ from torch's in the last bits, so a few values may round to the neighbouring FP8 value
    and a few power-of-2 tile scales may differ: values within one FP8 step, almost all bytes and scales equal."""
    step = {E4M3: 2.0**-3, E5M2: 2.0**-2}[fp8_dtype]
    for (q, s), (q_ref, s_ref) in (((cuda[0], cuda[1]), cpu[:2]), ((cuda[2], cuda[3]), cpu[2:4])):
        assert q.shape == q_ref.shape and s.shape == s_ref.shape
        assert (s.cpu() != s_ref).float().mean().item() <= max_differing
        out = tfp8.block_dequantize(q, s, 1, torch.float32).cpu()
        ref = tfp8.block_dequantize(q_ref, s_ref, 1, torch.float32)
        assert ((out - ref).abs() <= step * ref.abs() + 1e-6 * ref.abs().max()).all()
        assert (q.cpu().view(torch.uint8) != q_ref.view(torch.uint8)).float().mean().item() <= max_differing


@pytest.mark.gpu
@pytest.mark.parametrize("shape,normalization,with_bias,zero_centered",
                         NORM_CASES + [((4096, 2048), "RMSNorm", False, False), ((1000, 4096), "LayerNorm", True,
                                                                                 False), ((300, 1000), "RMSNorm",
                                                                                          False, True)])
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("weight_float32", [False, True])
def test_norm_block_cast_cuda_matches_cpu(shape, normalization, with_bias, zero_centered, dtype, weight_float32):
    x, weight, bias = _norm_inputs(shape, normalization, with_bias, dtype,
                                   weight_dtype=torch.float32 if weight_float32 else dtype)
    cpu = tfp8.norm_block_cast(x, weight, bias, normalization, 1e-5, zero_centered, E4M3, True, True)
    cuda = tfp8.norm_block_cast(x.cuda(), weight.cuda(), None if bias is None else bias.cuda(), normalization, 1e-5,
                                zero_centered, E4M3, True, True)
    _assert_close_to_cpu(cuda, cpu, E4M3)
    torch.testing.assert_close(cuda[5].cpu(), cpu[5], rtol=1e-5, atol=0)
    if normalization == "LayerNorm":
        torch.testing.assert_close(cuda[4].cpu(), cpu[4], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("activation,shape", DACT_CASES + [("swiglu", (2048, 2 * 4096)), ("gelu", (1000, 4096)),
                                                           ("swiglu", (100, 2 * 130))])
@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_dact_block_cast_cuda_matches_cpu(activation, shape, dtype):
    dy, x = _dact_inputs(activation, shape, dtype)
    cpu = tfp8.dact_block_cast(dy, x, activation, E5M2, True, True, compute_dbias=True)
    cuda = tfp8.dact_block_cast(dy.cuda(), x.cuda(), activation, E5M2, True, True, compute_dbias=True)
    _assert_close_to_cpu(cuda, cpu, E5M2)
    # dbias: float32 sums in another order (per 128-row tile, then over tiles), rounded to dtype
    d_input = tfp8.activation_bwd(dy.float(), x.float(), activation).double()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(cuda[4].cpu().double(), d_input.sum(dim=0), rtol=tol,
                               atol=tol * d_input.abs().sum(dim=0).max().item())
    only_dbias = tfp8.dact_block_cast(dy.cuda(), x.cuda(), activation, E5M2, False, False, compute_dbias=True)
    assert torch.equal(only_dbias[4], cuda[4])


@pytest.mark.gpu
def test_dact_block_cast_cuda_unaligned_rows():
    """A SwiGLU width f that is not a multiple of 4 takes the element-wise path (a lane's 4 columns may straddle the
    gate | up boundary), and an offset input pointer the guarded loads."""
    dy, x = _dact_inputs("swiglu", (70, 2 * 131), torch.bfloat16)
    cpu = tfp8.dact_block_cast(dy, x, "swiglu", E4M3, True, True)
    _assert_close_to_cpu(tfp8.dact_block_cast(dy.cuda(), x.cuda(), "swiglu", E4M3, True, True), cpu, E4M3)


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(4))
def test_opcheck_cuda(case):
    op, args, kwargs = opcheck_cases("cuda")[case]
    torch.library.opcheck(op, args, kwargs, test_utils=OPCHECK_UTILS)


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(12))
def test_bad_inputs_cuda(case):
    match, call = bad_calls("cuda")[case]
    with pytest.raises(BAD, match=match):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(128, 2 * 128), (384, 2 * 640), (2048, 2 * 4096)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("rowwise,transpose", [(True, True), (True, False), (False, True)])
def test_dact_swiglu_wide_kernel_matches_generic(monkeypatch, shape, dtype, fp8_dtype, rowwise, transpose):
    """The wide d(SwiGLU) kernel (m, f multiples of 128, 16-bit, no dbias) writes the very bytes and scales of the
    generic block cast kernel (TFP8_BLOCK_WIDE=0), and both stay close to the CPU reference."""
    dy, x = _dact_inputs("swiglu", shape, dtype, "cuda")
    dy = dy * torch.logspace(-3, 3, shape[0], device="cuda", dtype=dtype)[:, None]  # rows of very different amax
    wide = tfp8.dact_block_cast(dy, x, "swiglu", fp8_dtype, rowwise, transpose)
    monkeypatch.setenv("TFP8_BLOCK_WIDE", "0")
    generic = tfp8.dact_block_cast(dy, x, "swiglu", fp8_dtype, rowwise, transpose)
    for a, b in zip(wide[:4], generic[:4]):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a.view(torch.uint8) if a.dtype == fp8_dtype else a,
                           b.view(torch.uint8) if b.dtype == fp8_dtype else b)
    if rowwise and transpose:
        assert wide[0].view(torch.uint8).any() and wide[2].view(torch.uint8).any()  # (not all zeros)
        _assert_close_to_cpu(wide, tfp8.dact_block_cast(dy.cpu(), x.cpu(), "swiglu", fp8_dtype, True, True),
                             fp8_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("normalization,with_bias", [("RMSNorm", False), ("LayerNorm", True), ("LayerNorm", False)])
@pytest.mark.parametrize("weight_float32", [False, True])
@pytest.mark.parametrize("rowwise,transpose", [(True, True), (True, False), (False, True)])
def test_norm_block_cast_wide_kernel_matches_generic(monkeypatch, normalization, with_bias, weight_float32, rowwise,
                                                     transpose):
    """The fused norm cast on the wide kernel (interior 16-bit problems) writes the very bytes, scales and statistics
    of the generic kernel (TFP8_BLOCK_WIDE=0)."""
    x, weight, bias = _norm_inputs((384, 2048), normalization, with_bias, torch.bfloat16,
                                   weight_dtype=torch.float32 if weight_float32 else torch.bfloat16)
    x, weight = x.cuda(), weight.cuda()
    bias = None if bias is None else bias.cuda()
    args = (x, weight, bias, normalization, 1e-5, False, E4M3, rowwise, transpose)
    wide = tfp8.norm_block_cast(*args)
    monkeypatch.setenv("TFP8_BLOCK_WIDE", "0")
    generic = tfp8.norm_block_cast(*args)
    for a, b in zip(wide, generic):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a.view(torch.uint8) if a.dtype == E4M3 else a, b.view(torch.uint8) if b.dtype == E4M3 else b)
    assert wide[0 if rowwise else 2].view(torch.uint8).any()
