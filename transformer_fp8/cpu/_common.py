"""Helpers shared by the CPU reference kernels."""
import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def check_fp8_dtype(dtype, arg):
    if dtype not in FP8_MAX:
        raise ValueError(f"{arg}: expected torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")


def check_scalar_f32(t, data, arg):
    """scale / scale_inv / amax: one float32 element on the data's device (None passes)."""
    if t is None:
        return
    if t.dtype != torch.float32:
        raise TypeError(f"{arg}: expected a float32 tensor, got {t.dtype}")
    if t.numel() != 1:
        raise ValueError(f"{arg}: expected one element, got shape {tuple(t.shape)}")
    if t.device != data.device:
        raise ValueError(f"{arg}: expected a tensor on {data.device}, got one on {t.device}")


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
