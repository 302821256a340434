"""Serving a process's metrics registry (common/metrics.py defines every metric): on a
port of its own, or as an endpoint of the router's HTTP app."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server


class MetricsServer:
    """/metrics on its own port, served from a daemon thread (nodes; the router when
    ``--metrics-port`` differs from its HTTP port)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int):
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            raise ValueError(f"cannot serve /metrics on {host}:{port}: {exc}") from None
        self.port = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serves ``registry`` at http://host:port/metrics; ValueError if the port is taken."""
    return MetricsServer(registry, host, port)


def metrics_endpoint(registry: CollectorRegistry):
    """A Starlette endpoint serving ``registry``, for the router's HTTP app. Async, so it
    runs on the router's loop and reads the core's state from the thread that owns it."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.responses import Response

    async def metrics(_request):
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return metrics

