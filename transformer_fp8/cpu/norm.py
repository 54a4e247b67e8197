"""CPU reference kernels of the norm ops (placeholder until written)."""
