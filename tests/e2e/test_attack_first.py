"""A stranger who claims a node's name BEFORE the node connects (issue 35, "a peer's name").

With ROUTER_HANDOVER off an identity belongs to the first connection that claims it. When
nodes used their bare node id as their socket identity, a stranger who connected first as
``prefill-0`` to a decode node's KV socket (or as a node's id to the router's control
socket) kept the name: the real node's connection was refused by ZeroMQ itself, its KV or
its Hello never arrived. Nodes now connect as ``node_id/incarnation`` (unguessable), the
router binds a node id to the connection whose Hello registered it, and a decode node takes
KV only from the identity the router names (id and incarnation). Each test holds the
stranger's connection open for as long as it checks that serving goes on.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from pdserve.common import errors as E
from pdserve.common import protocol as P
from pdserve.common.transport import make_socket, recv_message, send_message
from tests.cluster import launched
from tests.e2e.test_attack import normal_text, process_tree


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    model_dir = Path(tiny_model("llama"))
    with launched(model_dir, 1, 1, log_dir=tmp_path_factory.mktemp("first")) as c:
        c.model, c.model_dir = model_dir.name, model_dir
        c.pids = process_tree(c.proc.pid)
        yield c


@contextlib.contextmanager
def stranger(address: str, identity: str, send: bytes | None = None):
    """A DEALER connected as ``identity`` for the whole block (ZMTP heartbeats keep it)."""
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER, connect=address, identity=identity)
    try:
        if send is not None:
            sock.send(send)
        time.sleep(0.5)  # connected and its identity taken before the block goes on
        yield sock
    finally:
        sock.close(0)
        ctx.term()


def served(c, seconds: float = 5.0, times: int = 2) -> None:
    for _ in range(times):
        started = time.monotonic()
        assert normal_text(c, timeout_s=seconds + 25) == c.baseline
        assert time.monotonic() - started < seconds
    assert c.pids <= process_tree(c.proc.pid), "a process of the cluster died or restarted"


def test_a_stranger_first_on_the_kv_socket_as_the_prefill_node(cluster):
    """Before any request, so before the prefill node has opened its KV connection."""
    wait_for(lambda: re.search(r"KV socket (tcp://\S+)", cluster.log()), 30)
    address = re.search(r"KV socket (tcp://\S+)", cluster.log()).group(1)
    with stranger(address, "prefill-0"):
        cluster.baseline = normal_text(cluster, timeout_s=60)
        assert cluster.baseline
        served(cluster)


@pytest.mark.parametrize("send", [None, b"hello"])
def test_a_stranger_first_on_the_control_socket_as_a_new_node(cluster, tmp_path, send):
    """A stranger holds the id decode-9 on the control socket; then the real decode-9
    starts, registers, and serves while the cluster's own decode node is stopped."""
    if not getattr(cluster, "baseline", ""):
        cluster.baseline = normal_text(cluster, timeout_s=60)
    log = tmp_path / "decode-9.log"
    start = len(cluster.log())
    with stranger(cluster.control, "decode-9", send), open(log, "w") as out:
        node = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "decode",
             "--model", str(cluster.model_dir), "--router", cluster.control,
             "--node-id", "decode-9", "--kv-bind", "tcp://127.0.0.1:*",
             "--heartbeat-interval", "0.5", "--threads", "1", "--log-level", "info"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        stopped = None
        try:
            deadline = time.monotonic() + 120
            while "decode node decode-9 joined" not in cluster.log()[start:]:
                assert node.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
            # Only decode-9 can serve now: the cluster's decode node is stopped.
            stopped = decode_pid(cluster)
            os.kill(stopped, signal.SIGSTOP)
            mark = len(cluster.log())
            wait_for(lambda: "decode-0 missed" in cluster.log()[mark:], 30)  # dropped
            served(cluster, times=1)
            served(cluster, times=1)
        finally:
            if stopped is not None:
                os.kill(stopped, signal.SIGCONT)
            node.terminate()
            try:
                node.wait(timeout=20)
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait()
    # decode-0, resumed, finds the router silent and says hello again: back in.
    wait_for(lambda: "decode node decode-0 joined" in cluster.log()[mark:]
             or "decode-0 said hello again" in cluster.log()[mark:], 30)
    served(cluster)


def test_a_node_whose_id_a_stranger_registered_first_serves_under_a_fresh_id(cluster,
                                                                           tmp_path):
    """A stranger says a valid Hello as decode-7 first and stays (it heartbeats, and
    refuses every reservation). The real decode-7, refused name_taken, registers as
    decode-7-XXXXXX and serves while the cluster's own decode node is stopped."""
    from tests.e2e.test_attack import FakeNode

    if not getattr(cluster, "baseline", ""):
        cluster.baseline = normal_text(cluster, timeout_s=60)
    fake = FakeNode(cluster, cluster.model_dir, "decode-7", "decode",
                    kv_address="tcp://127.0.0.1:9", grant=False)
    log = tmp_path / "decode-7.log"
    start = len(cluster.log())
    stopped = node = None
    try:
        assert fake.wait_for(P.Welcome).accepted
        with open(log, "w") as out:
            node = subprocess.Popen(
                [sys.executable, "-m", "pdserve.cli", "decode",
                 "--model", str(cluster.model_dir), "--router", cluster.control,
                 "--node-id", "decode-7", "--kv-bind", "tcp://127.0.0.1:*",
                 "--heartbeat-interval", "0.5", "--threads", "1", "--log-level", "info"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: re.search(r"decode node decode-7-[0-9a-f]{6} joined",
                                   cluster.log()[start:]) or node.poll() is not None, 120)
        assert node.poll() is None, log.read_text()[-3000:]
        assert "registering as decode-7-" in log.read_text()
        stopped = decode_pid(cluster)
        os.kill(stopped, signal.SIGSTOP)
        mark = len(cluster.log())
        wait_for(lambda: "decode-0 missed" in cluster.log()[mark:], 30)
        served(cluster)
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        if node is not None:
            node.terminate()
            try:
                node.wait(timeout=20)
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait()
        fake.close()
    if stopped is not None:
        wait_for(lambda: "decode node decode-0 joined" in cluster.log()[mark:]
                 or "decode-0 said hello again" in cluster.log()[mark:], 30)
    served(cluster)


def test_a_second_connection_claiming_a_registered_name_is_refused(cluster):
    """A Hello for the live decode-0 from another connection: refused with name_taken, and
    decode-0 keeps its name and its work."""
    if not getattr(cluster, "baseline", ""):
        cluster.baseline = normal_text(cluster, timeout_s=60)
    with stranger(cluster.control, "decode-0/" + "f" * 16) as sock:
        send_message(sock, claiming_hello("decode-0"))
        assert sock.poll(10_000), "no answer to the Hello"
        welcome = recv_message(sock, (P.Welcome,))
        assert not welcome.accepted and welcome.code == E.NAME_TAKEN, welcome
        assert "decode-0" in welcome.reason
        served(cluster)
    assert "hello from" in cluster.log() and "is held by another connection" in cluster.log()


def claiming_hello(node_id: str) -> P.Hello:
    """A Hello for ``node_id`` (refused before its fields are checked: the id is taken)."""
    return P.Hello(node_id=node_id, role="decode", protocol_version=P.PROTOCOL_VERSION,
                   model=P.ModelIdentity(name="m", config_hash="h"),
                   kv_layout=P.KVLayout(num_layers=1, num_kv_heads=1, head_dim=8,
                                        dtype="float32", block_size=16),
                   capacity=P.NodeStats(num_free_blocks=1, num_total_blocks=1, num_running=0,
                                        num_waiting=0, queued_prompt_tokens=0),
                   pid=1, incarnation="f" * 16, kv_address="tcp://127.0.0.1:9")


def decode_pid(c) -> int:
    for pid in process_tree(c.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if b"decode" in cmd and b"--config-env" in cmd:  # launch's own
            return pid
    raise AssertionError("no decode node process")


def wait_for(cond, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.2)

