"""Turns sampled tokens into text and decides when a request stops.

Used by the offline engine and by the router (nodes only see token ids), so
stop strings and streaming text behave the same everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.sampling import SamplingParams
from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class TextDelta:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_str: str | None = None     # the stop string that ended it (Anthropic's stop_sequence)


class RequestOutputState:
    """Text and stop state of one request. Text that could still turn out to be
    the start of a stop string is held back until it is decided."""

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: list[int],
                 params: SamplingParams, eos_token_ids: tuple[int, ...], max_model_len: int):
        self.params = params
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids) if tokenizer else None
        self.stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_ids.update(eos_token_ids)
        self.max_total = max_model_len
        self.num_prompt = len(prompt_ids)
        self.token_ids: list[int] = []
        self.text = ""
        self.num_emitted_chars = 0
        self.finish_reason: str | None = None
        self.stop_str: str | None = None
        self._hold = max((len(s) for s in params.stop), default=1) - 1

    def add(self, token_ids: list[int], finish_reason: str | None = None) -> TextDelta:
        """Adds tokens made by the engine; returns what a client should see now.
        ``finish_reason`` is a reason already decided elsewhere (a node)."""
        new_ids: list[int] = []
        for tok in token_ids:
            if self.finish_reason is not None:
                break
            new_ids.append(tok)
            self.token_ids.append(tok)
            if self.detok is not None:
                self.text += self.detok.add([tok])
                if self.params.stop and len(self.token_ids) >= self.params.min_tokens \
                        and self._cut_at_stop_string():
                    self.finish_reason = "stop"
                    break
            if tok in self.stop_ids:
                self.finish_reason = "stop"
            elif len(self.token_ids) >= self.params.max_tokens \
                    or self.num_prompt + len(self.token_ids) >= self.max_total:
                self.finish_reason = "length"
        if self.finish_reason is None and finish_reason is not None:
            self.finish_reason = finish_reason
        end = len(self.text) if self.finish_reason else max(
            self.num_emitted_chars, len(self.text) - self._undecided_tail())
        delta = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return TextDelta(new_ids, delta, self.finish_reason, self.stop_str)

    def _undecided_tail(self) -> int:
        """Length of the longest end of the text that begins some stop string. Only
        positions holding a stop string's first character are tried, in C (str.find),
        so the cost follows the held text, not hold x number of stop strings."""
        start = max(len(self.text) - self._hold, self.num_emitted_chars - self._hold, 0)
        best = 0
        for stop in self.params.stop:
            lo = max(start, len(self.text) - len(stop))
            pos = self.text.find(stop[0], lo)
            while pos >= 0 and len(self.text) - pos > best:
                if stop.startswith(self.text[pos:]):
                    best = len(self.text) - pos
                    break
                pos = self.text.find(stop[0], pos + 1)
        return best

    def _cut_at_stop_string(self) -> bool:
        window = self.text[max(0, self.num_emitted_chars - self._hold):]
        base = len(self.text) - len(window)
        hits = [(h, s) for s in self.params.stop if (h := window.find(s)) >= 0]
        if not hits:
            return False
        at, self.stop_str = min(hits, key=lambda hit: hit[0])
        self.text = self.text[:base + at]
        return True
