"""A stranger who claims a node's name on a named socket (issue 35, item 1).

A ZeroMQ ROUTER with ROUTER_HANDOVER gives an identity to the newest connection that
claims it: a DEALER that says it is ``prefill-0`` on a decode node's KV socket, or
``decode-0`` on the router's control socket, took the real node's traffic for good.
Each test claims a live node's name as a stranger, leaves, and shows that a normal
request is served within 5 s, twice (the first after the stranger leaves, and one more).
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import zmq

from pdserve.common.transport import make_socket
from tests.cluster import launched
from tests.e2e.test_attack import normal_text, process_tree


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    model_dir = Path(tiny_model("llama"))
    with launched(model_dir, 1, 1, log_dir=tmp_path_factory.mktemp("names")) as c:
        c.model = model_dir.name
        c.pids = process_tree(c.proc.pid)
        c.baseline = normal_text(c)  # the prefill node has connected to the KV socket now
        yield c


def claim(address: str, identity: str, hold_s: float = 1.0, send: bytes | None = None):
    """Connects as ``identity``, optionally sends one frame, holds, and leaves."""
    ctx = zmq.Context()
    try:
        sock = make_socket(ctx, zmq.DEALER, connect=address, identity=identity)
        if send is not None:
            sock.send(send)
        time.sleep(hold_s)
        sock.close(0)
    finally:
        ctx.term()


def served_within(c, seconds: float) -> None:
    for _ in range(2):
        started = time.monotonic()
        assert normal_text(c, timeout_s=seconds + 5) == c.baseline
        assert time.monotonic() - started < seconds
    assert process_tree(c.proc.pid) == c.pids, "a process of the cluster died or restarted"


@pytest.mark.parametrize("send", [None, b"hello"])
def test_a_stranger_claiming_the_prefill_nodes_name_on_a_kv_socket(cluster, send):
    address = re.search(r"KV socket (tcp://\S+)", cluster.log()).group(1)
    claim(address, "prefill-0", send=send)
    served_within(cluster, 5.0)


@pytest.mark.parametrize("send", [None, b"hello"])
def test_a_stranger_claiming_a_nodes_name_on_the_control_socket(cluster, send):
    for name in ("decode-0", "prefill-0"):
        claim(cluster.control, name, send=send)
        served_within(cluster, 5.0)
