"""The FP8 casts round ties to even: inputs placed exactly on the midpoint between two adjacent E4M3 (or E5M2) values,
in every binade of the format (subnormals included, and the midpoint between zero and the smallest subnormal),
positive and negative, at scale 1 and at power-of-two scales (which keep x * scale exact), must land on the
neighbour with the even code (the even last mantissa bit), as docs/numerics.md and csrc/ops.cpp promise.

The expected codes come from a float64 reference that decodes every FP8 bit pattern itself (no torch FP8
conversion involved) and breaks ties explicitly; a round-half-away-from-zero reference is shown to fail the same
check, so the check can tell the two apart. Covers `torch.ops.transformer_fp8.quantize` and `cast_transpose` on the
CPU (the reference kernels) and on CUDA (`@pytest.mark.gpu`)."""
import pytest
import torch

import transformer_fp8  # noqa: F401  (registers the CPU reference kernels)
from tests.utils import FP8_DTYPES

tfp8 = torch.ops.transformer_fp8

# (exponent bits, mantissa bits, exponent bias) of each format
LAYOUT = {torch.float8_e4m3fn: (4, 3, 7), torch.float8_e5m2: (5, 2, 15)}
HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # each holds every midpoint exactly (<= 5 significant bits)
SCALES = (1.0, 2.0 ** -3, 2.0 ** 5)  # powers of two: x = midpoint / scale and x * scale stay exact


def decode(fp8_dtype, code):
    """float64 value of a non-negative FP8 bit pattern (code < 0x80), or None for Inf/NaN patterns."""
    exp_bits, man_bits, bias = LAYOUT[fp8_dtype]
    exponent, mantissa = code >> man_bits, code & ((1 << man_bits) - 1)
    if fp8_dtype == torch.float8_e4m3fn and code == 0x7F:  # E4M3 (fn): the one NaN pattern, no Inf
        return None
    if fp8_dtype == torch.float8_e5m2 and exponent == (1 << exp_bits) - 1:  # E5M2: IEEE-style Inf and NaN
        return None
    if exponent == 0:  # subnormal
        return mantissa * 2.0 ** (1 - bias - man_bits)
    return (1 + mantissa * 2.0 ** -man_bits) * 2.0 ** (exponent - bias)


def finite_codes(fp8_dtype):
    """[(code, value)] of the non-negative finite values, increasing (codes 0, 1, 2, ...: adjacent values)."""
    out = []
    for code in range(0x80):
        value = decode(fp8_dtype, code)
        if value is not None:
            out.append((code, value))
    assert all(a[1] < b[1] for a, b in zip(out, out[1:]))
    return out


def midpoints(fp8_dtype):
    """(x float64 [n], the two neighbours' codes [n, 2] (lower magnitude first)): every midpoint between adjacent
    non-negative finite values, and its negative (codes with the sign bit 0x80)."""
    table = finite_codes(fp8_dtype)
    xs, pairs = [], []
    for (code_a, a), (code_b, b) in zip(table, table[1:]):
        xs.append((a + b) / 2)
        pairs.append((code_a, code_b))
    x = torch.tensor(xs, dtype=torch.float64)
    pairs = torch.tensor(pairs, dtype=torch.int64)
    return torch.cat([x, -x]), torch.cat([pairs, pairs | 0x80])


def round_half_even_reference(pairs):
    """The neighbour whose code is even (its last mantissa bit 0): round-to-nearest, ties to even."""
    return torch.where(pairs[:, 0] % 2 == 0, pairs[:, 0], pairs[:, 1])


def round_half_away_reference(pairs):
    """The neighbour of larger magnitude: round-to-nearest, ties away from zero (what the kernels must NOT do)."""
    return pairs[:, 1]


def check_ties(codes, x, pairs, what):
    """Assert the produced codes [n] (uint8 as int64) are the ties-to-even ones; the message lists the first misses."""
    want = round_half_even_reference(pairs)
    wrong = (codes != want).nonzero().flatten()
    misses = [f"x={x[i].item()!r}: got code {codes[i].item():#04x}, want {want[i].item():#04x}" for i in wrong[:5]]
    assert wrong.numel() == 0, f"{what}: {wrong.numel()} of {x.numel()} ties not rounded to even; " + "; ".join(misses)


def quantize_codes(x, scale, fp8_dtype, dtype, device):
    """Codes of tfp8.quantize(x / scale) at `scale` (x / scale exact in dtype, x / scale * scale exact in float32)."""
    inp = (x / scale).to(dtype).to(device)
    assert torch.equal(inp.double().cpu() * scale, x), "the test input is not exact in this dtype"
    s = torch.tensor([scale], dtype=torch.float32, device=device)
    return tfp8.quantize(inp, s, fp8_dtype).view(torch.uint8).cpu().long()


def cast_transpose_codes(x, scale, fp8_dtype, dtype, device):
    """Codes of both outputs of tfp8.cast_transpose on x laid out as [2, n / 2] (rowwise, then transposed back)."""
    inp = (x / scale).to(dtype).reshape(2, -1).to(device)
    assert torch.equal(inp.double().cpu().flatten() * scale, x), "the test input is not exact in this dtype"
    s = torch.tensor([scale], dtype=torch.float32, device=device)
    q, qt = tfp8.cast_transpose(inp, s, fp8_dtype)
    return q.view(torch.uint8).cpu().long().flatten(), qt.view(torch.uint8).cpu().long().t().flatten()


def test_midpoints_cover_every_binade_subnormals_and_both_signs():
    for fp8_dtype, (exp_bits, man_bits, _) in LAYOUT.items():
        x, pairs = midpoints(fp8_dtype)
        positive = x[x > 0]
        binades = torch.unique(torch.floor(torch.log2(positive)))
        assert binades.numel() >= (1 << exp_bits) - 2, fp8_dtype  # normal binades, plus the subnormal range
        smallest_subnormal = 2.0 ** (1 - LAYOUT[fp8_dtype][2] - man_bits)
        assert positive.min().item() == smallest_subnormal / 2  # the tie between 0 and the smallest subnormal
        assert (x < 0).sum() == (x > 0).sum()
        # both tie directions occur: toward the lower and toward the higher neighbour
        even = round_half_even_reference(pairs)
        assert (even == pairs[:, 0]).any() and (even == pairs[:, 1]).any()


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_a_round_half_away_from_zero_kernel_fails_the_check(fp8_dtype):
    """The check tells ties-to-even from ties-away: fed the codes a half-away-from-zero kernel would produce, it
    fails (on about half of the midpoints)."""
    x, pairs = midpoints(fp8_dtype)
    away = round_half_away_reference(pairs)
    assert (away != round_half_even_reference(pairs)).float().mean() > 0.4
    with pytest.raises(AssertionError, match="not rounded to even"):
        check_ties(away, x, pairs, "half-away reference")


def _devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_quantize_rounds_ties_to_even(fp8_dtype, dtype, scale, device):
    if dtype == torch.float16 and fp8_dtype == torch.float8_e5m2 and scale < 1:
        pytest.skip("E5M2's largest midpoints / scale exceed float16's range")
    x, pairs = midpoints(fp8_dtype)
    codes = quantize_codes(x, scale, fp8_dtype, dtype, device)
    check_ties(codes, x, pairs, f"quantize {dtype} -> {fp8_dtype} at scale {scale} on {device}")


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_cast_transpose_rounds_ties_to_even(fp8_dtype, dtype, device):
    x, pairs = midpoints(fp8_dtype)
    rowwise, transposed = cast_transpose_codes(x, 2.0 ** 5, fp8_dtype, dtype, device)
    check_ties(rowwise, x, pairs, f"cast_transpose rowwise {dtype} -> {fp8_dtype} on {device}")
    check_ties(transposed, x, pairs, f"cast_transpose transposed {dtype} -> {fp8_dtype} on {device}")


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_just_off_the_midpoint_rounds_to_the_nearer_neighbour(fp8_dtype):
    """One float32 ulp above / below a positive midpoint goes to the upper / lower neighbour, whichever is even: the
    kernels round to nearest, and only exact ties are broken to even."""
    x, pairs = midpoints(fp8_dtype)
    positive = x > 0
    x, pairs = x[positive], pairs[positive]
    x32 = x.float()
    above = torch.nextafter(x32, torch.tensor(float("inf")))
    below = torch.nextafter(x32, torch.tensor(0.0))
    one = torch.ones(1)
    assert torch.equal(tfp8.quantize(above, one, fp8_dtype).view(torch.uint8).long(), pairs[:, 1])
    assert torch.equal(tfp8.quantize(below, one, fp8_dtype).view(torch.uint8).long(), pairs[:, 0])
