"""KV-cache events as a vLLM consumer reads them: a ZMQ SUB decoding with the msgspec
types of vLLM's documented format (written here from that documentation, not taken
from pdserve), against a real `pdserve launch` cluster."""
from __future__ import annotations

import re
import time
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from pdserve.common.kv_events import KVEventsConfig
from tests.cluster import launched


# vLLM's documented event types (vllm.distributed.kv_events).
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def endpoints(cluster, timeout_s=30.0) -> dict[str, tuple[str, str]]:
    return {name: (pub, replay) for pub, replay, name in re.findall(
        r"kv events\s+(tcp://\S+), replay (tcp://\S+)\s+\((\S+)\)",
        cluster.ready_log(timeout_s))}


def receive(sub: zmq.Socket, until, timeout_s=20.0) -> list[tuple[int, KVEventBatch]]:
    got = []
    deadline = time.monotonic() + timeout_s
    while not until(got):
        assert time.monotonic() < deadline, f"events so far: {got}"
        if sub.poll(200):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv-events"
            got.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
    return got


def stored_tokens(batches) -> list[int]:
    return [t for _, b in batches for e in b.events if isinstance(e, BlockStored)
            for t in e.token_ids]


def test_config_is_checked_with_vllm_keys():
    cfg = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "topic": "t"}')
    assert cfg.active and cfg.endpoint == "tcp://*:5557" and cfg.publisher == "zmq"
    with pytest.raises(ValueError, match=r"unknown keys \['enable'\]"):
        KVEventsConfig.from_json('{"enable": true}')
    with pytest.raises(ValueError, match="publisher must be one of"):
        KVEventsConfig.from_json('{"publisher": "kafka"}')
    with pytest.raises(ValueError, match="buffer_steps must be a positive integer"):
        KVEventsConfig.from_json('{"buffer_steps": 1e99}')


def test_a_vllm_subscriber_sees_the_cached_prefix_and_can_replay(tiny_model, tmp_path):
    model_dir = tiny_model("llama")
    config = ('{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv-events", '
              '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}')
    prefix = [(5 * i) % 700 + 3 for i in range(64)]   # 4 full blocks of 16
    ctx = zmq.Context.instance()
    with launched(model_dir, 1, 1, "--kv-events-config", config, log_dir=tmp_path) as cluster:
        eps = endpoints(cluster)
        assert set(eps) == {"prefill-0", "decode-0"}
        assert len({p for p, _ in eps.values()} | {r for _, r in eps.values()}) == 4
        pub, replay = eps["prefill-0"]
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        sub.connect(pub)
        try:
            time.sleep(0.5)  # the slow joiner: SUB must be subscribed before the request
            r = httpx.post(f"{cluster.http_url}/v1/completions", timeout=60, json={
                "model": model_dir.name, "prompt": prefix + [9, 9], "max_tokens": 2,
                "temperature": 0})
            assert r.status_code == 200, r.text
            live = receive(sub, lambda got: len(stored_tokens(got)) >= 64)
        finally:
            sub.close()
        assert stored_tokens(live)[:64] == prefix
        first = next(e for _, b in live for e in b.events if isinstance(e, BlockStored))
        assert first.parent_block_hash is None and first.block_size == 16
        assert first.medium == "CPU" and first.lora_id is None
        assert [s for s, _ in live] == sorted(s for s, _ in live)
        # Replay from 0: the first batch ever sent says "forget this node's old blocks".
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(replay)
        try:
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            replayed = []
            while True:
                assert dealer.poll(10_000), "no replay answer"
                _, seq, payload = dealer.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) == -1:
                    assert payload == b""
                    break
                replayed.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        finally:
            dealer.close()
        assert replayed[0][0] == 0 and isinstance(replayed[0][1].events[0], AllBlocksCleared)
        assert stored_tokens(replayed)[:64] == prefix
