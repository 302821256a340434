"""Membership on etcd: each process's record under a leased key, and a watch of a prefix.

    /pdserve/CLUSTER/routers/ROUTER_ID  -> {"role": "router", "control": ..., "ingress": ...}
    /pdserve/CLUSTER/nodes/NODE_ID      -> {"role": "decode", "model": ..., "kv_layout": ...}

A key lives as long as its lease: a process that dies stops the keepalives and etcd
deletes its key within the lease's TTL (--discovery-ttl). The key's create revision is
the record's epoch: a process that lost its lease and wrote again has a larger one, so a
reader can tell a restart (or a partition healed) from the record it knew.

The client is ours, on etcd's JSON gateway (/v3/...) with httpx, rather than etcd3gw:
etcd3gw pulls in requests, futurist and pbr, and its watch needs a thread of its own
anyway. Ours is four calls (grant, put, keepalive, range) plus a streaming watch, each
on a thread of its own here, so neither a keepalive nor a watch that etcd does not answer
(etcd stopped, partitioned) ever blocks a node's compute loop, its I/O thread or a
router's event loop: what they read is a snapshot these threads replace.
"""
from __future__ import annotations

import base64
import json
import logging
import socket
import threading
import time
from typing import Callable
from urllib.parse import urlparse

import httpx

from pdserve.common.config_fields import flag

log = logging.getLogger(__name__)
# httpx logs every request at info: a keepalive each TTL/3 would drown a node's log.
logging.getLogger("httpx").setLevel(logging.WARNING)

DEFAULT_TTL_S = 10
RETRY_S = (0.5, 5.0)   # after a failed call to etcd, before the next: doubling up to 5 s
CALL_TIMEOUT_S = 3.0   # one unary call; a watch's read has none (it waits for events)


def discovery_flag():
    """The --discovery field of the router's and the nodes' configs (one definition)."""
    return flag(None, "Membership on etcd, etcd://HOST:PORT: register here and find the "
                "cluster's routers (nodes need no --router).", default_text="static")


def cluster_flag():
    return flag("default", "The cluster's name in --discovery (its etcd key prefix).")


def ttl_flag():
    return flag(DEFAULT_TTL_S, "Seconds of the etcd lease: a process that dies leaves "
                "the cluster this long after.", name="--discovery-ttl", min=2)


def check_discovery(url: str | None) -> None:
    if url is not None:
        gateway_url(url)


def gateway_url(url: str) -> str:
    """http://HOST:PORT for etcd://HOST:PORT (ValueError for anything else)."""
    parsed = urlparse(url)
    if parsed.scheme != "etcd" or not parsed.hostname or not parsed.port:
        raise ValueError(f"--discovery {url!r} must look like etcd://HOST:PORT")
    return f"http://{parsed.hostname}:{parsed.port}"


def prefix(cluster: str, kind: str) -> str:
    """The key prefix of a cluster's routers or nodes (kind: "routers" or "nodes")."""
    return f"/pdserve/{cluster}/{kind}/"


def _b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode()


def _range_end(key: str) -> str:
    """The end of the range of every key that starts with ``key`` (etcd's prefix range)."""
    raw = bytearray(key.encode())
    raw[-1] += 1
    return _b64(bytes(raw))


class EtcdClient:
    """The few calls of etcd's v3 JSON gateway we use. One per thread (httpx clients are
    not shared between threads here)."""

    def __init__(self, url: str):
        self.base = gateway_url(url)
        self.http = httpx.Client(timeout=CALL_TIMEOUT_S)

    def close(self) -> None:
        self.http.close()

    def _call(self, path: str, body: dict) -> dict:
        r = self.http.post(self.base + path, json=body)
        r.raise_for_status()
        return r.json()

    def grant(self, ttl_s: int) -> int:
        return int(self._call("/v3/lease/grant", {"TTL": ttl_s})["ID"])

    def keepalive(self, lease: int) -> int:
        """The lease's TTL left after this keepalive; 0: the lease is gone (expired)."""
        out = self._call("/v3/lease/keepalive", {"ID": lease})
        return int(out.get("result", {}).get("TTL", 0))

    def put(self, key: str, value: str, lease: int | None = None) -> int:
        """The revision of the write."""
        body = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = lease
        return int(self._call("/v3/kv/put", body)["header"]["revision"])

    def revoke(self, lease: int) -> None:
        self._call("/v3/kv/lease/revoke", {"ID": lease})

    def range(self, key_prefix: str) -> tuple[dict[str, tuple[dict, int]], int]:
        """({key: (record, create revision)}, the store's revision)."""
        out = self._call("/v3/kv/range", {"key": _b64(key_prefix),
                                          "range_end": _range_end(key_prefix)})
        found = {}
        for kv in out.get("kvs", []):
            found[_unb64(kv["key"])] = (json.loads(_unb64(kv["value"])),
                                        int(kv["create_revision"]))
        return found, int(out["header"]["revision"])

    def watch(self, key_prefix: str, start_revision: int, stopping: threading.Event):
        """Yields (type, key, record or None, create revision) for each change, as etcd
        streams them, until the stream ends or ``stopping`` is set."""
        body = {"create_request": {"key": _b64(key_prefix),
                                   "range_end": _range_end(key_prefix),
                                   "start_revision": start_revision}}
        timeout = httpx.Timeout(CALL_TIMEOUT_S, read=None)
        with self.http.stream("POST", self.base + "/v3/watch", json=body,
                              timeout=timeout) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if stopping.is_set():
                    return
                if not line.strip():
                    continue
                result = json.loads(line).get("result", {})
                for ev in result.get("events", []):
                    kv = ev["kv"]
                    kind = ev.get("type", "PUT")  # the gateway leaves the default out
                    record = json.loads(_unb64(kv["value"])) if kind == "PUT" else None
                    yield kind, _unb64(kv["key"]), record, int(kv.get("create_revision", 0))


class Registration(threading.Thread):
    """Writes ``record()`` under ``key`` bound to a lease and keeps the lease alive. If the
    lease expired (etcd unreachable longer than its TTL), grants a new one and writes the
    record again: a new epoch. ``epoch`` is 0 until the first write."""

    def __init__(self, url: str, key: str, record: Callable[[], dict], ttl_s: int):
        super().__init__(name=f"etcd-register-{key}", daemon=True)
        self.url, self.key, self.record, self.ttl_s = url, key, record, ttl_s
        self.epoch = 0
        self.registered = threading.Event()
        self._stopping = threading.Event()
        self._lease = 0

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        client = EtcdClient(self.url)
        try:
            delay = RETRY_S[0]
            while not self._stopping.is_set():
                try:
                    self._keep(client)
                    delay = RETRY_S[0]
                except (httpx.HTTPError, KeyError, ValueError) as exc:
                    log.warning("etcd at %s: %s (retrying in %g s)", self.url, exc, delay)
                    self._stopping.wait(delay)
                    delay = min(delay * 2, RETRY_S[1])
            if self._lease:  # leave at once rather than after the TTL
                try:
                    client.revoke(self._lease)
                except (httpx.HTTPError, ValueError):
                    pass
        finally:
            client.close()

    def _keep(self, client: EtcdClient) -> None:
        if not self._lease:
            lease = client.grant(self.ttl_s)
            self.epoch = client.put(self.key, json.dumps(self.record()), lease)
            self._lease = lease
            self.registered.set()
            log.info("registered %s in etcd (epoch %d)", self.key, self.epoch)
        while not self._stopping.wait(self.ttl_s / 3):
            if client.keepalive(self._lease) <= 0:
                log.warning("etcd lease of %s expired: registering again", self.key)
                self._lease = 0
                return


class Watch(threading.Thread):
    """The records under a prefix, kept current from a streaming watch: ``changed`` gets
    the whole {key: (record, epoch)} after the first read and after every change. On any
    failure the watch starts over from a fresh read, so nothing missed is lost."""

    def __init__(self, url: str, key_prefix: str,
                 changed: Callable[[dict[str, tuple[dict, int]]], None]):
        super().__init__(name=f"etcd-watch-{key_prefix}", daemon=True)
        self.url, self.key_prefix, self.changed = url, key_prefix, changed
        self.records: dict[str, tuple[dict, int]] = {}
        self.synced = threading.Event()
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        client = EtcdClient(self.url)
        try:
            delay = RETRY_S[0]
            while not self._stopping.is_set():
                try:
                    self._follow(client)
                    delay = RETRY_S[0]  # the stream ended after working: start over now
                except (httpx.HTTPError, KeyError, ValueError) as exc:
                    log.warning("etcd watch of %s: %s (starting over in %g s)",
                                self.key_prefix, exc, delay)
                    delay = min(delay * 2, RETRY_S[1])
                self._stopping.wait(delay)
        finally:
            client.close()

    def _follow(self, client: EtcdClient) -> None:
        records, revision = client.range(self.key_prefix)
        self._publish(records)
        for kind, key, record, epoch in client.watch(self.key_prefix, revision + 1,
                                                     self._stopping):
            records = dict(self.records)
            if kind == "PUT":
                records[key] = (record, epoch)
            else:
                records.pop(key, None)
            self._publish(records)

    def _publish(self, records: dict) -> None:
        self.records = records
        self.synced.set()
        try:
            self.changed(records)
        except Exception:  # the watch must go on
            log.exception("etcd watch callback failed")


def wait_until(event: threading.Event, timeout_s: float, stopping: Callable[[], bool]) -> bool:
    """Waits for ``event`` in short steps, giving up when ``stopping()`` says so."""
    deadline = time.monotonic() + timeout_s
    while not event.wait(0.1):
        if stopping() or time.monotonic() > deadline:
            return False
    return True


def advertised(endpoint: str, host: str | None) -> str:
    """The address other machines use for a bound endpoint (``tcp://0.0.0.0:5600`` is
    no address to connect to): what a record in etcd or a Hello carries."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    bound_host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    if host is None:
        host = socket.gethostname() if bound_host in ("0.0.0.0", "*", "[::]") else bound_host
    return f"tcp://{host}:{port}"
