"""Benchmark prompts: random token ids of exact lengths, or ShareGPT conversations.

Random prompts go out as token ids (``prompt`` on /v1/completions,
``prompt_token_ids`` on the ingress), so the server sees exactly the lengths
asked for; chat takes text, so there the ids are decoded and re-encoded until
the text is the asked number of tokens. Lengths are drawn as vLLM does:
uniform integers in ``[floor(L * (1 - r)), ceil(L * (1 + r))]``, plus a
shared random prefix of ``--random-prefix-len`` tokens.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# ShareGPT filtering, as vLLM does it: drop very short or very long pairs.
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048


@dataclass(frozen=True)
class SampleRequest:
    prompt: str | list[int] | list[dict]  # text, token ids, or chat messages (multi-turn)
    prompt_len: int
    output_len: int


def is_messages(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


def load_tokenizer(path: str | Path):
    """pdserve's tokenizer of a checkpoint folder (it needs tokenizer.json)."""
    from pdserve.model.tokenizer import Tokenizer

    return Tokenizer(path)


def _allowed_ids(tokenizer) -> np.ndarray:
    special = np.fromiter(tokenizer.special_ids, dtype=np.int64, count=len(tokenizer.special_ids))
    return np.setdiff1d(np.arange(tokenizer.vocab_size, dtype=np.int64), special)


def _text_of_length(tokenizer, ids: list[int], target: int, allowed: np.ndarray,
                    rng: np.random.Generator) -> tuple[str, int]:
    """Text that encodes (without special tokens) to ``target`` tokens, as near as a few
    decode/re-encode rounds get; returns (text, its token count)."""
    text, n = "", 0
    for _ in range(10):
        text = tokenizer.decode(ids)
        again = tokenizer.encode(text, add_special_tokens=False)
        n = len(again)
        if n == target:
            break
        if n > target:
            ids = again[:target]
        else:
            ids = again + allowed[rng.integers(0, len(allowed), size=target - n)].tolist()
    return text, n


def random_requests(tokenizer, num_prompts: int, input_len: int, output_len: int,
                    range_ratio: float = 0.0, prefix_len: int = 0, seed: int = 0,
                    as_text: bool = False) -> list[SampleRequest]:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    lo_in = math.floor(input_len * (1 - range_ratio))
    hi_in = math.ceil(input_len * (1 + range_ratio))
    lo_out = max(1, math.floor(output_len * (1 - range_ratio)))
    hi_out = max(1, math.ceil(output_len * (1 + range_ratio)))
    if prefix_len + lo_in < 1:
        raise ValueError("--random-input-len (with --random-range-ratio and "
                         "--random-prefix-len) leaves prompts with no token")
    rng = np.random.default_rng(seed)
    allowed = _allowed_ids(tokenizer)
    prefix = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist()
    in_lens = rng.integers(lo_in, hi_in + 1, size=num_prompts)
    out_lens = rng.integers(lo_out, hi_out + 1, size=num_prompts)
    offsets = rng.integers(0, len(allowed), size=num_prompts)
    out = []
    for i in range(num_prompts):
        # Consecutive ids from a random offset: each prompt differs, none is degenerate.
        inner = allowed[(offsets[i] + i + np.arange(in_lens[i])) % len(allowed)].tolist()
        ids = prefix + inner
        if as_text:
            text, n = _text_of_length(tokenizer, ids, len(ids), allowed, rng)
            out.append(SampleRequest(text, n, int(out_lens[i])))
        else:
            out.append(SampleRequest(ids, len(ids), int(out_lens[i])))
    return out


def sharegpt_requests(path: str | Path, tokenizer, num_prompts: int,
                      output_len: int | None = None, seed: int = 0,
                      chat: bool = False) -> list[SampleRequest]:
    """The first human turn as the prompt; the reply's length as the output length
    (or ``output_len``). Fewer usable conversations than asked: drawn again at random."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--dataset-path {path}: cannot read it as JSON: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: expected a JSON list of "
                         "{\"conversations\": [...]} objects (the ShareGPT layout)")
    convs = [d["conversations"] for d in data if isinstance(d, dict)
             and isinstance(d.get("conversations"), list) and len(d["conversations"]) >= 2]
    rng = np.random.default_rng(seed)
    rng.shuffle(convs)
    out: list[SampleRequest] = []
    for conv in convs:
        if len(out) == num_prompts:
            break
        prompt, reply = conv[0].get("value"), conv[1].get("value")
        if not isinstance(prompt, str) or not isinstance(reply, str):
            continue
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=not chat))
        n_out = output_len if output_len is not None else len(
            tokenizer.encode(reply, add_special_tokens=False))
        if prompt_len < SHAREGPT_MIN_LEN or (output_len is None and n_out < SHAREGPT_MIN_LEN):
            continue
        if prompt_len > SHAREGPT_MAX_PROMPT or prompt_len + n_out > SHAREGPT_MAX_TOTAL:
            continue
        out.append(SampleRequest(prompt, prompt_len, n_out))
    if not out:
        raise ValueError(f"--dataset-path {path}: no usable conversation (two turns, prompt "
                         f"{SHAREGPT_MIN_LEN}..{SHAREGPT_MAX_PROMPT} tokens)")
    while len(out) < num_prompts:
        out.append(out[int(rng.integers(0, len(out)))])
    return out
