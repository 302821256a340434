"""A node's I/O thread (pdserve/node/io.py) in this process, over real sockets on 127.0.0.1,
against the stand-in router: what the compute loop hands it reaches the router whole and
in order, whether it leaves from the compute thread or is queued for the I/O thread; a
queued burst wakes the thread far fewer times than it has messages, a put that races the
thread's read of its wake pipe does not stop later puts waking it, a router's message
arriving while the compute thread sends is still read, and neither a message that cannot be
encoded nor a router that stops reading stops the node."""
import os
import queue
import threading
import time

import pytest
import zmq

from pdserve.common import errors as E
from pdserve.common import protocol as P
from pdserve.common.transport import endpoint_of, make_socket
from pdserve.node import io as node_io
from pdserve.node.io import NodeIO
from tests import node_driver
from tests.node_driver import RouterDriver

BURST = 2000


def hello() -> P.Hello:
    stats = P.NodeStats(num_free_blocks=64, num_total_blocks=64, num_running=0,
                        num_waiting=0, queued_prompt_tokens=0)
    return P.Hello(node_id="io-test", role="prefill", protocol_version=P.PROTOCOL_VERSION,
                   model=P.ModelIdentity(name="m", config_hash="h"),
                   kv_layout=P.KVLayout(num_layers=2, num_kv_heads=2, head_dim=16,
                                        dtype="float32", block_size=4),
                   capacity=stats, pid=1)


def count_wakes(io: NodeIO) -> list:
    """A list that grows by one at each pipe write that wakes the I/O thread."""
    wakes, wake = [], io._wake

    def counted():
        wakes.append(1)
        wake()
    io._wake = counted
    return wakes


@pytest.fixture
def io_and_router():
    driver = RouterDriver()
    io = NodeIO([driver.address], hello())
    try:
        yield io, driver
    finally:
        io.stop()
        if io.is_alive():
            io.join(timeout=5)
        driver.close()


def error(req_id: str) -> P.Error:
    return P.Error(req_id=req_id, code="bad_message", message="x")


def test_a_burst_arrives_whole_and_in_order_with_few_wake_ups(io_and_router):
    io, driver = io_and_router
    wakes = count_wakes(io)
    io.start()
    assert io.welcomed.wait(30) and io.welcome.accepted
    # As a prefill step's messages leave, back to back: the first half while the I/O thread
    # is in its loop turn (its lock held), so queued for it; the second half right after,
    # from this thread once the queue is sent (queued until then, to keep the order).
    with io._lock:
        for i in range(BURST):
            io.send_control(error(f"r{i}"))
    for i in range(BURST, 2 * BURST):
        io.send_control(error(f"r{i}"))
    driver.wait(lambda: sum(isinstance(m, P.Error) for _, m in driver.inbox) >= 2 * BURST,
                what=f"{2 * BURST} messages at the router")
    got = [m.req_id for _, m in driver.inbox if isinstance(m, P.Error)]
    assert got == [f"r{i}" for i in range(2 * BURST)]
    # One pipe write per wake-up of the thread, not one per message (a syscall each).
    assert 1 <= len(wakes) < BURST / 10, len(wakes)
    # Between the I/O thread's turns a message leaves from this thread: no wake-up (one
    # may fall in a turn, a heartbeat's, and be queued).
    before = len(wakes)
    for i in range(50):
        io.send_control(error(f"late{i}"))
        driver.take(P.Error, lambda m, r=f"late{i}": m.req_id == r, timeout_s=10)
    assert len(wakes) - before < 10, len(wakes) - before


def test_a_message_that_cannot_be_encoded_fails_alone(io_and_router):
    """An Error whose text holds a lone surrogate (a client's JSON can carry one, escaped)
    cannot be encoded: the compute loop is told (an Error for that request in its inbox),
    and the next message still leaves, whether sent from the compute thread or queued for
    the I/O thread (which, before, died of it and took the node down)."""
    io, driver = io_and_router
    io.start()
    assert io.welcomed.wait(30) and io.welcome.accepted
    for how in ("direct", "queued"):
        bad = P.Error(req_id=f"bad-{how}", code="bad_message", message="\ud800")
        if how == "queued":
            with io._lock:
                io.send_control(bad)
        else:
            io.send_control(bad)
        item = io.inbox.get(timeout=10)
        assert (item.msg.req_id, item.msg.code) == (f"bad-{how}", E.INTERNAL), item
        assert "cannot pack" in item.msg.message
        io.send_control(error(f"after-{how}"))
        driver.take(P.Error, lambda m, r=f"after-{how}": m.req_id == r, timeout_s=10)
    assert io.is_alive() and io.failure is None


def test_a_router_that_stops_reading_fails_messages_not_the_node(monkeypatch):
    """A router that reads nothing (not even the Hello): the node's sends fill its queue to
    the high-water mark (made 1,000 here, for time), and then each message that does not
    fit comes back to the compute loop as a TIMEOUT Error for its request. The compute
    thread is never blocked, nothing is dropped in silence, and the I/O thread lives on."""
    monkeypatch.setattr(node_io, "OUTBOX_MAX", 1000)
    ctx = zmq.Context()
    router = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*")  # never read
    io = NodeIO([endpoint_of(router)], hello())
    try:
        io.start()
        # Until the node has connected, its Hello holds a place in the socket's queue and
        # the first refusal comes one message sooner (seen once on a loaded machine): wait
        # for the Hello to be there for the router (polled, never read).
        assert router.poll(30_000, zmq.POLLIN), "the node never connected"
        failed = None
        for i in range(400_000):  # the kernel's socket buffers hold some 100,000 too
            io.send_control(error(f"r{i}"))
            if not io.inbox.empty():
                failed = io.inbox.get_nowait()
                break
        assert failed is not None, "the router's queue never filled"
        # (sent from this thread, or queued behind an I/O turn and failed there)
        assert failed.msg.code == E.TIMEOUT, failed
        assert node_io.OUTBOX_MAX <= int(failed.msg.req_id[1:]) <= i  # at the mark, not sooner
        assert io.is_alive() and io.failure is None
    finally:
        io.stop()
        if io.is_alive():
            io.join(timeout=5)
        router.close(0)
        ctx.term()


def test_a_router_message_arriving_while_the_compute_thread_sends_is_read(monkeypatch):
    """A send from the compute thread may take the descriptor's signal of a router message
    that arrived while the I/O thread was on its way to poll (ZeroMQ's signal is
    edge-triggered); the sender must then wake the I/O thread. Made to happen here: the
    I/O thread is held just before its poll while the router's Abort arrives and this
    thread sends. Nothing else wakes it (no heartbeats either way, its poll's sleep raised
    to a minute), so a signal taken and not passed on leaves the Abort unread."""
    monkeypatch.setattr(node_driver, "HEARTBEAT_S", 3600.0)
    monkeypatch.setattr(node_io, "POLL_MAX_MS", 60_000)
    at_poll, go = threading.Event(), threading.Event()
    hold = []  # while it holds a True, the I/O thread waits for ``go`` before it polls

    class HeldPoller(zmq.Poller):
        def poll(self, timeout=None):
            if hold:
                hold.clear()
                at_poll.set()
                go.wait(30)
            return super().poll(timeout)
    monkeypatch.setattr(node_io.zmq, "Poller", HeldPoller)
    driver = RouterDriver()
    io = NodeIO([driver.address], hello(), heartbeat_interval_s=3600.0)
    try:
        io.start()
        assert io.welcomed.wait(30) and io.welcome.accepted
        for i in range(3):
            while True:  # a turn of the I/O thread (a queued put), ending at the hold
                at_poll.clear()
                go.clear()
                hold.append(True)
                with io._lock:
                    io.send_control(error("turn"))
                assert at_poll.wait(30)
                if io._queued == io._flushed:
                    break  # held with nothing queued: the next put leaves from this thread
                go.set()  # held before the turn that sends it: once more
            driver.send("io-test", P.Abort(req_ids=[f"a{i}"], reason="test"))
            time.sleep(0.2)  # the Abort reaches the node's socket
            io.send_control(error(f"s{i}"))  # from this thread: the I/O thread is held
            assert io._queued == io._flushed, "queued, not sent from this thread"
            go.set()
            try:
                item = io.inbox.get(timeout=10)
            except queue.Empty:
                raise AssertionError(f"round {i}: the router's Abort was never read") from None
            assert item.msg.req_ids == [f"a{i}"]
            driver.take(P.Error, lambda m, r=f"s{i}": m.req_id == r, timeout_s=10)
    finally:
        go.set()
        io.stop()
        if io.is_alive():
            io.join(timeout=5)
        driver.close()


def test_a_put_while_the_thread_reads_its_wake_pipe_does_not_silence_later_puts(
        io_and_router, monkeypatch):
    """The compute loop puts a message while the I/O thread is reading the wake pipe (made
    to happen here by putting from inside that read). Both messages leave, and the next
    put, once the thread is idle again, still wakes it: before, the flag said "woken" with
    the pipe empty, so later messages waited for unrelated socket traffic or the poll's
    timeout (seen as a cluster falling into a mode with 5x the latency)."""
    io, driver = io_and_router
    wakes = count_wakes(io)
    real_read, raced = os.read, []

    def read_racing_a_put(fd, n):
        if fd == io._wake_r and not raced:
            raced.append(1)
            io.send_control(error("during-read"))  # from the thread, in its turn: queued
        return real_read(fd, n)
    monkeypatch.setattr(os, "read", read_racing_a_put)
    io.start()
    assert io.welcomed.wait(30) and io.welcome.accepted
    with io._lock:  # the thread in its turn: these puts are queued for it, as every one here
        io.send_control(error("first"))
    for req_id in ("first", "during-read"):
        driver.take(P.Error, lambda m, r=req_id: m.req_id == r, timeout_s=10)
    assert raced
    before = len(wakes)
    with io._lock:
        io.send_control(error("after"))
    assert len(wakes) == before + 1, "the put after the race did not wake the I/O thread"
    driver.take(P.Error, lambda m: m.req_id == "after", timeout_s=10)
