"""CPU reference kernels of the gemm ops (placeholder until written)."""
