"""fp8_gemm with TFP8_GEMM_AUTOTUNE (read once per process: each check runs in a fresh Python): the first call of a
plan times cuBLASLt's candidate algorithms on the call's own buffers; its output, and every later call's, must be
the chosen algorithm's result, within FP8 GEMM tolerance of float64."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHECK = r"""
import torch
from tests.ops.test_gemm import OUT_RTOL, TC_RTOL, bias_for, dequantized, fp8_out_scale, operands, reference_f64
from tests.utils import FP8_RTOL, rel_error, scalar

ops = torch.ops.transformer_fp8
torch.manual_seed(0)
for m, k, n in [(1024, 2048, 4096), (4096, 1024, 3072), (256, 512, 384)]:
    a, sa, b, sb = operands(m, k, n, device="cuda")
    bias = bias_for(n, torch.bfloat16, "cuda")
    residual = torch.randn(m, n, device="cuda").bfloat16()
    ref, pre = reference_f64(a, sa, b, sb, bias)
    calls = {
        "bf16": (dict(), ref - bias.double()),
        "bias+residual": (dict(bias=bias, residual=residual), ref + residual.double()),
        "gelu": (dict(bias=bias, gelu=True), None),
    }
    for name, (kwargs, expected) in calls.items():
        first = ops.fp8_gemm(a, sa, b, sb, torch.bfloat16, **kwargs)  # tunes
        second = ops.fp8_gemm(a, sa, b, sb, torch.bfloat16, **kwargs)
        assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1]), (m, k, n, name)
        if name == "gelu":
            gelu_ref = reference_f64(a, sa, b, sb, bias, gelu=True)[0]
            err = max(rel_error(first[0], gelu_ref), rel_error(first[1], pre))
        else:
            err = rel_error(first[0], expected)
        assert err < OUT_RTOL[torch.bfloat16] + TC_RTOL[False], (m, k, n, name, err)
    plain = ref - bias.double()
    out_scale, amax = fp8_out_scale(plain, torch.float8_e4m3fn).cuda(), scalar(0.0, "cuda")
    for _ in range(2):  # (tunes, then runs the tuned plan)
        q, _ = ops.fp8_gemm(a, sa, b, sb, torch.float8_e4m3fn, out_scale=out_scale, out_amax=amax)
        assert abs(amax.item() / plain.abs().max().item() - 1) < 1e-2, (m, k, n, "amax")
        assert rel_error(dequantized(q, out_scale), plain) <= FP8_RTOL[torch.float8_e4m3fn], (m, k, n, "fp8 out")
print("ok")
"""


@pytest.mark.gpu
def test_autotuned_gemms_match_float64_and_repeat_bitwise():
    env = dict(os.environ, TFP8_GEMM_AUTOTUNE="verbose", PYTHONPATH=REPO)
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
    assert "tfp8 GEMM autotune" in done.stderr, "no plan was tuned"
