"""Picks the next token of every sampled sequence in one batched pass.

Greedy rows take the argmax. The others are scaled by temperature, filtered
by top-k and top-p, and drawn with the exponential-race trick
(argmax of p / Exp(1) noise), which lets a seeded request draw its noise from
its own generator: the same seed gives the same tokens whatever else is in
the batch.
"""
from __future__ import annotations

import torch

from pdserve.common.sampling import SamplingParams

_MASK64 = 2**64 - 1


def _mix(seed: int, index: int) -> int:
    """splitmix64 of (seed, index): a well-spread 63-bit seed for token ``index``."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class SeededStream:
    """A seeded request's random stream, counter-based: the noise of its n-th sampled token
    comes from a generator seeded with (seed, n). Any engine can so resume the stream at
    any n (after a failover, n = the tokens sampled elsewhere), in O(1)."""

    def __init__(self, seed: int, start: int, device: torch.device | str):
        self.seed = seed
        self.index = start
        self._gen = torch.Generator(device=device)

    def next(self) -> torch.Generator:
        self._gen.manual_seed(_mix(self.seed, self.index))
        self.index += 1
        return self._gen


def make_generator(params: SamplingParams, device: torch.device | str, vocab_size: int = 0,
                   num_drawn: int = 0) -> SeededStream | None:
    """The request's own random stream, positioned after the ``params.seed_offset`` tokens
    sampled in earlier attempts and the ``num_drawn`` sampled in this one (on a prefill
    node), so a seeded request continues exactly as if one engine had sampled all of it.
    ``vocab_size`` is unused (kept for callers)."""
    if params.seed is None or params.greedy:
        return None
    return SeededStream(params.seed, params.seed_offset + num_drawn, device)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [S, V] → the index of each row's largest value, the first one on ties, as
    ``x.argmax(-1)`` gives; ``max``'s indices are the same, and 3x faster on the CPU
    (1.06 against 0.35 ms for 16 x 49,152 float32 on one thread)."""
    return x.max(dim=-1).indices


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[SeededStream | None]) -> list[int]:
    """logits [S, V] float32 → one token id per row."""
    greedy = [p.greedy for p in params]
    if all(greedy):
        return argmax(logits).tolist()
    device = logits.device
    temps = torch.tensor([p.temperature if not g else 1.0 for p, g in zip(params, greedy)],
                         dtype=torch.float32, device=device)
    scaled = logits / temps[:, None]                                      # [S, V]
    top_ks = [p.top_k for p in params]
    if any(0 < k < logits.shape[-1] for k in top_ks):
        k = torch.tensor([k if 0 < k < logits.shape[-1] else logits.shape[-1] for k in top_ks],
                         device=device)
        sorted_desc = scaled.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(-1, (k - 1)[:, None])                   # [S, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    top_ps = [p.top_p for p in params]
    if any(p < 1.0 for p in top_ps):
        p = torch.tensor(top_ps, dtype=torch.float32, device=device)
        probs_sorted, idx = scaled.softmax(dim=-1).sort(dim=-1, descending=True)
        # Drop a token when the mass before it already reaches top_p; the first always stays.
        drop_sorted = (probs_sorted.cumsum(dim=-1) - probs_sorted) >= p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter_(-1, idx, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    probs = scaled.softmax(dim=-1)                                        # [S, V]
    noise = torch.empty_like(probs)
    for i, gen in enumerate(generators):
        noise[i].exponential_(generator=gen.next() if gen is not None else None)
    sampled = argmax(probs / noise)
    out = torch.where(torch.tensor(greedy, device=device), argmax(logits), sampled)
    return out.tolist()
