"""Prefill and decode nodes as real processes, started through the CLI, driven over
real ZeroMQ sockets on 127.0.0.1 by a stand-in for the router's side."""
import glob
import json
import os
import time
import urllib.request

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.common import codec
from pdserve.common import errors as E
from pdserve.common import protocol as P
from pdserve.common.sockets import free_port
from pdserve.node.kv.segment import SWEEP_INTERVAL_S
from tests.node_driver import RouterDriver, start_node, stop_nodes

PROMPT_LENGTHS = [1, 7, 16, 17, 40, 90]


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    """2 prefill + 2 decode nodes on the tiny llama."""
    model = tiny_model("llama")
    logs = tmp_path_factory.mktemp("logs")
    driver = RouterDriver()
    driver.logs = logs
    driver.p0_metrics = free_port()
    procs = []
    try:
        for role, node_id in [("prefill", "p0"), ("prefill", "p1"), ("decode", "d0"),
                              ("decode", "d1")]:
            extra = ("--max-num-batched-tokens", "48") if role == "prefill" else ()
            if node_id == "p0":
                extra += ("--metrics-port", str(driver.p0_metrics))
            procs.append(start_node(role, driver.address, model, node_id, *extra,
                                    log_path=logs / f"{node_id}.log"))
        driver.wait_nodes("p0", "p1", "d0", "d1")
        yield driver, model, procs
    finally:
        stop_nodes(procs)
        driver.close()


def kv_bytes_by_path(port: int) -> dict[str, float]:
    """pdserve_kv_transfer_bytes_total of a prefill node, by path, from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    return {s.labels["path"]: s.value
            for f in text_string_to_metric_families(text.decode())
            for s in f.samples if s.name == "pdserve_kv_transfer_bytes_total"}


def prompts_for(vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def greedy(max_tokens=24):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def wait_all_free(driver, *nodes):
    driver.wait(lambda: all(driver.stats.get(n) and driver.stats[n].num_free_blocks
                            == driver.stats[n].num_total_blocks for n in nodes),
                timeout_s=10, what=f"all KV blocks free on {nodes}")


def test_two_prefill_two_decode_equal_offline_llm(cluster):
    driver, model, _ = cluster
    llm = LLM(dtype="float32", model=model)
    prompts = prompts_for(llm.engine.model_config.vocab_size)
    want = [o.token_ids for o in llm.generate(prompts, greedy())]
    spec = greedy()
    reqs = {f"r{i}": (p, spec) for i, p in enumerate(prompts)}
    prefill_of = {r: ("p0", "p1")[i % 2] for i, r in enumerate(reqs)}
    decode_of = {r: ("d0", "d1")[(i // 2) % 2] for i, r in enumerate(reqs)}
    got = driver.run(reqs, prefill_of, decode_of)
    for i, r in enumerate(reqs):
        assert got[r]["error"] is None, got[r]["error"]
        assert got[r]["tokens"] == want[i], f"{r} ({len(prompts[i])}-token prompt)"
        assert got[r]["finish"] == "length"
    wait_all_free(driver, "p0", "p1", "d0", "d1")


def test_same_host_kv_goes_through_shared_memory_token_exact_vs_tcp(cluster):
    """With the decode node's host id passed on (as the router does; all nodes here share
    this host) the KV goes through the prefill node's /dev/shm segment: the prefill node
    counts the bytes under path="shm", logs the path once per decode node, and greedy output
    is token for token what the same prompts give over TCP."""
    driver, model, _ = cluster
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = prompts_for(vocab, seed=5)
    spec = greedy(16)
    tokens, moved = {}, {}
    before = kv_bytes_by_path(driver.p0_metrics)
    for path in ("tcp", "shm", "tcp again"):
        reqs = {f"{path}-{i}": (p, spec) for i, p in enumerate(prompts)}
        got = driver.run(reqs, {r: "p0" for r in reqs},
                         {r: ("d0", "d1")[i % 2] for i, r in enumerate(reqs)},
                         same_host=path == "shm")
        assert all(got[r]["error"] is None for r in reqs), [got[r]["error"] for r in reqs]
        tokens[path] = [got[r]["tokens"] for r in reqs]
        after = kv_bytes_by_path(driver.p0_metrics)
        moved[path] = {k: after.get(k, 0) - before.get(k, 0) for k in ("tcp", "shm")}
        before = after
    assert tokens["shm"] == tokens["tcp"] == tokens["tcp again"]
    assert all(len(t) == 16 for t in tokens["shm"])
    assert moved["tcp"]["tcp"] > 0 and moved["tcp"]["shm"] == 0
    assert moved["shm"]["shm"] > 0 and moved["shm"]["tcp"] == 0
    log = (driver.logs / "p0.log").read_text()
    shm_lines = [line for line in log.splitlines() if "goes through shared memory" in line]
    assert len(shm_lines) == 2 and "decode node d0" in shm_lines[0] + shm_lines[1]
    tcp_lines = [line for line in log.splitlines() if "goes over TCP: it is not on" in line]
    assert len(tcp_lines) == 2, "the path is logged once per decode node, not per request"
    wait_all_free(driver, "p0", "d0", "d1")


def test_corrupt_shm_region_is_caught_by_checksum(cluster):
    """KV named in a shared segment whose pages changed after the sender hashed them is
    refused by the decode node (a real process mapping the segment), with the reason."""
    import zmq

    from pdserve.common.transport import make_socket, recv_message, send_message
    from pdserve.engine.model_runner import kv_tensor_bytes, kv_views
    from pdserve.node.kv import Outgoing
    from pdserve.node.kv.segment import Segment
    from pdserve.node.kv.shm import shm_chunk

    driver, _, _ = cluster
    hello = driver.hellos["d0"]
    lay = hello.kv_layout
    prompt = list(range(3, 40))
    assert driver.reserve("d0", "bad-shm", prompt, greedy()).ok
    shape = (8, lay.block_size, lay.num_kv_heads, lay.head_dim)
    seg = Segment.create(2 * lay.num_layers * kv_tensor_bytes(shape, torch.float32))
    sock = make_socket(driver.ctx, zmq.DEALER, connect=hello.kv_address)
    try:
        pages = kv_views(seg.data, lay.num_layers, shape, torch.float32)
        for k, v in pages:
            k.normal_()
            v.normal_()
        chunk = shm_chunk(hello.model, lay, pages, [Outgoing("bad-shm", [5, 1, 2], len(prompt),
                                                            first_token=5)],
                          0, lay.num_layers, checksums=True, last=True, segment=seg)
        pages[1][0][2, 0, 0, 0] += 1.0  # k1, block 2: changed after the checksum
        send_message(sock, chunk)
        assert sock.poll(10_000)
        ack = recv_message(sock, (P.KVAck,))
    finally:
        sock.close(0)
        seg.close()
    (result,) = ack.results
    assert result.req_id == "bad-shm" and not result.ok
    assert result.reason.startswith(f"checksum_mismatch: KV frame k1 (read from shared segment "
                                 f"{seg.name})")
    _, err = driver.take(P.Error, lambda m: m.req_id == "bad-shm")
    assert err.code == E.CHECKSUM_MISMATCH
    assert not any(isinstance(m, P.TokenBatch) and any(i.req_id == "bad-shm" for i in m.items)
                   for _, m in driver.inbox)
    wait_all_free(driver, "d0")


def test_segment_of_a_killed_prefill_node_is_removed_by_a_survivor(cluster, tmp_path):
    """A prefill node killed with SIGKILL cannot remove its /dev/shm segment; the decode
    nodes' periodic sweep does (its owner no longer runs), so nothing leaks for good."""
    driver, model, _ = cluster
    proc = start_node("prefill", driver.address, model, "doomed-p",
                      log_path=tmp_path / "doomed.log")
    try:
        driver.wait_nodes("doomed-p")
        segments = glob.glob(f"/dev/shm/pdserve-kv-{proc.pid}-*")
        assert len(segments) == 1, "a CPU prefill node keeps its KV cache in one segment"
    finally:
        proc.kill()
        proc.wait()
    assert os.path.exists(segments[0])
    driver.wait(lambda: not os.path.exists(segments[0]), timeout_s=SWEEP_INTERVAL_S + 5,
                what="a decode node's sweep to remove the dead node's segment")


def test_first_token_that_finishes_needs_no_decode(cluster):
    driver, model, _ = cluster
    spec = SamplingParams(max_tokens=1, temperature=0)
    got = driver.run({"one": ([5, 6, 7], spec)}, {"one": "p0"}, {"one": "d0"})
    assert len(got["one"]["tokens"]) == 1 and got["one"]["finish"] == "length"
    driver.send("d0", P.Abort(req_ids=["one"], reason="finished at prefill"))
    wait_all_free(driver, "p0", "d0")


def test_abort_frees_blocks_on_both_sides(cluster):
    driver, _, _ = cluster
    spec = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)
    reply = driver.reserve("d1", "long", list(range(3, 60)), spec)
    assert reply.ok
    driver.send("p1", P.PrefillBatch(requests=[P.PrefillRequest(
        req_id="long", prompt_token_ids=list(range(3, 60)), sampling=spec, decode_node_id="d1",
        kv_address=driver.hellos["d1"].kv_address, timeout_s=30.0,
        skip_blocks=reply.cached_blocks)]))
    driver.take(P.TokenBatch, lambda m: any(i.req_id == "long" for i in m.items))
    assert driver.wait(lambda: driver.stats["d1"].num_running == 1, 5, "d1 running")
    for node in ("p1", "d1"):
        driver.send(node, P.Abort(req_ids=["long"], reason="client went away"))
    wait_all_free(driver, "p1", "d1")
    assert driver.stats["d1"].num_running == 0


def test_reservation_lease_expires_and_frees(cluster):
    driver, _, _ = cluster
    spec = greedy()
    assert driver.reserve("d0", "orphan", list(range(3, 40)), spec, lease_s=0.3).ok
    _, err = driver.take(P.Error, lambda m: m.req_id == "orphan", timeout_s=10)
    assert err.code == E.LEASE_EXPIRED and "without the KV arriving" in err.message
    wait_all_free(driver, "d0")


def test_corrupt_kv_frame_is_caught_by_checksum(cluster):
    """A peer sending KV whose frame does not match its checksum ends that request with an
    error; no token is produced from the bad KV and the node keeps serving."""
    import zmq

    from pdserve.common.transport import make_socket, recv_message, send_message

    driver, _, _ = cluster
    hello = driver.hellos["d0"]
    lay = hello.kv_layout
    prompt = list(range(3, 20))
    assert driver.reserve("d0", "corrupt", prompt, greedy()).ok
    nb = -(-len(prompt) // lay.block_size)
    shape = (nb, lay.block_size, lay.num_kv_heads, lay.head_dim)
    tensors = {f"{kv}{i}": torch.randn(shape) for i in range(lay.num_layers) for kv in "kv"}
    sums = [codec.checksum_of(t) for t in tensors.values()]
    tensors["v0"][0, 0, 0, 0] += 1.0  # flipped after the checksum: corrupted in flight
    chunk = P.KVChunk(model=hello.model, kv_layout=lay, layer_start=0, layer_end=lay.num_layers,
                      last=True, tensors=tensors, checksums=sums, parts=[P.KVPart(
                          req_id="corrupt", num_tokens=len(prompt), first_token=5)])
    sock = make_socket(driver.ctx, zmq.DEALER, connect=hello.kv_address)
    try:
        send_message(sock, chunk)
        assert sock.poll(10_000)
        ack = recv_message(sock, (P.KVAck,))
    finally:
        sock.close(0)
    (result,) = ack.results
    assert not result.ok and result.reason.startswith("checksum_mismatch: KV frame v0")
    _, err = driver.take(P.Error, lambda m: m.req_id == "corrupt")
    assert err.code == E.CHECKSUM_MISMATCH
    assert not any(isinstance(m, P.TokenBatch) and any(i.req_id == "corrupt" for i in m.items)
                   for _, m in driver.inbox)
    wait_all_free(driver, "d0")


def test_full_decode_node_refuses_reservation_and_layout_mismatch_is_refused(
        tiny_model, tmp_path):
    model = tiny_model("llama")
    driver = RouterDriver()
    procs = []
    try:
        procs.append(start_node("decode", driver.address, model, "small-d", "--num-kv-blocks",
                                "12", log_path=tmp_path / "d.log"))
        procs.append(start_node("prefill", driver.address, model, "bs32-p", "--block-size",
                                "32", log_path=tmp_path / "p.log"))
        driver.wait_nodes("small-d", "bs32-p")
        spec = greedy()
        assert driver.reserve("small-d", "a", list(range(3, 153)), spec).ok  # 10 of 12 blocks
        reply = driver.reserve("small-d", "big", list(range(3, 100)), spec)
        assert not reply.ok and reply.reason == "no_capacity: needs 7 KV blocks, 2 of 12 free"
        driver.send("small-d", P.Abort(req_ids=["a"], reason="test"))
        wait_all_free(driver, "small-d")
        # A prefill node with another block size ships KV the decode node must refuse.
        got = driver.run({"mm": (list(range(3, 20)), spec)}, {"mm": "bs32-p"},
                         {"mm": "small-d"})
        err = got["mm"]["error"]
        assert err is not None and err.code == E.LAYOUT_MISMATCH
        assert "block_size 32" in err.message and "block_size 16" in err.message
        assert got["mm"]["tokens"] == [got["mm"]["tokens"][0]]  # only prefill's first token
        wait_all_free(driver, "small-d", "bs32-p")
    finally:
        stop_nodes(procs)
        driver.close()


def test_heartbeats_flow_while_a_long_prefill_runs(tiny_model, tmp_path):
    """The compute step never blocks the I/O thread: heartbeats keep their interval
    while the prefill node is busy for many intervals."""
    model = tiny_model("llama")
    driver = RouterDriver()
    procs = []
    try:
        procs.append(start_node("prefill", driver.address, model, "busy-p",
                                "--max-num-batched-tokens", "16384", log_path=tmp_path / "p.log"))
        procs.append(start_node("decode", driver.address, model, "busy-d",
                                log_path=tmp_path / "d.log"))
        driver.wait_nodes("busy-p", "busy-d")
        spec = SamplingParams(max_tokens=1, temperature=0)
        gen = torch.Generator().manual_seed(1)
        reqs = [P.PrefillRequest(req_id=f"L{i}", prompt_token_ids=torch.randint(
                    3, 500, (1000,), generator=gen).tolist(), sampling=spec,
                    decode_node_id="busy-d", kv_address=driver.hellos["busy-d"].kv_address,
                    timeout_s=60.0) for i in range(160)]
        t0 = time.monotonic()
        driver.send("busy-p", P.PrefillBatch(requests=reqs))
        got = set()

        def all_first_tokens():
            for _, m in driver.inbox:
                if isinstance(m, P.FirstTokens):
                    got.update(i.req_id for i in m.items)
            driver.inbox.clear()
            return len(got) == 160

        driver.wait(all_first_tokens, timeout_s=300, what="160 first tokens")
        t1 = time.monotonic()
        beats = [t for t in driver.beats["busy-p"] if t0 <= t <= t1]
        assert t1 - t0 > 6 * 0.2, "the prefill was too short to show anything"
        gaps = [b - a for a, b in zip([t0, *beats], [*beats, t1])]
        assert max(gaps) < 0.2 * 4, f"heartbeat gaps during prefill: {max(gaps):.2f} s"
    finally:
        stop_nodes(procs)
        driver.close()
