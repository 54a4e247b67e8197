"""Rotary position embeddings (RoPE), non-interleaved "rotate half" convention (as HF Llama and TE's default).

`RotaryPositionEmbedding(dim)(seq_len)` gives the angles `freqs` [s, 1, 1, rot_dim] (float32);
`apply_rotary_pos_emb(t, freqs, tensor_format)` rotates the first rot_dim channels of every head of t
([s, b, h, d] for "sbhd", [b, s, h, d] for "bshd"; rot_dim <= d) and passes the rest through:
    out[..., :rot_dim] = t * cos(freqs) + rotate_half(t) * sin(freqs),  rotate_half([x1 | x2]) = [-x2 | x1].
The rotation is computed in float32 and returned in t's dtype.
"""
import torch
from torch import nn


class RotaryPositionEmbedding(nn.Module):
    """Angles of rotary embeddings: inv_freq[i] = base ** (-2i / rot_dim), rot_dim = int(dim * rotary_percent).

    Positions are divided by seq_len_interpolation_factor when given (linear position interpolation).
    """

    def __init__(self, dim, rotary_percent=1.0, seq_len_interpolation_factor=None, rotary_base=10000.0,
                 device=None):
        super().__init__()
        rot_dim = int(dim * rotary_percent)
        if rot_dim <= 0 or rot_dim % 2:
            raise ValueError(f"dim * rotary_percent: expected a positive even number, got {dim} * {rotary_percent}")
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        exponents = torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device) / rot_dim
        self.register_buffer("inv_freq", 1.0 / (rotary_base ** exponents), persistent=False)

    def forward(self, max_seq_len, offset=0):
        """-> freqs [max_seq_len, 1, 1, rot_dim] float32 for positions offset .. offset + max_seq_len - 1."""
        positions = torch.arange(max_seq_len, dtype=torch.float32, device=self.inv_freq.device) + offset
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        angles = torch.outer(positions, self.inv_freq)
        return torch.cat((angles, angles), dim=-1)[:, None, None, :]


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t, freqs, tensor_format="sbhd"):
    """Rotate t ([s, b, h, d] "sbhd" or [b, s, h, d] "bshd") by freqs [>= s, 1, 1, rot_dim]; returns t's dtype."""
    if tensor_format not in ("sbhd", "bshd"):
        raise ValueError(f"tensor_format: expected 'sbhd' or 'bshd', got {tensor_format!r}")
    if t.dim() != 4 or freqs.dim() != 4:
        raise ValueError(f"t, freqs: expected 4-D tensors, got t {tuple(t.shape)}, freqs {tuple(freqs.shape)}")
    seq_len = t.shape[0] if tensor_format == "sbhd" else t.shape[1]
    rot_dim = freqs.shape[-1]
    if freqs.shape[0] < seq_len or rot_dim > t.shape[-1]:
        raise ValueError(f"freqs: expected [>= {seq_len}, 1, 1, <= {t.shape[-1]}], got {tuple(freqs.shape)}")
    freqs = freqs[:seq_len].float()
    if tensor_format == "bshd":
        freqs = freqs.transpose(0, 1)
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    x = t_rot.float()
    rotated = (x * freqs.cos() + _rotate_half(x) * freqs.sin()).to(t.dtype)
    return torch.cat((rotated, t_pass), dim=-1) if t_pass.shape[-1] else rotated
