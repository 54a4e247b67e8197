"""activation_fwd / activation_bwd / dact_cast_transpose: CPU reference vs float64 PyTorch, CUDA vs CPU reference."""
import pytest
import torch
import torch.nn.functional as F

import transformer_fp8  # noqa: F401  (registers the ops)
from tests.utils import FP8_DTYPES, FP8_RTOL, assert_close_rel, rel_error, scalar

ops = torch.ops.transformer_fp8
ACTIVATIONS = ("gelu", "relu", "swiglu")
# One rounding of the output to the input's dtype (bf16: 2**-9 relative), float32: a few ulps of float32 math.
HP_RTOL = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}
# CUDA vs the CPU reference: float32 ulps of tanh/exp, which flip a rare rounding to bf16/fp16.
CUDA_VS_CPU_RTOL = {torch.float32: 1e-6, torch.bfloat16: 2e-3, torch.float16: 2.5e-4}
SHAPES = ((7, 32), (3, 5, 64), (1, 130), (33, 18))
SCALES = (0.5, 1.0, 8.0)


def ref_forward(x, activation):
    """float64 activation with plain PyTorch."""
    x = x.double()
    if activation == "gelu":
        return F.gelu(x, approximate="tanh")
    if activation == "relu":
        return F.relu(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def ref_backward(dy, x, activation):
    """float64 d(input) by autograd through ref_forward."""
    x = x.double().requires_grad_(True)
    ref_forward(x, activation).backward(dy.double())
    return x.grad


def random_pair(shape, activation, dtype, device="cpu"):
    """(grad_out, input) with input [..., F_in] and grad_out [..., F_out]."""
    x = torch.randn(shape, dtype=dtype, device=device) * 2
    f_out = shape[-1] // 2 if activation == "swiglu" else shape[-1]
    dy = torch.randn((*shape[:-1], f_out), dtype=dtype, device=device)
    return dy, x


def dequantize(q, scale):
    return q.double() / scale


# ----------------------------------------------------------------------------------------------------- CPU reference
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("shape", SHAPES)
def test_fwd_high_precision_matches_float64(activation, dtype, shape):
    x = torch.randn(shape, dtype=dtype) * 2
    y = ops.activation_fwd(x, activation)
    assert y.dtype == dtype and y.shape == (*shape[:-1], shape[-1] // 2 if activation == "swiglu" else shape[-1])
    assert_close_rel(y, ref_forward(x, activation), HP_RTOL[dtype])


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("scale_value", SCALES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fwd_fp8_matches_float64(activation, fp8_dtype, scale_value, shape):
    x = torch.randn(shape, dtype=torch.bfloat16) * 2
    scale, amax, scale_inv = scalar(scale_value), scalar(0.0), scalar(-1.0)
    q = ops.activation_fwd(x, activation, scale, fp8_dtype, amax, scale_inv)
    ref = ref_forward(x, activation)
    assert q.dtype == fp8_dtype
    assert_close_rel(dequantize(q, scale_value), ref, FP8_RTOL[fp8_dtype])
    assert amax.item() == pytest.approx(ref.abs().max().item(), rel=1e-6)
    assert scale_inv.item() == 1.0 / scale_value


def test_fwd_fp8_saturates_and_keeps_larger_amax():
    x = torch.tensor([[-1000.0, 3.0, 1000.0, 0.0]])
    amax = scalar(5000.0)
    q = ops.activation_fwd(x, "relu", scalar(1.0), torch.float8_e4m3fn, amax)
    assert q.float().tolist() == [[0.0, 3.0, 448.0, 0.0]]
    assert amax.item() == 5000.0


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("shape", SHAPES)
def test_bwd_matches_float64(activation, dtype, shape):
    dy, x = random_pair(shape, activation, dtype)
    dx = ops.activation_bwd(dy, x, activation)
    assert dx.dtype == dtype and dx.shape == x.shape
    assert_close_rel(dx, ref_backward(dy, x, activation), 4 * HP_RTOL[dtype])


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("scale_value", SCALES)
@pytest.mark.parametrize("m,f_in", ((7, 32), (33, 18), (1, 130)))
def test_dact_cast_transpose_matches_float64(activation, fp8_dtype, scale_value, m, f_in):
    dy, x = random_pair((m, f_in), activation, torch.bfloat16)
    scale, amax, scale_inv = scalar(scale_value), scalar(0.0), scalar(0.0)
    q, qt, dbias = ops.dact_cast_transpose(dy, x, activation, scale, fp8_dtype, amax, scale_inv, compute_dbias=True)
    ref = ref_backward(dy, x, activation)
    assert q.shape == (m, f_in) and qt.shape == (f_in, m) and q.dtype == qt.dtype == fp8_dtype
    assert_close_rel(dequantize(q, scale_value), ref, FP8_RTOL[fp8_dtype])
    assert torch.equal(qt.view(torch.uint8), q.t().view(torch.uint8))
    assert dbias.dtype == torch.bfloat16
    assert_close_rel(dbias, ref.sum(dim=0), 8e-3, "dbias")
    assert amax.item() == pytest.approx(ref.abs().max().item(), rel=1e-5)
    assert scale_inv.item() == 1.0 / scale_value


def test_dact_cast_transpose_without_dbias_returns_empty():
    dy, x = random_pair((4, 16), "gelu", torch.bfloat16)
    _, _, dbias = ops.dact_cast_transpose(dy, x, "gelu", scalar(1.0), torch.float8_e5m2)
    assert dbias.numel() == 0


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_dact_cast_transpose_without_transpose(activation):
    dy, x = random_pair((40, 24), activation, torch.bfloat16)
    amax, amax_both = scalar(0.0), scalar(0.0)
    q, qt, dbias = ops.dact_cast_transpose(dy, x, activation, scalar(2.0), torch.float8_e4m3fn, amax, None, True, False)
    q_both, _, dbias_both = ops.dact_cast_transpose(dy, x, activation, scalar(2.0), torch.float8_e4m3fn, amax_both,
                                                    None, True)
    assert qt.numel() == 0 and torch.equal(q.view(torch.uint8), q_both.view(torch.uint8))
    assert torch.equal(dbias, dbias_both) and torch.equal(amax, amax_both)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_empty_tensors(activation):
    dy, x = random_pair((0, 8), activation, torch.bfloat16)
    amax = scalar(0.0)
    assert ops.activation_fwd(x, activation, scalar(1.0), torch.float8_e4m3fn, amax).shape == dy.shape
    assert ops.activation_bwd(dy, x, activation).shape == x.shape
    q, qt, dbias = ops.dact_cast_transpose(dy, x, activation, scalar(1.0), torch.float8_e4m3fn, amax,
                                           compute_dbias=True)
    assert q.shape == (0, 8) and qt.shape == (8, 0) and dbias.tolist() == [0.0] * 8
    assert amax.item() == 0.0


def opcheck_args(activation, device):
    dy, x = random_pair((6, 16), activation, torch.bfloat16, device)
    s = lambda v: scalar(v, device)  # noqa: E731
    return [
        ("activation_fwd", (x, activation)),
        ("activation_fwd", (x, activation, s(2.0), torch.float8_e4m3fn, s(0.0), s(0.0))),
        ("activation_bwd", (dy, x, activation)),
        ("dact_cast_transpose", (dy, x, activation, s(2.0), torch.float8_e5m2, s(0.0), s(0.0), True)),
    ]


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_opcheck_cpu(activation):
    for name, args in opcheck_args(activation, "cpu"):
        torch.library.opcheck(getattr(ops, name).default, args)


@pytest.mark.parametrize("call,match", [
    (lambda x, dy: ops.activation_fwd(x, "geglu"), "activation: expected one of"),
    (lambda x, dy: ops.activation_fwd(x[:, :15].contiguous(), "swiglu"), "input: swiglu expects an even"),
    (lambda x, dy: ops.activation_fwd(x.int(), "relu"), "input: expected a float32"),
    (lambda x, dy: ops.activation_fwd(x.t(), "relu"), "input: expected a contiguous"),
    (lambda x, dy: ops.activation_fwd(x, "relu", None, torch.float8_e4m3fn), "scale: required"),
    (lambda x, dy: ops.activation_fwd(x, "relu", scalar(1.0)), "scale: given without fp8_dtype"),
    (lambda x, dy: ops.activation_fwd(x, "relu", scalar(1.0), torch.float16), "fp8_dtype: expected"),
    (lambda x, dy: ops.activation_fwd(x, "relu", scalar(1.0).double(), torch.float8_e4m3fn), "scale: expected a"),
    (lambda x, dy: ops.activation_fwd(x, "relu", scalar(1.0), torch.float8_e4m3fn, torch.zeros(2)), "amax: expected"),
    (lambda x, dy: ops.activation_bwd(dy, x, "relu"), "grad_out: expected shape"),
    (lambda x, dy: ops.activation_bwd(x.float(), x, "relu"), "grad_out: expected dtype"),
    (lambda x, dy: ops.dact_cast_transpose(dy, x[None], "swiglu", scalar(1.0), torch.float8_e4m3fn),
     "input: expected a 2-D"),
    (lambda x, dy: ops.dact_cast_transpose(dy, x, "swiglu", scalar(1.0), torch.bfloat16), "fp8_dtype: expected"),
    (lambda x, dy: ops.dact_cast_transpose(dy, x, "swish", scalar(1.0), torch.float8_e4m3fn), "activation: expected"),
])
def test_bad_inputs_raise(call, match):
    dy, x = random_pair((4, 16), "swiglu", torch.bfloat16)
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        call(x, dy)


# ----------------------------------------------------------------------------------------------------- CUDA kernels
GPU_SHAPES = ((1, 2), (33, 18), (128, 256), (257, 1000), (4, 7, 96), (300, 4098))


def assert_fp8_nearly_equal(q, q_ref, max_fraction=1e-3):
    """FP8 bytes equal except a few neighbours (float32 tanh/exp ulps may flip a rounding)."""
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape
    a, b = q.cpu().view(torch.uint8).int(), q_ref.cpu().view(torch.uint8).int()
    mismatch = a != b
    assert mismatch.float().mean().item() <= max_fraction, f"{mismatch.sum().item()} of {a.numel()} bytes differ"
    assert ((a - b).abs()[mismatch] <= 1).all(), "a byte differs by more than one FP8 step"


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_cuda_fwd_bwd_high_precision(activation, dtype, shape):
    dy, x = random_pair(shape, activation, dtype, "cuda")
    y = ops.activation_fwd(x, activation)
    y_ref = ops.activation_fwd(x.cpu(), activation)
    assert rel_error(y.cpu(), y_ref) <= CUDA_VS_CPU_RTOL[dtype]
    assert_close_rel(y.cpu(), ref_forward(x.cpu(), activation), HP_RTOL[dtype])
    dx = ops.activation_bwd(dy, x, activation)
    dx_ref = ops.activation_bwd(dy.cpu(), x.cpu(), activation)
    assert rel_error(dx.cpu(), dx_ref) <= CUDA_VS_CPU_RTOL[dtype]
    assert_close_rel(dx.cpu(), ref_backward(dy.cpu(), x.cpu(), activation), 4 * HP_RTOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("scale_value", SCALES)
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_cuda_fwd_fp8_matches_cpu(activation, fp8_dtype, scale_value, shape):
    x = torch.randn(shape, dtype=torch.bfloat16, device="cuda") * 2
    amax, scale_inv = scalar(0.25, "cuda"), scalar(0.0, "cuda")
    q = ops.activation_fwd(x, activation, scalar(scale_value, "cuda"), fp8_dtype, amax, scale_inv)
    amax_ref = scalar(0.25)
    q_ref = ops.activation_fwd(x.cpu(), activation, scalar(scale_value), fp8_dtype, amax_ref)
    assert_fp8_nearly_equal(q, q_ref)
    assert_close_rel(dequantize(q.cpu(), scale_value), ref_forward(x.cpu(), activation), FP8_RTOL[fp8_dtype])
    assert amax.item() == pytest.approx(amax_ref.item(), rel=1e-6)
    assert scale_inv.item() == 1.0 / scale_value


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
# (rows 200 / 260 / 1024 take the 8- / 4- / 16-byte transposed stores, 33 / 257 / 130 bytes; f_in 18 / 1000 / 66 /
# 4098 the element path)
@pytest.mark.parametrize("m,f_in", ((1, 2), (33, 18), (64, 128), (200, 512), (260, 512), (257, 1000), (1000, 66),
                                    (130, 4098), (1024, 256)))
def test_cuda_dact_cast_transpose_matches_cpu(activation, fp8_dtype, dtype, m, f_in):
    dy, x = random_pair((m, f_in), activation, dtype, "cuda")
    amax, scale_inv = scalar(0.0, "cuda"), scalar(0.0, "cuda")
    q, qt, dbias = ops.dact_cast_transpose(dy, x, activation, scalar(8.0, "cuda"), fp8_dtype, amax, scale_inv, True)
    amax_ref = scalar(0.0)
    q_ref, qt_ref, dbias_ref = ops.dact_cast_transpose(dy.cpu(), x.cpu(), activation, scalar(8.0), fp8_dtype, amax_ref,
                                                       None, True)
    assert_fp8_nearly_equal(q, q_ref)
    assert torch.equal(qt.cpu().view(torch.uint8), q.cpu().t().view(torch.uint8))
    ref = ref_backward(dy.cpu(), x.cpu(), activation)
    assert_close_rel(dequantize(q.cpu(), 8.0), ref, FP8_RTOL[fp8_dtype])
    assert dbias.dtype == dtype
    dbias_rtol = 1e-5 if dtype == torch.float32 else 8e-3
    assert_close_rel(dbias.cpu(), dbias_ref, dbias_rtol, "dbias vs CPU")
    assert_close_rel(dbias.cpu(), ref.sum(dim=0), dbias_rtol, "dbias")
    assert amax.item() == pytest.approx(amax_ref.item(), rel=1e-6)
    assert scale_inv.item() == 1.0 / 8.0


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_cuda_fwd_fp8_over_several_grid_strides(activation, fp8_dtype):
    """A call larger than the grid the GPU holds at once: each thread takes several steps of two chunks, the last one
    partly out of range (3001 rows: no whole number of steps)."""
    x = torch.randn(3001, 4352, dtype=torch.bfloat16, device="cuda") * 2
    amax = scalar(0.0, "cuda")
    q = ops.activation_fwd(x, activation, scalar(4.0, "cuda"), fp8_dtype, amax)
    amax_ref = scalar(0.0)
    q_ref = ops.activation_fwd(x.cpu(), activation, scalar(4.0), fp8_dtype, amax_ref)
    assert_fp8_nearly_equal(q, q_ref)
    assert amax.item() == pytest.approx(amax_ref.item(), rel=1e-5)  # (float32 ulps of the math, as above)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("m,f_in", ((33, 18), (257, 1000), (1024, 4096)))
def test_cuda_dact_cast_transpose_without_transpose(activation, m, f_in):
    dy, x = random_pair((m, f_in), activation, torch.bfloat16, "cuda")
    amax, amax_both = scalar(0.0, "cuda"), scalar(0.0, "cuda")
    q, qt, dbias = ops.dact_cast_transpose(dy, x, activation, scalar(8.0, "cuda"), torch.float8_e5m2, amax, None,
                                           True, False)
    q_both, _, dbias_both = ops.dact_cast_transpose(dy, x, activation, scalar(8.0, "cuda"), torch.float8_e5m2,
                                                    amax_both, None, True)
    assert qt.numel() == 0 and torch.equal(q.view(torch.uint8), q_both.view(torch.uint8))
    assert torch.equal(dbias, dbias_both) and torch.equal(amax, amax_both)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_cuda_empty_tensors(activation):
    dy, x = random_pair((0, 8), activation, torch.bfloat16, "cuda")
    amax, scale_inv = scalar(0.5, "cuda"), scalar(0.0, "cuda")
    assert ops.activation_fwd(x, activation, scalar(4.0, "cuda"), torch.float8_e4m3fn, amax, scale_inv).numel() == 0
    assert ops.activation_bwd(dy, x, activation).shape == x.shape
    q, qt, dbias = ops.dact_cast_transpose(dy, x, activation, scalar(4.0, "cuda"), torch.float8_e4m3fn, amax,
                                           scale_inv, True)
    assert q.shape == (0, 8) and qt.shape == (8, 0) and dbias.cpu().tolist() == [0.0] * 8
    assert amax.item() == 0.5 and scale_inv.item() == 0.25


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_opcheck_cuda(activation):
    for name, args in opcheck_args(activation, "cuda"):
        torch.library.opcheck(getattr(ops, name).default, args)


@pytest.mark.gpu
def test_cuda_rejects_mixed_devices():
    dy, x = random_pair((4, 16), "relu", torch.bfloat16, "cuda")
    with pytest.raises(RuntimeError, match="scale"):
        ops.activation_fwd(x, "relu", scalar(1.0), torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="grad_out"):
        ops.activation_bwd(dy.cpu(), x, "relu")
