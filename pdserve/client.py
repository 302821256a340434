"""Clients of the queue ingress (docs/queue-protocol.md), and ``pdserve submit``.

One DEALER socket carries every request of a client; replies are told apart by
id. ``QueueClient`` is blocking and belongs to one thread (as its socket does):
submit many, then read each ``stream(id)`` — replies of the others wait in
their buffers meanwhile. ``AsyncQueueClient`` is the same over zmq.asyncio,
with one reader task routing replies to per-id queues. Given a list of routers, either
resumes its streams on the next router when its router's connection ends
(client_streams.py).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections import defaultdict, deque
from dataclasses import dataclass

import click
import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdserve.client_streams import (  # noqa: F401 (QueueError: this module's API)
    ENDED,
    QueueError,
    Streams,
    close_sockets,
    endpoints_of,
)
from pdserve.client_streams import event as _event
from pdserve.common.cli_options import sampling_options
from pdserve.common.protocol import queue as Q
from pdserve.common.protocol.queue import Done, Tokens  # noqa: F401 (this module's API)
from pdserve.common.sockets import CurveConfig, make_socket

DEFAULT_INGRESS = "tcp://127.0.0.1:5557"
MAX_MSG_SIZE = 4 * 1024 * 1024  # the ingress's default limit: bigger frames are refused
_POLL_MS = 100  # never wait on the socket without a bound


@dataclass
class Result:
    id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    usage: dict


def _submit_message(rid, prompt, prompt_token_ids, sampling, max_msg_size) -> bytes:
    unknown = sorted(set(sampling) - set(Q.Submit.__struct_fields__))
    if unknown:  # the ingress would refuse it: say so before sending
        raise QueueError("bad_request", f"unknown field(s) {', '.join(unknown)}")
    msg = Q.Submit(id=rid, **sampling,
                   prompt=msgspec.UNSET if prompt is None else prompt,
                   prompt_token_ids=msgspec.UNSET if prompt_token_ids is None
                   else list(prompt_token_ids))
    data = Q.ENCODER.encode(msg)
    if len(data) > max_msg_size:
        # The ingress would drop the connection (and every request on it) without a word.
        raise QueueError("too_large", f"the request is {len(data)} bytes; the ingress takes "
                                      f"at most {max_msg_size}")
    return data


def _cancel_message(rid: str) -> bytes:
    return Q.ENCODER.encode(Q.Cancel(id=rid))


def _collect(rid: str, events) -> Result:
    ids, text = [], []
    for ev in events:
        if isinstance(ev, Tokens):
            ids.extend(ev.token_ids)
            text.append(ev.text)
        else:
            return Result(rid, ids, "".join(text), ev.finish_reason, ev.usage)
    raise QueueError("internal", f"request {rid!r} ended without a done message")


class QueueClient:
    def __init__(self, address: str | list[str] = DEFAULT_INGRESS, *,
                 max_msg_size: int = MAX_MSG_SIZE, send_timeout_s: float = 10.0,
                 curve: CurveConfig | None = None):
        """``address``: a router's ingress; or a list of them, and a stream whose router's
        connection ends resumes on the next one by itself."""
        self._ctx = zmq.Context()
        self._streams = Streams(*endpoints_of(address))
        self._options = dict(sndtimeo_ms=int(send_timeout_s * 1000), curve=curve)
        self._open()
        self.max_msg_size = max_msg_size
        self._buffers: dict[str, deque] = {}      # id -> events not yet read
        self._discard: dict[str, int] = defaultdict(int)  # id -> abandoned requests to skip

    def _open(self) -> None:
        self._sock = make_socket(self._ctx, zmq.DEALER, connect=self._streams.endpoint,
                                 **self._options, **self._streams.socket_options())
        self._monitor = self._sock.get_monitor_socket(ENDED) if self._streams.resumes \
            else None
        self._poller = zmq.Poller()  # the monitor wakes a wait as an answer does
        for sock in (self._sock, self._monitor):
            if sock is not None:
                self._poller.register(sock, zmq.POLLIN)

    def _close_socket(self) -> None:
        close_sockets(self._sock, self._monitor)

    def _failover(self) -> None:
        """The router's connection ended: what it sent is read, then every request in
        flight resumes on the next router."""
        while self._sock.poll(0):
            self._route(self._sock.recv())
        frames = self._streams.failover()
        self._close_socket()
        self._open()
        for data in frames:
            self._send(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self._close_socket()
        self._ctx.term()

    def submit(self, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
               id: str | None = None, **sampling) -> str:
        """Sends a request (sampling fields as in the protocol); returns its id at once."""
        rid = id if id is not None else uuid.uuid4().hex
        if rid in self._buffers:
            raise QueueError("duplicate_id", f"request id {rid!r} is already in flight")
        data = _submit_message(rid, prompt, prompt_token_ids, sampling, self.max_msg_size)
        self._send(data)
        self._buffers[rid] = deque()
        self._streams.sent(rid, data)
        return rid

    def cancel(self, id: str) -> None:
        """Ends the request on the router; its remaining replies are dropped."""
        if self._buffers.pop(id, None) is not None:
            self._streams.ended(id)
            self._discard[id] += 1
            self._send(_cancel_message(id))

    def stream(self, id: str, timeout_s: float | None = None):
        """Yields Tokens, then one Done; raises QueueError on an error answer, TimeoutError
        (after cancelling) when ``timeout_s`` passes. Leaving the loop early cancels."""
        if id not in self._buffers:
            raise KeyError(f"request id {id!r} is not in flight on this client")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        finished = False
        try:
            while True:
                ev = self._next(id, deadline)
                if isinstance(ev, QueueError):
                    finished = True
                    raise ev
                if isinstance(ev, Done):
                    finished = True
                yield ev
                if finished:
                    return
        finally:
            if finished:
                self._buffers.pop(id, None)
            else:
                self.cancel(id)

    def generate(self, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                 id: str | None = None, timeout_s: float | None = None, **sampling) -> Result:
        """Submits and waits for the whole result."""
        rid = self.submit(prompt, prompt_token_ids, id, **sampling)
        return _collect(rid, self.stream(rid, timeout_s))

    def _send(self, data: bytes) -> None:
        try:
            self._sock.send(data)
        except zmq.Again:
            raise TimeoutError("the ingress is not taking messages (send timed out)") from None

    def _next(self, rid: str, deadline: float | None):
        buf = self._buffers[rid]
        while not buf:
            wait_ms = _POLL_MS if deadline is None else \
                min(_POLL_MS, int((deadline - time.monotonic()) * 1000))
            if wait_ms <= 0:
                raise TimeoutError(f"request {rid!r} did not finish in time")
            ready = dict(self._poller.poll(wait_ms))
            if self._sock in ready:
                while self._sock.poll(0):
                    self._route(self._sock.recv())
            if self._monitor in ready and \
                    parse_monitor_message(self._monitor.recv_multipart())["event"] == ENDED:
                self._failover()
        return buf.popleft()

    def _route(self, data: bytes) -> None:
        rid, ev = _event(data)
        if self._discard.get(rid):
            if isinstance(ev, (Done, QueueError)):
                self._discard[rid] -= 1
                if not self._discard[rid]:
                    del self._discard[rid]
            return
        ev, again = self._streams.answer(rid, ev)
        if again is not None:  # no router had it: it is submitted again, as it was
            self._send(again)
        elif rid in self._buffers and ev is not None:
            self._buffers[rid].append(ev)
            if isinstance(ev, (Done, QueueError)):
                self._streams.ended(rid)


class AsyncQueueClient:
    """``await client.generate(...)``, ``async for ev in client.stream(id)``; one event loop."""

    def __init__(self, address: str | list[str] = DEFAULT_INGRESS, *,
                 max_msg_size: int = MAX_MSG_SIZE, curve: CurveConfig | None = None):
        self._ctx = zmq.asyncio.Context()
        self._streams = Streams(*endpoints_of(address))
        self._curve = curve
        self._open()
        self.max_msg_size = max_msg_size
        self._queues: dict[str, asyncio.Queue] = {}
        self._discard: dict[str, int] = defaultdict(int)
        self._reader: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # the watch of the router's connection

    def _open(self) -> None:
        self._sock = make_socket(self._ctx, zmq.DEALER, connect=self._streams.endpoint,
                                 curve=self._curve, **self._streams.socket_options())
        self._monitor = self._sock.get_monitor_socket(ENDED) if self._streams.resumes \
            else None

    async def _watch(self, monitor) -> None:
        """Until this router's connection ends; then every request in flight resumes on
        the next router (the reader has taken what the old one sent)."""
        while parse_monitor_message(await monitor.recv_multipart())["event"] != ENDED:
            pass
        self._reader.cancel()
        while True:  # what the router sent before it went, not read yet
            try:
                await self._take(await self._sock.recv(flags=zmq.NOBLOCK))
            except zmq.Again:
                break
        close_sockets(self._sock, monitor)
        frames = self._streams.failover()
        self._open()
        self._reader = asyncio.get_running_loop().create_task(self._read())
        for data in frames:
            await self._sock.send(data)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.close()

    def close(self) -> None:
        for task in [self._reader, *self._tasks]:
            if task is not None:
                task.cancel()
        close_sockets(self._sock, self._monitor)
        self._ctx.term()

    async def submit(self, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                     id: str | None = None, **sampling) -> str:
        rid = id if id is not None else uuid.uuid4().hex
        if rid in self._queues:
            raise QueueError("duplicate_id", f"request id {rid!r} is already in flight")
        data = _submit_message(rid, prompt, prompt_token_ids, sampling, self.max_msg_size)
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())
        self._queues[rid] = asyncio.Queue()
        self._streams.sent(rid, data)
        await self._sock.send(data)
        return rid

    async def cancel(self, id: str) -> None:
        if self._queues.pop(id, None) is not None:
            self._streams.ended(id)
            self._discard[id] += 1
            await self._sock.send(_cancel_message(id))

    async def stream(self, id: str, timeout_s: float | None = None):
        """As QueueClient.stream."""
        queue = self._queues.get(id)
        if queue is None:
            raise KeyError(f"request id {id!r} is not in flight on this client")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        finished = False
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(queue.get(), None if deadline is None
                                                else max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    raise TimeoutError(f"request {id!r} did not finish in time") from None
                finished = isinstance(ev, (Done, QueueError))
                if isinstance(ev, QueueError):
                    raise ev
                yield ev
                if finished:
                    return
        finally:
            if finished:
                self._queues.pop(id, None)
            elif self._queues.pop(id, None) is not None and not self._sock.closed:
                # A `break` closes the generator later, from the loop's finalizer, where
                # awaiting is unreliable: send without waiting (NOBLOCK resolves at once).
                self._discard[id] += 1
                fut = self._sock.send(_cancel_message(id), flags=zmq.NOBLOCK)
                if fut.done():
                    fut.exception()  # a full queue: the router's deadline ends it instead

    async def generate(self, prompt: str | None = None,
                       prompt_token_ids: list[int] | None = None, id: str | None = None,
                       timeout_s: float | None = None, **sampling) -> Result:
        rid = await self.submit(prompt, prompt_token_ids, id, **sampling)
        events = [ev async for ev in self.stream(rid, timeout_s)]
        return _collect(rid, events)

    async def _read(self) -> None:
        if self._monitor is not None:  # the watch starts the next reader when it fails over
            watch = asyncio.get_running_loop().create_task(self._watch(self._monitor))
            self._tasks.add(watch)
            watch.add_done_callback(self._tasks.discard)
        while True:
            await self._take(await self._sock.recv())

    async def _take(self, data: bytes) -> None:
        rid, ev = _event(data)
        if self._discard.get(rid):
            if isinstance(ev, (Done, QueueError)):
                self._discard[rid] -= 1
                if not self._discard[rid]:
                    del self._discard[rid]
            return
        ev, again = self._streams.answer(rid, ev)
        queue = self._queues.get(rid)
        if again is not None:  # no router had it: it is submitted again, as it was
            await self._sock.send(again)
        elif queue is not None and ev is not None:
            queue.put_nowait(ev)
            if isinstance(ev, (Done, QueueError)):
                self._streams.ended(rid)


@click.command("submit")
@click.option("--ingress", default=DEFAULT_INGRESS, show_default=True,
              help="The router's queue ingress.")
@click.option("--prompt", required=True, help="Prompt text.")
@sampling_options
@click.option("--stop", multiple=True, help="Stop string; repeat for more.")
@click.option("--ignore-eos", is_flag=True, default=False)
@click.option("--stream/--no-stream", default=True, show_default=True,
              help="Print text as it comes, or all at the end.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True),
              default=600.0, show_default=True, help="Seconds to wait for the whole result.")
@click.option("--curve-dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="CurveZMQ keys: router.key and --curve-key's keypair (docs/security.md).")
@click.option("--curve-key", default="client", show_default=True)
def submit_cmd(ingress, prompt, max_tokens, temperature, top_p, top_k, seed, stop, ignore_eos,
               stream, timeout_s, curve_dir, curve_key) -> None:
    """Send one request to a running router's queue ingress and print the completion."""
    sampling = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                    seed=seed, stop=list(stop), ignore_eos=ignore_eos)
    parts, done = [], None
    from pdserve.common.security import client_curve

    try:
        curve = client_curve(curve_dir, curve_key)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    with QueueClient(ingress, curve=curve) as client:
        try:
            rid = client.submit(prompt=prompt, **sampling)
            for ev in client.stream(rid, timeout_s):
                if isinstance(ev, Done):
                    done = ev
                elif stream:
                    click.echo(ev.text, nl=False)
                else:
                    parts.append(ev.text)
        except QueueError as e:
            raise click.ClickException(f"{e.code}: {e.message}") from None
        except TimeoutError as e:
            raise click.ClickException(f"timeout: {e} (is a router at {ingress}?)") from None
    click.echo("".join(parts))
    click.echo(f"--- finish_reason={done.finish_reason} prompt_tokens="
               f"{done.usage.get('prompt_tokens')} completion_tokens="
               f"{done.usage.get('completion_tokens')}")
