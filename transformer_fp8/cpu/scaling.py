"""CPU reference kernels of the scaling ops (placeholder until written)."""
