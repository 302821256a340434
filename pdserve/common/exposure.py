"""Secure by default off loopback: what a config opens to other machines without CURVE or
an API key, refused unless ``--insecure`` (and then said again every minute)."""
from __future__ import annotations

import logging
import time

log = logging.getLogger("pdserve.common.security")  # one logger for every security line


def _is_loopback(address: str) -> bool:
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return address.startswith(("ipc://", "inproc://")) or host in ("127.0.0.1", "localhost", "::1")


INSECURE_WARN_PERIOD_S = 60.0


def router_exposures(config) -> list[str]:
    """What the router's config opens to other machines without protection."""
    out = []
    if config.curve_dir is None:
        for what, address in (("control", config.control), ("ingress", config.ingress)):
            if address and not _is_loopback(address):
                out.append(f"the {what} socket {address} is open to other machines without "
                           f"CURVE: anyone who reaches it can "
                           f"{'join as a node' if what == 'control' else 'submit work'} "
                           "(--curve-dir)")
    if not _is_loopback(f"tcp://{config.host}:0") and config.api_key is None:
        out.append(f"the HTTP API on {config.host} takes requests from anyone who reaches it "
                   "(--api-key)")
    return out


def node_exposures(config) -> list[str]:
    """What a node's config opens to other machines without protection."""
    if config.role == "decode" and config.curve_dir is None and config.kv_bind \
            and not _is_loopback(config.kv_bind):
        return [f"the KV socket {config.kv_bind} is open to other machines without CURVE: "
                "anyone who reaches it can feed this node KV (--curve-dir)"]
    return []


def refuse_insecure(exposures: list[str], insecure: bool) -> None:
    """Secure by default off loopback: ValueError naming each exposure unless ``insecure``
    (then they are logged now, and by ``InsecureWarnings`` every minute)."""
    if not exposures:
        return
    if not insecure:
        raise ValueError("refusing to start: " + "; ".join(exposures) + ". Set the keys, or "
                         "pass --insecure to run unprotected (docs/security.md)")
    for line in exposures:
        log.warning("INSECURE (--insecure): %s", line)


class InsecureWarnings:
    """``due()`` turns true once a minute while an --insecure process runs exposed."""

    def __init__(self, exposures: list[str], period_s: float = INSECURE_WARN_PERIOD_S):
        self.exposures = exposures
        self.period_s = period_s
        self.next = time.monotonic() + period_s

    def tick(self) -> None:
        if self.exposures and time.monotonic() >= self.next:
            self.next = time.monotonic() + self.period_s
            for line in self.exposures:
                log.warning("INSECURE (--insecure): %s", line)
