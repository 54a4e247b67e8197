"""CPU reference kernels: the same schemas and semantics as the CUDA kernels, written with plain torch ops and
torch's float8 dtypes (saturating cast = clamp to the format's max, then round to nearest even).
They are slow and exact; tests compare the CUDA kernels against them."""
from . import (activation, attention, attention_fp8, block, block_fused, gemm, inference, loss,  # noqa: F401
               moe, moe_grouped_gemm, norm, optim, quantize, rope, scaling)  # (each registers its kernels on import)
