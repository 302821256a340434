"""The router process: control socket, HTTP API and queue ingress on one asyncio loop.

    1. load the model's config and tokenizer, bind the control socket
    2. serve HTTP (uvicorn) and the ingress until SIGTERM/SIGINT
    3. stop: fail what is still in flight with a reason, close every socket
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket

import uvicorn
import uvloop

from pdserve.common import heap_dump
from pdserve.common.gc_heap import freeze_startup_objects
from pdserve.common.metrics_http import start_metrics_server
from pdserve.common.security import (
    INGRESS_DOMAIN,
    InsecureWarnings,
    check_router_security,
    router_exposures,
    server_curve,
)
from pdserve.router.config import RouterConfig
from pdserve.router.core import RouterCore

log = logging.getLogger(__name__)


def bind_http(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound before anything says "ready"; ValueError naming the address if
    it cannot be (uvicorn would bind it only once serving, after our ready line, and exit 3)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(f"cannot serve HTTP on {host}:{port}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        hint = " (another process holds it: choose another --http-port)" \
            if exc.errno == 98 else ""
        raise ValueError(f"cannot serve HTTP on {host}:{port}: {exc.strerror}{hint}") from None
    return sock


async def serve(config: RouterConfig) -> None:
    check_router_security(config)
    http_socket = bind_http(config.host, config.http_port)
    try:
        await _serve(config, http_socket)
    finally:
        http_socket.close()


async def _serve(config: RouterConfig, http_socket: socket.socket) -> None:
    from pdserve.router.http.api import build_app

    core = RouterCore(config)
    metrics_server = None
    if config.metrics_port and config.metrics_port != config.http_port:
        metrics_server = start_metrics_server(core.metrics.registry, config.host,
                                              config.metrics_port)
    await core.start()
    app = build_app(core, api_key=config.api_key)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host,
                                           port=config.http_port, log_level="warning",
                                           lifespan="off", access_log=False,
                                           http="httptools"))
    server.install_signal_handlers = lambda: None  # ours below stop everything together
    ingress = None
    tasks = [asyncio.create_task(server.serve(sockets=[http_socket]))]
    if config.ingress:
        from pdserve.router.ingress import Ingress

        ingress = Ingress(core, config.ingress,
                          curve=server_curve(config.curve_dir, INGRESS_DOMAIN))
        tasks.append(asyncio.create_task(ingress.run()))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    while not server.started and not tasks[0].done():  # listening, not only bound
        await asyncio.sleep(0.01)
    membership = None
    if config.discovery:
        from pdserve.router.membership import RouterMembership

        membership = RouterMembership(config, core, loop)
        membership.start()  # nodes find this router only now, when it serves
    freeze_startup_objects()
    heap_dump.install()  # only with PDSERVE_HEAP_DUMP set
    log.info("router ready: http://%s:%d (OpenAI API), control %s, ingress %s",
             config.host, config.http_port, config.control, config.ingress or "off")
    warnings = InsecureWarnings(router_exposures(config))
    if warnings.exposures:  # --insecure: said again every minute
        async def warn():
            while True:
                await asyncio.sleep(5)
                warnings.tick()
        tasks.append(asyncio.create_task(warn()))
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
    try:
        for t in done:
            if t is not stopper and t.exception() is not None:
                raise t.exception()
    finally:
        server.should_exit = True
        if membership is not None:
            membership.stop()
        for t in tasks[1:]:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if ingress is not None:
            ingress.close()
        if metrics_server is not None:
            metrics_server.close()
        await core.stop()


def run_router(config: RouterConfig) -> int:
    uvloop.run(serve(config))  # libuv's loop: less CPU per socket event than asyncio's own
    return 0
