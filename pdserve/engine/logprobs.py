"""Logprobs of the model's raw distribution, as vLLM reports them by default: log_softmax of
the unprocessed float32 logits, whatever temperature, filters or logits processors do to
sampling. Computed where the logits are (the node that samples), as ``types.Logprobs``;
a node sends them as ``protocol.Logprobs`` (the same fields).

- sampled tokens: each sampled row's token logprob and its k most likely alternatives;
- prompt tokens: the prefill forward already computes every position's hidden state;
  position p's row scores prompt token p + 1 (token 0 has none). With chunked prefill the
  rows arrive chunk by chunk and are appended to ``Sequence.prompt_logprobs``.
"""
from __future__ import annotations

import torch

from pdserve.engine.types import Logprobs


def raw_rows(logits: torch.Tensor, ks: list[int | None]
             ) -> tuple[list[int], torch.Tensor] | None:
    """Before sampling (which may process the logits): the rows whose ``ks`` is set, and
    their log_softmax [R, V], or None when no row asks."""
    rows = [i for i, k in enumerate(ks) if k is not None]
    if not rows:
        return None
    picked = logits if len(rows) == len(ks) else \
        logits[torch.tensor(rows, device=logits.device)]
    return rows, torch.log_softmax(picked.float(), dim=-1)


def of_tokens(logprobs: torch.Tensor, token_ids: list[int], ks: list[int]) -> list[Logprobs]:
    """logprobs [N, V] (a log_softmax); for row i the logprob of ``token_ids[i]`` and its
    ``ks[i]`` most likely tokens, one Logprobs of one entry per row."""
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logprobs.device)
    chosen = logprobs.gather(-1, ids[:, None]).squeeze(-1).tolist()        # [N]
    kmax = max(ks, default=0)
    top_vals, top_idx = (logprobs.topk(kmax, dim=-1) if kmax else
                         (logprobs[:, :0], logprobs[:, :0].long()))         # [N, kmax]
    top_vals, top_idx = top_vals.tolist(), top_idx.tolist()
    return [Logprobs(token_logprobs=[c], top_ids=[i[:k]], top_logprobs=[v[:k]])
            for c, i, v, k in zip(chosen, top_idx, top_vals, ks)]


def prompt_of(seq) -> Logprobs | None:
    """What to send of a prefilled sequence's prompt logprobs: None when not asked for."""
    if not seq.scores_prompt:
        return None
    return seq.prompt_logprobs or Logprobs()


def prompt_targets(seq, start: int, n: int) -> tuple[int, int]:
    """Of a prefill chunk feeding prompt positions [start, start + n), the rows (relative
    to the chunk) whose logits score prompt tokens not yet scored: [first, end)."""
    have = seq.num_prompt_scored                     # tokens 1..have are scored
    first = max(have - start, 0)                     # row r scores token start + r + 1
    end = min(n, seq.num_prompt_tokens - 1 - start)
    return first, max(first, end)


def record_sampled(raw: tuple[list[int], torch.Tensor] | None, seqs: list,
                   tokens: list[int]) -> None:
    """Each sampled sequence that asks gets its token's logprobs (``raw``: raw_rows)."""
    if raw is None:
        return
    rows, logprob_rows = raw
    found = of_tokens(logprob_rows, [tokens[i] for i in rows],
                      [seqs[i].params.logprobs for i in rows])
    for i, lp in zip(rows, found):
        seqs[i].logprobs = lp


def record_prompt(model, hidden: torch.Tensor, batch) -> None:
    """Appends, to each batch sequence collecting prompt logprobs, those of the prompt
    tokens its chunk scores. hidden [T, H]: the forward's hidden states, the batch's
    chunks one after another; logits of a few rows at a time, to bound memory."""
    offset = 0
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        offset += n
        if not seq.wants_prompt_logprobs:
            continue
        base = offset - n
        start = seq.num_computed_tokens
        first, end = prompt_targets(seq, start, n)
        for lo in range(first, end, 256):
            hi = min(end, lo + 256)
            logits = model.compute_logits(hidden[base + lo:base + hi])            # [r, V]
            targets = seq.token_ids[start + lo + 1:start + hi + 1]
            parts = of_tokens(torch.log_softmax(logits, dim=-1), targets,
                              [seq.params.prompt_logprobs] * len(targets))
            seq.prompt_logprobs = seq.prompt_logprobs or Logprobs()
            for part in parts:
                seq.prompt_logprobs.extend(part)
