"""KV-cache events in vLLM's wire format, published by each node on a ZMQ PUB socket.

What consumers of vLLM's events (llm-d, Dynamo, SMG, Mooncake) read, unchanged:

- a multipart message ``[topic, seq, payload]``: ``seq`` an 8-byte big-endian counter
  from 0, ``payload`` msgpack ``[ts, events, data_parallel_rank]``;
- each event a msgpack array led by its tag, fields in vLLM's order:
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium]``, ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``;
- an optional replay ROUTER: a client sends ``[b"", start_seq]`` (8 bytes, big-endian)
  and gets every buffered ``[b"", seq, payload]`` from there, then ``[b"", -1, b""]``.

Hashes are pdserve's chained XXH3-64 block keys (``common/block_hash.py``). A node
publishes ``AllBlocksCleared`` first, so a subscriber drops what an earlier process
with the same endpoint told it. The socket belongs to the publisher's own thread; the
node hands it events through a bounded queue and never waits on it.

A batch is numbered when the node hands it over, not when it is sent: a batch the full
queue drops leaves a hole in the numbers, which a subscriber sees (a gap: it asks the node
for its whole index, protocol/index.py), and ``last_seq`` is what the node's compute loop
has published, the number an index dump is taken at.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields, replace

import msgpack
import msgspec
import zmq

from pdserve.common.block_hash import BlockRemoved, BlockStored
from pdserve.common.sockets import make_socket

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` keys and defaults."""
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000        # batches kept for replay
    hwm: int = 100_000                # PUB socket high-water mark
    max_queue_size: int = 100_000     # batches waiting for the publisher thread
    topic: str = ""

    def __post_init__(self):
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv-events publisher must be one of {PUBLISHERS}, "
                             f"got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv-events {name} must be a positive integer, got {value!r}")
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise ValueError(f"kv-events endpoint must look like tcp://HOST:PORT, "
                             f"got {self.endpoint!r}")

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        """Parses the flag's JSON; unknown keys and wrong types are errors that name them."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"--kv-events-config has unknown keys {unknown}; "
                             f"known: {sorted(known)}")
        if not isinstance(raw.get("enable_kv_cache_events", False), bool):
            raise ValueError("--kv-events-config enable_kv_cache_events must be true or false")
        for key in ("publisher", "endpoint", "topic"):
            if key in raw and not isinstance(raw[key], str):
                raise ValueError(f"--kv-events-config {key} must be a string")
        return cls(**raw)

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})

    def with_endpoints(self, endpoint: str, replay_endpoint: str | None) -> "KVEventsConfig":
        return replace(self, endpoint=endpoint, replay_endpoint=replay_endpoint)


# What a subscriber decodes (router/kv_index.py): vLLM's own msgspec types, the same
# tags and field order as encode_events writes.
class _Event(msgspec.Struct, array_like=True, tag=True, gc=False):
    pass


class StoredEvent(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class RemovedEvent(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class ClearedEvent(_Event, tag="AllBlocksCleared"):
    pass


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[StoredEvent | RemovedEvent | ClearedEvent]
    data_parallel_rank: int | None = None


_BATCH = msgspec.msgpack.Decoder(EventBatch)


def decode_batch(payload) -> EventBatch:
    """One published payload; msgspec.ValidationError/DecodeError when it is not one."""
    return _BATCH.decode(payload)


def encode_events(events: list, block_size: int, medium: str) -> list:
    """The allocator's events as vLLM event arrays; a chain of stored blocks (each the
    parent of the next) becomes one BlockStored, as vLLM sends them."""
    out: list = []
    for ev in events:
        if isinstance(ev, BlockStored):
            last = out[-1] if out else None
            if last is not None and last[0] == "BlockStored" and ev.parent_hash == last[1][-1]:
                last[1].append(ev.block_hash)
                last[3].extend(ev.token_ids)
            else:
                out.append(["BlockStored", [ev.block_hash], ev.parent_hash, list(ev.token_ids),
                            block_size, None, medium])
        elif isinstance(ev, BlockRemoved):
            last = out[-1] if out else None
            if last is not None and last[0] == "BlockRemoved":
                last[1].append(ev.block_hash)
            else:
                out.append(["BlockRemoved", [ev.block_hash], medium])
    return out


class KVEventPublisher(threading.Thread):
    def __init__(self, config: KVEventsConfig, block_size: int, medium: str = "CPU",
                 data_parallel_rank: int = 0):
        super().__init__(name="kv-events", daemon=True)
        self.config = config
        self.block_size = block_size
        self.medium = medium
        self.rank = data_parallel_rank
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque = deque(maxlen=config.buffer_steps)
        self._stopping = threading.Event()
        self._bound = threading.Event()
        self.num_dropped = 0
        self.last_seq = -1   # the number of the last batch handed over (-1: none)
        self.failure: BaseException | None = None
        self.endpoint = config.endpoint            # the bound address once started
        self.replay_endpoint = config.replay_endpoint
        self._put([["AllBlocksCleared"]])

    def start_and_wait(self, timeout_s: float = 10.0) -> None:
        """Starts the thread; ValueError when its sockets could not bind."""
        self.start()
        self._bound.wait(timeout_s)
        if self.failure is not None:
            raise ValueError(f"KV events socket {self.config.endpoint}: {self.failure}")

    def publish(self, allocator_events: list) -> None:
        """Never blocks: a full queue drops the batch and says so."""
        if allocator_events:
            self._put(encode_events(allocator_events, self.block_size, self.medium))

    def _put(self, events: list) -> None:
        self.last_seq += 1
        try:
            self._queue.put_nowait((self.last_seq, time.time(), events))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                log.warning("KV events queue full (%d batches): %d batches dropped",
                            self.config.max_queue_size, self.num_dropped)

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        ctx = zmq.Context.instance()
        pub = replay = None
        try:
            pub = make_socket(ctx, zmq.PUB, bind=self.config.endpoint, sndhwm=self.config.hwm)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if self.config.replay_endpoint:
                replay = make_socket(ctx, zmq.ROUTER, bind=self.config.replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception as exc:  # noqa: BLE001 - reported to the node by start_and_wait
            self.failure = exc
            self._bound.set()
            for sock in (pub, replay):
                if sock is not None:
                    sock.close(linger=0)
            return
        self._bound.set()
        topic = self.config.topic.encode()
        try:
            while not self._stopping.is_set():
                if replay is not None and replay.poll(0):
                    self._serve_replay(replay, topic)
                try:
                    seq, ts, events = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                payload = msgpack.packb([ts, events, self.rank])
                pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
        except Exception:  # noqa: BLE001 - events are advisory: the node keeps serving
            log.exception("KV events publisher failed; no more events from this node")
        finally:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def _serve_replay(self, replay: zmq.Socket, topic: bytes) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.warning("KV events replay: malformed request of %d frames ignored", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        try:
            for seq, payload in self._buffer:
                if seq >= start:
                    replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload),
                                          flags=zmq.NOBLOCK)
            replay.send_multipart((client, b"", END_SEQ, b""), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("KV events replay to a client failed: %s", exc)
