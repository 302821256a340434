"""The loop every node runs, in a few numbered steps; roles fill in the steps.

    1. start the I/O thread, say Hello, wait for the router's Welcome
    2. loop: take what the I/O thread received (block only when idle),
       expire leases and deadlines, run one step if there is work,
       publish stats for the next heartbeat
    3. on SIGTERM/SIGINT or an I/O failure: stop the I/O thread (it says Bye),
       free the device
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import msgspec

from pdserve.common import errors as E
from pdserve.common import heap_dump
from pdserve.common import protocol as P
from pdserve.common.gc_heap import freeze_startup_objects
from pdserve.common.metrics import node_metrics
from pdserve.common.metrics_http import start_metrics_server
from pdserve.common.sampling import SamplingParams
from pdserve.common.security import InsecureWarnings, node_curves, node_exposures
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import Sequence
from pdserve.engine.types import EngineStats, Logprobs
from pdserve.node import kv_index
from pdserve.node.config import NodeConfig
from pdserve.node.io import InboxItem, NodeIO
from pdserve.node.kv import segment as shm
from pdserve.node.membership import Membership

log = logging.getLogger(__name__)


@dataclass
class Parked:
    """A request waiting for its guide to compile (Node.park_for_guide)."""
    future: Future
    deadline: float
    resume: Callable[[], None]
    fail: Callable[[str], None]

IDLE_WAIT_S = 0.05  # longest block on the inbox when idle: bounds lease-expiry lag
STATS_PERIOD_S = 0.02  # busy, heartbeats' stats and gauges refresh this often (idle: a turn)


# The engine hands out plain data; what travels is the protocol's (the same fields).
def wire_stats(s: EngineStats, kv_events_seq: int = -1) -> P.NodeStats:
    return P.NodeStats(num_free_blocks=s.num_free_blocks, num_total_blocks=s.num_total_blocks,
                       num_running=s.num_running, num_waiting=s.num_waiting,
                       queued_prompt_tokens=s.queued_prompt_tokens,
                       kv_events_seq=kv_events_seq)


def wire_logprobs(lp: Logprobs | None) -> P.Logprobs | None:
    """The same lists, not copied."""
    if lp is None:
        return None
    return P.Logprobs(token_logprobs=lp.token_logprobs, top_ids=lp.top_ids,
                      top_logprobs=lp.top_logprobs)


class Node:
    role = ""

    def __init__(self, config: NodeConfig):
        self.config = config
        self.node_id = config.node_id or f"{self.role}-{socket.gethostname()}-{os.getpid()}"
        shm.sweep()  # KV segments of processes killed before they could remove them
        self.host_id = shm.host_id()
        # No detokenizing here: text and stop strings are the router's (it has the tokenizer).
        self.engine = Engine(config.engine, kv_storage=self.kv_storage, detokenize=False)
        model, lay = self.engine.identity(), self.engine.kv_layout()
        self.identity = P.ModelIdentity(name=model.name, config_hash=model.config_hash)
        self.layout = P.KVLayout(num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads,
                                 head_dim=lay.head_dim, dtype=lay.dtype,
                                 block_size=lay.block_size)
        self.metrics = node_metrics(self.role, self.identity.name, self.node_id)
        self.kv_events = kv_index.make_publisher(config, self.engine, self.layout.block_size)
        hello = P.Hello(node_id=self.node_id, role=self.role,
                        protocol_version=P.PROTOCOL_VERSION, model=self.identity,
                        kv_layout=self.layout, capacity=self.stats(), pid=os.getpid(),
                        compute=config.engine.compute, incarnation=os.urandom(8).hex(),
                        host_id=self.host_id)
        self.io = NodeIO(config.routers, hello,
                         kv_bind=config.kv_bind if self.role == "decode" else None,
                         advertise_host=config.advertise_host,
                         heartbeat_interval_s=config.heartbeat_interval_s,
                         curve=node_curves(config.curve_dir, self.role, config.curve_key),
                         dropped=self.metrics.dropped)
        self._stop = threading.Event()
        self.insecure_warnings = InsecureWarnings(node_exposures(config))
        self.draining = False
        self._drain_asked = False   # set by the signal handler, acted on by the loop
        self.drain_deadline = 0.0
        self.jobs: dict = {}    # the role's requests by wire id
        self._parked: dict[str, Parked] = {}  # requests whose guide compiles meanwhile
        if config.engine.compute == "none":
            log.warning("COMPUTE NONE: benchmark mode, the forward is skipped and every token "
                        "is %d; outputs are not the model's", self.engine.runner.fixed_token)
        elif config.engine.compute == "simulated":
            log.warning("COMPUTE SIMULATED: %s, step times from its roofline, tokens a seeded "
                        "stream; %d KV blocks of %d-byte pages (--sim-kv-bytes-scale %g)",
                        self.engine.profile.name, self.engine.num_blocks,
                        self.layout.block_size * self.layout.num_kv_heads *
                        self.layout.head_dim * self.engine.dtype.itemsize,
                        config.engine.sim_kv_bytes_scale)

    # -- for the roles ---------------------------------------------------------------------
    def kv_storage(self, nbytes: int):
        """Where the CPU KV cache lives (see ModelRunner); None: the process's own memory."""
        return None

    def release(self) -> None:
        """Frees what the role holds outside the process (shared-memory segments)."""

    def handle(self, item: InboxItem) -> None:
        raise NotImplementedError

    def has_work(self) -> bool:
        return self.engine.scheduler.has_unfinished()

    def step(self) -> None:
        raise NotImplementedError

    def expire(self) -> None:
        """Ends whatever waited past its deadline; called every turn of the loop."""

    def stats(self) -> P.NodeStats:
        return wire_stats(self.engine.stats(), self.events_seq())

    def events_seq(self) -> int:
        return self.kv_events.last_seq if self.kv_events is not None else -1

    def request_params(self, req_id: str, prompt: list[int],
                       params: SamplingParams) -> SamplingParams:
        """The request's sampling parameters (checked against their limits as they were
        decoded); ValueError saying why this model cannot serve them."""
        self.engine.check_request(prompt, params, what=f"prompt of {req_id}")
        return params

    def park_for_guide(self, req_id: str, params: SamplingParams,
                       resume: Callable[[], None], fail: Callable[[str], None]) -> bool:
        """True when the request's structured-output guide is compiling on a worker thread:
        ``resume()`` runs on a later turn of this loop once it has compiled (everything is
        then as if it had been compiled all along), ``fail(why)`` if it did not compile or
        took longer than --guide-timeout. False: nothing to wait for, go on now. A guide
        compiled in this loop stalled every running stream for as long as it took."""
        future = self.engine.guide_compiling(params)
        if future is None:
            return False
        self._parked[req_id] = Parked(future, time.monotonic() + self.config.guide_timeout_s,
                                      resume, fail)
        return True

    def unpark(self, req_id: str) -> None:
        """An aborted request no longer waits for its guide."""
        self._parked.pop(req_id, None)

    def _resume_parked(self) -> None:
        now = time.monotonic()
        for req_id, parked in list(self._parked.items()):
            if not parked.future.done() and now < parked.deadline:
                continue
            del self._parked[req_id]
            try:
                if not parked.future.done():
                    # Not started yet: it never will be, unless another request waits for
                    # the same guide. Started: it runs on (a thread cannot be stopped) and
                    # its result is cached.
                    if not any(p.future is parked.future for p in self._parked.values()):
                        parked.future.cancel()
                    parked.fail(f"its structured-output guide did not compile within "
                                f"{self.config.guide_timeout_s:g} s (--guide-timeout)")
                elif parked.future.exception() is not None:
                    exc = parked.future.exception()
                    parked.fail(str(exc) if isinstance(exc, ValueError) else
                                f"its structured-output guide failed to compile: "
                                f"{type(exc).__name__}: {exc}")
                else:
                    parked.resume()
            except Exception:  # that request fails, no other
                self.metrics.internal_error(f"{self.role}.resume", log)
                self.drop(req_id, "error")
                self.error_to_router(req_id, E.INTERNAL, f"node {self.node_id} hit an "
                                     "internal error while taking the request; see its log")

    def admit(self, req: P.PrefillRequest, known: bool) -> Sequence | None:
        """A sequence for a request to prefill here, or None after telling the router why not."""
        if known:
            self.error_to_router(req.req_id, E.BAD_MESSAGE,
                                 f"request id {req.req_id!r} is already in flight here")
            return None
        try:
            params = self.request_params(req.req_id, req.prompt_token_ids, req.sampling)
        except ValueError as exc:
            self.error_to_router(req.req_id, E.BAD_MESSAGE, str(exc))
            return None
        return Sequence(req.req_id, req.prompt_token_ids, params)

    def send_first_tokens(self, firsts: list[P.FirstToken]) -> None:
        """The first tokens of one step to the router, together (time to first token); one
        carrying its prompt's logprobs (a number or more per prompt token) in a message of
        its own, so that the step's message stays under the header limit."""
        plain = [f for f in firsts if f.prompt_logprobs is None]
        if plain:
            self.io.send_control(P.FirstTokens(items=plain))
        for f in firsts:
            if f.prompt_logprobs is not None:
                self.io.send_control(P.FirstTokens(items=[f]))

    def error_to_router(self, req_id: str | None, code: str, message: str) -> None:
        log.warning("request %s failed (%s): %s", req_id, code, message)
        self.io.send_control(P.Error(req_id=req_id, code=code, message=message))

    # -- the loop ----------------------------------------------------------------------------
    def stop(self, *_args) -> None:
        """First SIGTERM/SIGINT: drain (no new work; running requests finish, then exit 0).
        A second one, or one before the router welcomed us: stop now. Only flags are set
        here: a signal handler runs inside whatever the loop was doing (holding a queue's
        or the wake pipe's lock, say), so the loop itself starts the drain."""
        if self._drain_asked or not self.io.welcomed.is_set():
            self._stop.set()
            return
        self._drain_asked = True

    def _start_drain(self) -> None:
        self.draining = True
        self.drain_deadline = time.monotonic() + self.config.drain_timeout_s
        log.info("draining: no new work; %d requests to finish (at most %.0f s)",
                 len(self.jobs), self.config.drain_timeout_s)
        self.io.send_control(P.Drain(reason="the node is shutting down"))

    def refuse_when_draining(self, req_id: str) -> bool:
        """While draining, new work is refused with a reason the router retries elsewhere."""
        if self.draining:
            self.error_to_router(req_id, E.NO_CAPACITY, f"node {self.node_id} is draining")
        return self.draining

    def run(self) -> int:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.stop)
            signal.signal(signal.SIGINT, self.stop)
        metrics_server = start_metrics_server(self.metrics.registry, self.config.metrics_host,
                                              self.config.metrics_port) \
            if self.config.metrics_port else None
        membership = None
        try:
            kv_index.start_publisher(self)  # its address is in the Hello the I/O thread says
            self.io.start()
            membership = Membership(self) if self.config.discovery else None
            if not self._wait_welcome():
                return 1
            if membership is not None:
                membership.register()
            freeze_startup_objects()
            heap_dump.install()  # only with PDSERVE_HEAP_DUMP set
            log.info("%s node %s registered with router %s%s", self.role, self.node_id,
                     ", ".join(self.io.links.wanted),
                     f", KV socket {self.io.hello.kv_address}" if self.io.hello.kv_address else "")
            stats_due = 0.0
            while not self._stop.is_set():
                if self._drain_asked and not self.draining:
                    self._start_drain()
                if self.draining and (not self.jobs or time.monotonic() > self.drain_deadline):
                    log.info("drained: %d requests left", len(self.jobs))
                    break
                if self.io.failure is not None:
                    raise RuntimeError("node I/O thread failed") from self.io.failure
                self._take_inbox(block=not self.has_work())
                self._turn()
                self.insecure_warnings.tick()
                if (now := time.monotonic()) >= stats_due or not self.has_work():
                    stats_due = now + STATS_PERIOD_S  # (every step, a tenth of its Python)
                    self.io.stats = self.stats()
                    self.metrics.node_stats(self.io.stats)
                    self.metrics.prefix_cache(self.engine.scheduler.num_prefix_queried_tokens,
                                              self.engine.scheduler.num_prefix_hit_tokens)
                if self.kv_events is not None:
                    self.kv_events.publish(self.engine.allocator.drain_events())
            return 0
        finally:
            if membership is not None:
                membership.stop()
            if self.kv_events is not None:
                self.kv_events.stop()
            self.io.stop()
            if self.io.ident is not None:  # (not started when the publisher could not bind)
                self.io.join(timeout=5)
            self.release()
            if metrics_server is not None:
                metrics_server.close()

    def _turn(self) -> None:
        """Expiry and one step. A failure here is a bug or input no check caught: the
        requests on this node fail with a reason, the node keeps serving."""
        try:
            self._resume_parked()
            self.expire()
            if self.has_work():
                self.step()
            for req_id, (code, why) in self.engine.take_rejected().items():
                self.drop(req_id, "error")
                self.error_to_router(req_id, code, why)
        except Exception:
            self.metrics.internal_error(f"{self.role}.step", log)
            for req_id in list(self.jobs):
                self.drop(req_id, "error")
                self.error_to_router(req_id, E.INTERNAL, f"node {self.node_id} hit an internal "
                                     "error while serving it; see the node's log")

    def _fail_requests_of(self, msg: P.Message) -> None:
        """The requests a message whose handling failed was about end with a reason."""
        if isinstance(msg, P.PrefillBatch):
            ids = [r.req_id for r in msg.requests]
        elif isinstance(msg, P.KVChunk):  # only the requests reserved here are ours to end
            ids = [p.req_id for p in msg.parts if p.req_id in self.jobs]
        else:
            ids = [r.req_id for r in msg.items] if isinstance(msg, P.Reserve) else []
        for req_id in ids:
            self.drop(req_id, "error")
            self.error_to_router(req_id, E.INTERNAL, f"node {self.node_id} hit an internal "
                                 "error while taking the request; see the node's log")

    def _wait_welcome(self) -> bool:
        if not self._wait_welcome_once():
            return False
        welcome = self.io.welcome
        if not welcome.accepted and welcome.code == E.NAME_TAKEN:
            # Another connection holds this node id at the router (a stranger who said
            # Hello with it first, or a twin with the same --node-id): serve under a fresh
            # id rather than not at all. Metrics keep the configured id.
            fresh = f"{self.node_id}-{self.io.hello.incarnation[:6]}"
            log.warning("router refused node id %s (%s); registering as %s", self.node_id,
                        welcome.reason, fresh)
            self.node_id = fresh
            self.io.hello = msgspec.structs.replace(self.io.hello, node_id=fresh)
            self.io.welcome = None
            self.io.welcomed.clear()
            self.io.send_control(self.io.hello)
            if not self._wait_welcome_once():
                return False
        welcome = self.io.welcome
        if not welcome.accepted:
            log.error("router refused this node: %s", welcome.reason)
            return False
        self.io.heartbeat_interval_s = welcome.heartbeat_interval_s
        return True

    def _wait_welcome_once(self) -> bool:
        timeout = self.config.welcome_timeout_s
        while not self.io.welcomed.wait(0.1):
            timeout -= 0.1
            if self._stop.is_set():
                return False
            if timeout <= 0 and self.config.discovery:  # routers may come later
                log.warning("no router of cluster %s has answered yet (%s); waiting",
                            self.config.cluster, self.config.discovery)
                timeout = self.config.welcome_timeout_s
            elif timeout <= 0:
                log.error("router at %s did not answer Hello within %.0f s",
                          self.config.router, self.config.welcome_timeout_s)
                return False
        if self.io.failure is not None:
            log.error("node I/O failed before registering: %s", self.io.failure)
            return False
        return True

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self.io.inbox.get(timeout=IDLE_WAIT_S) if block \
                else self.io.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                # (A restarted router's work comes back as an Abort from the I/O thread:
                # that router's requests end, other routers' go on.)
                if isinstance(item.msg, P.IndexDumpRequest):
                    kv_index.answer_dump(self, item.peer, item.msg)
                else:
                    self.handle(item)
            except Exception:  # one bad message must not stop the node: its requests fail
                self.metrics.internal_error(
                    f"{self.role}.handle.{type(item.msg).__name__}", log)
                self._fail_requests_of(item.msg)
            try:
                item = self.io.inbox.get_nowait()
            except queue.Empty:
                return
