"""CPU reference kernels of the quantize ops (placeholder until written)."""
