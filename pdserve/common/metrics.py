"""Every Prometheus metric of pdserve, defined once; each process owns one registry.

Names carry the ``pdserve_`` prefix and their base unit (``_seconds``, ``_bytes``,
``_total``, ``_ratio``). Labels: ``model_name`` everywhere, ``node`` (the node id) on
what a node process exports; never a request id (one series per request would
explode Prometheus). The router labels with the served model name, nodes with
their checkpoint folder's name: the same unless ``--served-model-name`` is set.

Every interval is measured inside one process from its own monotonic clock
(clocks differ between machines):

- router: time to first token (submit -> first token reaches the router), inter-token
  latency (between deliveries of one request's tokens), time per output token
  ((e2e - TTFT) / (tokens - 1), once per request), end-to-end latency (submit ->
  finish), queue time (submit -> the request's PrefillBatch leaves the router).
- prefill node: prefill time (the first step a request is in -> its first token
  sampled), KV transfer time (first KV chunk handed to the sender -> the decode
  node's KVAck).
- decode node: one step (forward + sampling of the whole running batch).

Buckets (vLLM's are the reference; ours are denser where a healthy cluster and our
alert thresholds lie, and the alert thresholds, TTFT 2 s and ITL 200 ms, are bucket
bounds, so a p99 compared with them is not an interpolation artefact):

- ``TTFT_BUCKETS``: 5 ms .. 160 s. Short prompts on a GPU land at 10-100 ms, long or
  queued ones in seconds.
- ``TOKEN_BUCKETS`` (TPOT, ITL, decode step): 1 ms .. 10 s, dense from 5 to 100 ms
  where a healthy decode step lies.
- ``E2E_BUCKETS``: 100 ms .. 1200 s (the default deadline is 600 s).
- ``QUEUE_BUCKETS``: 0.5 ms .. 120 s: normally the router keeps a request well under a
  millisecond; anything long means no decode node had room.
- ``PREFILL_BUCKETS``: 5 ms .. 80 s; ``KV_TRANSFER_BUCKETS``: 0.5 ms .. 30 s (one
  request's KV over loopback takes milliseconds, over a busy 10 GbE link up to seconds).
- ``BATCH_BUCKETS``: powers of two, 1 .. 1024 sequences.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
)
from prometheus_client.core import GaugeMetricFamily

from pdserve.common.config import ROLES

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
               90.0, 120.0, 180.0, 300.0, 600.0, 1200.0)
QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                 5.0, 10.0, 30.0, 60.0, 120.0)
PREFILL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   2.0, 5.0, 10.0, 20.0, 40.0, 80.0)
KV_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                       2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

FINISH_REASONS = ("stop", "length", "abort", "error")   # "error": see request_errors_total
NODE_STATES = ("live", "draining")


INTERNAL_LOG_PERIOD_S = 60.0  # one traceback per (where, error type) and period


class _Metrics:
    """A registry of its own (never the global default) and the constant labels."""

    def __init__(self, process: str, **labels: str):
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)   # process_cpu_seconds_total, memory, fds
        self.labels = labels
        self.process = process
        self.internal_errors = self._counter(
            "pdserve_internal_errors_total", "Failures of a handler (a bug, or input no check "
            "caught) contained to one request or peer, by process and where.", "process",
            "where")
        self.messages_dropped = self._counter(
            "pdserve_messages_dropped_total", "Messages dropped unread, by process and reason "
            "(rate_limit: the sending peer was over its message budget).", "process", "reason")
        self._logged: dict[tuple[str, str], tuple[float, int]] = {}

    def internal_error(self, where: str, log: logging.Logger) -> None:
        """Call from an ``except`` block: counts the failure and logs it with its traceback,
        once per (where, error type) and minute (a peer repeating it must not flood the log);
        the rest are counted and summed up in the next line."""
        import sys

        self.internal_errors.labels(**self.labels, process=self.process, where=where).inc()
        exc = sys.exc_info()[1]
        key = (where, type(exc).__name__)
        now = time.monotonic()
        if len(self._logged) > 1000:
            self._logged.clear()
        last, quiet = self._logged.get(key, (-1e9, 0))
        if now - last < INTERNAL_LOG_PERIOD_S:
            self._logged[key] = (last, quiet + 1)
            return
        self._logged[key] = (now, 0)
        log.error("internal error in %s (contained; %d more of this kind not logged in the "
                  "last minute)", where, quiet, exc_info=exc is not None)

    def dropped(self, reason: str) -> None:
        self.messages_dropped.labels(**self.labels, process=self.process, reason=reason).inc()

    def _histogram(self, name: str, doc: str, buckets) -> Histogram:
        return Histogram(name, doc, list(self.labels), registry=self.registry,
                         buckets=buckets).labels(**self.labels)

    def _counter(self, name: str, doc: str, *extra: str):
        """Bound to the constant labels unless ``extra`` labels remain to be chosen."""
        c = Counter(name, doc, [*self.labels, *extra], registry=self.registry)
        return c if extra else c.labels(**self.labels)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, list(self.labels), registry=self.registry).labels(**self.labels)


class RouterMetrics(_Metrics):
    """What the router observes. Per-request timing lives here (keyed by request id,
    dropped at the request's end), so the router core only reports events."""

    def __init__(self, model_name: str, error_codes: Iterable[str] = ()):
        super().__init__("router", model_name=model_name)
        self.ttft = self._histogram("pdserve_time_to_first_token_seconds",
                                    "Submit to the first token reaching the router.",
                                    TTFT_BUCKETS)
        self.tpot = self._histogram("pdserve_time_per_output_token_seconds",
                                    "(e2e - TTFT) / (output tokens - 1), once per request.",
                                    TOKEN_BUCKETS)
        self.itl = self._histogram("pdserve_inter_token_latency_seconds",
                                   "Between two deliveries of one request's tokens.",
                                   TOKEN_BUCKETS)
        self.e2e = self._histogram("pdserve_e2e_request_latency_seconds",
                                   "Submit to finish, of requests that ended without error.",
                                   E2E_BUCKETS)
        self.queue = self._histogram("pdserve_request_queue_time_seconds",
                                     "Submit to the request's PrefillBatch leaving the router.",
                                     QUEUE_BUCKETS)
        self.requests = self._counter("pdserve_requests_total", "Requests ended, by finish "
                                      "reason ('error': failed or refused).", "finish_reason")
        self.prompt_tokens = self._counter("pdserve_prompt_tokens_total",
                                           "Prompt tokens of requests that got a first token.")
        self.generation_tokens = self._counter("pdserve_generation_tokens_total",
                                               "Output tokens delivered to clients.")
        self.errors = self._counter("pdserve_request_errors_total", "Requests that failed "
                                    "or were refused (the HTTP edge's 400/401/404/413 too), "
                                    "by error code.", "code")
        self.index_degraded = Gauge(
            "pdserve_prefix_index_degraded", "1 while this router's prefix index of a node "
            "may lack blocks the node holds (its dump not in yet, or events lost and a dump "
            "on its way); --policy cache_aware only.", [*self.labels, "node"],
            registry=self.registry)
        self.index_blocks = Gauge(
            "pdserve_prefix_index_blocks", "Block keys this router's prefix index holds for "
            "a node (from its KV events and dumps); --policy cache_aware only.",
            [*self.labels, "node"], registry=self.registry)
        self.index_dumps = self._counter(
            "pdserve_prefix_index_dumps_total", "Index dumps asked of nodes, by reason "
            "(joined: a node registered; gap: its events were lost).", "reason")
        self.responses_stored = self._gauge("pdserve_responses_stored", "Responses held "
                                            "for previous_response_id and GET "
                                            "/v1/responses/{id} (--responses-store-*).")
        # Every series exists from the start, so rate() and ratios have data at once.
        for reason in FINISH_REASONS:
            self.requests.labels(finish_reason=reason, **self.labels)
        for code in error_codes:
            self.errors.labels(code=code, **self.labels)
        self._timing: dict[str, _Timing] = {}

    def watch(self, requests_running: Callable[[], int],
              nodes: Callable[[], Iterable[tuple[str, str]]]) -> None:
        """Gauges read at scrape time: requests in flight, (role, state) of each node."""
        self.registry.register(_RouterGauges(self.labels["model_name"], requests_running,
                                             nodes))

    def prefix_index(self, node: str, degraded: bool, num_blocks: int) -> None:
        self.index_degraded.labels(**self.labels, node=node).set(1 if degraded else 0)
        self.index_blocks.labels(**self.labels, node=node).set(num_blocks)

    def prefix_index_node_gone(self, node: str) -> None:
        for gauge in (self.index_degraded, self.index_blocks):
            try:
                gauge.remove(*self.labels.values(), node)
            except KeyError:
                pass

    def prefix_index_dump(self, reason: str) -> None:
        self.index_dumps.labels(**self.labels, reason=reason).inc()

    # -- events, in a request's order ------------------------------------------------------------
    def submitted(self, req_id: str) -> None:
        self._timing[req_id] = _Timing(time.monotonic())

    def refused(self, code: str) -> None:
        """Refused at submit (overloaded, no nodes, bad request): no flight was made."""
        self.finished("", None, code)

    def dispatched(self, req_ids: Iterable[str]) -> None:
        now = time.monotonic()
        for req_id in req_ids:
            t = self._timing.get(req_id)
            if t is not None and not t.dispatched:   # a re-dispatch is not queue time
                t.dispatched = True
                self.queue.observe(now - t.submitted)

    def delivered(self, req_id: str, num_tokens: int, num_prompt_tokens: int) -> None:
        t = self._timing.get(req_id)
        if t is None or num_tokens <= 0:
            return
        now = time.monotonic()
        if t.first is None:
            t.first = now
            self.ttft.observe(now - t.submitted)
            self.prompt_tokens.inc(num_prompt_tokens)
        else:
            self.itl.observe(now - t.last)
        t.last = now
        t.num_tokens += num_tokens
        self.generation_tokens.inc(num_tokens)

    def finished(self, req_id: str, finish_reason: str | None, error_code: str | None) -> None:
        t = self._timing.pop(req_id, None)
        if error_code is not None:
            self.errors.labels(code=error_code, **self.labels).inc()
            self.requests.labels(finish_reason="error", **self.labels).inc()
            return
        self.requests.labels(finish_reason=finish_reason or "abort", **self.labels).inc()
        if t is None:
            return
        now = time.monotonic()
        self.e2e.observe(now - t.submitted)
        if t.first is not None and t.num_tokens > 1:
            self.tpot.observe((now - t.first) / (t.num_tokens - 1))


@dataclass
class _Timing:
    submitted: float
    dispatched: bool = False
    first: float | None = None
    last: float = 0.0
    num_tokens: int = 0


class _RouterGauges:
    """Collected at scrape time from the router's own state, so they never drift."""

    def __init__(self, model_name, requests_running, nodes):
        self.model_name, self.requests_running, self.nodes = model_name, requests_running, nodes

    def collect(self):
        running = GaugeMetricFamily("pdserve_requests_running", "Requests in flight at the "
                                    "router.", labels=["model_name"])
        running.add_metric([self.model_name], self.requests_running())
        yield running
        counts = {(r, s): 0 for r in ROLES for s in NODE_STATES}
        for role, state in list(self.nodes()):
            counts[(role, state)] = counts.get((role, state), 0) + 1
        nodes = GaugeMetricFamily("pdserve_nodes", "Registered nodes, by role and state.",
                                  labels=["model_name", "role", "state"])
        for (role, state), n in sorted(counts.items()):
            nodes.add_metric([self.model_name, role, state], n)
        yield nodes


class NodeMetrics(_Metrics):
    """What both node kinds export: gauges from the stats they also heartbeat."""

    def __init__(self, model_name: str, node: str, process: str = "node"):
        super().__init__(process, model_name=model_name, node=node)
        self.kv_cache_usage = self._gauge("pdserve_kv_cache_usage_ratio",
                                          "Used KV cache blocks / all blocks (0..1).")
        self.waiting = self._gauge("pdserve_requests_waiting", "Requests accepted by the "
                                   "node but not in its running batch.")
        # vLLM's prefix_cache_queries / prefix_cache_hits, in tokens.
        self.prefix_queries = self._counter("pdserve_prefix_cache_queries_tokens_total",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = self._counter("pdserve_prefix_cache_hits_tokens_total", "Prompt "
                                         "tokens found in the prefix cache (not computed).")
        self._prefix_seen = (0, 0)

    def node_stats(self, stats) -> None:
        """``stats``: the protocol's NodeStats, published every loop turn."""
        total = stats.num_total_blocks or 1
        self.kv_cache_usage.set(1.0 - stats.num_free_blocks / total)
        self.waiting.set(stats.num_waiting)

    def prefix_cache(self, queried_tokens: int, hit_tokens: int) -> None:
        """The scheduler's running totals; the counters advance by what is new."""
        seen_q, seen_h = self._prefix_seen
        if queried_tokens > seen_q:
            self.prefix_queries.inc(queried_tokens - seen_q)
        if hit_tokens > seen_h:
            self.prefix_hits.inc(hit_tokens - seen_h)
        self._prefix_seen = (queried_tokens, hit_tokens)


class PrefillMetrics(NodeMetrics):
    def __init__(self, model_name: str, node: str):
        super().__init__(model_name, node)
        self.batch_size = self._histogram("pdserve_prefill_batch_size", "Sequences in one "
                                          "prefill step.", BATCH_BUCKETS)
        self.prefill_time = self._histogram("pdserve_prefill_time_seconds", "A request's "
                                            "first prefill step to its first token.",
                                            PREFILL_BUCKETS)
        self.kv_time = self._histogram("pdserve_kv_transfer_seconds", "First KV chunk sent "
                                       "to the decode node's KVAck.", KV_TRANSFER_BUCKETS)
        self.kv_bytes = self._counter("pdserve_kv_transfer_bytes_total", "KV bytes sent to "
                                      "decode nodes, by path: tcp (frames on the KV socket) "
                                      "or shm (same host, through shared memory).", "path")
        self.kv_failures = self._counter("pdserve_kv_transfer_failures_total", "KV transfers "
                                         "refused, failed to send or never acknowledged.")
        self.kv_blocks_sent = self._counter("pdserve_kv_blocks_sent_total", "Prompt KV blocks "
                                            "sent to decode nodes.")
        self.kv_blocks_skipped = self._counter("pdserve_kv_blocks_skipped_total", "Prompt KV "
                                               "blocks not sent: the decode node had them "
                                               "cached.")
        self._started: dict[str, float] = {}
        self._kv_started: dict[str, float] = {}

    def step(self, req_ids: list[str]) -> None:
        now = time.monotonic()
        self.batch_size.observe(len(req_ids))
        for req_id in req_ids:
            self._started.setdefault(req_id, now)

    def first_token(self, req_id: str) -> None:
        started = self._started.pop(req_id, None)
        if started is not None:
            self.prefill_time.observe(time.monotonic() - started)

    def kv_sent(self, req_ids: list[str], nbytes: int, path: str = "tcp") -> None:
        now = time.monotonic()
        for req_id in req_ids:
            self._kv_started.setdefault(req_id, now)
        self.kv_bytes.labels(**self.labels, path=path).inc(nbytes)

    def kv_blocks(self, sent: int, skipped: int) -> None:
        self.kv_blocks_sent.inc(sent)
        self.kv_blocks_skipped.inc(skipped)

    def kv_acked(self, req_id: str, ok: bool) -> None:
        started = self._kv_started.pop(req_id, None)
        if not ok:
            self.kv_failures.inc()
        elif started is not None:
            self.kv_time.observe(time.monotonic() - started)

    def kv_failed(self, req_id: str) -> None:
        self._kv_started.pop(req_id, None)
        self.kv_failures.inc()

    def forget(self, req_id: str) -> None:
        """The request left this node (aborted, finished at its first token, acknowledged)."""
        self._started.pop(req_id, None)
        self._kv_started.pop(req_id, None)


class DecodeMetrics(NodeMetrics):
    def __init__(self, model_name: str, node: str):
        super().__init__(model_name, node)
        self.step_time = self._histogram("pdserve_decode_step_seconds", "One decode step of "
                                         "the running batch: forward, sampling and stop checks.",
                                         TOKEN_BUCKETS)
        self.batch_size = self._histogram("pdserve_decode_batch_size", "Sequences in one "
                                          "decode step.", BATCH_BUCKETS)

    def step(self, batch_size: int, seconds: float) -> None:
        self.batch_size.observe(batch_size)
        self.step_time.observe(seconds)


def node_metrics(role: str, model_name: str, node: str) -> NodeMetrics:
    """A colocated node's steps are decode steps (with prompt chunks in them)."""
    cls = {"prefill": PrefillMetrics, "decode": DecodeMetrics, "colocated": DecodeMetrics}[role]
    metrics = cls(model_name, node)
    metrics.process = role
    return metrics
