"""Logprobs as they travel (``protocol.Logprobs``) and as the router hands them on:
joining, cutting and checking what a peer sent; no torch (engine/logprobs.py computes
them where the logits are)."""
from __future__ import annotations

from pdserve.common.protocol import Logprobs


def empty() -> Logprobs:
    return Logprobs(token_logprobs=[], top_ids=[], top_logprobs=[])


def join(parts: list[Logprobs]) -> Logprobs:
    """The entries of ``parts`` one after another."""
    out = empty()
    for p in parts:
        out.token_logprobs.extend(p.token_logprobs)
        out.top_ids.extend(p.top_ids)
        out.top_logprobs.extend(p.top_logprobs)
    return out


def head(lp: Logprobs | None, n: int) -> Logprobs | None:
    """The first ``n`` entries."""
    if lp is None:
        return None
    return Logprobs(token_logprobs=lp.token_logprobs[:n], top_ids=lp.top_ids[:n],
                    top_logprobs=lp.top_logprobs[:n])


def problem(lp: Logprobs | None, num_tokens: int, k: int, vocab: int) -> str | None:
    """Why logprobs a peer sent for ``num_tokens`` tokens with ``k`` alternatives each do
    not fit, or None."""
    if lp is None:
        return "no logprobs came with the tokens though the request asked for them"
    if not len(lp.token_logprobs) == len(lp.top_ids) == len(lp.top_logprobs) == num_tokens:
        return (f"logprobs for {len(lp.token_logprobs)}/{len(lp.top_ids)}/"
                f"{len(lp.top_logprobs)} tokens, expected {num_tokens}")
    for ids, vals in zip(lp.top_ids, lp.top_logprobs):
        if len(ids) != len(vals) or len(ids) != k or not all(0 <= t < vocab for t in ids):
            return f"top logprobs {ids[:4]} are not {k} token ids inside [0, {vocab})"
    return None
