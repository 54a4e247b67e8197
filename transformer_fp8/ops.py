"""The op namespace `torch.ops.transformer_fp8` and its fake (meta) kernels.

Schemas and their contracts live in csrc/ops.cpp. CUDA kernels come from the compiled extension, CPU reference kernels
from transformer_fp8/cpu, and the fake kernels below give output shapes and dtypes so torch.compile can trace the ops.
"""
import torch

from . import _C  # noqa: F401  (loads the library: registers the schemas and the CUDA kernels)
from ._layout import dense_in_order_of
from .cpu.block import block_scale_shape

tfp8 = torch.ops.transformer_fp8

_register_fake = torch.library.register_fake


def _empty(t):
    return t.new_empty((0,))


@_register_fake("transformer_fp8::quantize")
def _(input, scale, fp8_dtype, amax=None, scale_inv=None):
    return input.new_empty(input.shape, dtype=fp8_dtype)


@_register_fake("transformer_fp8::dequantize_into")
def _(input, scale_inv, out):
    return None


@_register_fake("transformer_fp8::dequantize")
def _(input, scale_inv, out_dtype):
    return torch.empty_like(input, dtype=out_dtype)


@_register_fake("transformer_fp8::compute_amax")
def _(input, amax):
    return None


@_register_fake("transformer_fp8::cast_transpose")
def _(input, scale, fp8_dtype, rowwise=True, transpose=True, amax=None, scale_inv=None):
    m, n = input.shape
    q = input.new_empty((m, n), dtype=fp8_dtype) if rowwise else input.new_empty((0,), dtype=fp8_dtype)
    qt = input.new_empty((n, m), dtype=fp8_dtype) if transpose else input.new_empty((0,), dtype=fp8_dtype)
    return q, qt


@_register_fake("transformer_fp8::cast_transpose_dbias")
def _(grad, scale, fp8_dtype, amax=None, scale_inv=None):
    m, n = grad.shape
    return grad.new_empty((m, n), dtype=fp8_dtype), grad.new_empty((n, m), dtype=fp8_dtype), grad.new_empty((n,))


@_register_fake("transformer_fp8::fp8_transpose")
def _(input):
    m, n = input.shape
    return input.new_empty((n, m))


@_register_fake("transformer_fp8::block_cast")
def _(input, fp8_dtype, block_dim, rowwise=True, transpose=False, amax_epsilon=0.0, power_2_scale=True):
    m, k = input.shape
    empty_q, empty_s = input.new_empty((0,), dtype=fp8_dtype), input.new_empty((0,), dtype=torch.float32)
    q = input.new_empty((m, k), dtype=fp8_dtype) if rowwise else empty_q
    scale_inv = input.new_empty(block_scale_shape(m, k, block_dim), dtype=torch.float32) if rowwise else empty_s
    qt = input.new_empty((k, m), dtype=fp8_dtype) if transpose else empty_q
    scale_inv_t = input.new_empty(block_scale_shape(k, m, block_dim), dtype=torch.float32) if transpose else empty_s
    return q, scale_inv, qt, scale_inv_t


@_register_fake("transformer_fp8::block_activation_cast")
def _(input, activation, fp8_dtype, rowwise=True, transpose=False, amax_epsilon=0.0, power_2_scale=True):
    m, k = input.shape[0], activation_out_features(activation, input.shape[1])
    return _block_1x128_outputs(input, m, k, fp8_dtype, rowwise, transpose)


def _block_1x128_outputs(input, m, k, fp8_dtype, rowwise, transpose):
    """Fake outputs of a 1x128 block cast of values [m, k]: (q, scale_inv, qt, scale_inv_t), empty when not asked."""
    empty_q, empty_s = input.new_empty((0,), dtype=fp8_dtype), input.new_empty((0,), dtype=torch.float32)
    q = input.new_empty((m, k), dtype=fp8_dtype) if rowwise else empty_q
    scale_inv = input.new_empty(block_scale_shape(m, k, 1), dtype=torch.float32) if rowwise else empty_s
    qt = input.new_empty((k, m), dtype=fp8_dtype) if transpose else empty_q
    scale_inv_t = input.new_empty(block_scale_shape(k, m, 1), dtype=torch.float32) if transpose else empty_s
    return q, scale_inv, qt, scale_inv_t


@_register_fake("transformer_fp8::norm_block_cast")
def _(input, weight, bias, normalization, eps, zero_centered_gamma, fp8_dtype, rowwise=True, transpose=False,
      amax_epsilon=0.0, power_2_scale=True):
    m, k = input.shape
    mean = input.new_empty((m if normalization == "LayerNorm" else 0,), dtype=torch.float32)
    return (*_block_1x128_outputs(input, m, k, fp8_dtype, rowwise, transpose), mean,
            input.new_empty((m,), dtype=torch.float32))


@_register_fake("transformer_fp8::dact_block_cast")
def _(grad_out, input, activation, fp8_dtype, rowwise=True, transpose=False, amax_epsilon=0.0, power_2_scale=True,
      compute_dbias=False):
    dbias = grad_out.new_empty((input.shape[1] if compute_dbias else 0,))
    return (*_block_1x128_outputs(input, input.shape[0], input.shape[1], fp8_dtype, rowwise, transpose), dbias)


@_register_fake("transformer_fp8::block_dequantize")
def _(input, scale_inv, block_dim, out_dtype):
    return torch.empty_like(input, dtype=out_dtype)


@_register_fake("transformer_fp8::block_fp8_gemm")
def _(a, a_scale_inv, a_block_dim, b, b_scale_inv, b_block_dim, out_dtype, bias=None, residual=None):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@_register_fake("transformer_fp8::block_fp8_gemm_accumulate")
def _(a, a_scale_inv, a_block_dim, b, b_scale_inv, b_block_dim, out):
    return None


@_register_fake("transformer_fp8::fp8_gemm")
def _(a, a_scale_inv, b, b_scale_inv, out_dtype, bias=None, gelu=False, out_scale=None, out_amax=None,
      use_split_accumulator=True, residual=None):
    m, n = a.shape[0], b.shape[0]
    out = a.new_empty((m, n), dtype=out_dtype)
    pre_gelu_dtype = bias.dtype if bias is not None else (torch.bfloat16 if out_dtype.itemsize == 1 else out_dtype)
    pre_gelu = a.new_empty((m, n) if gelu else (0,), dtype=pre_gelu_dtype)
    return out, pre_gelu


@_register_fake("transformer_fp8::fp8_gemm_accumulate")
def _(a, a_scale_inv, b, b_scale_inv, out, use_split_accumulator=True):
    return None


@_register_fake("transformer_fp8::layernorm_fwd")
def _(input, weight, bias, eps, zero_centered_gamma=False, scale=None, fp8_dtype=None, amax=None, scale_inv=None):
    m = input.shape[0]
    out = torch.empty_like(input, dtype=fp8_dtype or input.dtype)
    stat = input.new_empty((m,), dtype=torch.float32)
    return out, stat, stat.clone()


@_register_fake("transformer_fp8::layernorm_bwd")
def _(grad_out, input, mean, rstd, weight, zero_centered_gamma=False, dx_add=None):
    return torch.empty_like(input), torch.empty_like(weight), torch.empty_like(weight)


@_register_fake("transformer_fp8::rmsnorm_fwd")
def _(input, weight, eps, zero_centered_gamma=False, scale=None, fp8_dtype=None, amax=None, scale_inv=None):
    out = torch.empty_like(input, dtype=fp8_dtype or input.dtype)
    return out, input.new_empty((input.shape[0],), dtype=torch.float32)


@_register_fake("transformer_fp8::rmsnorm_bwd")
def _(grad_out, input, rstd, weight, zero_centered_gamma=False, dx_add=None):
    return torch.empty_like(input), torch.empty_like(weight)


def activation_out_features(activation, in_features):
    """Last-dim size of activation_fwd's output: gated activations (swiglu) halve it."""
    return in_features // 2 if activation == "swiglu" else in_features


@_register_fake("transformer_fp8::activation_fwd")
def _(input, activation, scale=None, fp8_dtype=None, amax=None, scale_inv=None):
    shape = (*input.shape[:-1], activation_out_features(activation, input.shape[-1]))
    return input.new_empty(shape, dtype=fp8_dtype or input.dtype)


def activation_high_precision(input, activation):
    """activation_fwd(input, activation) (no FP8 output). Traced by torch.compile it goes through the op `activation`
    below instead: inductor (torch 2.11) fails to lower a call of an op with mutable arguments that returns one
    tensor when all those arguments are None ("getitem is not an OpOverload")."""
    if torch.compiler.is_compiling():
        return _activation(input, activation)
    return tfp8.activation_fwd(input, activation)


@torch.library.custom_op("transformer_fp8::activation", mutates_args=())
def _activation(input: torch.Tensor, activation: str) -> torch.Tensor:
    """activation_fwd without an FP8 output, under a schema with no mutable arguments."""
    return tfp8.activation_fwd(input, activation)


@_activation.register_fake
def _(input, activation):
    return input.new_empty((*input.shape[:-1], activation_out_features(activation, input.shape[-1])))


@_register_fake("transformer_fp8::activation_bwd")
def _(grad_out, input, activation):
    return torch.empty_like(input)


@_register_fake("transformer_fp8::dact_cast_transpose")
def _(grad_out, input, activation, scale, fp8_dtype, amax=None, scale_inv=None, compute_dbias=False, transpose=True):
    m, f = input.shape
    dbias = grad_out.new_empty((f,) if compute_dbias else (0,))
    qt = grad_out.new_empty((f, m) if transpose else (0,), dtype=fp8_dtype)
    return grad_out.new_empty((m, f), dtype=fp8_dtype), qt, dbias


@_register_fake("transformer_fp8::activation_fwd_keep_input")
def _(input, activation, scale, fp8_dtype, amax=None, scale_inv=None):
    shape = (*input.shape[:-1], activation_out_features(activation, input.shape[-1]))
    kept_scales = (*input.shape[:-1], input.shape[-1] // 128)
    return (input.new_empty(shape, dtype=fp8_dtype), input.new_empty(input.shape, dtype=torch.float8_e4m3fn),
            input.new_empty(kept_scales, dtype=torch.float32))


@_register_fake("transformer_fp8::dact_cast_transpose_kept_input")
def _(grad_out, kept_input, kept_scale_inv, activation, scale, fp8_dtype, amax=None, scale_inv=None,
      compute_dbias=False, transpose=True):
    m, f = kept_input.shape
    dbias = grad_out.new_empty((f,) if compute_dbias else (0,))
    qt = grad_out.new_empty((f, m) if transpose else (0,), dtype=fp8_dtype)
    return grad_out.new_empty((m, f), dtype=fp8_dtype), qt, dbias


@_register_fake("transformer_fp8::inference_cast")
def _(x, scale, fp8_dtype, amax, scale_inv, current_scaling, fp8_max, history=None, state_scale=None,
      state_scale_inv=None, backup=None, margin=0.0, amax_compute_algo="max"):
    return x.new_empty(x.shape, dtype=fp8_dtype)


@_register_fake("transformer_fp8::delayed_scaling_update")
def _(amax_histories, scales, scale_invs, fp8_max, margin, amax_compute_algo):
    return None


@_register_fake("transformer_fp8::adamw_step_")
def _(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step, maximize=False,
      master_params=None, bias_correction=True, decoupled_weight_decay=True):
    return None


@_register_fake("transformer_fp8::rope_fwd")
def _(t, freqs, qkv_format, interleaved=False):
    return t.new_empty(t.shape)  # contiguous, whatever t's strides


@_register_fake("transformer_fp8::rope_bwd")
def _(grad_out, freqs, qkv_format, interleaved=False):
    return grad_out.new_empty(grad_out.shape)


@_register_fake("transformer_fp8::rope_fwd_into")
def _(t, freqs, qkv_format, interleaved, out):
    return None


@_register_fake("transformer_fp8::rope_bwd_into")
def _(grad_out, freqs, qkv_format, interleaved, out):
    return None


@_register_fake("transformer_fp8::cross_entropy_chunk")
def _(logits, targets, ignore_index, grad_dtype):
    dlogits = logits.new_empty(logits.shape, dtype=grad_dtype) if grad_dtype is not None else logits.new_empty(0)
    return logits.new_empty(logits.shape[0]), dlogits


@_register_fake("transformer_fp8::fused_attn_fwd")
def _(q, k, v, scale, causal=False, dropout_p=0.0, seqlens_q=None, seqlens_kv=None, rng_state=None):
    b, hq, sq = q.shape[:3]
    out = dense_in_order_of(q, (b, hq, sq, v.shape[3]))
    return out, q.new_empty((b, hq, sq, 1), dtype=torch.float32)


@_register_fake("transformer_fp8::fused_attn_bwd")
def _(grad_out, q, k, v, out, stats, dq, dk, dv, scale, causal=False, dropout_p=0.0, seqlens_q=None,
      seqlens_kv=None, rng_state=None):
    return None


@_register_fake("transformer_fp8::fused_attn_fp8_fwd")
def _(q, k, v, descale_q, descale_k, descale_v, scale_s, descale_s, scale_o, amax_s, amax_o, scale, causal=False):
    b, hq, sq = q.shape[:3]
    return dense_in_order_of(q, (b, hq, sq, v.shape[3])), q.new_empty((b, hq, sq, 1), dtype=torch.float32)


@_register_fake("transformer_fp8::fused_attn_fp8_bwd")
def _(grad_out, q, k, v, out, stats, descale_q, descale_k, descale_v, descale_o, descale_do, scale_s, descale_s,
      scale_dp, descale_dp, scale_dq, scale_dk, scale_dv, amax_dp, amax_dq, amax_dk, amax_dv, scale, causal=False):
    return tuple(dense_in_order_of(t, tuple(t.shape), dtype=grad_out.dtype) for t in (q, k, v))


@_register_fake("transformer_fp8::moe_permute_rows")
def _(inp, slot_of_row, slots_per_token, probs=None):
    return inp.new_empty((slot_of_row.shape[0], inp.shape[1]))


@_register_fake("transformer_fp8::moe_unpermute_rows")
def _(inp, row_id_map, probs=None):
    return inp.new_empty((row_id_map.shape[0], inp.shape[1]))


@_register_fake("transformer_fp8::moe_merging_probs_grad")
def _(grad_out, inp, row_id_map):
    return inp.new_empty(tuple(row_id_map.shape), dtype=torch.float32)


@_register_fake("transformer_fp8::grouped_fp8_gemm")
def _(a, a_scale_inv, b, b_scale_inv, offs, out_dtype, use_split_accumulator=True):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@_register_fake("transformer_fp8::grouped_fp8_gemm_wgrad")
def _(a_t, a_scale_inv, b_t, b_scale_inv, offs, out_dtype):
    return a_t.new_empty((offs.shape[0], a_t.shape[0], b_t.shape[0]), dtype=out_dtype)
