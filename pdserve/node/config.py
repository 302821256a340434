"""Frozen configuration of a node process, built once by the CLI (or `pdserve launch`)
and passed down."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.config import ROLES
from pdserve.common.kv_events import KVEventsConfig
from pdserve.engine.config import EngineConfig


@dataclass(frozen=True)
class NodeConfig:
    role: str
    engine: EngineConfig
    router: str = "tcp://127.0.0.1:5556"
    node_id: str | None = None               # None: "<role>-<host>-<pid>"
    kv_bind: str = "tcp://127.0.0.1:*"        # decode nodes: where prefill nodes send KV
    advertise_host: str | None = None         # host in the KV address told to the router
    heartbeat_interval_s: float = 1.0         # until the router's Welcome says otherwise
    welcome_timeout_s: float = 60.0           # how long to wait for the router at start
    drain_timeout_s: float = 30.0             # SIGTERM: how long running requests may finish
    kv_checksums: bool = True                 # a checksum on every KV frame
    kv_shm: bool = True                       # prefill: KV to same-host decode nodes via /dev/shm
    kv_layers_per_chunk: int = 4              # layers per KV message (overlap vs. overhead)
    curve_dir: str | None = None              # CurveZMQ keys (docs/security.md); None: off
    curve_key: str = "node"                   # this node's keypair in curve_dir
    metrics_host: str = "127.0.0.1"           # where /metrics listens (0.0.0.0: other machines)
    metrics_port: int = 0                     # Prometheus /metrics port; 0: not served
    kv_events: KVEventsConfig | None = None   # vLLM-format KV-cache events; None: off
    insecure: bool = False                    # allow a KV socket off loopback without CURVE

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.router.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"router address {self.router!r} must look like tcp://HOST:PORT")
        if self.heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s must be > 0, got {self.heartbeat_interval_s}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.kv_layers_per_chunk < 1:
            raise ValueError(f"kv_layers_per_chunk must be >= 1, got {self.kv_layers_per_chunk}")
