"""``pdserve launch``: a router and its nodes as child processes on this machine.

    1. start the router, then N prefill and M decode nodes pointed at it
    2. wait until the router's /health says every role is live; print the endpoints
       (each node gets a free port for its Prometheus /metrics unless --node-arg sets one)
    3. watch the children; on Ctrl-C/SIGTERM (or the router dying) stop every child:
       terminate, a timed wait, then kill
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from pdserve.common.kv_events import KVEventsConfig
from pdserve.common.logs import DEFAULT_LEVEL
from pdserve.engine.config import EngineConfig
from pdserve.router.config import RouterConfig

STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class LaunchConfig:
    router: RouterConfig
    num_prefill: int = 1
    num_decode: int = 1
    colocated: bool = False               # one colocated node instead of prefill + decode
    compute: str = EngineConfig.compute   # "none": benchmark mode (fixed tokens)
    node_args: tuple[str, ...] = ()       # engine flags passed to every node
    log_level: str = DEFAULT_LEVEL
    ready_timeout_s: float = 600.0
    kv_events: KVEventsConfig | None = None  # each node gets its own free port(s)


def connect_address(bind: str) -> str:
    """Where a process on this machine reaches a socket bound at ``bind``."""
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:"):
        if bind.startswith(wildcard):
            return "tcp://127.0.0.1:" + bind[len(wildcard):]
    return bind


def _router_cmd(cfg: LaunchConfig) -> list[str]:
    r = cfg.router
    cmd = [sys.executable, "-m", "pdserve.cli", "router", "--host", r.host, "--http-port",
           str(r.http_port), "--control", r.control, "--ingress", r.ingress or "none",
           "--policy", r.policy, "--heartbeat-interval", str(r.heartbeat_interval_s),
           "--liveness", str(r.liveness), "--request-timeout", str(r.request_timeout_s),
           "--max-pending-requests", str(r.max_pending_requests), "--log-level", cfg.log_level,
           "--reserve-lease", str(r.reserve_lease_s), "--max-stop-strings",
           str(r.max_stop_strings), "--max-stop-bytes", str(r.max_stop_bytes),
           "--max-prompt-bytes", str(r.max_prompt_bytes)]
    if r.insecure:
        cmd += ["--insecure"]
    if r.model:
        cmd += ["--model", r.model]
    if r.served_model_name:
        cmd += ["--served-model-name", r.served_model_name]
    if r.metrics_port:
        cmd += ["--metrics-port", str(r.metrics_port)]
    if r.curve_dir:
        cmd += ["--curve-dir", r.curve_dir]
    return cmd


def _router_env(cfg: LaunchConfig) -> dict | None:
    """The API key goes to the router in its environment: argv is visible to every user."""
    return {**os.environ, "PDSERVE_API_KEY": cfg.router.api_key} if cfg.router.api_key else None


def _node_cmd(cfg: LaunchConfig, role: str, index: int) -> list[str]:
    cmd = [sys.executable, "-m", "pdserve.cli", role, "--router",
           connect_address(cfg.router.control), "--node-id", f"{role}-{index}",
           "--heartbeat-interval", str(cfg.router.heartbeat_interval_s),
           "--log-level", cfg.log_level, *cfg.node_args]
    if cfg.router.model and "--model" not in cfg.node_args:
        cmd += ["--model", cfg.router.model]
    if cfg.router.curve_dir and not any(a.startswith("--curve-dir") for a in cfg.node_args):
        cmd += ["--curve-dir", cfg.router.curve_dir]
    if "--threads" not in cfg.node_args:
        share = max(1, (os.cpu_count() or 1) // len(_roles(cfg)))
        cmd += ["--threads", str(share)]
    if not any(a.startswith("--metrics-port") for a in cfg.node_args):
        cmd += ["--metrics-port", str(_free_port())]
        if _open(cfg):
            cmd += ["--metrics-host", "0.0.0.0"]
    if cfg.kv_events is not None:
        cmd += ["--kv-events-config", _node_kv_events(cfg).to_json()]
    return cmd


def _open(cfg: LaunchConfig) -> bool:
    return cfg.router.host in ("0.0.0.0", "*", "::")


def _node_kv_events(cfg: LaunchConfig) -> KVEventsConfig:
    """vLLM's one endpoint would collide between nodes (and its default port is the
    ingress's here): every node publishes on free ports of its own."""
    host = "0.0.0.0" if _open(cfg) else "127.0.0.1"
    replay = f"tcp://{host}:{_free_port()}" if cfg.kv_events.replay_endpoint else None
    return cfg.kv_events.with_endpoints(f"tcp://{host}:{_free_port()}", replay)


def _kv_events_lines(cmd: list[str], name: str) -> str:
    if "--kv-events-config" not in cmd:
        return ""
    ev = KVEventsConfig.from_json(cmd[cmd.index("--kv-events-config") + 1])
    if not ev.active:
        return ""
    replay = f", replay {connect_address(ev.replay_endpoint)}" if ev.replay_endpoint else ""
    return f"  {'kv events':<14} {connect_address(ev.endpoint)}{replay}   ({name})\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics_url(cmd: list[str], host: str) -> str:
    """Where the process started with ``cmd`` serves /metrics (its last --metrics-port)."""
    port = None
    for i, arg in enumerate(cmd):
        if arg == "--metrics-port" and i + 1 < len(cmd):
            port = cmd[i + 1]
        elif arg.startswith("--metrics-port="):
            port = arg.split("=", 1)[1]
    return f"http://{host}:{port}/metrics" if port not in (None, "0") else "off"


def _roles(cfg: LaunchConfig) -> list[tuple[str, int]]:
    if cfg.colocated:
        return [("colocated", 0)]
    return [("prefill", i) for i in range(cfg.num_prefill)] + \
        [("decode", i) for i in range(cfg.num_decode)]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _stop(children: dict[str, subprocess.Popen]) -> None:
    for proc in children.values():
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for name, proc in children.items():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"pdserve launch: {name} did not stop in {STOP_TIMEOUT_S:g} s: killed",
                  file=sys.stderr)
            proc.kill()
            proc.wait()


def run_launch(cfg: LaunchConfig) -> int:
    stop_requested = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop_requested.append(True))
    children: dict[str, subprocess.Popen] = {}
    host = "127.0.0.1" if _open(cfg) else cfg.router.host
    http = f"http://{host}:{cfg.router.http_port}"
    metrics = {"router": _metrics_url(_router_cmd(cfg), host)
               if cfg.router.metrics_port else f"{http}/metrics"}
    events = ""
    try:
        children["router"] = subprocess.Popen(_router_cmd(cfg), env=_router_env(cfg))
        for role, i in _roles(cfg):
            cmd = _node_cmd(cfg, role, i)
            children[f"{role}-{i}"] = subprocess.Popen(cmd)
            metrics[f"{role}-{i}"] = _metrics_url(cmd, host)
            events += _kv_events_lines(cmd, f"{role}-{i}")
        deadline = time.monotonic() + cfg.ready_timeout_s
        while not _healthy(f"{http}/health"):
            dead = [n for n, p in children.items() if p.poll() is not None]
            if dead or stop_requested:
                why = f"{', '.join(dead)} exited during start-up" if dead else "stopped"
                print(f"pdserve launch: {why}", file=sys.stderr)
                return 1
            if time.monotonic() > deadline:
                print(f"pdserve launch: not healthy after {cfg.ready_timeout_s:g} s",
                      file=sys.stderr)
                return 1
            time.sleep(0.2)
        ingress = connect_address(cfg.router.ingress) if cfg.router.ingress else "off"
        nodes = "1 colocated node" if cfg.colocated else \
            f"{cfg.num_prefill} prefill, {cfg.num_decode} decode nodes"
        mode = "COMPUTE NONE: benchmark mode, nodes emit a fixed token, not model output\n" \
            if cfg.compute == "none" else ""
        print("pdserve is ready:\n"
              f"  OpenAI API     {http}/v1   (health: {http}/health)\n"
              f"  queue ingress  {ingress}\n"
              f"  control        {connect_address(cfg.router.control)}   ({nodes})\n"
              + "".join(f"  {'metrics' if i == 0 else '':<14} {url}   ({name})\n"
                        for i, (name, url) in enumerate(metrics.items())) +
              f"{events}{mode}Ctrl-C stops everything.", flush=True)
        reported = set()
        while not stop_requested:
            if children["router"].poll() is not None:
                print("pdserve launch: the router exited; stopping", file=sys.stderr)
                return 1
            for name, proc in children.items():
                if proc.poll() is not None and name not in reported:
                    reported.add(name)
                    print(f"pdserve launch: {name} exited with {proc.returncode}",
                          file=sys.stderr)
            time.sleep(0.2)
        return 0
    finally:
        _stop(children)
