"""Rotary embedding tables, computed the way transformers computes them so that
cos/sin agree bit for bit in float32."""
from __future__ import annotations

import math

import torch

from pdserve.model.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, with linear or llama3 scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.freq_factors is not None:
        if len(rope.freq_factors) != inv_freq.numel():
            raise ValueError(f"{len(rope.freq_factors)} rope frequency factors for a head_dim "
                             f"of {head_dim} (want {inv_freq.numel()})")
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def cos_sin_cache(rope: RopeConfig, head_dim: int, max_position: int,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """Table [max_position, head_dim]: cos in the first half, sin in the second (float32)."""
    inv_freq = inverse_frequencies(rope, head_dim)
    positions = torch.arange(max_position, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)
