"""The router core in this process, real prefill/decode node processes on 127.0.0.1.

Covers dispatch and stream independence without HTTP in the way: the four
decoupled cases, cancellation, stop strings, nodes joining and leaving.
"""
import asyncio
import threading
import time

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.router import streams as S
from pdserve.router.config import RouterConfig
from pdserve.router.core import RouterCore
from tests.cluster import free_port
from tests.node_driver import start_node, stop_nodes


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def offline(model):
    return LLM(dtype="float32", model=model)


async def until(cond, what: str, timeout_s: float = 60.0):
    """cond()'s first truthy value, polled every 5 ms on the running loop; TimeoutError
    saying ``what`` once ``timeout_s`` has passed without one."""
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} (after {timeout_s:.0f} s)")
        await asyncio.sleep(0.005)
    return value


class Harness:
    """Runs the core on an event loop in a thread of its own, as the router process runs
    it: always turning, heartbeating its nodes. Nodes are child processes."""

    def __init__(self, model, log_dir, heartbeat_interval_s=0.2, liveness=10):
        # Beats every 0.2 s, so a killed node is dropped within seconds; a liveness of 10
        # (2 s) rather than the default 3 (0.6 s): on a loaded machine a node starting up
        # (the suite's other worker beside it) missed 0.6 s right after registering.
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.control = f"tcp://127.0.0.1:{free_port()}"
        self.core = RouterCore(RouterConfig(model=str(model), control=self.control,
                                            ingress=None, heartbeat_interval_s=heartbeat_interval_s,
                                            liveness=liveness, policy="least_loaded"))
        self.run(self.core.start())
        self.model, self.log_dir, self.procs = model, log_dir, {}

    def start(self, role, node_id, *extra):
        self.procs[node_id] = start_node(role, self.control, self.model, node_id, *extra,
                                         log_path=self.log_dir / f"{node_id}.log")

    def start_nodes(self, nodes):
        """Starts (role, node_id) nodes and waits until the core has registered them all."""
        for role, node_id in nodes:
            self.start(role, node_id)
        self.wait(lambda: all(nid in self.core.registry.nodes for _, nid in nodes))

    def wait(self, cond, timeout_s=60.0):
        """Polls cond on the core's loop (the core is not thread-safe)."""
        self.run(until(cond, "condition not met", timeout_s))

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self):
        stop_nodes(list(self.procs.values()))
        self.run(self.core.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def harness(model, tmp_path_factory):
    h = Harness(model, tmp_path_factory.mktemp("router-logs"))
    try:
        h.start_nodes([("prefill", "p0"), ("decode", "d0"), ("decode", "d1")])
        yield h
    finally:
        h.close()


async def collect(stream):
    tokens, text, last = [], "", None
    async for ev in stream:
        tokens += ev.token_ids
        text += ev.text
        last = ev
    return tokens, text, last


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def prompts(n, seed=0, lengths=(3, 9, 17, 33, 5, 60, 12, 24)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (lengths[i % len(lengths)],), generator=gen).tolist()
            for i in range(n)]


def test_batch_of_requests_equals_offline(harness, offline):
    ps = prompts(8)
    want = [o.token_ids for o in offline.generate(ps, greedy(20))]

    async def go():
        streams = [harness.core.submit(S.GenerationRequest(p, greedy(20))) for p in ps]
        return await asyncio.gather(*(collect(s) for s in streams))
    got = harness.run(go())
    assert [g[0] for g in got] == want
    assert all(g[2].finish_reason == "length" and g[2].completion_tokens == 20 for g in got)
    assert not harness.core.flights


def test_short_request_after_long_one_finishes_first(harness):
    async def go():
        order = []

        async def run(name, n):
            await collect(harness.core.submit(S.GenerationRequest([5, 6, 7], greedy(n))))
            order.append(name)
        long = asyncio.create_task(run("long", 200))
        await asyncio.sleep(0.05)
        await asyncio.gather(long, run("short", 3))
        return order
    assert harness.run(go()) == ["short", "long"]


def test_cancel_frees_blocks_and_leaves_others_alone(harness, offline):
    want = offline.generate([[9, 8, 7]], greedy(30))[0].token_ids

    async def go():
        victim = harness.core.submit(S.GenerationRequest([4, 5, 6], greedy(500)))
        other = harness.core.submit(S.GenerationRequest([9, 8, 7], greedy(30)))
        async for ev in victim:
            if ev.token_ids:
                victim.cancel()
        last = ev
        return last, await collect(other)
    last, (tokens, _, end) = harness.run(go())
    assert last.finish_reason == "abort"
    assert tokens == want and end.finish_reason == "length"
    harness.wait(lambda: all(n.stats.num_free_blocks == n.stats.num_total_blocks
                             for n in harness.core.registry.nodes.values()), 10)


def test_stop_string_is_cut_at_the_router(harness, offline):
    base = offline.generate([[11, 12, 13]], greedy(24))[0]
    stop = base.text[4:7]

    async def go():
        return await collect(harness.core.submit(
            S.GenerationRequest([11, 12, 13], greedy(24, stop=[stop]))))
    tokens, text, last = harness.run(go())
    assert text == base.text[:base.text.index(stop)] and last.finish_reason == "stop"


def test_bad_requests_are_refused_at_submit(harness):
    for req, msg in [(S.GenerationRequest([], greedy(3)), "prompt is empty"),
                     (S.GenerationRequest([1] * 5000, greedy(3)), "5000 tokens"),
                     (S.GenerationRequest([10**7], greedy(3)), "integers in")]:
        with pytest.raises(S.RequestError, match=msg) as info:
            harness.core.submit(req)
        assert info.value.code == S.BAD_REQUEST


def test_node_joins_and_leaves(harness, offline):
    harness.start("prefill", "p-late")
    harness.wait(lambda: "p-late" in harness.core.registry.nodes)
    ps = prompts(4, seed=5)
    want = [o.token_ids for o in offline.generate(ps, greedy(8))]

    async def go():
        streams = [harness.core.submit(S.GenerationRequest(p, greedy(8))) for p in ps]
        return await asyncio.gather(*(collect(s) for s in streams))
    assert [g[0] for g in harness.run(go())] == want
    harness.procs["p-late"].terminate()
    harness.wait(lambda: "p-late" not in harness.core.registry.nodes, 10)
    assert harness.core.health()[0]
    assert [g[0] for g in harness.run(go())] == want


def test_exception_in_one_request_fails_only_that_request(harness, offline, caplog):
    """A fault while serving one request (injected into the router's detokenizer for
    prompts starting with a marker token) is logged with its traceback and becomes that
    request's error; the requests beside it in the same batches finish normally."""
    tok = harness.core.tokenizer
    real_decode = tok.decode
    poisoned = []

    def decode(ids, skip_special_tokens=True):
        if ids and ids[0] == 777:
            poisoned.append(ids)
            raise RuntimeError("injected detokenizer fault")
        return real_decode(ids, skip_special_tokens)

    ps = prompts(4, seed=9)
    want = [o.token_ids for o in offline.generate(ps, greedy(10))]
    tok.decode = decode
    try:
        async def go():
            bad = harness.core.submit(S.GenerationRequest([777, 5, 6], greedy(10)))
            good = [harness.core.submit(S.GenerationRequest(p, greedy(10))) for p in ps]
            return await collect(bad), await asyncio.gather(*(collect(s) for s in good))
        with caplog.at_level("ERROR"):
            (_, _, bad_last), good = harness.run(go())
    finally:
        tok.decode = real_decode
    assert poisoned, "the fault was never reached"
    assert bad_last.error is not None and bad_last.error.code == S.INTERNAL
    assert "injected detokenizer fault" in bad_last.error.message
    assert "Traceback" in caplog.text or any(r.exc_info for r in caplog.records)
    assert [g[0] for g in good] == want


def test_colocated_node_equals_offline_and_compute_none_is_labelled(model, offline,
                                                                     tmp_path):
    h = Harness(model, tmp_path)
    try:
        h.start("colocated", "c0", "--max-num-batched-tokens", "32")
        h.wait(lambda: h.core.health()[0])
        ps = prompts(6, seed=2)
        want = [o.token_ids for o in offline.generate(ps, greedy(12))]

        async def go():
            streams = [h.core.submit(S.GenerationRequest(p, greedy(12))) for p in ps]
            return await asyncio.gather(*(collect(s) for s in streams))
        got = h.run(go())
        assert [g[0] for g in got] == want
        assert all(g[2].finish_reason == "length" for g in got)
        # A benchmark node that skips the forward says so, and emits one fixed token.
        h.start("colocated", "c-none", "--compute", "none")
        h.wait(lambda: "c-none" in h.core.registry.nodes)
        assert "COMPUTE NONE" in h.core.health()[1]
        h.procs["c0"].terminate()
        h.wait(lambda: "c0" not in h.core.registry.nodes, 10)
        tokens = [g[0] for g in h.run(go())]
        assert all(len(set(t)) == 1 and len(t) == 12 for t in tokens)
    finally:
        h.close()


def _kill(proc):
    import signal
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def streaming_decode_node(flights) -> str | None:
    """The decode node streaming the most requests that have 3 tokens or more and are not
    finished; None while there is none."""
    counts: dict[str, int] = {}
    for f in flights:
        if f.decode_node and len(f.out.token_ids) >= 3:
            counts[f.decode_node] = counts.get(f.decode_node, 0) + 1
    return max(counts, key=counts.get) if counts else None


def test_decode_node_killed_mid_stream_loses_no_token(model, offline, tmp_path):
    """SIGKILL a decode node while it streams: every request finishes, and the greedy
    outputs equal a run without the failure (each token seen exactly once)."""
    h = Harness(model, tmp_path)
    try:
        h.start_nodes([("prefill", "fp"), ("decode", "fd0"), ("decode", "fd1")])
        ps = prompts(6, seed=11)
        want = [o.token_ids for o in offline.generate(ps, greedy(60))]

        async def go():
            streams = [h.core.submit(S.GenerationRequest(p, greedy(60))) for p in ps]
            tasks = [asyncio.create_task(collect(s)) for s in streams]
            # Wait until tokens flow from a decode node, then kill it. (Not a node named
            # in advance: on a loaded machine the prefills can come far enough apart that
            # one node's requests all finish before the other's first tokens.)
            victim = await until(lambda: streaming_decode_node(h.core.requests.values()),
                                 "no decode node streamed")
            victims = h.core.dispatch.placement.requests(victim)
            assert victims, "nothing was running on the node about to die"
            _kill(h.procs[victim])
            return victim, await asyncio.gather(*tasks)
        victim, got = h.run(go())
        assert [g[0] for g in got] == want
        assert all(g[2].finish_reason == "length" for g in got)
        assert victim not in h.core.registry.nodes
    finally:
        h.close()


def test_prefill_node_killed_with_a_batch_in_flight(model, offline, tmp_path):
    h = Harness(model, tmp_path)
    try:
        h.start_nodes([("prefill", "kp0"), ("prefill", "kp1"), ("decode", "kd")])
        ps = prompts(12, seed=12, lengths=(700, 650, 600))
        want = [o.token_ids for o in offline.generate(ps, greedy(4))]

        async def go():
            streams = [h.core.submit(S.GenerationRequest(p, greedy(4))) for p in ps]
            tasks = [asyncio.create_task(collect(s)) for s in streams]
            await until(lambda: h.core.dispatch.placement.requests("kp0"),
                        "kp0 was given no request")
            _kill(h.procs["kp0"])
            return await asyncio.gather(*tasks)
        got = h.run(go())
        assert [g[0] for g in got] == want
    finally:
        h.close()


def test_no_node_before_the_deadline_is_a_timeout_error(model, tmp_path):
    # Beats every 1 s: the killed node stays "live" for 3 s, past the request's 2 s deadline,
    # however slowly this machine gets from the kill to the submit.
    h = Harness(model, tmp_path, heartbeat_interval_s=1.0, liveness=3)
    try:
        h.start("decode", "lonely-d")
        h.start("prefill", "lonely-p")
        h.wait(lambda: h.core.health()[0])
        _kill(h.procs["lonely-p"])
        h.wait(lambda: "lonely-p" not in h.core.registry.nodes, 10)
        h.start("prefill", "lonely-p2")   # joins, then dies before taking anything
        h.wait(lambda: "lonely-p2" in h.core.registry.nodes)
        _kill(h.procs["lonely-p2"])

        async def go():
            return await collect(h.core.submit(
                S.GenerationRequest([5, 6, 7], greedy(4), timeout_s=2.0)))
        _, _, last = h.run(go())
        assert last.error is not None and last.error.code == S.TIMEOUT
        assert "deadline" in last.error.message
    finally:
        h.close()


def test_sigterm_drains_a_node_then_it_exits_cleanly(model, offline, tmp_path):
    """SIGTERM on a decode node: it takes no new work, its running requests finish
    (token-exact), new requests go elsewhere, and it exits 0."""
    h = Harness(model, tmp_path)
    try:
        h.start_nodes([("prefill", "dp"), ("decode", "dd0"), ("decode", "dd1")])
        ps = prompts(4, seed=21)
        want = [o.token_ids for o in offline.generate(ps, greedy(80))]

        async def go():
            first = [h.core.submit(S.GenerationRequest(p, greedy(80))) for p in ps]
            tasks = [asyncio.create_task(collect(s)) for s in first]
            # SIGTERM while dd0 streams a request it has begun: waiting for every request's
            # second token instead let dd0 finish all of its own first on a loaded machine
            await until(lambda: any(len(h.core.requests[r].out.token_ids) >= 2
                                    for r in h.core.dispatch.placement.requests("dd0")),
                        "dd0 was given no request to stream")
            h.procs["dd0"].terminate()  # SIGTERM
            await until(lambda: h.core.registry.nodes["dd0"].state == "draining",
                        "dd0 did not say it drains")
            late = h.core.submit(S.GenerationRequest(ps[0], greedy(80)))
            assert h.core.requests[late.request_id].decode_node == "dd1"
            return await asyncio.gather(*tasks, collect(late))
        got = h.run(go())
        assert [g[0] for g in got] == want + want[:1]
        assert h.procs["dd0"].wait(timeout=30) == 0
    finally:
        h.close()


def test_restarted_router_gets_its_nodes_back(model, offline, tmp_path):
    h = Harness(model, tmp_path)
    try:
        h.start("prefill", "rp")
        h.start("decode", "rd")
        h.wait(lambda: h.core.health()[0])
        h.run(h.core.stop())
        config = h.core.config
        # the router is away for longer than the nodes' liveness window
        time.sleep(config.liveness * config.heartbeat_interval_s + 0.5)
        h.core = RouterCore(config)   # a new router process would do the same
        h.run(h.core.start())
        h.wait(lambda: h.core.health()[0], timeout_s=20)
        want = offline.generate([[3, 4, 5]], greedy(6))[0].token_ids

        async def go():
            return await collect(h.core.submit(S.GenerationRequest([3, 4, 5], greedy(6))))
        assert h.run(go())[0] == want
        assert all(p.poll() is None for p in h.procs.values()), "nodes were restarted"
    finally:
        h.close()


def test_compute_none_through_prefill_and_decode_nodes(model, tmp_path):
    """The benchmark mode still moves KV between nodes (zeros), layer group by group."""
    h = Harness(model, tmp_path)
    try:
        h.start("prefill", "np", "--compute", "none", "--kv-layers-per-chunk", "1")
        h.start("decode", "nd", "--compute", "none")
        h.wait(lambda: h.core.health()[0])

        async def go():
            streams = [h.core.submit(S.GenerationRequest(p, greedy(8))) for p in prompts(5)]
            return await asyncio.gather(*(collect(s) for s in streams))
        got = h.run(go())
        assert all(g[2].error is None and g[2].finish_reason == "length" for g in got), got
        assert all(len(g[0]) == 8 and len(set(g[0])) == 1 for g in got)
    finally:
        h.close()
