"""The multi-turn workload: chat conversations whose every turn resends the whole history.

A conversation is a system prompt (shared by groups of ``shared_system`` conversations),
then ``turns`` turns; turn k+1's prompt is turn k's prompt, the answer the server gave
to it, and a new user message. A prefix cache can therefore serve all of turn k+1's
prompt but its last two parts, if the request lands where turn k's prompt was cached.

What goes on the wire depends on the endpoint, as for the random dataset:

- ``/v1/completions`` and the ingress: token ids. The history is the previous prompt's
  ids, unchanged, then the answer's ids (those the ingress streamed; over HTTP, which
  streams text, the answer's text encoded again) and the user message's ids. The
  server sees exact lengths, and the previous prompt byte for byte, whatever the
  detokenizer made of the answer.
- ``/v1/chat/completions``: messages (system, user, assistant, user...), the answer as
  the text streamed; the server's chat template renders the history the same way every
  turn, so the previous prompt is again a prefix. ``prompt_len`` then counts the
  messages' tokens, not the template's.

Pure: the conversations are built from a seed, and ``Conversation`` only keeps state;
runner.run_conversations sends the turns.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pdserve.bench.datasets import SampleRequest, _allowed_ids, _text_of_length


@dataclass(frozen=True)
class MultiTurnSpec:
    """The workload's shape, as the flags give it."""
    turns: int
    system_len: int
    user_len: int
    output_len: int
    shared_system: int = 1   # conversations per system prompt
    range_ratio: float = 0.0  # user and output lengths uniform in [L*(1-r), L*(1+r)]

    def check(self) -> None:
        """Raises ValueError naming the flag that is out of range."""
        for flag, value, least in (("--multi-turn-turns", self.turns, 1),
                                   ("--multi-turn-system-len", self.system_len, 0),
                                   ("--multi-turn-user-len", self.user_len, 1),
                                   ("--multi-turn-shared-system", self.shared_system, 1),
                                   ("--output-len", self.output_len, 1)):
            if value < least:
                raise ValueError(f"{flag} must be at least {least}, got {value}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {self.range_ratio}")
        if math.floor(self.user_len * (1 - self.range_ratio)) < 1:
            raise ValueError("--multi-turn-user-len with --random-range-ratio leaves user "
                             "messages with no token")

    def longest_prompt(self) -> int:
        """The most tokens a last turn's prompt can hold (messages only, in chat)."""
        hi_user = math.ceil(self.user_len * (1 + self.range_ratio))
        hi_out = math.ceil(self.output_len * (1 + self.range_ratio))
        return self.system_len + self.turns * hi_user + (self.turns - 1) * hi_out


@dataclass
class Conversation:
    """One conversation's messages to come and its history so far."""
    index: int
    system: list[int] | str
    system_tokens: int
    users: list[list[int] | str]  # one per turn
    user_tokens: list[int]
    output_lens: list[int]
    chat: bool
    turn: int = 0                 # the next turn to send
    history: list = field(default_factory=list)  # ids, or chat messages
    history_len: int = 0          # its tokens (the messages' only, in chat)

    def __post_init__(self):
        if self.chat:
            self.history = [{"role": "system", "content": self.system}] if self.system else []
        else:
            self.history = list(self.system)
        self.history_len = self.system_tokens

    @property
    def done(self) -> bool:
        return self.turn == len(self.users)

    def next_request(self) -> SampleRequest:
        """Turn ``self.turn``'s request: the history and a new user message."""
        user = self.users[self.turn]
        prompt = [*self.history, {"role": "user", "content": user}] if self.chat \
            else [*self.history, *user]
        return SampleRequest(prompt, self.history_len + self.user_tokens[self.turn],
                             self.output_lens[self.turn])

    def add_answer(self, request: SampleRequest, answer_text: str,
                   answer_ids: list[int] | None, encode) -> None:
        """The server's answer to the last request closes the turn: the history becomes
        that request's prompt plus the answer (what arrived of it, if the turn failed).
        ``encode(text)`` gives a text's ids (no special tokens)."""
        if self.chat:
            self.history = [*request.prompt, {"role": "assistant", "content": answer_text}]
            self.history_len = request.prompt_len + len(encode(answer_text))
        else:
            ids = answer_ids if answer_ids is not None else encode(answer_text)
            self.history = [*request.prompt, *ids]
            self.history_len = len(self.history)
        self.turn += 1


def _piece(tokenizer, n: int, allowed: np.ndarray, rng: np.random.Generator,
           chat: bool) -> tuple[list[int] | str, int]:
    """``n`` random consecutive ids (from a random offset, so that pieces differ), or in
    chat their text, re-encoded to about ``n`` tokens; and its token count."""
    ids = allowed[(int(rng.integers(0, len(allowed))) + np.arange(n)) % len(allowed)].tolist()
    if not chat:
        return ids, n
    return _text_of_length(tokenizer, ids, n, allowed, rng) if n else ("", 0)


def conversations(tokenizer, num_prompts: int, spec: MultiTurnSpec, seed: int = 0,
                  chat: bool = False) -> list[Conversation]:
    """``num_prompts`` requests as ceil(num_prompts / turns) conversations (the last one
    shorter when they do not divide): --num-prompts counts requests, as for the other
    datasets, so throughput and counts mean the same."""
    spec.check()
    rng = np.random.default_rng(seed)
    allowed = _allowed_ids(tokenizer)
    r = spec.range_ratio
    lo_u, hi_u = math.floor(spec.user_len * (1 - r)), math.ceil(spec.user_len * (1 + r))
    lo_o = max(1, math.floor(spec.output_len * (1 - r)))
    hi_o = max(1, math.ceil(spec.output_len * (1 + r)))
    out: list[Conversation] = []
    system, system_tokens = [], 0
    for c in range(math.ceil(num_prompts / spec.turns)):
        if c % spec.shared_system == 0:
            system, system_tokens = _piece(tokenizer, spec.system_len, allowed, rng, chat)
        turns = min(spec.turns, num_prompts - c * spec.turns)
        users = [_piece(tokenizer, int(n), allowed, rng, chat)
                 for n in rng.integers(lo_u, hi_u + 1, size=turns)]
        outs = [int(n) for n in rng.integers(lo_o, hi_o + 1, size=turns)]
        out.append(Conversation(c, system, system_tokens, [u for u, _ in users],
                                [n for _, n in users], outs, chat))
    return out
