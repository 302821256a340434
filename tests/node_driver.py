"""A test stand-in for the router's side of the control protocol, plus node processes.

It speaks the real protocol over a real ROUTER socket on 127.0.0.1 and starts
real nodes through the CLI; it only lacks the router's policies and HTTP.
"""
from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections import defaultdict

import zmq

from pdserve.common import protocol as P
from pdserve.common.transport import SendError, endpoint_of, make_socket, recv_routed, send_routed

HEARTBEAT_S = 0.2
# Missed beats before a node gives this router up and says Hello again: 10 (2 s), not the
# default 3 (0.6 s), so that a loaded machine (the suite's other worker beside) cannot.
LIVENESS = 10


class RouterDriver:
    """Owns a ROUTER socket in a thread of its own that is always answering, as a router
    is: it welcomes nodes, heartbeats them, and files what they send in ``inbox``. The test
    thread sends through ``send`` and reads ``inbox`` under ``lock`` (``wait`` does)."""

    def __init__(self, accept=lambda hello: (True, "")):
        self.ctx = zmq.Context()
        self.sock = make_socket(self.ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*")
        self.address = endpoint_of(self.sock)
        self.accept = accept
        self.hellos: dict[str, P.Hello] = {}
        self.stats: dict[str, P.NodeStats] = {}
        self.beats: dict[str, list[float]] = defaultdict(list)
        self.byes: list[P.Bye] = []
        self.inbox: list[tuple[str, P.Message]] = []
        # A node's socket identity is not its id (P.peer_identity): the id is its Hello's.
        self.routes: dict[str, bytes] = {}
        self.names: dict[bytes, str] = {}
        self.lock = threading.RLock()
        self._outbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close(0)
        self.ctx.term()

    def _loop(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + HEARTBEAT_S
                for node in list(self.hellos):
                    self._outbox.put((node, P.Heartbeat(node_id="router", stats=None)))
            while True:
                try:
                    node, msg = self._outbox.get_nowait()
                except queue.Empty:
                    break
                try:
                    send_routed(self.sock, self.routes.get(node, node.encode()), msg)
                except SendError:
                    pass  # a node that is gone; tests look at what arrives
            if self.sock.poll(10):
                self._receive()

    def _receive(self) -> None:
        while True:
            try:
                peer, msg = recv_routed(self.sock, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            with self.lock:
                if isinstance(msg, P.Hello):
                    self.routes[msg.node_id], self.names[peer] = peer, msg.node_id
                node = self.names.get(peer, peer.decode())
                if isinstance(msg, P.Hello):
                    ok, reason = self.accept(msg)
                    if ok:
                        self.hellos[node] = msg
                    self._outbox.put((node, P.Welcome(accepted=ok, reason=reason,
                                                      heartbeat_interval_s=HEARTBEAT_S,
                                                      liveness=LIVENESS)))
                elif isinstance(msg, P.Heartbeat):
                    self.beats[node].append(time.monotonic())
                    self.stats[node] = msg.stats
                elif isinstance(msg, P.Bye):
                    self.byes.append(msg)
                else:
                    self.inbox.append((node, msg))

    def send(self, node: str, msg: P.Message) -> None:
        self._outbox.put((node, msg))

    def wait(self, cond, timeout_s: float = 60.0, what: str = "condition"):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                result = cond()
            if result:
                return result
            time.sleep(0.01)
        raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")

    def wait_nodes(self, *node_ids: str, timeout_s: float = 120.0) -> None:
        self.wait(lambda: all(n in self.hellos for n in node_ids), timeout_s,
                  f"nodes {node_ids} to say hello")

    def take(self, kind, pred=lambda m: True, timeout_s: float = 30.0):
        def find():
            for i, (node, msg) in enumerate(self.inbox):
                if isinstance(msg, kind) and pred(msg):
                    return self.inbox.pop(i)
        return self.wait(find, timeout_s, kind.__name__)

    def reserve(self, decode: str, req_id: str, prompt: list[int], spec: P.SamplingParams,
                lease_s: float = 30.0) -> P.ReserveResult:
        self.send(decode, P.Reserve(items=[P.ReserveRequest(
            req_id=req_id, prompt_token_ids=prompt, sampling=spec, prefill_node_id="",
            lease_s=lease_s)]))
        (result,) = self.take(P.ReserveReply, lambda m: m.items[0].req_id == req_id)[1].items
        return result

    def run(self, requests: dict[str, tuple[list[int], P.SamplingParams]],
            prefill_of: dict[str, str], decode_of: dict[str, str],
            timeout_s: float = 120.0, same_host: bool = False) -> dict[str, dict]:
        """Reserve, prefill in one batch per prefill node, collect every token. same_host:
        pass the decode node's host id on, as the router does (KV then goes through shared
        memory); else leave it out (KV over TCP)."""
        results = {r: {"tokens": [], "finish": None, "error": None} for r in requests}
        cached = {}
        for req_id, (prompt, spec) in requests.items():
            reply = self.reserve(decode_of[req_id], req_id, prompt, spec)
            assert reply.ok, reply.reason
            cached[req_id] = reply.cached_blocks
        batches = defaultdict(list)
        for req_id, (prompt, spec) in requests.items():
            decode = decode_of[req_id]
            batches[prefill_of[req_id]].append(P.PrefillRequest(
                req_id=req_id, prompt_token_ids=prompt, sampling=spec, decode_node_id=decode,
                kv_address=self.hellos[decode].kv_address, timeout_s=30.0,
                skip_blocks=cached[req_id],
                decode_host_id=self.hellos[decode].host_id if same_host else ""))
        for prefill, reqs in batches.items():
            self.send(prefill, P.PrefillBatch(requests=reqs))

        def collect():
            for node, msg in self.inbox:
                if isinstance(msg, P.FirstTokens):
                    for it in msg.items:
                        results[it.req_id]["tokens"].append(it.token_id)
                        results[it.req_id]["finish"] = it.finish_reason
                elif isinstance(msg, P.TokenBatch):
                    for it in msg.items:
                        results[it.req_id]["tokens"].extend(it.token_ids)
                        results[it.req_id]["finish"] = it.finish_reason
                elif isinstance(msg, P.Error) and msg.req_id in results:
                    results[msg.req_id]["error"] = msg
            self.inbox.clear()
            return all(r["finish"] or r["error"] for r in results.values())
        self.wait(collect, timeout_s, "every request to finish")
        return results


def start_node(role: str, router: str, model_dir, node_id: str, *extra: str,
               log_path=None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pdserve.cli", role, "--router", router, "--model",
           str(model_dir), "--node-id", node_id, "--heartbeat-interval", str(HEARTBEAT_S),
           "--threads", "1", *extra]
    out = open(log_path, "w") if log_path else subprocess.DEVNULL
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def stop_nodes(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
