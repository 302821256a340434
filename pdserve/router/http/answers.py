"""A submitted OpenAI request's answer, built from its choices' events: the full response
body (``collect``) or the chunk dicts of a stream, turn by turn (``ChunkStream``). The
one shape every generating endpoint reads: chat and completions serialize it as SSE, the
Responses and Anthropic adapters translate the chat chunks into their own events."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from pdserve.common.logprobs import empty, join
from pdserve.router.http.choices import (
    Choice,
    Choices,
    TokenTexts,
    choice_logprobs,
)
from pdserve.router.http.openai_schema import ChoiceOptions, Reply, error_body, usage
from pdserve.router.http.tool_parsers import finish_reason
from pdserve.router.http.wait import ClientWatch
from pdserve.router.streams import INTERNAL, RequestError, StreamEvent

logger = logging.getLogger(__name__)


def ended_early() -> RequestError:
    return RequestError(INTERNAL, "the request's stream ended without a final event")


@dataclass
class Answer:
    """What shapes the response of one request: its reply head, options and counts."""
    reply: Reply
    opts: ChoiceOptions
    texts: TokenTexts
    num_prompt: int           # prompt tokens, counted once per prompt (not per choice)

    def logprobs(self, choice: Choice, token_ids: list[int], lp, offset: int,
                 with_prompt: bool) -> dict | None:
        if self.opts.logprobs is None:
            return None
        if self.opts.echo_only:
            token_ids, lp = [], empty()
        return choice_logprobs(self.reply.chat, self.texts, choice, self.opts.echo, token_ids,
                               lp, offset, with_prompt)


class ClientGone(Exception):
    """The HTTP client went away before its answer was ready (499)."""


async def collect(answer: Answer, choices: Choices, watch: ClientWatch) -> dict:
    """A non-streaming response body: every event of every choice gathered into one.
    Raises the request's RequestError, or ClientGone."""
    while not choices.done:
        item = await watch.next(choices)
        if item is None:
            if watch.gone:  # nobody will read this
                raise ClientGone()
            raise ended_early()
        choice, event = item
        if event.error is not None:
            raise event.error
        choice.add(event)
    bodies, opts = [], answer.opts
    for c in choices.choices:
        text, calls = "" if opts.echo_only else "".join(c.parts), None
        if c.tools is not None:
            text, calls = c.tools.feed(text, final=True)[0], c.tools.calls
        lp = answer.logprobs(c, c.token_ids, join(c.logprobs), 0, with_prompt=True)
        bodies.append(answer.reply.choice(c.index, c.prompt_text + text, finish_reason(
            c.finish_reason, c.tools), lp, calls, c.stop_str))
    completion = 0 if opts.echo_only else choices.completion_tokens()
    return answer.reply.full(bodies, answer.num_prompt, completion)


def _stream_chunks(answer: Answer, choice: Choice, event: StreamEvent,
                   progress: dict) -> list[dict]:
    """The chunks of one event (its finish reason aside): its text, then its tool-call
    deltas (tool_parsers.ToolStream holds back what may open a call)."""
    opts, echoing = answer.opts, not choice.num_chars and choice.prompt_text
    ids, text = ([], "") if opts.echo_only else (event.token_ids, event.text)
    lp = answer.logprobs(choice, ids, event.logprobs, choice.num_chars, bool(echoing))
    if echoing:
        text = choice.prompt_text + text
    choice.num_chars += len(text)
    out, calls = [], None
    if choice.tools is not None:
        text, calls = choice.tools.feed(text, final=event.finish_reason is not None)
    if text or (lp and (ids or echoing)):
        out.append(answer.reply.chunk(text, index=choice.index, logprobs=lp,
                                      progress=progress))
    # One entry a chunk, as OpenAI streams them: a call's head, then its argument pieces.
    out += [answer.reply.chunk(index=choice.index, progress=progress, tool_calls=[entry])
            for entry in calls or ()]
    return out


@dataclass
class ChunkStream:
    """A streamed request whose first event is in and is not an error: its chunk dicts,
    one list per turn (what leaves in one write). A failure mid-stream is a last chunk
    holding an OpenAI error body (``{"error": ...}``), as the SSE stream carries it."""
    answer: Answer
    choices: Choices
    watch: ClientWatch
    first: tuple

    async def turns(self):
        """(chunks, ended) per turn; ``ended``: the stream is complete ([DONE] follows)."""
        item, reply, answer, choices = self.first, self.answer.reply, self.answer, self.choices
        out: list[dict] = []
        try:
            if reply.chat:
                out += [reply.chunk(role=True, index=c.index,
                                    progress=usage(answer.num_prompt, 0))
                        for c in choices.choices]
            while True:
                if item is None:
                    if not self.watch.gone:
                        yield out + [error_body(ended_early())], True
                    return
                if _event_chunks(answer, choices, item, out):
                    break
                yield out, False
                out = []
                item = await self.watch.next(choices)
            yield out, True
        except Exception:
            logger.exception("request %s failed while streaming", choices.request_id)
            yield [error_body(RequestError(INTERNAL, "internal error while streaming; see "
                                                     "the router's log"))], True
        finally:
            self.close()

    async def chunks(self):
        """The chunk dicts one by one (the adapters' view)."""
        async for turn, _ in self.turns():
            for chunk in turn:
                yield chunk

    def close(self) -> None:
        self.watch.close(self.choices)


def _event_chunks(answer: Answer, choices: Choices, item, out: list[dict]) -> bool:
    """Appends the chunks of one (choice, event) to ``out``; True when the stream ends
    (failed, or every choice finished)."""
    choice, event = item
    reply = answer.reply
    choice.add(event)
    progress = usage(answer.num_prompt, choices.completion_tokens())
    # an event may carry the last tokens and the end together
    out += _stream_chunks(answer, choice, event, progress)
    if event.error is not None:
        logger.warning("request %s failed mid-stream (%s): %s", choices.request_id,
                       event.error.code, event.error.message)
        out.append(error_body(event.error))
        return True
    if event.finish_reason is not None:
        out.append(reply.chunk(finish_reason=finish_reason(choice.finish_reason,
                                                           choice.tools),
                               index=choice.index, progress=progress,
                               stop_str=choice.stop_str))
    if choices.done:
        if reply.include_usage:
            completion = 0 if answer.opts.echo_only else choices.completion_tokens()
            out.append(reply.usage_chunk(answer.num_prompt, completion))
        return True
    return False
