"""Rotary position embeddings (RoPE), "rotate half" convention by default (as HF Llama and TE's default).

`RotaryPositionEmbedding(dim)(seq_len)` gives the angles `freqs` [s, 1, 1, rot_dim] (float32);
`apply_rotary_pos_emb(t, freqs, tensor_format)` rotates the first rot_dim channels of every head of t
([s, b, h, d] for "sbhd", [b, s, h, d] for "bshd"; rot_dim <= d) and passes the rest through:
    out[..., :rot_dim] = t * cos(freqs) + rotate_half(t) * sin(freqs),  rotate_half([x1 | x2]) = [-x2 | x1].
interleaved=True (both) pairs channels (2i, 2i + 1) instead of (i, i + rot_dim/2).
The rotation is computed in float32 and returned in t's dtype, by the fused ops rope_fwd / rope_bwd (csrc/ops.cpp).
"""
import torch
from torch import nn

from ..ops import tfp8


class RotaryPositionEmbedding(nn.Module):
    """Angles of rotary embeddings: inv_freq[i] = base ** (-2i / rot_dim), rot_dim = int(dim * rotary_percent).

    Positions are divided by seq_len_interpolation_factor when given (linear position interpolation).
    Angles along rot_dim = r: [theta_0 .. theta_{r/2-1} | theta_0 .. theta_{r/2-1}] for the rotate-half pairs
    (i, i + r/2), or [theta_0, theta_0, theta_1, theta_1, ..] with interleaved=True for the pairs (2i, 2i + 1).
    """

    def __init__(self, dim, rotary_percent=1.0, seq_len_interpolation_factor=None, rotary_base=10000.0,
                 device=None, interleaved=False):
        super().__init__()
        rot_dim = int(dim * rotary_percent)
        if rot_dim <= 0 or rot_dim % 2:
            raise ValueError(f"dim * rotary_percent: expected a positive even number, got {dim} * {rotary_percent}")
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.interleaved = interleaved
        exponents = torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device) / rot_dim
        self.register_buffer("inv_freq", 1.0 / (rotary_base ** exponents), persistent=False)

    def forward(self, max_seq_len, offset=0):
        """-> freqs [max_seq_len, 1, 1, rot_dim] float32 for positions offset .. offset + max_seq_len - 1."""
        positions = torch.arange(max_seq_len, dtype=torch.float32, device=self.inv_freq.device) + offset
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        angles = torch.outer(positions, self.inv_freq)
        if self.interleaved:
            return angles.repeat_interleave(2, dim=-1)[:, None, None, :]
        return torch.cat((angles, angles), dim=-1)[:, None, None, :]


class _ApplyRope(torch.autograd.Function):
    """rope_fwd forward, rope_bwd backward; saves only freqs (not t). No gradient flows to freqs."""

    @staticmethod
    def forward(ctx, t, freqs, tensor_format, interleaved):
        ctx.save_for_backward(freqs)
        ctx.args = (tensor_format, interleaved)
        return tfp8.rope_fwd(t, freqs, tensor_format, interleaved)

    @staticmethod
    def backward(ctx, grad_out):
        (freqs,) = ctx.saved_tensors
        grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()  # e.g. expanded, from a sum
        return tfp8.rope_bwd(grad_out, freqs, *ctx.args), None, None, None


def apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", interleaved=False):
    """Rotate t ([s, b, h, d] "sbhd" or [b, s, h, d] "bshd"; any strides, e.g. q, k views of a fused QKV output) by
    freqs [>= s, 1 or b, 1, rot_dim] (angles, one row per position, optionally per sequence); returns a contiguous
    tensor of t's dtype. interleaved: pairs (2i, 2i + 1) instead of (i, i + rot_dim/2), for the angles of a
    RotaryPositionEmbedding(interleaved=True). One fused kernel forward and backward (ops rope_fwd / rope_bwd)."""
    if tensor_format not in ("sbhd", "bshd"):
        raise ValueError(f"tensor_format: expected 'sbhd' or 'bshd', got {tensor_format!r}")
    if t.dim() != 4 or freqs.dim() != 4:
        raise ValueError(f"t, freqs: expected 4-D tensors, got t {tuple(t.shape)}, freqs {tuple(freqs.shape)}")
    seq_len, batch = t.shape[:2] if tensor_format == "sbhd" else t.shape[1::-1]
    rot_dim = freqs.shape[-1]
    if (freqs.shape[0] < seq_len or freqs.shape[1] not in (1, batch) or freqs.shape[2] != 1 or rot_dim % 2
            or not 0 < rot_dim <= t.shape[-1]):
        raise ValueError(f"freqs: expected [>= {seq_len}, 1 or {batch}, 1, even rot_dim <= {t.shape[-1]}], "
                         f"got {tuple(freqs.shape)}")
    if freqs.requires_grad and torch.is_grad_enabled():
        raise ValueError("freqs: no gradient flows to the angles; pass freqs.detach()")
    t = t if t.stride(-1) == 1 else t.contiguous()
    freqs = freqs.float()
    freqs = freqs if freqs.stride(-1) == 1 else freqs.contiguous()
    return _ApplyRope.apply(t, freqs, tensor_format, interleaved)
