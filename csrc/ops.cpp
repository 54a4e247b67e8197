// Every op's schema, in one place. Kernels register elsewhere:
//   CUDA: csrc/<family>*.cpp (TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m)), kernels in csrc/<family>*.cu
//   CPU reference: transformer_fp8/cpu/<family>.py, fake (meta) kernels: transformer_fp8/ops.py
//
// Conventions (see docs/design.md):
//   - FP8 dtypes are torch.float8_e4m3fn (max 448) and torch.float8_e5m2 (max 57344).
//   - q = saturate(x * scale) rounded to nearest even; x ~= q * scale_inv.
//   - scale, scale_inv, amax are float32 tensors of one element on the device of the data.
//   - An `amax` argument is max-accumulated: amax = max(amax, max|x|) (NaN wins). The scaling update zeroes it.
//   - A `scale_inv` output argument, when given, receives 1 / scale (so a cast can refresh a tensor's scale_inv).
//   - GEMMs are "TN": a [M, K] and b [N, K], both K-contiguous; out [M, N] = (a * a_scale_inv) @ (b * b_scale_inv)^T.
#include <torch/library.h>

TORCH_LIBRARY(transformer_fp8, m) {
  // --- quantize family ---
  // input: contiguous, or rows of contiguous elements at one stride: its trailing dims (contiguous among themselves)
  // make the rows, its leading dims merge into one row index at one stride (e.g. q of a fused QKV output, a slice
  // of its last dim). Returns FP8 of input's shape, contiguous.
  m.def("quantize(Tensor input, Tensor scale, ScalarType fp8_dtype, Tensor(a!)? amax=None, "
        "Tensor(b!)? scale_inv=None) -> Tensor");
  // input contiguous FP8 -> out_dtype, contiguous.
  m.def("dequantize(Tensor input, Tensor scale_inv, ScalarType out_dtype) -> Tensor");
  // input contiguous FP8 dequantized into out (float32 / float16 / bfloat16, input's shape; contiguous or rows at a
  // stride as quantize's input: e.g. the q, k, v views of one fused QKV gradient).
  m.def("dequantize_into(Tensor input, Tensor scale_inv, Tensor(a!) out) -> ()");
  m.def("compute_amax(Tensor input, Tensor(a!) amax) -> ()");
  // input [M, N] -> (q [M, N] or empty, qT [N, M] or empty)
  m.def("cast_transpose(Tensor input, Tensor scale, ScalarType fp8_dtype, bool rowwise=True, bool transpose=True, "
        "Tensor(a!)? amax=None, Tensor(b!)? scale_inv=None) -> (Tensor, Tensor)");
  // grad [M, N] -> (q [M, N], qT [N, M], dbias [N] in grad's dtype, summed in float32)
  m.def("cast_transpose_dbias(Tensor grad, Tensor scale, ScalarType fp8_dtype, Tensor(a!)? amax=None, "
        "Tensor(b!)? scale_inv=None) -> (Tensor, Tensor, Tensor)");
  // FP8 [M, N] -> FP8 [N, M], same dtype
  m.def("fp8_transpose(Tensor input) -> Tensor");

  // --- block scaling (recipe Float8BlockScaling; layouts: transformer_fp8/quantization/block.py) ---
  // input [M, K] contiguous high precision -> (q [M, K] or empty, scale_inv, qt [K, M] or empty, scale_inv_t), each
  // scale float32 per tile: block_dim 1: 1x128 tiles (q: along K, scale_inv [ceil(K/128), pad4(M)]; qt: its own
  // tiles along M, scale_inv_t [ceil(M/128), pad4(K)]); block_dim 2: 128x128 blocks (scale_inv [ceil(M/128),
  // pad4(ceil(K/128))], qt with the same scales transposed [ceil(K/128), pad4(ceil(M/128))]). Padding entries are 1.
  // Per tile: amax floored at amax_epsilon; scale = fp8_max / amax (float32 max on overflow; 1 for a zero, Inf or
  // NaN amax), rounded down to a power of 2 when power_2_scale; q = saturate(x * scale); scale_inv = 1 / scale.
  m.def("block_cast(Tensor input, ScalarType fp8_dtype, int block_dim, bool rowwise=True, bool transpose=False, "
        "float amax_epsilon=0.0, bool power_2_scale=True) -> (Tensor, Tensor, Tensor, Tensor)");
  // block_cast (1x128 tiles) of act(input) computed in float32 (activation_fwd's math, without its rounding to the
  // input dtype): input [M, F] ("gelu", "relu") or [M, 2F] = [gate | up] ("swiglu") -> the cast of [M, F].
  m.def("block_activation_cast(Tensor input, str activation, ScalarType fp8_dtype, bool rowwise=True, "
        "bool transpose=False, float amax_epsilon=0.0, bool power_2_scale=True) -> (Tensor, Tensor, Tensor, Tensor)");
  // LayerNorm / RMSNorm forward (normalization "LayerNorm" / "RMSNorm"; layernorm_fwd's contract, bias LayerNorm only)
  // fused with block_cast (1x128 tiles) of its float32 output, which is never stored in high precision ->
  // (q, scale_inv, qt, scale_inv_t as block_cast, mean [M] (LayerNorm; RMSNorm: empty), rstd [M]), float32 stats.
  m.def("norm_block_cast(Tensor input, Tensor weight, Tensor? bias, str normalization, float eps, "
        "bool zero_centered_gamma, ScalarType fp8_dtype, bool rowwise=True, bool transpose=False, "
        "float amax_epsilon=0.0, bool power_2_scale=True) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // block_cast (1x128 tiles) of d(input) = act'(input) * grad_out computed in float32 (activation_bwd's math, without
  // its rounding): input [M, F] ("gelu", "relu") or [M, 2F] ("swiglu"), grad_out [M, F] -> the cast of [M, F or 2F],
  // and with compute_dbias its column sums in float32 (the bias gradient, in grad_out's dtype; else empty).
  m.def("dact_block_cast(Tensor grad_out, Tensor input, str activation, ScalarType fp8_dtype, bool rowwise=True, "
        "bool transpose=False, float amax_epsilon=0.0, bool power_2_scale=True, bool compute_dbias=False) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor)");
  // q [M, K] FP8 with its scale_inv (block_cast's layout for block_dim) -> out_dtype [M, K] = q * scale_inv of its tile
  m.def("block_dequantize(Tensor input, Tensor scale_inv, int block_dim, ScalarType out_dtype) -> Tensor");
  // out [M, N] = (a * a_scale_inv) @ (b * b_scale_inv)^T (+ bias [N]) (+ residual [M, N] of out_dtype, contiguous)
  // in out_dtype (float32 / float16 / bfloat16), computed in float32 and rounded once: "TN" as fp8_gemm, each operand
  // [rows, K] block-scaled along its rows as block_cast made it (a_block_dim / b_block_dim: 1 = 1x128 tiles, 2 =
  // 128x128 blocks; not both 2); split accumulator (cuBLASLt takes no other).
  m.def("block_fp8_gemm(Tensor a, Tensor a_scale_inv, int a_block_dim, Tensor b, Tensor b_scale_inv, "
        "int b_block_dim, ScalarType out_dtype, Tensor? bias=None, Tensor? residual=None) -> Tensor");
  // out [M, N] float32 += the same product (wgrad into main_grad)
  m.def("block_fp8_gemm_accumulate(Tensor a, Tensor a_scale_inv, int a_block_dim, Tensor b, Tensor b_scale_inv, "
        "int b_block_dim, Tensor(a!) out) -> ()");

  // --- gemm family ---
  // Returns (out [M, N] of out_dtype, pre_gelu [M, N] (empty unless gelu)). bias [N]; with an FP8 out_dtype,
  // out_scale is required and out_amax (optional) is max-accumulated. residual [M, N] of out_dtype (not FP8, not
  // with gelu): added to the result in the epilogue (out = a bᵀ + bias + residual, rounded once).
  m.def("fp8_gemm(Tensor a, Tensor a_scale_inv, Tensor b, Tensor b_scale_inv, ScalarType out_dtype, "
        "Tensor? bias=None, bool gelu=False, Tensor? out_scale=None, Tensor(a!)? out_amax=None, "
        "bool use_split_accumulator=True, Tensor? residual=None) -> (Tensor, Tensor)");
  // out [M, N] float32 += (a * a_scale_inv) @ (b * b_scale_inv)^T   (wgrad into main_grad)
  m.def("fp8_gemm_accumulate(Tensor a, Tensor a_scale_inv, Tensor b, Tensor b_scale_inv, Tensor(a!) out, "
        "bool use_split_accumulator=True) -> ()");

  // --- composites (csrc/composite.cpp): the ops of an FP8 Linear step, one call per direction ---
  // Forward of out = x Wᵀ (+ bias) (+ residual): x [M, K] and weight [N, K] (high precision) cast as cast_transpose
  // does (rowwise, transposed when x_transpose / w_transpose; into x_scale_inv / w_scale_inv, amaxes accumulated),
  // then fp8_gemm(xq, x_scale_inv, wq, w_scale_inv, out_dtype, bias, use_split_accumulator=False, residual=residual).
  // Returns (out [M, N], xqT [K, M] or empty, wqT [K, N] or empty).
  m.def("fp8_linear_fwd(Tensor x, Tensor weight, Tensor x_scale, Tensor w_scale, ScalarType fp8_dtype, "
        "Tensor(a!)? x_amax, Tensor(b!) x_scale_inv, Tensor(c!)? w_amax, Tensor(d!) w_scale_inv, bool x_transpose, "
        "bool w_transpose, ScalarType out_dtype, Tensor? bias=None, Tensor? residual=None) "
        "-> (Tensor, Tensor, Tensor)");
  // Backward from the forward's FP8 operands: dy [M, N] cast into dy_scale_inv (cast_transpose_dbias when
  // compute_dbias, else cast_transpose, rowwise when w_t is given, transposed when x_t is), then
  // dx [M, K] = fp8_gemm(dyq, dy_scale_inv, w_t [K, N], w_scale_inv, dx_dtype) when w_t is given;
  // dW [N, K] = fp8_gemm(dyqT, dy_scale_inv, x_t [K, M], x_scale_inv, dw_dtype) when x_t is given, or accumulated
  // into main_grad (float32 [N, K], fp8_gemm_accumulate) when that is given too. Split accumulators in both.
  // Returns (dx or empty, dW or empty, dbias [N] in dy's dtype or empty).
  m.def("fp8_linear_bwd(Tensor dy, Tensor dy_scale, ScalarType fp8_dtype, Tensor(a!)? dy_amax, "
        "Tensor(b!) dy_scale_inv, bool compute_dbias, Tensor? w_t, Tensor w_scale_inv, ScalarType dx_dtype, "
        "Tensor? x_t, Tensor x_scale_inv, ScalarType dw_dtype, Tensor(c!)? main_grad=None) "
        "-> (Tensor, Tensor, Tensor)");

  // Inference forward of out = x Wᵀ (+ bias) with an FP8 weight (fp8_model_init): x [..., K] (contiguous, float32 /
  // float16 / bfloat16) cast by inference_cast(x as [-1, K], x_scale, fp8_dtype, x_amax, x_scale_inv,
  // current_scaling, fp8_max, history, state_scale, state_scale_inv, backup, margin, amax_compute_algo), then
  // fp8_gemm(xq, x_scale_inv, w, w_scale_inv, x's dtype, bias, use_split_accumulator=False) (a float32 output gets the
  // bias added after the GEMM). w [N, K] FP8 with one float32 w_scale_inv. Returns out [..., N] in x's dtype (no
  // autograd: nothing is saved).
  m.def("fp8_linear_inference(Tensor x, Tensor w, Tensor w_scale_inv, Tensor(a!) x_scale, ScalarType fp8_dtype, "
        "Tensor(b!) x_amax, Tensor(c!) x_scale_inv, Tensor? bias=None, bool current_scaling=False, "
        "float fp8_max=448.0, Tensor(d!)? history=None, Tensor(e!)? state_scale=None, "
        "Tensor(f!)? state_scale_inv=None, Tensor(g!)? backup=None, float margin=0.0, "
        "str amax_compute_algo=\"max\") -> Tensor");
  // The input cast of an FP8-weight Linear's inference with its scaling bookkeeping, in one launch: x (contiguous,
  // float32 / float16 / bfloat16) -> q (fp8_dtype, x's shape) = saturate(x * scale). scale, amax, scale_inv: one
  // float32 element each. Delayed scaling (current_scaling false): as cast_transpose(x, scale, fp8_dtype, True, False,
  // amax, scale_inv) (amax max-accumulated, scale_inv = 1 / scale); with history, state_scale, state_scale_inv and
  // backup (all or none; history [H, n], state_scale / state_scale_inv [n], backup [4, n]; scale and amax may be
  // elements of state_scale and history row 0): afterwards backup = (history[0], history[H - 1], state_scale,
  // state_scale_inv) as the cast left them, then delayed_scaling_update([history], [state_scale], [state_scale_inv],
  // fp8_max, margin, amax_compute_algo). Current scaling: compute_amax(x, amax) (amax zero on entry),
  // delayed_scaling_update([amax as [1, 1]], [scale], [scale_inv], fp8_max, 0, "most_recent"), then the cast
  // writing scale_inv (no state arguments).
  m.def("inference_cast(Tensor x, Tensor(a!) scale, ScalarType fp8_dtype, Tensor(b!) amax, Tensor(c!) scale_inv, "
        "bool current_scaling, float fp8_max, Tensor(d!)? history=None, Tensor(e!)? state_scale=None, "
        "Tensor(f!)? state_scale_inv=None, Tensor(g!)? backup=None, float margin=0.0, "
        "str amax_compute_algo=\"max\") -> Tensor");

  // --- norm family --- input [M, N]; out in input's dtype, or fp8_dtype (scale required) when given
  m.def("layernorm_fwd(Tensor input, Tensor weight, Tensor? bias, float eps, bool zero_centered_gamma=False, "
        "Tensor? scale=None, ScalarType? fp8_dtype=None, Tensor(a!)? amax=None, Tensor(b!)? scale_inv=None) "
        "-> (Tensor, Tensor, Tensor)");  // (out, mean [M] f32, rstd [M] f32)
  // dx_add (the input's shape and dtype): a gradient reaching the input by another path, added to dx (one rounding)
  m.def("layernorm_bwd(Tensor grad_out, Tensor input, Tensor mean, Tensor rstd, Tensor weight, "
        "bool zero_centered_gamma=False, Tensor? dx_add=None) -> (Tensor, Tensor, Tensor)");  // (dx, dgamma, dbeta)
  m.def("rmsnorm_fwd(Tensor input, Tensor weight, float eps, bool zero_centered_gamma=False, Tensor? scale=None, "
        "ScalarType? fp8_dtype=None, Tensor(a!)? amax=None, Tensor(b!)? scale_inv=None) -> (Tensor, Tensor)");
  m.def("rmsnorm_bwd(Tensor grad_out, Tensor input, Tensor rstd, Tensor weight, bool zero_centered_gamma=False, "
        "Tensor? dx_add=None) -> (Tensor, Tensor)");  // (dx, dgamma)

  // --- activation family --- activation in {"gelu", "relu", "swiglu"}; swiglu halves the last dim:
  // input [..., 2F] = [gate | up] -> silu(gate) * up [..., F]
  m.def("activation_fwd(Tensor input, str activation, Tensor? scale=None, ScalarType? fp8_dtype=None, "
        "Tensor(a!)? amax=None, Tensor(b!)? scale_inv=None) -> Tensor");
  m.def("activation_bwd(Tensor grad_out, Tensor input, str activation) -> Tensor");
  // d(activation) fused with the FP8 cast + transpose of the result (and its column sums for a bias gradient).
  // grad_out [M, F], input [M, F] (or [M, 2F] for swiglu) -> d(input) as (q [M, F_in], qT [F_in, M] (empty unless
  // transpose), dbias [F_in] or empty), F_in = input's last dim
  m.def("dact_cast_transpose(Tensor grad_out, Tensor input, str activation, Tensor scale, ScalarType fp8_dtype, "
        "Tensor(a!)? amax=None, Tensor(b!)? scale_inv=None, bool compute_dbias=False, bool transpose=True) -> "
        "(Tensor, Tensor, Tensor)");
  // activation_fwd to an FP8 output that also keeps its input for the backward in E4M3, 1x128 tiles along each row with
  // one float32 scale_inv per tile (amax_tile / 448): (out [..., F] in fp8_dtype, kept [..., F_in] float8_e4m3fn,
  // kept_scale_inv [..., F_in / 128]). float16 / bfloat16 input whose output's last dim is a multiple of 128.
  m.def("activation_fwd_keep_input(Tensor input, str activation, Tensor scale, ScalarType fp8_dtype, "
        "Tensor(a!)? amax=None, Tensor(b!)? scale_inv=None) -> (Tensor, Tensor, Tensor)");
  // dact_cast_transpose whose activation input is such a kept copy ([M, F_in] and [M, F_in / 128]); grad_out's dtype
  // is the high precision one (dbias's).
  m.def("dact_cast_transpose_kept_input(Tensor grad_out, Tensor kept_input, Tensor kept_scale_inv, str activation, "
        "Tensor scale, ScalarType fp8_dtype, Tensor(a!)? amax=None, Tensor(b!)? scale_inv=None, "
        "bool compute_dbias=False, bool transpose=True) -> (Tensor, Tensor, Tensor)");

  // --- scaling family --- amax_histories[i] [H, n_i], scales[i] / scale_invs[i] [n_i], all float32.
  // Row 0 holds the amax accumulated this step. One launch: roll every history by one (row 0 -> row 1, ...),
  // zero row 0, amax = max(history) or the newest, scale = fp8_max / amax / 2**margin, scale_inv = 1 / scale.
  // A zero, NaN or Inf amax keeps the old scale; a NaN/Inf amax enters the history as 0.
  m.def("delayed_scaling_update(Tensor(a!)[] amax_histories, Tensor(b!)[] scales, Tensor(c!)[] scale_invs, "
        "float fp8_max, float margin, str amax_compute_algo) -> ()");

  // --- optim family --- one Adam step over lists of tensors (torch.optim.AdamW's update; TE's FusedAdam's options):
  // params[i], grads[i] (the parameters' dtype), exp_avgs[i], exp_avg_sqs[i] (the moments' dtype: the parameters'
  // or float32, one for the call) and, when given, master_params[i] (float32 master weights of 16-bit parameters),
  // contiguous, of one shape; one parameter dtype and device for the whole call; step >= 1 is the step being taken.
  // Scalars computed in double and rounded once to float32: lr * weight_decay, beta1, 1 - beta1, beta2, 1 - beta2,
  // eps, step_size = lr / (1 - beta1**step) and inv_bc2 = 1 / sqrt(1 - beta2**step) (lr and 1 without
  // bias_correction). Per element in float32, each operation rounded: w = master_params[i] if given, else param;
  // g = -grad if maximize else grad; decoupled_weight_decay: w = w - (lr * weight_decay) * w, else (L2) g = g +
  // weight_decay * w; m = beta1 * exp_avg + (1 - beta1) * g; v = beta2 * exp_avg_sq + ((1 - beta2) * g) * g;
  // w = w - (step_size * m) / (sqrt(v) * inv_bc2 + eps); master = w, param = w, exp_avg = m, exp_avg_sq = v (each
  // rounded to its dtype). In place; grads are read only.
  m.def("adamw_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "float lr, float beta1, float beta2, float eps, float weight_decay, int step, bool maximize=False, "
        "Tensor(d!)[]? master_params=None, bool bias_correction=True, bool decoupled_weight_decay=True) -> ()");

  // --- rope family --- rotary position embeddings. t [s, b, h, d] (qkv_format "sbhd") or [b, s, h, d] ("bshd") of
  // float32/float16/bfloat16, last dim contiguous, any strides elsewhere (q, k, v may be views of a fused QKV tensor);
  // freqs float32 angles [>= s, 1 or b, 1, rot_dim] (rows past s unused), last dim contiguous, rot_dim even,
  // 2 <= rot_dim <= d. Channels (i, j) pair up as (i, i + rot_dim/2) for i < rot_dim/2, or (2i, 2i + 1) when
  // interleaved; each pair (x_i, x_j) -> (x_i cos f_i - x_j sin f_i, x_j cos f_j + x_i sin f_j) (the "rotate half"
  // formula t * cos(freqs) + rotate_half(t) * sin(freqs)); channels rot_dim.. pass through. Math in float32; out is
  // contiguous, in t's shape and dtype.
  m.def("rope_fwd(Tensor t, Tensor freqs, str qkv_format, bool interleaved=False) -> Tensor");
  // d(t) of rope_fwd for grad_out (t's shape, the same rules): each pair (g_i, g_j) ->
  // (g_i cos f_i + g_j sin f_j, g_j cos f_j - g_i sin f_i), the rotation by the negated angle when f_i == f_j.
  m.def("rope_bwd(Tensor grad_out, Tensor freqs, str qkv_format, bool interleaved=False) -> Tensor");
  // rope_fwd / rope_bwd writing into out (t's / grad_out's shape and dtype, any strides with a contiguous last dim):
  // either the input itself, the same view (in place), or a tensor of another storage. E.g. q and k rotated straight
  // into their places in one fused-QKV-shaped buffer, and their gradients rotated back in place.
  m.def("rope_fwd_into(Tensor t, Tensor freqs, str qkv_format, bool interleaved, Tensor(a!) out) -> ()");
  m.def("rope_bwd_into(Tensor grad_out, Tensor freqs, str qkv_format, bool interleaved, Tensor(a!) out) -> ()");

  // --- loss family --- cross-entropy of a chunk of float32 logits [rows, classes] against int64 targets [rows] (a
  // row whose target is ignore_index counts for nothing): (loss_rows [rows] float32 = logsumexp(row) - row[target], 0
  // for an ignored row; dlogits [rows, classes] in grad_dtype = softmax(row), minus 1 at the target (subtracted in
  // float32, rounded once), all zeros for an ignored row; an empty tensor when grad_dtype is None). Targets must lie in
  // [0, classes) or equal ignore_index (another raises: on CUDA as a device-side error, as torch's gather does).
  m.def("cross_entropy_chunk(Tensor logits, Tensor targets, int ignore_index, ScalarType? grad_dtype) -> "
        "(Tensor, Tensor)");

  // --- attention family --- scaled-dot-product attention (CUDA: cuDNN's graph API; CPU: float32 math reference).
  // q [b, hq, sq, d_qk], k [b, hkv, skv, d_qk], v [b, hkv, skv, d_v]: float16 or bfloat16 (one dtype), last dim
  // contiguous, any other strides (sbhd / bshd tensors, or views of a fused QKV buffer, permuted to [b, h, s, d]);
  // hq % hkv == 0 (GQA / MQA: query head i reads kv head i / (hq / hkv)), skv >= 1.
  // out = dropout(softmax(q kᵀ * scale + mask)) v, math in float32. Masks: causal (top-left aligned: key j > query i
  // is masked); padding: seqlens_q / seqlens_kv (int32 [b] on q's device, given together, 1 <= len <= s) mask keys
  // j >= seqlens_kv[b], and query rows i >= seqlens_q[b] of out are zero. Dropout (dropout_p in [0, 1)) zeroes
  // probabilities and scales the kept ones by 1 / (1 - dropout_p); it needs rng_state, int64 [2] (philox seed,
  // offset) on q's device: the same rng_state gives the same mask (the CPU reference draws its own, different mask).
  // Returns (out [b, hq, sq, d_v] in q's dtype, dense in q's dim order (dims 0..2 by decreasing stride, so an sbhd
  // view gives an sbhd out), stats float32 [b, hq, sq, 1] contiguous: logsumexp over the unmasked keys of
  // q kᵀ * scale, what the backward needs). NotImplementedError (saying why) when cuDNN cannot run the case.
  m.def("fused_attn_fwd(Tensor q, Tensor k, Tensor v, float scale, bool causal=False, float dropout_p=0.0, "
        "Tensor? seqlens_q=None, Tensor? seqlens_kv=None, Tensor? rng_state=None) -> (Tensor, Tensor)");
  // Gradients of fused_attn_fwd (called with the same q, k, v, scale, causal, dropout_p, seqlens and rng_state) for
  // grad_out (out's shape and dtype, last dim contiguous), written into dq, dk, dv (q's / k's / v's shapes, q's
  // dtype, last dim contiguous, any strides: views of one dqkv buffer laid out like the fused QKV are the point).
  // With seqlens, rows past the lengths may be left unwritten: pass zeroed buffers to get zeros there.
  m.def("fused_attn_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor stats, Tensor(a!) dq, "
        "Tensor(b!) dk, Tensor(c!) dv, float scale, bool causal=False, float dropout_p=0.0, Tensor? seqlens_q=None, "
        "Tensor? seqlens_kv=None, Tensor? rng_state=None) -> ()");
  // FP8 attention (CUDA: cuDNN's per-tensor-scaled FP8 SDPA; CPU: emulated with torch's float8 dtypes, float32 math).
  // q, k, v: FP8 (one dtype; cuDNN: E4M3), shapes and strides as fused_attn_fwd; no dropout, no padding mask.
  // With x = x8 * descale_x (descale = scale_inv = 1 / scale of the cast that made x8):
  //   P = softmax(q kᵀ * scale + causal mask) (float32), P8 = saturate(P * scale_s) (q's dtype),
  //   O = (P8 * descale_s) v, out = saturate(O * scale_o) in q's dtype, dense in q's dim order;
  //   amax_s = max(amax_s, max P), amax_o = max(amax_o, max|O|) (max-accumulated, NaN wins), stats as fused_attn_fwd.
  // FP8 out only: on Hopper cuDNN has no FP8 SDPA with a BF16 output (Blackwell does); dequantize with 1 / scale_o.
  // NotImplementedError (saying why) when cuDNN cannot run the case (Hopper: head dims multiples of 16, <= 256).
  m.def("fused_attn_fp8_fwd(Tensor q, Tensor k, Tensor v, Tensor descale_q, Tensor descale_k, Tensor descale_v, "
        "Tensor scale_s, Tensor descale_s, Tensor scale_o, Tensor(a!) amax_s, Tensor(b!) amax_o, float scale, "
        "bool causal=False) -> (Tensor, Tensor)");
  // Gradients of fused_attn_fp8_fwd for grad_out (FP8 E5M2 or E4M3, out's shape, last dim contiguous), with q, k, v,
  // out, stats, scale, causal of the forward (out and its descale_o: the forward's FP8 out and 1 / scale_o):
  //   dO = grad_out * descale_do, P recomputed from q, k, stats; P8 = saturate(P * scale_s) (q's dtype);
  //   dv = (P8 * descale_s)ᵀ dO; dS = P * (dO vᵀ - rowsum(dO * O)) * scale (the gradient of q kᵀ);
  //   dS8 = saturate(dS * scale_dp) (grad_out's dtype), dq = (dS8 * descale_dp) k, dk = (dS8 * descale_dp)ᵀ q (kv
  //   heads summed over their query heads); each of dq, dk, dv cast as saturate(x * scale_x) to grad_out's dtype.
  // amax_dp (max|dS|), amax_dq, amax_dk, amax_dv: max-accumulated. Returns (dq, dk, dv) in grad_out's dtype, dense
  // in q's / k's / v's dim order; dequantize with 1 / scale_dq etc. NotImplementedError when cuDNN cannot run the
  // case (Hopper: head dims 128 only).
  m.def("fused_attn_fp8_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor stats, "
        "Tensor descale_q, Tensor descale_k, Tensor descale_v, Tensor descale_o, Tensor descale_do, Tensor scale_s, "
        "Tensor descale_s, Tensor scale_dp, Tensor descale_dp, Tensor scale_dq, Tensor scale_dk, Tensor scale_dv, "
        "Tensor(a!) amax_dp, Tensor(b!) amax_dq, Tensor(c!) amax_dk, Tensor(d!) amax_dv, float scale, "
        "bool causal=False) -> (Tensor, Tensor, Tensor)");

  // --- moe family --- token permutation for mixture-of-experts layers (transformer_fp8/permutation.py builds the maps
  // on the device with torch ops). row_id_map int32 [T, S] (contiguous): the permuted row of slot s of token t, or -1
  // (slots: the experts for mask routing, the top-k choices for index routing); slot_of_row int32 [N]: its inverse,
  // the flat slot t * S + s whose copy fills row n, or -1. Indices outside their range give zero rows / are skipped
  // (never read out of bounds; not checked on the host: that would synchronise).
  // inp [T, H] contiguous, any float dtype or FP8 (rows copied as bytes: the per-tensor scale_inv stays valid) ->
  // out [N, H] in inp's dtype, row n = inp[slot_of_row[n] / S] (* probs[slot_of_row[n]] when probs, float32 [T, S]
  // contiguous, is given: not with FP8; product rounded once), zeros for slot -1.
  m.def("moe_permute_rows(Tensor inp, Tensor slot_of_row, int slots_per_token, Tensor? probs=None) -> Tensor");
  // inp [N, H] contiguous float32 / float16 / bfloat16 -> out [T, H] in inp's dtype, row t = sum over s (in order) of
  // probs[t, s] * inp[row_id_map[t, s]] (rows >= 0 only; probs float32 [T, S], absent: 1), each product and sum
  // rounded to float32, the result once to inp's dtype.
  m.def("moe_unpermute_rows(Tensor inp, Tensor row_id_map, Tensor? probs=None) -> Tensor");
  // d(merging probs) of moe_unpermute_rows: float32 [T, S], dot(grad_out[t], inp[row_id_map[t, s]]) summed in float32
  // (0 where row_id_map is -1). grad_out [T, H], inp [N, H]: one high-precision dtype, contiguous.
  m.def("moe_merging_probs_grad(Tensor grad_out, Tensor inp, Tensor row_id_map) -> Tensor");
  // --- grouped GEMM (a family of its own: the CUDA kernels are torch's CUTLASS grouped GEMM, torch._scaled_grouped_mm,
  // registered from transformer_fp8/grouped_gemm.py; CPU reference: transformer_fp8/cpu/moe_grouped_gemm.py) ---
  // offs: int32 [G] on a's device, the cumulative ends of the row groups (group g: rows offs[g-1] .. offs[g]; empty
  // groups allowed; offs[G-1] <= M; rows past it: unspecified). E4M3 operands only (Hopper's grouped kernel),
  // per-tensor a_scale_inv [1]; b_scale_inv [1] or [G] (one per group); each group's product is computed in float32
  // and rounded to bfloat16 (the kernel's only output type), then converted to out_dtype (float32 / float16 /
  // bfloat16). use_split_accumulator=False: FP8 fast accumulation (forward GEMMs).
  // out [M, N], row m of group g = (a[m] * a_scale_inv) . (b[g] * b_scale_inv[g])ᵀ: a [M, K] (contiguous),
  // b [G, N, K] with a contiguous last dim (any other strides: a transposed view of a [K, G*N] FP8 tensor is how the
  // dgrad takes Wᵀ), K and N multiples of 16.
  m.def("grouped_fp8_gemm(Tensor a, Tensor a_scale_inv, Tensor b, Tensor b_scale_inv, Tensor offs, "
        "ScalarType out_dtype, bool use_split_accumulator=True) -> Tensor");
  // The weight gradient of a grouped GEMM, contracting over the grouped rows: a_t [N, M] and b_t [K, M] (contiguous,
  // the transposed copies of dy and x), groups of columns by offs as above -> out [G, N, K], out[g] =
  // (a_t[:, group g] * a_scale_inv) (b_t[:, group g] * b_scale_inv)ᵀ (zeros for an empty group), split accumulator.
  // CUDA: M and every group size must be multiples of 16 (the kernel's 16-byte alignment; device-side assert
  // otherwise: GroupedLinear pads its groups, see transformer_fp8/grouped_gemm.py).
  m.def("grouped_fp8_gemm_wgrad(Tensor a_t, Tensor a_scale_inv, Tensor b_t, Tensor b_scale_inv, Tensor offs, "
        "ScalarType out_dtype) -> Tensor");
  // Our own Hopper grouped kernel (CUTLASS 3 pointer-array, sm_90a; csrc/grouped_gemm_*.cu, built when the CUTLASS
  // headers are found), which grouped_fp8_gemm / grouped_fp8_gemm_wgrad run on unless
  // transformer_fp8.grouped_gemm.BACKEND says "torch". The same products with a bfloat16 output: out [M, N] as
  // grouped_fp8_gemm (b_scale_inv [1] or [G]), and out [G, N, K] as grouped_fp8_gemm_wgrad (zeros for an empty group;
  // every group but the last must start at a multiple of 16 columns). fast_accumulation: Hopper's FP8 accumulation
  // (False: float32 promotion of the partial sums every 128 elements of K). tile: 0 auto, 1 large, 2 small, 3 alt,
  // 4 wide, 5 solo, 6 ping (the CTA tile configurations of csrc/grouped_gemm.h), 7 ours (our own kernel, for the
  // fast-accumulation rows form; auto's choice elsewhere). N, K (and the wgrad's M) multiples of 16; compute
  // capability 9.0 only.
  m.def("grouped_fp8_gemm_sm90(Tensor a, Tensor a_scale_inv, Tensor b, Tensor b_scale_inv, Tensor offs, "
        "bool fast_accumulation=False, int tile=0) -> Tensor");
  m.def("grouped_fp8_gemm_wgrad_sm90(Tensor a_t, Tensor a_scale_inv, Tensor b_t, Tensor b_scale_inv, Tensor offs, "
        "bool fast_accumulation=False, int tile=0) -> Tensor");
  // Block-scaled grouped GEMMs (recipe Float8BlockScaling; layouts: transformer_fp8/quantization/block.py), E4M3
  // operands, each group's product summed in float32 and rounded to bfloat16, then converted to out_dtype.
  // out [M, N], rows of group g = a[rows] (1x128 tiles along K, a_scale_inv [cdiv(K, 128), >= M] with a contiguous
  // last dim: block_cast's layout) . b[g]ᵀ (b [G, N, K] with a contiguous last dim, 128x128 blocks, b_scale_inv
  // [G, cdiv(N, 128), cdiv(K, 128)] of any strides: the transposed view of the forward's scales serves the dgrad's Wᵀ).
  // offs as grouped_fp8_gemm's; K and N multiples of 16.
  m.def("grouped_block_fp8_gemm(Tensor a, Tensor a_scale_inv, Tensor b, Tensor b_scale_inv, Tensor offs, "
        "ScalarType out_dtype) -> Tensor");
  // The block-scaled weight gradient: a_t [N, M], b_t [K, M] (contiguous, the transposed copies of dy and x with their
  // own 1x128 tiles along M: scales [cdiv(M, 128), >= N] and [cdiv(M, 128), >= K]) -> out [G, N, K], out[g] = a_t's
  // group-g columns . b_t's (zeros for an empty group). Every non-empty group starts at a multiple of 128 rows, so that
  // no tile straddles two groups (GroupedLinear pads its groups; CPU: ValueError; CUDA: a device trap). M, N, K
  // multiples of 16.
  m.def("grouped_block_fp8_gemm_wgrad(Tensor a_t, Tensor a_scale_inv, Tensor b_t, Tensor b_scale_inv, Tensor offs, "
        "ScalarType out_dtype) -> Tensor");
  // Our CUTLASS sm90 ptr-array blockwise-scaled kernels (csrc/grouped_block_*.cu) behind the two ops above: the same
  // products with a bfloat16 output; compute capability 9.0 only.
  m.def("grouped_block_fp8_gemm_sm90(Tensor a, Tensor a_scale_inv, Tensor b, Tensor b_scale_inv, Tensor offs) "
        "-> Tensor");
  m.def("grouped_block_fp8_gemm_wgrad_sm90(Tensor a_t, Tensor a_scale_inv, Tensor b_t, Tensor b_scale_inv, "
        "Tensor offs) -> Tensor");
}

// (The Python module transformer_fp8._C, whose import loads this library, is defined in csrc/python_module.cpp.)
