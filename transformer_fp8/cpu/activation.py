"""CPU reference kernels of the activation ops (placeholder until written)."""
