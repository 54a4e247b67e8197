"""Helpers shared by the CPU reference kernels."""
import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def check_fp8_dtype(dtype, arg):
    if dtype not in FP8_MAX:
        raise ValueError(f"{arg}: expected torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")


def saturating_cast(x_f32, fp8_dtype):
    """float32 -> FP8 with saturation to the format's max and round-to-nearest-even (NaN stays NaN)."""
    m = FP8_MAX[fp8_dtype]
    return x_f32.clamp(-m, m).to(fp8_dtype)


def accumulate_amax(amax, x):
    """amax = max(amax, max|x|) in place; a NaN in x makes amax NaN (as the CUDA kernels do)."""
    if amax is None or x.numel() == 0:
        return
    value = x.detach().abs().amax().float()  # NaN if x holds one
    torch.maximum(amax, value.reshape(amax.shape), out=amax)


def register(name):
    """Decorator: register a function as the CPU kernel of transformer_fp8::<name>."""
    return torch.library.register_kernel(f"transformer_fp8::{name}", "cpu")
