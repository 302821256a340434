"""``pdserve launch``: a router and its nodes as child processes on this machine.

    1. start the router, then N prefill and M decode nodes pointed at it (simulated nodes
       forked from one process that has imported torch: forked_nodes.py)
    2. wait until the router's /health says every role is live and every node started is
       registered with every router; print the endpoints
       (each node gets a free port for its Prometheus /metrics, or --node-metrics-port's
       PORT+k; each decode node a KV port, free or --decode-kv-port's PORT+i)
    3. watch the children; on Ctrl-C/SIGTERM (or the router dying) stop every child:
       terminate, a timed wait, then kill
"""
from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from pdserve.common.config_fields import check_fields, flag
from pdserve.common.config_io import ENV, child_env
from pdserve.common.kv_events import KVEventsConfig
from pdserve.common.logs import DEFAULT_LEVEL
from pdserve.common.sockets import PortPicker, port_picker
from pdserve.engine.config import EngineConfig
from pdserve.forked_nodes import ForkedNode, ForkServer
from pdserve.node.config import NodeConfig
from pdserve.router.config import RouterConfig

STOP_TIMEOUT_S = 10.0
# A decode node's OpenMP spins before a thread sleeps (libgomp reckons 100,000 a ms)
DECODE_SPIN_COUNT = "1000"


@dataclass(frozen=True)
class LaunchConfig:
    router: RouterConfig
    num_routers: int = flag(1, "Routers to start, every node serving each: the first on "
                            "--http-port, --control and --ingress, the others on free "
                            "ports (the table prints them).", name="--routers", min=1)
    num_prefill: int = flag(1, "Prefill nodes to start.", name="--prefill", min=1)
    num_decode: int = flag(1, "Decode nodes to start.", name="--decode", min=1)
    colocated: bool = flag(False, "Start one colocated node (prefill + decode in one "
                           "engine) instead of separate prefill and decode nodes. The "
                           "default on a CPU machine of 2 cores or fewer, unless --prefill "
                           "or --decode is given (one colocated node served more there: "
                           "benchmarks/RESULTS.md).")
    # Ports launch would otherwise pick free: --node-arg goes to every node, so one port
    # there would clash. A base port each, counted up per node, so a firewall or a
    # Prometheus config can name them.
    node_metrics_port: int | None = flag(
        None, "The first node's /metrics port: node k (prefill nodes first, then decode, in "
        "the order the table prints) serves on PORT+k.", min=1, max=65535,
        default_text="a free port per node")
    decode_kv_port: int | None = flag(
        None, "The first decode node's KV port: decode node i binds PORT+i (on 0.0.0.0 with "
        "--host 0.0.0.0, else 127.0.0.1).", min=1, max=65535,
        default_text="a free port per decode node")
    compute: str = EngineConfig.compute   # "none": fixed tokens; "simulated": sim/
    fork_nodes: bool = flag(True, "Fork the simulated nodes from one process that has "
                            "imported torch, so that they share its memory (~150 MiB a "
                            "node otherwise); --no-fork-nodes starts each as its own "
                            "program, as other nodes are.")
    # Each role's node config from the --node-arg flags: (config, log level, the flags given)
    node_configs: dict[str, tuple[NodeConfig, str, set[str]]] = field(default_factory=dict)
    log_level: str = DEFAULT_LEVEL
    ready_timeout_s: float = 600.0
    # The nodes' --kv-events-config; each node gets its own free port(s)
    kv_events: KVEventsConfig | None = None
    # Why launch chose the topology itself (``auto_topology``), for the ready table
    topology_why: str = ""

    def __post_init__(self):
        check_fields(self)


def connect_address(bind: str) -> str:
    """Where a process on this machine reaches a socket bound at ``bind``."""
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:"):
        if bind.startswith(wildcard):
            return "tcp://127.0.0.1:" + bind[len(wildcard):]
    return bind


def _child(role: str) -> list[str]:
    """A child's argv: its role only; its config comes in its environment (config_io)."""
    return [sys.executable, "-m", "pdserve.cli", role, "--config-env"]


def _node_config(cfg: LaunchConfig, role: str, index: int, k: int,
                 routers: list[RouterConfig], ports: PortPicker) -> tuple[NodeConfig, str]:
    """(config, log level) of one node: what its --node-arg flags say, and what the launcher
    decides unless they say it (model, threads, metrics and KV ports, CURVE keys, KV
    events). ``index``: its number in its role; ``k``: among all nodes (prefill first)."""
    base, log_level, given = cfg.node_configs[role]
    engine = {}
    if base.engine.compute == "simulated" and base.engine.sim_token_space is None:
        engine["sim_token_space"] = _token_space(base.engine.model or cfg.router.model)
    if cfg.router.model and "model" not in given:
        engine["model"] = cfg.router.model
    if "threads" not in given:
        engine["threads"] = os.cpu_count() or 1   # shared, see _node_env
    node = {"router": ",".join(connect_address(r.control) for r in routers),
            "node_id": f"{role}-{index}",
            "heartbeat_interval_s": cfg.router.heartbeat_interval_s}
    if cfg.router.curve_dir and "curve_dir" not in given:
        node["curve_dir"] = cfg.router.curve_dir
    if "metrics_port" not in given:
        node["metrics_port"] = ports() if cfg.node_metrics_port is None \
            else cfg.node_metrics_port + k
        if _open(cfg):
            node["metrics_host"] = "0.0.0.0"
    if role == "decode" and cfg.decode_kv_port is not None and "kv_bind" not in given:
        host = "0.0.0.0" if _open(cfg) else "127.0.0.1"
        node["kv_bind"] = f"tcp://{host}:{cfg.decode_kv_port + index}"
    if cfg.kv_events is not None:
        node["kv_events"] = _node_kv_events(cfg, ports)
    return (replace(base, engine=replace(base.engine, **engine), **node),
            log_level if "log_level" in given else cfg.log_level)


def _node_env(cfg: LaunchConfig, node: NodeConfig, log_level: str) -> dict[str, str]:
    """A node's environment. Nodes that share this machine each get every core (the
    default threads), and their OpenMP threads sleep at the end of a parallel region
    (OMP_WAIT_POLICY=PASSIVE, unless this environment says otherwise) instead of spinning
    for the next: so a role with work takes the cores the other leaves idle, and a busy
    role does not lose them to the other's spinning. On 2 cores, 1P1D, two runs
    (benchmarks/launch_threads.py; RESULTS.md "Threads of nodes that share a machine"):
    one core each, 73-75 ms a token at batch 1 and 37-51 tokens/s at 16 concurrent
    requests; every core each, passive, 54-59 ms and 55-61 tokens/s; spinning
    (OMP_WAIT_POLICY=ACTIVE), 149 ms and 22 tokens/s.

    A decode node's threads spin briefly before they sleep (GOMP_SPINCOUNT, unless the
    environment sets it): waking a sleeping thread for each parallel region of a
    batch-1 step made a float32 token 28 ms against 21 with 10,000 spins (RESULTS.md
    "Batch-1 TPOT through launch"). Spins are cores the other role loses under load
    (10,000: 16 concurrent requests 96-105 tokens/s against 112-115), hence 1,000:
    launch's defaults 14 ms a token against 18, and 103-110 tokens/s."""
    env = child_env(node, log_level)
    if node.engine.compute == "model" and len(_roles(cfg)) > 1:
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        if node.role == "decode":
            env.setdefault("GOMP_SPINCOUNT", DECODE_SPIN_COUNT)
    return env


def _routers(cfg: LaunchConfig, ports: PortPicker) -> list[RouterConfig]:
    """Each router's config: the first as given, the others on free ports."""
    return [cfg.router, *(replace(cfg.router, http_port=ports(), metrics_port=None,
                                  control=_free_like(cfg.router.control, ports),
                                  ingress=_free_like(cfg.router.ingress, ports)
                                  if cfg.router.ingress else None)
                          for _ in range(cfg.num_routers - 1))]


def _free_like(endpoint: str, ports: PortPicker) -> str:
    """``endpoint`` with its port replaced by a free one (tcp://HOST:PORT)."""
    return f"{endpoint.rsplit(':', 1)[0]}:{ports()}"


@functools.lru_cache(maxsize=4)
def _token_space(model: str | None) -> tuple:
    """Read once for all simulated nodes (model/config.py)."""
    from pdserve.model.config import read_token_space
    from pdserve.model.default_model import default_model_dir

    return read_token_space(model or default_model_dir())


def _open(cfg: LaunchConfig) -> bool:
    return cfg.router.host in ("0.0.0.0", "*", "::")


def _node_kv_events(cfg: LaunchConfig, ports: PortPicker) -> KVEventsConfig:
    """vLLM's one endpoint would collide between nodes (and its default port is the
    ingress's here): every node publishes on free ports of its own."""
    host = "0.0.0.0" if _open(cfg) else "127.0.0.1"
    replay = f"tcp://{host}:{ports()}" if cfg.kv_events.replay_endpoint else None
    return cfg.kv_events.with_endpoints(f"tcp://{host}:{ports()}", replay)


def _kv_events_line(node: NodeConfig, name: str) -> str:
    ev = node.kv_events
    if ev is None or not ev.active:
        return ""
    replay = f", replay {connect_address(ev.replay_endpoint)}" if ev.replay_endpoint else ""
    return f"  {'kv events':<14} {connect_address(ev.endpoint)}{replay}   ({name})\n"


def _metrics_url(port: int | None, host: str) -> str:
    return f"http://{host}:{port}/metrics" if port else "off"


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


def _nodes_registered(metrics_url: str) -> int:
    """The nodes a router counts (its pdserve_nodes gauge, every role and state)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=1) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError):
        return 0
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("pdserve_nodes{")))


def _stop(children: dict[str, subprocess.Popen | ForkedNode]) -> None:
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


def _make_interrupted() -> Callable[[], bool]:
    """Under make (``make serve``): whether make was interrupted or is gone.

    GNU make forwards SIGTERM to its recipe but not SIGINT (it expects the terminal to
    have sent that to the whole process group): a SIGINT sent to make's own PID leaves
    make waiting for us forever. make resets the signal to its default on receipt, before
    it waits, so its caught-signal mask in /proc tells us it came."""
    ppid = os.getppid()
    if "MAKELEVEL" not in os.environ:
        return lambda: False

    def catches_sigint() -> bool | None:
        try:
            with open(f"/proc/{ppid}/status") as f:
                masks = dict(line.split(":", 1) for line in f if ":" in line)
            return bool(int(masks["SigCgt"], 16) & (1 << (signal.SIGINT - 1)))
        except (OSError, KeyError, ValueError):
            return None
    if not catches_sigint():
        return lambda: False
    return lambda: os.getppid() != ppid or catches_sigint() is False


def _start_nodes(cfg: LaunchConfig, routers: list[RouterConfig], ports: PortPicker,
                 host: str, children: dict, metrics: dict[str, str]) -> str:
    """Starts every node into ``children`` (simulated ones forked, unless --no-fork-nodes),
    its /metrics URL into ``metrics``; returns the ready table's KV-events lines."""
    server = ForkServer() if cfg.fork_nodes and cfg.compute == "simulated" else None
    events, forks = "", []   # (the server imports while the routers start)
    try:
        for k, (role, i) in enumerate(_roles(cfg)):
            node, log_level = _node_config(cfg, role, i, k, routers, ports)
            env = _node_env(cfg, node, log_level)
            if server and node.engine.compute == "simulated":
                forks.append((f"{role}-{i}", role, env[ENV]))
            else:
                children[f"{role}-{i}"] = subprocess.Popen(_child(role), env=env)
            metrics[f"{role}-{i}"] = _metrics_url(node.metrics_port, host)
            events += _kv_events_line(node, f"{role}-{i}")
        if server:
            children.update(server.fork(forks, cfg.ready_timeout_s))
    finally:
        if server:
            server.close()
    return events


def run_launch(cfg: LaunchConfig) -> int:
    requested = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: requested.append(True))
    make_interrupted = _make_interrupted()

    def stop_requested() -> bool:
        return bool(requested) or make_interrupted()
    children: dict[str, subprocess.Popen | ForkedNode] = {}
    host = "127.0.0.1" if _open(cfg) else cfg.router.host
    ports = port_picker()  # the process's one: shared with free_port's other callers
    routers = _routers(cfg, ports)  # once: every node must name the same ones
    https = [f"http://{host}:{r.http_port}" for r in routers]
    http = https[0]
    metrics = {"router": _metrics_url(cfg.router.metrics_port, host)
               if cfg.router.metrics_port else f"{http}/metrics"}
    metrics.update({f"router-{i}": f"{url}/metrics" for i, url in enumerate(https) if i})
    try:
        for i, router in enumerate(routers):
            children[f"router-{i}" if i else "router"] = subprocess.Popen(
                _child("router"), env=child_env(router, cfg.log_level))
        events = _start_nodes(cfg, routers, ports, host, children, metrics)
        deadline = time.monotonic() + cfg.ready_timeout_s
        # Ready means every node started here is registered with every router: /health is
        # ok once one node of each role is, and the ready table lists every node's endpoints.
        router_metrics = [metrics["router"]] + [f"{url}/metrics" for url in https[1:]]
        num_nodes = len(_roles(cfg))
        while not all(_healthy(f"{url}/health") for url in https) or \
                not all(_nodes_registered(url) >= num_nodes for url in router_metrics):
            dead = [n for n, p in children.items() if p.poll() is not None]
            if dead or stop_requested():
                why = f"{', '.join(dead)} exited during start-up" if dead else "stopped"
                print(f"pdserve launch: {why}", file=sys.stderr)
                return 1
            if time.monotonic() > deadline:
                print(f"pdserve launch: not healthy, or not every node registered, after "
                      f"{cfg.ready_timeout_s:g} s",
                      file=sys.stderr)
                return 1
            time.sleep(0.2)
        ingress = connect_address(cfg.router.ingress) if cfg.router.ingress else "off"
        nodes = "1 colocated node" if cfg.colocated else \
            f"{cfg.num_prefill} prefill, {cfg.num_decode} decode nodes"
        if cfg.topology_why:
            nodes += f": {cfg.topology_why}"
        mode = {"none": "COMPUTE NONE: benchmark mode, nodes emit a fixed token, not model "
                        "output\n",
                "simulated": f"COMPUTE SIMULATED: {cfg.router.sim_profile} (simulated GPUs: a "
                             "seeded token stream, not model output)\n"}.get(cfg.compute, "")
        print("pdserve is ready:\n"
              f"  OpenAI API     {http}/v1   (health: {http}/health)\n"
              f"  queue ingress  {ingress}\n"
              f"  control        {connect_address(cfg.router.control)}   ({nodes})\n"
              + "".join(f"  router {i:<7} {url}/v1, ingress "
                        f"{connect_address(r.ingress) if r.ingress else 'off'}, control "
                        f"{connect_address(r.control)}\n"
                        for i, (url, r) in enumerate(zip(https, routers)) if i)
              + "".join(f"  {'metrics' if i == 0 else '':<14} {url}   ({name})\n"
                        for i, (name, url) in enumerate(metrics.items())) +
              f"{events}{mode}Ctrl-C stops everything.", flush=True)
        reported = set()
        while not stop_requested():
            if children["router"].poll() is not None:
                print("pdserve launch: the router exited; stopping", file=sys.stderr)
                return 1
            # (another router exiting is reported below: the nodes serve the others)
            for name, proc in children.items():
                if proc.poll() is not None and name not in reported:
                    reported.add(name)
                    print(f"pdserve launch: {name} exited with {proc.returncode}",
                          file=sys.stderr)
            time.sleep(0.2)
        return 0
    finally:
        _stop(children)
