"""RoPE angles of a Hugging Face Llama-like config, for our fused rope kernel (module/rope.py).

Supported rope types: "default", "linear" (inverse frequencies divided by `factor`) and "llama3" (Llama 3.1's
frequency-dependent scaling: wavelengths shorter than original_max_position_embeddings / high_freq_factor are kept,
those longer than original_max_position_embeddings / low_freq_factor are divided by `factor`, and the band between
is interpolated linearly in original_max_position_embeddings / wavelength). Others ("dynamic", "yarn", ...) and a
partial_rotary_factor are refused. The angles are computed in float32, as transformers computes them, without its
rounding of cos/sin to the model's dtype.
"""
import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's RoPE parameters as one dict with rope_type and rope_theta (transformers >= 5 keeps them in
    config.rope_parameters; older versions in rope_theta and rope_scaling).

    Args:
        config: a Hugging Face config.
    Returns:
        A new dict.
    """
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def _llama3_scaled(inv_freq: torch.Tensor, params: dict, config) -> torch.Tensor:
    """Llama 3.1's scaling of the inverse frequencies (see the module docstring)."""
    factor, low, high = float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"])
    original = float(params.get("original_max_position_embeddings") or config.max_position_embeddings)
    wavelength = 2 * math.pi / inv_freq
    blend = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: fully scaled, 1: kept
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    between = (wavelength <= original / low) & (wavelength >= original / high)
    return torch.where(between, (1 - blend) * inv_freq / factor + blend * inv_freq, scaled)


def inverse_frequencies(config: Any, head_dim: int) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2] (float32, CPU) of a Hugging Face config.

    Args:
        config: a Hugging Face config (rope_parameters or rope_theta / rope_scaling).
        head_dim: channels per head.
    Returns:
        The inverse frequencies.
    Raises:
        NotImplementedError: an unsupported rope_type or a partial_rotary_factor other than 1.
    """
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(f"config.rope_parameters: rope_type {rope_type!r} is not supported (supported: "
                                  f"{', '.join(SUPPORTED_ROPE_TYPES)})")
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    if partial != 1.0:
        raise NotImplementedError(f"config.partial_rotary_factor: only 1.0 is supported, got {partial}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / float(params["rope_theta"]) ** exponents
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, params, config)
    return inv_freq


class RopeAngles:
    """RoPE angles for position ids, shared by the layers of one model, cached for the last position_ids tensor (the
    model passes the same tensor to every layer) while its values are unchanged (its version counter: a static
    buffer written in place between CUDA graph replays is recomputed).

    Call: (position_ids [b or 1, s] or None for 0..s-1, seq_len, device) -> freqs [s, b or 1, 1, head_dim] float32,
    the layout MultiheadAttention's rotary_pos_emb takes (one row of positions per sequence).
    """

    def __init__(self, config: Any, head_dim: int) -> None:
        """Args:
            config: the Hugging Face config.
            head_dim: channels per head.
        """
        self.inv_freq = inverse_frequencies(config, head_dim)
        self._last = ((None, None), None)

    def __call__(self, position_ids: torch.Tensor | None, seq_len: int, device: torch.device) -> torch.Tensor:
        """Args:
            position_ids: [b or 1, s] token positions, or None for 0..seq_len-1.
            seq_len: the sequence length s.
            device: where the angles go.

        Returns:
            freqs [s, b or 1, 1, head_dim], float32 (MultiheadAttention's rotary_pos_emb layout).
        """
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=device)[None]
        if self.inv_freq.device != device:
            self.inv_freq = self.inv_freq.to(device)
        if torch.compiler.is_compiling():  # (a traced graph computes them once per graph anyway: no host cache)
            return self._angles(position_ids, device)
        key = (position_ids, position_ids._version)
        if key[0] is self._last[0][0] and key[1] == self._last[0][1]:
            return self._last[1]
        freqs = self._angles(position_ids, device)
        self._last = (key, freqs)
        return freqs

    def _angles(self, position_ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        angles = position_ids.to(device=device, dtype=torch.float32)[..., None] * self.inv_freq  # [b or 1, s, d/2]
        return torch.cat((angles, angles), dim=-1).transpose(0, 1)[:, :, None, :]
