"""The queue ingress and its clients.

Socket tests run the real Ingress on loopback against a stand-in core (fast, no
model); end-to-end tests start ``pdserve launch`` and compare with the offline LLM.
"""
from __future__ import annotations

import asyncio
import threading
import time

import msgpack
import pytest
import zmq
from click.testing import CliRunner

from pdserve.client import (
    AsyncQueueClient,
    Done,
    QueueClient,
    QueueError,
    Tokens,
    submit_cmd,
)
from pdserve.common.metrics import RouterMetrics
from pdserve.common.transport import make_socket
from pdserve.router.config import RouterConfig
from pdserve.router.ingress import Ingress
from pdserve.router.limits import PromptBound
from pdserve.router.streams import BAD_REQUEST, OVERLOADED, RequestError, RequestStream, StreamEvent
from pdserve.router.tokenizing import TokenizerPool

# ------------------------------------------------------------------ stand-in core


class ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode())


class EchoCore:
    """Stands in for RouterCore: echoes the prompt's ids back, one every 5 ms."""
    tokenizer = ByteTokenizer()
    max_model_len = 64
    config = RouterConfig()
    prompt_bound = PromptBound(config, max_model_len, 1)  # one byte a token

    def __init__(self):
        self.cancelled: list[str] = []
        self._n = 0
        self.tokenizing = TokenizerPool(1, 64)
        self.metrics = RouterMetrics("echo")

    def submit(self, req):
        ids, params = req.prompt_token_ids, req.params
        if not ids:
            raise RequestError(BAD_REQUEST, "the prompt is empty", "prompt")
        if len(ids) >= self.max_model_len:
            raise RequestError(BAD_REQUEST, f"the prompt has {len(ids)} tokens but the "
                               f"model's context is {self.max_model_len} tokens", "prompt")
        if ids[0] == 0:
            raise RequestError(OVERLOADED, "queues full: retry later")
        self._n += 1
        stream = RequestStream(f"req-{self._n}", list(ids))
        task = asyncio.get_running_loop().create_task(self._run(stream, params.max_tokens))

        def cancel(rid):
            task.cancel()
            self.cancelled.append(rid)
            stream.push(StreamEvent([], "", finish_reason="abort"))
        stream._cancel = cancel
        return stream

    async def _run(self, stream, max_tokens):
        ids = stream.prompt_token_ids
        big = bytes(ids[:3]) == b"big"  # 100 kB of text per event: fills a producer fast
        for i in range(max_tokens):
            await asyncio.sleep(0.005)
            tok = ids[i % len(ids)]
            stream.push(StreamEvent([tok], chr(tok) * (100_000 if big else 1),
                                    prompt_tokens=len(ids),
                                    completion_tokens=i + 1,
                                    finish_reason="length" if i == max_tokens - 1 else None))


@pytest.fixture
def echo(request):
    """(address, core) of an Ingress over EchoCore, served by a loop in a thread; indirect
    parametrization passes Ingress keyword arguments."""
    started, box = threading.Event(), {}

    async def main():
        box["core"] = core = EchoCore()
        ingress = Ingress(core, "tcp://127.0.0.1:*", **getattr(request, "param", {}))
        box["address"], box["loop"] = ingress.endpoint, asyncio.get_running_loop()
        box["task"] = asyncio.current_task()
        started.set()
        try:
            await ingress.run()
        except asyncio.CancelledError:
            pass

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(10)
    yield box["address"], box["core"]
    box["loop"].call_soon_threadsafe(box["task"].cancel)
    thread.join(10)


class Producer:
    """A raw DEALER speaking the protocol by hand."""

    def __init__(self, address):
        self.ctx = zmq.Context()
        self.sock = make_socket(self.ctx, zmq.DEALER, connect=address)

    def send(self, msg):
        self.sock.send(msg if isinstance(msg, bytes) else msgpack.packb(msg))

    def recv(self, timeout_s=10.0):
        if not self.sock.poll(int(timeout_s * 1000)):
            raise TimeoutError("no answer from the ingress")
        return msgpack.unpackb(self.sock.recv(), raw=False)

    def until_end(self, timeout_s=30.0):
        msgs = [self.recv(timeout_s)]
        while msgs[-1]["type"] == "tokens":
            msgs.append(self.recv(timeout_s))
        return msgs

    def close(self):
        self.sock.close(0)
        self.ctx.term()


def submit(rid, **kw):
    if "prompt_token_ids" not in kw:
        kw.setdefault("prompt", "hi")
    return {"type": "submit", "id": rid, **kw}


# (what is sent, id the answer carries, words the message must contain)
BAD_INPUTS = [
    (b"\xc1\x00\xff random", None, "MessagePack"),
    (msgpack.packb([1, 2, 3]), None, "map"),
    ({"type": "launch", "id": "a"}, "a", "'type'"),
    ({"type": "submit"}, None, "'id'"),
    ({"type": "submit", "id": "b", "max_tokens": 4}, "b", "prompt"),
    (submit("c", max_tokens="4"), "c", "max_tokens"),
    (submit("d", max_tokens=0), "d", "max_tokens"),
    (submit("e", max_tokens=4, temperature=-1), "e", "temperature"),
    (submit("f", max_tokens=4, prompt="a", prompt_token_ids=[1, 2]), "f", "exactly one"),
    (submit("g", max_tokens=4, max_token=5), "g", "max_token"),
    (submit("h", max_tokens=4, prompt_token_ids=[5] * 2000), "h", "context"),
    # The schema's own limits (common/protocol/queue.py), named in the answer.
    (submit("i", max_tokens=4, seed=2**63), "i", "field 'seed' must be an integer in [0, 2^63)"),
    (submit("j", max_tokens=2**64 - 1), "j", "field 'max_tokens'"),
    (submit("k", max_tokens=4, stop=["a", 1]), "k", "field 'stop' must be a string or a list"),
    (submit("l", max_tokens=4, prompt_token_ids=[1, 2**64 - 1]), "l", "'prompt_token_ids'"),
    (submit("m", max_tokens=4, ignore_eos=1), "m", "field 'ignore_eos' must be a boolean"),
    (submit("n", max_tokens=4, max_token=5, top_q=1), "n", "unknown field(s) max_token, top_q"),
    (submit("o" * 1025, max_tokens=4), None, "field 'id' must be a non-empty string of at most"),
    ({"type": "cancel"}, None, "field 'id' is required"),
    # A string claiming 4 GiB in a few bytes: refused before anything is allocated.
    (msgpack.packb({"type": "submit", "id": "p", "max_tokens": 4})[:-1] + b"\xa6prompt"
     + b"\xdb\xff\xff\xff\xff", None, "MessagePack"),
    # Empty lists are 1 byte on the wire and 56 in memory: at most one per 4 bytes.
    (msgpack.packb(submit("q", max_tokens=4, stop_token_ids=[[]] * 100_000)), None,
     "one map or array per 4 bytes"),
]


def check_bad_inputs(address):
    p = Producer(address)
    try:
        for sent, rid, words in BAD_INPUTS:
            p.send(sent)
            got = p.recv()
            assert got["type"] == "error" and got["id"] == rid, (sent, got)
            assert got["code"] == "bad_request", got
            assert words in got["message"], (words, got)
            p.send(submit(f"ok-{rid}", max_tokens=2))  # still serving
            assert p.until_end()[-1]["type"] == "done"
    finally:
        p.close()


# ------------------------------------------------------------------ socket tests


def test_echo_tokens_done_and_usage(echo):
    address, _ = echo
    with QueueClient(address) as client:
        out = client.generate("hello", max_tokens=7, timeout_s=10)
    assert out.token_ids == list(b"hellohe") and out.text == "hellohe"
    assert out.finish_reason == "length"
    assert out.usage == {"prompt_tokens": 5, "completion_tokens": 7}


def test_bad_input_is_answered_and_ingress_keeps_serving(echo):
    check_bad_inputs(echo[0])


def test_submit_refused_by_core_keeps_its_code(echo):
    with QueueClient(echo[0]) as client, pytest.raises(QueueError) as e:
        client.generate(prompt_token_ids=[0, 1], max_tokens=3, timeout_s=10)
    assert e.value.code == OVERLOADED


def test_duplicate_id_and_ids_are_per_producer(echo):
    a, b = Producer(echo[0]), Producer(echo[0])
    try:
        a.send(submit("x", max_tokens=20))
        a.send(submit("x", max_tokens=20))
        a.send(submit("x", max_tokens=20, temperature=1000))  # a duplicate, and malformed
        b.send(submit("x", max_tokens=3))  # another producer: its own "x"
        errors = []
        while len(errors) < 2:  # the duplicates' errors come among x's tokens
            msg = a.recv()
            assert msg["type"] in ("tokens", "error"), msg
            errors += [msg] if msg["type"] == "error" else []
        # both say duplicate_id: an error naming "x" otherwise would read as x's end
        assert [e["code"] for e in errors] == ["duplicate_id"] * 2, errors
        msgs = a.until_end()
        assert msgs[-1]["type"] == "done" and msgs[-1]["usage"]["completion_tokens"] == 20
        assert b.until_end()[-1]["usage"]["completion_tokens"] == 3
    finally:
        a.close()
        b.close()


def test_cancel_ends_with_abort_and_cancels_core(echo):
    address, core = echo
    p = Producer(address)
    try:
        p.send(submit("long", max_tokens=60))
        assert p.recv()["type"] == "tokens"
        p.send({"type": "cancel", "id": "long"})
        msgs = p.until_end()
        assert msgs[-1]["type"] == "done" and msgs[-1]["finish_reason"] == "abort"
        p.send({"type": "cancel", "id": "long"})  # no longer in flight: ignored
        with pytest.raises(TimeoutError):
            p.recv(0.3)
        assert len(core.cancelled) == 1
    finally:
        p.close()


def test_vanished_producer_is_cancelled_others_unaffected(echo):
    address, core = echo
    gone = Producer(address)
    gone.send(submit("a", max_tokens=60))
    gone.send(submit("b", max_tokens=60))
    assert gone.recv()["type"] == "tokens"
    gone.close()
    deadline = time.monotonic() + 5
    while len(core.cancelled) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(core.cancelled) == 2
    with QueueClient(address) as client:
        assert client.generate("ok", max_tokens=3, timeout_s=10).finish_reason == "length"


@pytest.mark.parametrize("echo", [{"sndhwm": 8}], indirect=True)
def test_producer_not_reading_is_cancelled_others_unaffected(echo):
    address, core = echo
    ctx = zmq.Context()
    stuck = make_socket(ctx, zmq.DEALER, connect=address, rcvhwm=1)
    try:
        stuck.send(msgpack.packb(submit("s", prompt="big", max_tokens=2000)))
        with QueueClient(address) as client:
            assert client.generate("fine", max_tokens=50, timeout_s=10).text.startswith("fine")
            deadline = time.monotonic() + 20
            while not core.cancelled and time.monotonic() < deadline:
                time.sleep(0.05)
            assert core.cancelled, "the stuck producer's request was never cancelled"
            assert client.generate("after", max_tokens=5, timeout_s=10).text == "after"
    finally:
        stuck.close(0)
        ctx.term()


def test_oversized_frame_refused_locally_and_by_socket(echo):
    with QueueClient(echo[0]) as client, pytest.raises(QueueError) as e:
        client.submit(prompt="x" * (5 << 20), max_tokens=1)
    assert e.value.code == "too_large"
    p = Producer(echo[0])
    try:
        p.send(submit("big", max_tokens=1, prompt="x" * (5 << 20)))
        with pytest.raises(TimeoutError):
            p.recv(0.5)  # the socket dropped the producer; nothing was read
    finally:
        p.close()
    with QueueClient(echo[0]) as client:
        assert client.generate("ok", max_tokens=2, timeout_s=10).token_ids == list(b"ok")


def test_client_speaks_the_protocol_types(echo):
    """The client's events are protocol.queue's Structs, and a field the protocol does not
    have is refused before anything is sent."""
    with QueueClient(echo[0]) as client:
        with pytest.raises(QueueError, match="unknown field.*max_token") as e:
            client.submit("hi", max_token=3)
        assert e.value.code == "bad_request"
        rid = client.submit("hi", max_tokens=2)
        events = list(client.stream(rid, timeout_s=10))
    assert all(isinstance(ev, Tokens) for ev in events[:-1]) and len(events) > 1
    assert isinstance(events[-1], Done) and events[-1].usage["completion_tokens"] == 2


def test_client_timeout_cancels(echo):
    address, core = echo
    with QueueClient(address) as client:
        with pytest.raises(TimeoutError):
            client.generate("slow", max_tokens=60, timeout_s=0.05)
        # the abandoned request's late replies never reach the next one
        assert client.generate("next", max_tokens=4, timeout_s=10).text == "next"
    assert len(core.cancelled) == 1


def test_async_client_many_in_flight_and_break_cancels(echo):
    address, core = echo

    async def main():
        async with AsyncQueueClient(address) as client:
            outs = await asyncio.gather(*(client.generate(f"p{i:02d}", max_tokens=6,
                                                          timeout_s=10) for i in range(30)))
            assert [o.text for o in outs] == [f"p{i:02d}p{i:02d}"[:6] for i in range(30)]
            rid = await client.submit("loop", max_tokens=60)
            gen = client.stream(rid)
            async for _ in gen:
                break
            await gen.aclose()
            with pytest.raises(TimeoutError):
                await client.generate("slow", max_tokens=60, timeout_s=0.05)
            return (await client.generate("end", max_tokens=3, timeout_s=10)).text

    assert asyncio.run(main()) == "end"
    time.sleep(0.2)
    assert len(core.cancelled) == 2


# ------------------------------------------------------------------ end to end

try:
    from tests.cluster import launched
except ImportError:  # the launcher lands separately
    launched = None

e2e = pytest.mark.skipif(launched is None, reason="tests/cluster.py is not there yet")
PROMPTS = ["The cluster of prefill", "Hello, my name is", "a", "Queues are"]


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    model = tiny_model("llama")
    with launched(model, 1, 1, log_dir=tmp_path_factory.mktemp("logs")) as c:
        yield model, c


@pytest.fixture(scope="module")
def offline(cluster):
    from pdserve import LLM, SamplingParams

    llm = LLM(dtype="float32", model=cluster[0])
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True))]


GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)


@e2e
def test_e2e_blocking_and_async_equal_offline(cluster, offline):
    address = cluster[1].ingress
    with QueueClient(address) as client:
        assert client.generate(PROMPTS[0], **GREEDY, timeout_s=60).token_ids == offline[0]
        ids = [client.submit(p, **GREEDY) for p in PROMPTS]  # all in flight at once
        got = [[t for ev in client.stream(i, 60) if not isinstance(ev, Done)
                for t in ev.token_ids] for i in reversed(ids)]
    assert got == offline[::-1]

    async def main():
        async with AsyncQueueClient(address) as client:
            return await asyncio.gather(*(client.generate(p, **GREEDY, timeout_s=60)
                                          for p in PROMPTS))

    outs = asyncio.run(main())
    assert [o.token_ids for o in outs] == offline
    assert all(o.finish_reason == "length" and o.usage["completion_tokens"] == 12
               for o in outs)


@e2e
def test_e2e_many_in_flight_and_short_finishes_first(cluster):
    address = cluster[1].ingress

    async def main():
        finished = []
        async with AsyncQueueClient(address) as client:
            async def run(name, prompt, n):
                out = await client.generate(prompt, max_tokens=n, ignore_eos=True,
                                            temperature=0, timeout_s=120)
                finished.append(name)
                return out

            async def run_long():  # streams, so the short one is sent while it decodes
                rid = await client.submit("a long one", max_tokens=900, ignore_eos=True)
                n = 0
                async for ev in client.stream(rid, 120):
                    n += len(getattr(ev, "token_ids", []))
                    if n and not started.is_set():
                        started.set()
                finished.append("long")
                return n

            started = asyncio.Event()
            long = asyncio.create_task(run_long())
            await started.wait()
            outs = await asyncio.gather(run("short", "short", 2),
                                        *(run(f"m{i}", f"request {i}", 8) for i in range(24)))
            return finished, await long, outs

    finished, num_long, outs = asyncio.run(main())
    assert finished.index("short") < finished.index("long"), finished
    assert num_long == 900 and [len(o.token_ids) for o in outs] == [2] + [8] * 24


@e2e
def test_e2e_cancel_duplicate_and_bad_input(cluster):
    address = cluster[1].ingress
    p = Producer(address)
    try:
        p.send(submit("x", max_tokens=500, ignore_eos=True))
        p.send(submit("x", max_tokens=5))
        seen = p.recv(60)
        while seen["type"] == "tokens":
            seen = p.recv(60)
        assert seen["code"] == "duplicate_id"
        p.send({"type": "cancel", "id": "x"})
        end = p.until_end()[-1]
        assert end["type"] == "done" and end["finish_reason"] == "abort", end
        assert end["usage"]["completion_tokens"] < 500
    finally:
        p.close()
    check_bad_inputs(address)


@e2e
def test_e2e_submit_cli(cluster):
    address = cluster[1].ingress
    res = CliRunner().invoke(submit_cmd, ["--ingress", address, "--prompt", "Hello",
                                          "--max-tokens", "5", "--ignore-eos"])
    assert res.exit_code == 0, res.output
    assert "finish_reason=length" in res.output and "completion_tokens=5" in res.output
    res = CliRunner().invoke(submit_cmd, ["--ingress", address, "--prompt", "x " * 3000,
                                          "--no-stream"])
    assert res.exit_code != 0 and "bad_request" in res.output and "context" in res.output



@e2e
def test_e2e_answers_leave_batched_per_producer_and_turn(cluster, offline):
    """64 requests in flight from one producer: their answers come as a few multipart
    messages (one per loop turn, each frame one answer), not one send per token per
    request, and every request's tokens still arrive exactly once and in order."""
    n = 64
    p = Producer(cluster[1].ingress)
    try:
        for i in range(n):
            p.send(submit(f"r{i}", prompt=PROMPTS[i % len(PROMPTS)], **GREEDY))
        tokens, ends, messages, frames = {}, {}, 0, 0
        while len(ends) < n:
            assert p.sock.poll(60_000), f"{len(ends)} of {n} requests ended"
            parts = p.sock.recv_multipart()
            messages, frames = messages + 1, frames + len(parts)
            for part in parts:
                msg = msgpack.unpackb(part, raw=False)
                assert msg["id"] not in ends, f"an answer after the end: {msg}"
                if msg["type"] == "tokens":
                    tokens.setdefault(msg["id"], []).extend(msg["token_ids"])
                else:
                    ends[msg["id"]] = msg
    finally:
        p.close()
    for i in range(n):
        assert ends[f"r{i}"]["type"] == "done", ends[f"r{i}"]
        assert tokens[f"r{i}"] == offline[i % len(PROMPTS)], i
    assert frames >= 2 * n
    assert messages * 4 <= frames, (messages, frames)
