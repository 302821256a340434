"""Queue-producer ingress: a ROUTER socket where producers (DEALERs) submit requests
as plain MessagePack maps and get their tokens back on the same socket.

The contract is docs/queue-protocol.md; its messages are the Structs of
common/protocol/queue.py, which the clients use too. It runs in the router's asyncio loop:

1. ``run`` receives one message, decodes it (one typed msgspec pass, bounded in how far it
   may outgrow its frame) and answers bad input with an ``error`` at once, naming the
   field (the ingress keeps serving whatever a producer sends).
2. A ``submit`` becomes ``core.submit(GenerationRequest)`` (never waits); the stream
   hands each event to ``_deliver`` (no task per request), which turns it into a
   ``tokens`` message and, at the end, exactly one ``done`` or ``error``.
   A producer's messages of one loop turn leave together, one multipart message.
3. A ``cancel`` aborts the stream and answers ``done`` with finish_reason "abort".
4. A ``resume`` (the producer's router died) is a request too: ``core.resume`` finds its
   stream on the decode node that keeps it, and it goes on as a submit's would.

Requests are keyed by (producer identity, id): ids are the producer's own.
Every send is NOBLOCK: a producer that vanished or stopped reading (its queue is
full) gets its requests cancelled and logged; it never holds up anyone else.
"""
from __future__ import annotations

import asyncio
import errno
import functools
import logging
import re
import reprlib
from dataclasses import dataclass

import msgspec
import zmq

from pdserve.common.codec import check_expansion
from pdserve.common.errors import DUPLICATE_ID, OVERLOADED
from pdserve.common.logs import LogThrottle
from pdserve.common.protocol import queue as Q
from pdserve.common.rate_limit import Bucket
from pdserve.common.sampling import SamplingParams
from pdserve.common.transport import CurveConfig, PlainTwin, endpoint_of, make_socket
from pdserve.router.http.openai_schema import encode_text
from pdserve.router.streams import (
    BAD_REQUEST,
    INTERNAL,
    GenerationRequest,
    RequestError,
    RequestStream,
    StreamEvent,
)

log = logging.getLogger(__name__)

MAX_MSG_SIZE = 4 * 1024 * 1024  # bytes per frame; a bigger one disconnects the producer
# Messages queued per producer before it counts as not reading. High, because one producer
# may have thousands of requests whose tokens all go out in the same loop tick.
SNDHWM = 100_000
MAX_FRAMES_PER_SEND = 256  # messages to one producer in one multipart send, at most
SUBMIT_FIELDS = ("type", *Q.Submit.__struct_fields__)
# Back-pressure per producer: 100,000 submits from one producer, each a task, stalled the
# router's clock for seconds (every producer, /health and the HTTP API waited, and the
# stale clock refused as no_nodes). Beyond these a submit is `overloaded` at once.
MAX_IN_FLIGHT_PER_PRODUCER = 4096   # requests not yet ended
SUBMITS_PER_S, SUBMIT_BURST = 2000.0, 4096.0
MAX_PRODUCERS_TRACKED = 4096        # submit budgets kept (a producer may mint identities)
RETRY_AFTER_S = 1.0
REFUSAL_LOG_PERIOD_S = 10.0         # one log line per producer and reason per period
_FIELD = re.compile(r"`\$\.(\w+)")                       # msgspec's path to a bad value
_MISSING = re.compile(r"missing required field `(\w+)`")  # ... and to a missing one


@dataclass
class _Flight:
    stream: RequestStream | None = None  # None while its prompt is being tokenized
    task: asyncio.Task | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Ingress:
    def __init__(self, core, address: str, *, max_msg_size: int = MAX_MSG_SIZE,
                 sndhwm: int = SNDHWM, ctx: zmq.Context | None = None,
                 curve: CurveConfig | None = None):
        """Binds at once, so a taken address fails here; ``endpoint`` is the bound address.
        ``sndhwm``: messages queued per producer before it counts as not reading.
        ``curve``: CURVE server keys + allowed producers (security.server_curve)."""
        self.core = core
        self._sock = make_socket(ctx or zmq.Context.instance(), zmq.ROUTER,
                                 bind=address, max_msg_size=max_msg_size, sndhwm=sndhwm,
                                 curve=curve)
        self._twin = PlainTwin(self._sock)  # every send and receive goes through it
        self.endpoint = endpoint_of(self._sock)
        self._flights: dict[tuple[bytes, str], _Flight] = {}
        self._outbox: dict[bytes, list[bytes]] = {}   # this loop turn's messages per producer
        self._in_flight: dict[bytes, int] = {}        # requests not yet ended, per producer
        self._budgets: dict[bytes, Bucket] = {}       # submits per second, per producer
        self._refusal_log = LogThrottle(period_s=REFUSAL_LOG_PERIOD_S)
        self._closed = False

    @property
    def num_in_flight(self) -> int:
        return len(self._flights)

    async def run(self) -> None:
        """Serves until cancelled; then cancels every request in flight and closes."""
        log.info("queue ingress listening on %s", self.endpoint)
        try:
            async for frames in self._twin.received():
                try:
                    self._handle(frames[0], frames[1:])
                except Exception:  # a bug must not stop the ingress
                    self.core.metrics.internal_error("router.ingress", log)
        finally:
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for flight in self._flights.values():
            self._abort(flight)
        self._flights.clear()
        self._in_flight.clear()
        self._twin.close()
        self._sock.close(linger=0)

    # ------------------------------------------------------------ input

    def _handle(self, peer: bytes, frames: list[bytes]) -> None:
        if len(frames) != 1:
            return self._reject(peer, None, f"expected one frame (a MessagePack map), got "
                                            f"{len(frames)}")
        try:
            check_expansion(frames[0])
            msg = Q.PRODUCER_DECODER.decode(frames[0])
        except msgspec.ValidationError as e:
            rid, why = _explain(frames[0], e)
            if rid is not None and (peer, rid) in self._flights:
                # An error carrying the id of a request in flight would read as its end.
                return self._duplicate(peer, rid)
            return self._reject(peer, rid, why)
        except Exception as e:  # not MessagePack, or a frame that would grow too far
            return self._reject(peer, None, f"not valid MessagePack: {e}")
        if isinstance(msg, (Q.Submit, Q.Resume)):
            self._submit(peer, msg.id, msg)
        else:
            self._cancel(peer, msg.id)

    def _submit(self, peer: bytes, rid: str, msg: Q.Submit | Q.Resume) -> None:
        if (peer, rid) in self._flights:
            return self._duplicate(peer, rid)
        busy = self._over_budget(peer)
        if busy:
            self._send_error(peer, rid, OVERLOADED,
                             f"{busy}; retry after {RETRY_AFTER_S:g} s")
            return
        self._in_flight[peer] = self._in_flight.get(peer, 0) + 1
        flight = _Flight()  # holds the id while the prompt is tokenized off the loop
        self._flights[(peer, rid)] = flight
        flight.task = asyncio.get_running_loop().create_task(self._start(peer, rid, msg, flight))

    def _duplicate(self, peer: bytes, rid: str) -> None:
        self._send_error(peer, rid, DUPLICATE_ID,
                         f"request id {rid!r} is already in flight from this producer")

    def _over_budget(self, peer: bytes) -> str | None:
        """Why this producer may not submit now, or None (and its submit is counted)."""
        if self._in_flight.get(peer, 0) >= MAX_IN_FLIGHT_PER_PRODUCER:
            return (f"this producer has {MAX_IN_FLIGHT_PER_PRODUCER} requests in flight "
                    f"(MAX_IN_FLIGHT_PER_PRODUCER)")
        now = asyncio.get_running_loop().time()
        bucket = self._budgets.get(peer)
        if bucket is None:
            if len(self._budgets) >= MAX_PRODUCERS_TRACKED:
                del self._budgets[next(iter(self._budgets))]
            bucket = self._budgets[peer] = Bucket(SUBMITS_PER_S, SUBMIT_BURST, now)
        if not bucket.take(now):
            return f"this producer submits over {SUBMITS_PER_S:g} per second (SUBMITS_PER_S)"
        return None

    def _ended(self, key: tuple[bytes, str]) -> _Flight | None:
        """Forgets a request (answered, cancelled or dropped): its producer may send one
        more."""
        flight = self._flights.pop(key, None)
        if flight is not None:
            left = self._in_flight.get(key[0], 0) - 1
            if left > 0:
                self._in_flight[key[0]] = left
            else:
                self._in_flight.pop(key[0], None)
        return flight

    async def _start(self, peer: bytes, rid: str, msg: Q.Submit | Q.Resume,
                     flight: _Flight) -> None:
        try:
            if isinstance(msg, Q.Resume):  # the producer is its identity, as for its flights
                stream = self.core.resume(peer.hex(), rid, msg.tokens, None if msg.chars is
                                          msgspec.UNSET else msg.chars)
            else:  # the decode node keeps the stream for a resume: whose it is goes along
                stream = self.core.submit(await self._request(msg, (peer.hex(), rid)))
        except RequestError as e:
            self._ended((peer, rid))
            self._send_error(peer, rid, e.code, e.message)
            return
        except Exception as e:
            self._ended((peer, rid))
            self.core.metrics.internal_error("router.ingress.submit", log)
            self._send_error(peer, rid, INTERNAL, f"internal error: {e}")
            return
        flight.stream, flight.prompt_tokens = stream, len(stream.prompt_token_ids)
        stream.sink = functools.partial(self._deliver, peer, rid, flight)

    async def _request(self, msg: Q.Submit, origin: tuple[str, str]) -> GenerationRequest:
        """The GenerationRequest of a submit whose types the decoder checked; RequestError
        (bad_request) naming the field for what the types cannot say."""
        has_text, has_ids = msg.prompt is not msgspec.UNSET, msg.prompt_token_ids is not \
            msgspec.UNSET
        if has_text == has_ids:
            raise RequestError(BAD_REQUEST, "exactly one of 'prompt' (string) or "
                               "'prompt_token_ids' (list of integers) is required", "prompt")
        if has_text:
            self.core.prompt_bound.check(msg.prompt)
            ids = await self.core.tokenizing.run(encode_text, self.core.tokenizer,
                                                 msg.prompt) if msg.prompt else []
        else:
            ids = msg.prompt_token_ids
        if msg.max_tokens is msgspec.UNSET:
            raise RequestError(BAD_REQUEST, "field 'max_tokens' is required: "
                               f"{Q.FIELD_TYPES['max_tokens']}", "max_tokens")
        kwargs = {name: getattr(msg, name) for name in Q.SAMPLING_FIELDS
                  if getattr(msg, name) is not msgspec.UNSET}
        try:
            params = SamplingParams(**kwargs)
        except ValueError as e:
            raise RequestError(BAD_REQUEST, str(e), str(e).split("=", 1)[0]) from None
        return GenerationRequest(prompt_token_ids=list(ids), params=params, origin=origin)

    def _cancel(self, peer: bytes, rid: str) -> None:
        """Ends the request with done/abort now; an id not in flight is ignored, since its
        terminal message is already on its way."""
        flight = self._ended((peer, rid))
        if flight is None:
            return
        self._abort(flight)
        self._send(peer, self._done(rid, "abort", flight))

    # ------------------------------------------------------------ output

    def _deliver(self, peer: bytes, rid: str, flight: _Flight, ev: StreamEvent) -> None:
        """One stream event -> a tokens message; the last one also -> exactly one done or
        error. Called by the stream as the core pushes (no task per request)."""
        if self._flights.get((peer, rid)) is not flight:
            return  # cancelled or its producer dropped: already answered
        try:
            flight.prompt_tokens = ev.prompt_tokens or flight.prompt_tokens
            flight.completion_tokens = (ev.completion_tokens
                                        or flight.completion_tokens + len(ev.token_ids))
            if ev.token_ids or ev.text:
                self._send(peer, _tokens(rid, ev))
            if ev.error is not None:
                self._send(peer, _error(rid, ev.error.code, ev.error.message))
            elif ev.finish_reason is not None:
                self._send(peer, self._done(rid, ev.finish_reason, flight))
            else:
                return
        except Exception as e:
            self.core.metrics.internal_error("router.ingress.deliver", log)
            flight.stream.sink = None   # its abort event goes nowhere
            flight.stream.cancel()
            self._send(peer, _error(rid, INTERNAL, f"internal error: {e}"))
        self._ended((peer, rid))

    def _send(self, peer: bytes, msg: Q.Tokens | Q.Done | Q.Error) -> None:
        """Queues one message; each producer's messages of this loop turn leave together as
        one multipart message (one frame per message) when the turn ends."""
        if self._closed:
            return
        frames = self._outbox.get(peer)
        if frames is None:
            if not self._outbox:
                asyncio.get_running_loop().call_soon(self._flush)
            frames = self._outbox[peer] = []
        frames.append(Q.ENCODER.encode(msg))

    def _flush(self) -> None:
        """NOBLOCK sends of the turn's messages; a producer that cannot take them (gone, or
        its queue is full) has its requests cancelled."""
        outbox, self._outbox = self._outbox, {}
        if self._closed:
            return
        try:
            for peer, frames in outbox.items():
                for i in range(0, len(frames), MAX_FRAMES_PER_SEND):
                    try:
                        self._twin.plain.send_multipart(
                            [peer, *frames[i:i + MAX_FRAMES_PER_SEND]], flags=zmq.NOBLOCK)
                    except zmq.ZMQError as exc:
                        why = ("gone (not connected)" if exc.errno == errno.EHOSTUNREACH else
                               "not reading (send queue full)" if isinstance(exc, zmq.Again)
                               else str(exc))
                        self._drop_producer(peer, why)
                        break
        finally:
            if outbox:
                self._twin.rearm()

    def _drop_producer(self, peer: bytes, why: str) -> None:
        mine = [key for key in self._flights if key[0] == peer]
        log.warning("ingress: producer %r is %s; cancelling its %d request(s)", peer, why,
                    len(mine))
        current = asyncio.current_task()
        for key in mine:
            flight = self._ended(key)
            if flight.stream is not None:
                flight.stream.cancel()
            if flight.task is not None and flight.task is not current:
                flight.task.cancel()

    def _abort(self, flight: _Flight) -> None:
        if flight.stream is not None:
            flight.stream.cancel()
        if flight.task is not None and flight.task is not asyncio.current_task():
            flight.task.cancel()

    def _reject(self, peer: bytes, rid: str | None, message: str) -> None:
        self._send_error(peer, rid, BAD_REQUEST, message)

    def _send_error(self, peer: bytes, rid: str | None, code: str, message: str) -> None:
        # One line per producer and reason per period: a flood's refusals were 95,923
        # lines (16 MB) of log.
        suppressed = self._refusal_log((peer, code))
        if suppressed is not None:
            more = f" (and {suppressed} more refused since the last line)" if suppressed else ""
            log.warning("ingress: %s from %r (id %r): %s%s", code, peer, rid, message, more)
        self._send(peer, _error(rid, code, message))

    @staticmethod
    def _done(rid: str, finish_reason: str, flight: _Flight) -> Q.Done:
        return Q.Done(id=rid, finish_reason=finish_reason,
                      usage={"prompt_tokens": flight.prompt_tokens,
                             "completion_tokens": flight.completion_tokens})


def _error(rid: str | None, code: str, message: str) -> Q.Error:
    return Q.Error(id=rid, code=code, message=message)


def _describe(v) -> str:
    return "nothing" if v is None else f"{reprlib.repr(v)} ({type(v).__name__})"


def _explain(data: bytes, error: msgspec.ValidationError) -> tuple[str | None, str]:
    """(the id to answer with, what was wrong) for a frame the typed decoder refused, in
    docs/queue-protocol.md's words. The slow path: the frame is read again, untyped (its
    size was checked)."""
    try:
        msg = msgspec.msgpack.decode(data)
    except Exception as e:
        return None, f"not valid MessagePack: {e}"
    if not isinstance(msg, dict):
        return None, f"message must be a MessagePack map, got {type(msg).__name__}"
    rid, kind = msg.get("id"), msg.get("type")
    readable = rid if isinstance(rid, str) and 0 < len(rid) <= Q.MAX_ID_CHARS else None
    if kind not in ("submit", "cancel", "resume"):
        return readable, f"field 'type' must be {Q.FIELD_TYPES['type']}, got {_describe(kind)}"
    unknown = sorted(str(k) for k in msg if k not in SUBMIT_FIELDS)
    if kind == "submit" and unknown:
        return readable, (f"unknown field(s) {', '.join(unknown)}; allowed: "
                          f"{', '.join(SUBMIT_FIELDS)}")
    missing = _MISSING.search(str(error))
    if missing is not None:
        return None, f"field {missing.group(1)!r} is required: {Q.FIELD_TYPES[missing.group(1)]}"
    field = _FIELD.search(str(error))
    if field is None or field.group(1) not in Q.FIELD_TYPES:
        return readable, f"bad message: {error}"
    name = field.group(1)
    detail = str(error).split(" - at ")[0]
    return (readable if name != "id" else None,
            f"field {name!r} must be {Q.FIELD_TYPES[name]}, got {_describe(msg.get(name))} "
            f"({detail[:1].lower() + detail[1:]})")


def _tokens(rid: str, ev) -> Q.Tokens:
    lp = ev.logprobs
    return Q.Tokens(id=rid, token_ids=list(ev.token_ids), text=ev.text, logprobs=None
                    if lp is None else Q.TokenLogprobs(token_logprobs=lp.token_logprobs,
                                                       top_ids=lp.top_ids,
                                                       top_logprobs=lp.top_logprobs))
