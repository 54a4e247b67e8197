"""Block scaling (recipe.Float8BlockScaling): the operand layout, and the quantizer that casts to it.

Operand layout (what the block ops produce and block_fp8_gemm takes; the layout cuBLASLt's block-scaled FP8 GEMM on
Hopper reads, so nothing is re-laid out before a GEMM). All scales are float32 `scale_inv` (x ~= q * scale_inv),
`cdiv(a, b) = ceil(a / b)`, `pad4(a) = a rounded up to a multiple of 4` (cuBLASLt wants 16-byte scale rows). Padding
entries of a scale tensor hold 1.0.

1x128 tiles (block_dim 1: activations and gradients), x [M, K] high precision:
  data        [M, K] FP8                      row m, columns 128*j .. 128*j+127 share one scale
  scale_inv   [cdiv(K, 128), pad4(M)] f32     scale_inv[j, m] belongs to x[m, 128*j : 128*j+128]   (M contiguous)
  data_t      [K, M] FP8                      the transposed copy, quantized with its OWN 1x128 tiles along M
                                              (cast from x, not from data: no double rounding)
  scale_inv_t [cdiv(M, 128), pad4(K)] f32     scale_inv_t[i, k] belongs to x[128*i : 128*i+128, k]
  (data_t / scale_inv_t are exactly the 1x128 layout of xᵀ [K, M].)

128x128 blocks (block_dim 2: weights), w [N, K] high precision:
  data        [N, K] FP8                      one scale per 128x128 block
  scale_inv   [cdiv(N, 128), pad4(cdiv(K, 128))] f32   scale_inv[i, j] belongs to w[128*i : .., 128*j : ..]
  data_t      [K, N] FP8                      the same values transposed (same block scales: one rounding)
  scale_inv_t [cdiv(K, 128), pad4(cdiv(N, 128))] f32   scale_inv transposed: scale_inv_t[j, i] = scale_inv[i, j]
  (A Hugging Face block-FP8 checkpoint's `weight_scale_inv` [cdiv(N, 128), cdiv(K, 128)] is scale_inv without the
  padding columns.)

Scale of a tile (as TE computes it): amax = max|tile| floored at amax_epsilon; scale = fp8_max / amax (float32
division), float32 max when that overflows, 1 when amax is 0, Inf or NaN; with power_2_scale the scale is rounded
down to a power of two (its mantissa bits cleared). q = saturate(x * scale) rounded to nearest even,
scale_inv = 1 / scale.

GEMM ("TN", out [M, N] = a [M, K] · b [N, K]ᵀ): each operand is 1x128 or 128x128 along its K-contiguous rows;
fprop a = x (1x128) and b = w (128x128); dgrad a = dy (1x128) and b = w's data_t (128x128); wgrad a = dy's data_t
(1x128) and b = x's data_t (1x128). 128x128 x 128x128 is refused (cuBLASLt has no such kernel).
"""
