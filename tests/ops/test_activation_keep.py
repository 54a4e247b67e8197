"""activation_fwd_keep_input / dact_cast_transpose_kept_input: the activation's input kept in E4M3 1x128 tiles for
the backward. CPU reference vs float64 PyTorch (tile by tile), CUDA vs the CPU reference, opcheck, bad inputs."""
import pytest
import torch

import transformer_fp8  # noqa: F401  (registers the ops)
from tests.ops.test_activation import ACTIVATIONS, ref_backward, ref_forward
from tests.utils import FP8_RTOL, assert_close_rel, scalar
from transformer_fp8.cpu.activation import KEEP_TILE, dequantize_kept_input

ops = torch.ops.transformer_fp8
E4M3_TILE_RTOL = 0.04  # E4M3 (3 mantissa bits, 2**-4 relative at most) with each tile scaled to its own amax
SHAPES = {"gelu": ((6, 128), (3, 4, 256)), "relu": ((5, 384),), "swiglu": ((6, 256), (3, 2, 512), (1, 768))}


def random_input(shape, dtype=torch.bfloat16, device="cpu"):
    """Values over several orders of magnitude from tile to tile, so that one scale per tensor would not do."""
    x = torch.randn(shape, device=device) * 2
    tile_scale = 10.0 ** torch.randint(-3, 3, (*shape[:-1], shape[-1] // KEEP_TILE, 1), device=device).float()
    return (x.reshape(*shape[:-1], -1, KEEP_TILE) * tile_scale).reshape(shape).to(dtype)


def ref_tiles(x):
    """float64 (values, tile scale_inv): each 128-value tile scaled to [-448, 448] by its own amax."""
    tiles = x.double().reshape(*x.shape[:-1], x.shape[-1] // KEEP_TILE, KEEP_TILE)
    amax = tiles.abs().amax(dim=-1)
    return tiles, torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))


def cases():
    return [(a, s) for a in ACTIVATIONS for s in SHAPES[a]]


@pytest.mark.parametrize("activation,shape", cases())
@pytest.mark.parametrize("fp8_dtype", (torch.float8_e4m3fn, torch.float8_e5m2))
def test_keep_input_matches_float64(activation, shape, fp8_dtype):
    x = random_input(shape)
    amax, scale_inv = scalar(0.0), scalar(0.0)
    out, kept, kept_scale_inv = ops.activation_fwd_keep_input(x, activation, scalar(2.0), fp8_dtype, amax, scale_inv)
    plain = ops.activation_fwd(x, activation, scalar(2.0), fp8_dtype)
    assert torch.equal(out.view(torch.uint8), plain.view(torch.uint8))  # the output is activation_fwd's
    y = ref_forward(x, activation)
    assert amax.item() == pytest.approx(y.abs().max().item(), rel=1e-6) and scale_inv.item() == 0.5
    tiles, ref_scale_inv = ref_tiles(x)
    assert kept.dtype == torch.float8_e4m3fn and kept.shape == x.shape
    assert kept_scale_inv.shape == (*shape[:-1], shape[-1] // KEEP_TILE)
    torch.testing.assert_close(kept_scale_inv.double(), ref_scale_inv, rtol=1e-6, atol=0)
    assert kept.float().abs().amax() <= 448.0
    assert_close_rel(dequantize_kept_input(kept, kept_scale_inv, torch.float32), tiles.reshape(x.shape),
                     E4M3_TILE_RTOL, "kept input")


def test_keep_input_all_zero_tile_and_ties_round_to_even():
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    x[1, :128] = 448.0  # one tile whose amax maps to 448 exactly: scale 1
    x[1, 1] = 1.0625  # halfway between the E4M3 values 1.0 and 1.125: rounds to even, 1.0
    _, kept, kept_scale_inv = ops.activation_fwd_keep_input(x, "gelu", scalar(1.0), torch.float8_e4m3fn)
    assert kept_scale_inv[0].tolist() == [1.0, 1.0] and kept[0].float().abs().max() == 0
    assert kept[1, 1].float().item() == 1.0 and kept[1, 0].float().item() == 448.0


@pytest.mark.parametrize("activation,shape", [(a, s) for a, s in cases() if len(s) == 2])
@pytest.mark.parametrize("fp8_dtype", (torch.float8_e4m3fn, torch.float8_e5m2))
def test_dact_from_kept_input_matches_float64(activation, shape, fp8_dtype):
    x = random_input(shape)
    _, kept, kept_scale_inv = ops.activation_fwd_keep_input(x, activation, scalar(1.0), torch.float8_e4m3fn)
    f_out = shape[-1] // 2 if activation == "swiglu" else shape[-1]
    dy = torch.randn(shape[0], f_out, dtype=torch.bfloat16)
    exact = ref_backward(dy, x, activation)  # from the 16-bit input: the kept copy's error included
    scale = 2.0 ** torch.floor(torch.log2(0.5 * torch.finfo(fp8_dtype).max / exact.abs().max())).item()  # no saturation
    amax, scale_inv = scalar(0.0), scalar(0.0)
    q, qt, dbias = ops.dact_cast_transpose_kept_input(dy, kept, kept_scale_inv, activation, scalar(scale), fp8_dtype,
                                                      amax, scale_inv, True)
    assert_close_rel(q.double() / scale, exact, FP8_RTOL[fp8_dtype] + E4M3_TILE_RTOL, "d(input)")
    assert torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8)) and scale_inv.item() == 1 / scale
    from_kept = ref_backward(dy, dequantize_kept_input(kept, kept_scale_inv, torch.float64), activation)
    assert_close_rel(q.double() / scale, from_kept, FP8_RTOL[fp8_dtype], "d(input) from the kept values")
    assert_close_rel(dbias, from_kept.sum(0), 1e-2, "dbias")
    assert amax.item() == pytest.approx(from_kept.abs().max().item(), rel=1e-5)


def opcheck_args(activation, device):
    x = random_input(SHAPES[activation][0], device=device)
    f_out = x.shape[-1] // 2 if activation == "swiglu" else x.shape[-1]
    _, kept, kept_scale_inv = ops.activation_fwd_keep_input(x, activation, scalar(1.0, device), torch.float8_e4m3fn)
    dy = torch.randn(x.shape[0], f_out, dtype=x.dtype, device=device)
    return [("activation_fwd_keep_input", (x, activation, scalar(1.0, device), torch.float8_e4m3fn,
                                           scalar(0.0, device), scalar(0.0, device))),
            ("dact_cast_transpose_kept_input", (dy, kept, kept_scale_inv, activation, scalar(2.0, device),
                                                torch.float8_e5m2, scalar(0.0, device), scalar(0.0, device), True))]


# opcheck's test_schema compares inputs with torch.allclose, which has no float8 kernel: skipped for the FP8 input.
FP8_INPUT_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def run_opcheck(activation, device):
    for name, args in opcheck_args(activation, device):
        utils = FP8_INPUT_UTILS if name == "dact_cast_transpose_kept_input" else None
        kwargs = {} if utils is None else {"test_utils": utils}
        torch.library.opcheck(getattr(ops, name).default, args, **kwargs)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_opcheck_cpu(activation):
    run_opcheck(activation, "cpu")


BAD = [
    (lambda d: ops.activation_fwd_keep_input(torch.randn(4, 128, device=d), "gelu", scalar(1.0, d),
                                             torch.float8_e4m3fn), "float16 or bfloat16"),
    (lambda d: ops.activation_fwd_keep_input(torch.randn(4, 192, dtype=torch.bfloat16, device=d), "swiglu",
                                             scalar(1.0, d), torch.float8_e4m3fn), "multiple of 128"),
    (lambda d: ops.dact_cast_transpose_kept_input(torch.randn(4, 128, dtype=torch.bfloat16, device=d),
                                                  torch.zeros(4, 128, dtype=torch.bfloat16, device=d),
                                                  torch.ones(4, 1, device=d), "gelu", scalar(1.0, d),
                                                  torch.float8_e4m3fn), "kept_input"),
    (lambda d: ops.dact_cast_transpose_kept_input(torch.randn(4, 128, dtype=torch.bfloat16, device=d),
                                                  torch.zeros(4, 128, dtype=torch.float8_e4m3fn, device=d),
                                                  torch.ones(4, 2, device=d), "gelu", scalar(1.0, d),
                                                  torch.float8_e4m3fn), "kept_scale_inv"),
    (lambda d: ops.dact_cast_transpose_kept_input(torch.randn(4, 64, dtype=torch.bfloat16, device=d),
                                                  torch.zeros(4, 256, dtype=torch.float8_e4m3fn, device=d),
                                                  torch.ones(4, 2, device=d), "swiglu", scalar(1.0, d),
                                                  torch.float8_e4m3fn), "grad_out"),
]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("call,match", BAD)
def test_bad_inputs_raise(device, call, match):
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        call(device)


# -------------------------------------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("activation,shape", cases() + [("swiglu", (8192, 16384)), ("gelu", (333, 4096))])
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_cuda_keep_input_matches_cpu(activation, shape, dtype):
    x = random_input(shape, dtype, "cuda")
    amax, scale_inv = scalar(0.0, "cuda"), scalar(0.0, "cuda")
    out, kept, kept_scale_inv = ops.activation_fwd_keep_input(x, activation, scalar(2.0, "cuda"),
                                                              torch.float8_e4m3fn, amax, scale_inv)
    plain_amax = scalar(0.0, "cuda")
    plain = ops.activation_fwd(x, activation, scalar(2.0, "cuda"), torch.float8_e4m3fn, plain_amax)
    assert torch.equal(out.view(torch.uint8), plain.view(torch.uint8)) and torch.equal(amax, plain_amax)
    ref_kept, ref_scale_inv = ops.activation_fwd_keep_input(x.cpu(), activation, scalar(2.0), torch.float8_e4m3fn)[1:]
    torch.testing.assert_close(kept_scale_inv.cpu(), ref_scale_inv, rtol=1e-6, atol=0)
    different = (kept.cpu().view(torch.uint8) != ref_kept.view(torch.uint8)).sum().item()
    assert different <= kept.numel() * 1e-4, f"{different} of {kept.numel()} kept bytes differ"  # (ties)
    assert scale_inv.item() == 0.5


@pytest.mark.gpu
@pytest.mark.parametrize("activation,shape", [(a, s) for a, s in cases() if len(s) == 2] +
                         [("swiglu", (4096, 8192)), ("swiglu", (260, 512)), ("gelu", (200, 384))])
def test_cuda_dact_from_kept_input_matches_cpu(activation, shape):
    x = random_input(shape, torch.bfloat16, "cuda")
    _, kept, kept_scale_inv = ops.activation_fwd_keep_input(x, activation, scalar(1.0, "cuda"), torch.float8_e4m3fn)
    f_out = shape[-1] // 2 if activation == "swiglu" else shape[-1]
    dy = torch.randn(shape[0], f_out, dtype=torch.bfloat16, device="cuda")
    amax, scale_inv = scalar(0.0, "cuda"), scalar(0.0, "cuda")
    q, qt, dbias = ops.dact_cast_transpose_kept_input(dy, kept, kept_scale_inv, activation, scalar(8.0, "cuda"),
                                                      torch.float8_e5m2, amax, scale_inv, True)
    ref_amax = scalar(0.0)
    ref_q, _, ref_dbias = ops.dact_cast_transpose_kept_input(dy.cpu(), kept.cpu(), kept_scale_inv.cpu(), activation,
                                                             scalar(8.0), torch.float8_e5m2, ref_amax, None, True)
    assert_close_rel(q.cpu().double(), ref_q.double(), 0.02, "d(input)")
    assert torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))
    assert_close_rel(dbias.cpu(), ref_dbias, 2e-2, "dbias")
    assert amax.item() == pytest.approx(ref_amax.item(), rel=1e-3) and scale_inv.item() == 0.125


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_opcheck_cuda(activation):
    run_opcheck(activation, "cuda")
