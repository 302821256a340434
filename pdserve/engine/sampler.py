"""Picks the next token of every sampled sequence in one batched pass.

Greedy rows take the argmax. The others are scaled by temperature, filtered
by top-k and top-p, and drawn with the exponential-race trick
(argmax of p / Exp(1) noise), which lets a seeded request draw its noise from
its own generator: the same seed gives the same tokens whatever else is in
the batch.
"""
from __future__ import annotations

import torch

from pdserve.engine.sampling_params import SamplingParams


def make_generator(params: SamplingParams, device: torch.device | str, vocab_size: int = 0,
                   num_drawn: int = 0) -> torch.Generator | None:
    """The request's own generator, advanced past the ``num_drawn`` tokens already sampled
    (elsewhere: a prefill node, a node that died), so a seeded request continues exactly
    as if one engine had sampled all of it."""
    if params.seed is None or params.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed)
    if num_drawn:
        skip = torch.empty(vocab_size, device=device)
        for _ in range(num_drawn):  # each sampled token draws one row of noise in sample()
            skip.exponential_(generator=gen)
    return gen


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits [S, V] float32 → one token id per row."""
    greedy = [p.greedy for p in params]
    if all(greedy):
        return logits.argmax(dim=-1).tolist()
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
        noise[i].exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    out = torch.where(torch.tensor(greedy, device=device), logits.argmax(dim=-1), sampled)
    return out.tolist()
