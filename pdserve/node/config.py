"""Frozen configuration of a node process, built once by the CLI (or `pdserve launch`)
and passed down. Each field that is a command-line flag says so once, here
(common/config_fields.py); ``roles`` names the node commands that take it."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.config import ROLES
from pdserve.common.config_fields import check_fields, flag
from pdserve.common.discovery import check_discovery, cluster_flag, discovery_flag, ttl_flag
from pdserve.common.kv_events import KVEventsConfig
from pdserve.engine.config import EngineConfig


@dataclass(frozen=True)
class NodeConfig:
    role: str
    engine: EngineConfig
    router: str = flag("tcp://127.0.0.1:5556", "The router's control socket; several, "
                       "comma-separated: this node serves each.")
    discovery: str | None = discovery_flag()
    cluster: str = cluster_flag()
    discovery_ttl_s: int = ttl_flag()
    node_id: str | None = flag(None, "This node's name.", default_text="ROLE-HOST-PID")
    kv_bind: str = flag("tcp://127.0.0.1:*", "Where prefill nodes send KV (tcp://*:PORT to "
                        "accept other machines).", roles=("decode",))
    advertise_host: str | None = flag(
        None, "Host prefill nodes should connect to.", roles=("decode",),
        default_text="the bound host, or this machine's name when bound to *")
    heartbeat_interval_s: float = flag(1.0, "Seconds, until the router says.",
                                       name="--heartbeat-interval", min=0, min_open=True)
    welcome_timeout_s: float = 60.0           # how long to wait for the router at start
    drain_timeout_s: float = 30.0             # SIGTERM: how long running requests may finish
    kv_checksums: bool = flag(True, "A 64-bit checksum on every KV frame sent.",
                              roles=("prefill",))
    kv_shm: bool = flag(True, "Keep the KV cache (CPU) in a /dev/shm segment, so that "
                        "decode nodes on this host copy KV from it instead of receiving it "
                        "over TCP.", roles=("prefill",))
    kv_layers_per_chunk: int = flag(4, "Layers per KV message: smaller overlaps transfer "
                                    "with compute more.", min=1, roles=("prefill",))
    curve_dir: str | None = flag(None, "CurveZMQ key folder (pdserve keys generate): "
                                 "encrypt and authenticate the control and KV sockets.",
                                 kind="dir", default_text="off")
    curve_key: str = flag("node", "This node's keypair in --curve-dir (NAME.key_secret).")
    metrics_host: str = flag("127.0.0.1", "Bind host of /metrics; 0.0.0.0 lets other "
                             "machines scrape it.")
    metrics_port: int = flag(0, "Serve Prometheus /metrics on this port; 0: off.",
                             min=0, max=65535)
    kv_events: KVEventsConfig | None = flag(
        None, "Publish KV-cache events in vLLM's format, with vLLM's keys, e.g. "
        "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5560\"}' "
        "(docs/protocol.md); cache_aware routers build their prefix index from them.",
        name="--kv-events-config", kind="json",
        default_text="on with prefix caching, on a free 127.0.0.1 port")
    guide_timeout_s: float = flag(10.0, "Seconds a structured-output guide may take to "
                                  "compile (off the compute loop); past it its request "
                                  "fails.", name="--guide-timeout", min=0, min_open=True)
    stream_keep_s: float = flag(30.0, "Seconds a stream is kept after its end, or decoding "
                                "on after its router went, so that its producer can resume "
                                "it on another router (docs/queue-protocol.md).",
                                name="--stream-keep", min=0, roles=("decode",))
    insecure: bool = flag(False, "Start even though the KV socket is open to other machines "
                          "without CURVE (warned every minute).")

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        check_fields(self)
        check_discovery(self.discovery)
        for router in self.routers:
            if not router.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"router address {router!r} must look like tcp://HOST:PORT")

    @property
    def routers(self) -> list[str]:
        """The routers to serve from the start: --router's, or none with --discovery (etcd
        says which)."""
        if self.discovery:
            return []
        return [r.strip() for r in self.router.split(",") if r.strip()]
