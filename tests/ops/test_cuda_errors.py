"""CUDA argument checks whose messages carry shapes and numbers, one per op family, in a child process (a crash while
formatting a message must fail this test, not kill the session)."""
import subprocess
import sys

import pytest

SCRIPT = r'''
import pytest, torch, transformer_fp8
ops, d, e4 = torch.ops.transformer_fp8, "cuda", torch.float8_e4m3fn
x = torch.randn(8, 32, device=d, dtype=torch.bfloat16)
one = torch.ones(1, device=d)
cases = [
    ("input: expected a contiguous tensor", lambda: ops.cast_transpose(x.t(), one, e4)),
    ("scale: expected one element", lambda: ops.quantize(x, torch.ones(2, device=d), e4)),
    ("weight: expected shape",
     lambda: ops.layernorm_fwd(x, torch.ones(31, device=d, dtype=torch.bfloat16), None, 1e-5)),
    ("grad_out: expected shape", lambda: ops.activation_bwd(x[:4], x, "gelu")),
    ("scales: expected 1 tensors",
     lambda: ops.delayed_scaling_update([torch.zeros(4, 2, device=d)], [], [], 448.0, 0.0, "max")),
    ("b: expected K = 32", lambda: ops.fp8_gemm(x.to(e4), one, x[:, :16].contiguous().to(e4), one, torch.bfloat16)),
]
for match, call in cases:
    with pytest.raises((RuntimeError, ValueError), match=match):
        call()
print("all raised")
'''


@pytest.mark.gpu
def test_cuda_errors_with_shapes_raise_cleanly():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "all raised" in result.stdout, result.stderr[-3000:]
