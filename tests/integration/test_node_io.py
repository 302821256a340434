"""A node's I/O thread (pdserve/node/io.py) in this process, over real sockets on 127.0.0.1,
against the stand-in router: what the compute loop hands it reaches the router whole and
in order, a burst of messages wakes the thread far fewer times than it has messages, and
a put that races the thread's read of its wake pipe does not stop later puts waking it."""
import os

import pytest

from pdserve.common import protocol as P
from pdserve.node.io import NodeIO
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


def test_a_burst_arrives_whole_and_in_order_with_few_wake_ups(io_and_router):
    io, driver = io_and_router
    wakes = count_wakes(io)
    io.start()
    assert io.welcomed.wait(30) and io.welcome.accepted
    for i in range(BURST):  # as a prefill step's messages leave: back to back
        io.send_control(P.Error(req_id=f"r{i}", code="bad_message", message="x"))
    driver.wait(lambda: sum(isinstance(m, P.Error) for _, m in driver.inbox) >= BURST,
                what=f"{BURST} messages at the router")
    got = [m.req_id for _, m in driver.inbox if isinstance(m, P.Error)]
    assert got == [f"r{i}" for i in range(BURST)]
    # One pipe write per wake-up of the thread, not one per message (a syscall each).
    assert len(wakes) < BURST / 10, len(wakes)
    # After the burst the thread still wakes for the next message.
    io.send_control(P.Error(req_id="late", code="bad_message", message="x"))
    driver.take(P.Error, lambda m: m.req_id == "late", timeout_s=10)
    assert len(wakes) >= 2


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
            io.send_control(P.Error(req_id="during-read", code="bad_message", message="x"))
        return real_read(fd, n)
    monkeypatch.setattr(os, "read", read_racing_a_put)
    io.start()
    assert io.welcomed.wait(30) and io.welcome.accepted
    io.send_control(P.Error(req_id="first", code="bad_message", message="x"))
    for req_id in ("first", "during-read"):
        driver.take(P.Error, lambda m, r=req_id: m.req_id == r, timeout_s=10)
    assert raced
    before = len(wakes)
    io.send_control(P.Error(req_id="after", code="bad_message", message="x"))
    assert len(wakes) == before + 1, "the put after the race did not wake the I/O thread"
    driver.take(P.Error, lambda m: m.req_id == "after", timeout_s=10)
