"""The choices of one OpenAI request: ``n`` per prompt, every prompt of a completions list,
each its own request in the core (seeded by vLLM's rule: see openai_schema.child_params),
read together and answered as one body or one SSE stream, choice index = prompt_i * n + j.

Also the logprobs' wire shapes, vLLM's: completions ``{tokens, token_logprobs,
top_logprobs (dicts keyed by token text: the token and the k most likely), text_offset}``,
chat ``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``;
-inf is written as -9999.0, as OpenAI and vLLM do.
"""
from __future__ import annotations

import asyncio
import functools
import uuid
from collections import deque
from dataclasses import dataclass, field

from pdserve.common.logprobs import empty, join
from pdserve.common.protocol import MAX_HEADER_BYTES, Logprobs
from pdserve.router.http.openai_schema import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_CHOICES,
    ChoiceOptions,
    bad,
    chat_messages,
    chat_prompt_ids,
    child_params,
    completion_prompts,
    encode_text,
    sampling_params,
)
from pdserve.router.streams import GenerationRequest, RequestStream, StreamEvent

LOWEST = -9999.0
# Prompt logprobs travel in one FirstTokens header: at most half its limit, an entry (an id
# and a float) packing in at most 14 bytes.
MAX_PROMPT_LOGPROBS_BYTES = MAX_HEADER_BYTES // 2
BYTES_PER_LOGPROB = 14


# -- logprobs in vLLM's shapes ------------------------------------------------------------
class TokenTexts:
    """Token id -> its text alone (special tokens spelt out), cached per request."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id],
                                                                skip_special_tokens=False)
        return text


def _lp(value: float) -> float:
    return max(value, LOWEST)


def completion_logprobs(texts: TokenTexts, token_ids: list[int], lp: Logprobs,
                        offset: int = 0, first_unscored: bool = False) -> dict:
    """``lp`` holds one entry per token, except the first when ``first_unscored`` (an echoed
    prompt's first token: logprob and top_logprobs null). ``offset``: the text_offset of
    the first token (the choice's text before it)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for i, token_id in enumerate(token_ids):
        token = texts(token_id)
        out["tokens"].append(token)
        out["text_offset"].append(offset)
        offset += len(token)
        e = i - first_unscored
        if e < 0:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_lp(lp.token_logprobs[e]))
        top = {token: _lp(lp.token_logprobs[e])}
        for t, v in zip(lp.top_ids[e], lp.top_logprobs[e]):
            top[texts(t)] = _lp(v)
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(texts: TokenTexts, token_ids: list[int], lp: Logprobs) -> dict:
    def entry(token_id: int, value: float) -> dict:
        token = texts(token_id)
        return {"token": token, "logprob": _lp(value),
                "bytes": list(token.encode("utf-8", errors="replace"))}

    return {"content": [
        {**entry(t, lp.token_logprobs[i]),
         "top_logprobs": [entry(a, v) for a, v in zip(lp.top_ids[i], lp.top_logprobs[i])]}
        for i, t in enumerate(token_ids)]}


# -- the choices of one request -----------------------------------------------------------
@dataclass
class Choice:
    index: int
    stream: RequestStream
    prompt_text: str = ""               # echoed before the completion (echo only)
    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    prompt_logprobs: Logprobs | None = None
    finish_reason: str | None = None
    stop_str: str | None = None         # the stop string that ended it, if one did
    completion_tokens: int = 0
    num_chars: int = 0                  # text sent so far (streaming), for text_offset
    tools: object = None                # a ToolStream (tool_parsers.py) when calls may come

    def add(self, event: StreamEvent) -> None:
        self.parts.append(event.text)
        self.token_ids.extend(event.token_ids)
        if event.logprobs is not None:
            self.logprobs.append(event.logprobs)
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        self.completion_tokens = event.completion_tokens or len(self.token_ids)
        self.finish_reason = event.finish_reason
        self.stop_str = event.stop_str


class Choices:
    """The choices' streams read as one: ``__anext__`` gives (choice, event) in arrival
    order; ``cancel`` ends them all; ClientWatch reads it with take, ended and wakeup. As
    a stream does, it merges the events of a choice its reader has not taken yet: a slow
    reader holds at most one event per choice."""

    def __init__(self, choices: list[Choice]):
        self.choices = choices
        self.request_id = choices[0].stream.request_id
        self._pending: dict[int, StreamEvent] = {}   # by position in choices
        self._order: deque[int] = deque()            # positions with an event, oldest first
        self._waiter: asyncio.Future | None = None
        if len(choices) > 1:
            for pos, c in enumerate(choices):
                c.stream.sink = functools.partial(self._take, pos)

    def _take(self, pos: int, event: StreamEvent) -> None:
        earlier = self._pending.get(pos)
        if earlier is None:
            self._order.append(pos)
        self._pending[pos] = event if earlier is None else earlier.then(event)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[Choice, StreamEvent]:
        while (item := self.take()) is None:
            if self.ended:
                raise StopAsyncIteration
            await self.wakeup()
        return item

    def take(self) -> tuple[Choice, StreamEvent] | None:
        """The oldest choice with events not taken yet, and those events merged; None when
        no choice has any (never waits)."""
        if len(self.choices) == 1:  # one choice: read its stream directly
            event = self.choices[0].stream.take()
            return None if event is None else (self.choices[0], event)
        if not self._order:
            return None
        pos = self._order.popleft()
        return self.choices[pos], self._pending.pop(pos)

    @property
    def ended(self) -> bool:
        """Every choice's last event arrived and was taken."""
        if len(self.choices) == 1:
            return self.choices[0].stream.ended
        return not self._order and all(c.stream.done for c in self.choices)

    def wakeup(self) -> asyncio.Future:
        """A future set when any choice's next event arrives."""
        if len(self.choices) == 1:
            return self.choices[0].stream.wakeup()
        self._waiter = asyncio.get_running_loop().create_future()
        return self._waiter

    def cancel(self) -> None:
        for c in self.choices:
            c.stream.cancel()

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)


async def prompts(core, body: dict, chat: bool,
                  plan=None) -> list[tuple[str | None, list[int]]]:
    """Each prompt's (text or None, token ids). Text is checked for size, then templated and
    tokenized in the core's bounded tokenizer pool, never on the event loop. ``plan``: the
    chat's tools (tools.ToolPlan), rendered with the messages."""
    if chat:
        messages = chat_messages(body.get("messages"), core.max_model_len)
        core.prompt_bound.check_messages(messages)
        tools, family = (plan.tools, plan.family) if plan is not None else (None, None)
        return [(None, await core.tokenizing.run(chat_prompt_ids, core.tokenizer, messages,
                                                 tools, family))]
    out = []
    for prompt in completion_prompts(body.get("prompt")):
        if isinstance(prompt, list):
            out.append((None, prompt))
            continue
        core.prompt_bound.check(prompt)
        out.append((prompt, await core.tokenizing.run(encode_text, core.tokenizer, prompt)))
    return out


def submit_choices(core, body: dict, chat: bool, opts: ChoiceOptions,
                   prompt_list: list[tuple[str | None, list[int]]], plan=None) -> Choices:
    """One core request per choice (prompt-major: index = prompt_i * n + j); when one is
    refused, those already submitted are cancelled. ``plan``: the chat's tools
    (tools.ToolPlan): each choice gets its own parser."""
    if len(prompt_list) * opts.n > MAX_CHOICES:
        raise bad(f"{len(prompt_list)} prompts x n={opts.n} make {len(prompt_list) * opts.n} "
                  f"choices; at most {MAX_CHOICES} are accepted", "n")
    if opts.echo_only:
        body = {**body, "max_tokens": 1}  # scored by the prefill; the token is not shown
    if opts.echo and opts.logprobs is not None:
        longest = max(len(ids) for _, ids in prompt_list)
        if longest * (opts.logprobs + 1) * BYTES_PER_LOGPROB > MAX_PROMPT_LOGPROBS_BYTES:
            raise bad(f"echo with logprobs={opts.logprobs} on a {longest}-token prompt makes "
                      f"more prompt logprobs than a node can send (at most "
                      f"{MAX_PROMPT_LOGPROBS_BYTES // BYTES_PER_LOGPROB} token x alternative "
                      "entries): ask for fewer logprobs", "logprobs")
    choices, base = [], uuid.uuid4().hex
    try:
        for i, (text, ids) in enumerate(prompt_list):
            if chat:
                # Default: as many tokens as the context leaves (core.check refuses a full one).
                params = sampling_params(body, max(1, core.max_model_len - len(ids)),
                                         ("max_completion_tokens", "max_tokens"))
            else:
                params = sampling_params(body, COMPLETIONS_DEFAULT_MAX_TOKENS)
            for j in range(opts.n):
                index = i * opts.n + j
                req = GenerationRequest(ids, child_params(params, opts, j),
                                        request_id=base if index == 0 else f"{base}-{index}")
                stream = core.submit(req)  # runs core.check: context, vocabulary, params
                echo = "" if not opts.echo else \
                    text if text is not None else core.tokenizer.decode(ids, False)
                choices.append(Choice(index, stream, echo,
                                      tools=plan.stream() if plan is not None else None))
    except BaseException:
        for c in choices:
            c.stream.cancel()
        raise
    return Choices(choices)


def choice_logprobs(chat: bool, texts: TokenTexts, choice: Choice, echo: bool,
                    token_ids: list[int], lp: Logprobs | None, offset: int,
                    with_prompt: bool) -> dict | None:
    """The logprobs object of some of a choice's tokens; ``with_prompt``: the echoed
    prompt's tokens come first (completions only)."""
    if lp is None:
        return None
    if chat:
        return chat_logprobs(texts, token_ids, lp)
    if with_prompt and echo:
        prompt_ids = choice.stream.prompt_token_ids
        lp = join([choice.prompt_logprobs or empty(), lp])
        return completion_logprobs(texts, prompt_ids + token_ids, lp, 0,
                                   first_unscored=True)
    return completion_logprobs(texts, token_ids, lp, offset)
