"""The router's frozen configuration, built once by the CLI."""
from __future__ import annotations

from dataclasses import dataclass, field

POLICIES = ("round_robin", "least_loaded")


@dataclass(frozen=True)
class RouterConfig:
    model: str | None = None                 # checkpoint folder or .gguf (config + tokenizer)
    served_model_name: str | None = None     # the name clients use; default: model_name()
    host: str = "127.0.0.1"                  # HTTP bind host
    http_port: int = 8000
    metrics_port: int | None = None          # /metrics on its own port too; None: HTTP port only
    control: str = "tcp://127.0.0.1:5556"    # nodes connect here
    ingress: str | None = "tcp://127.0.0.1:5557"  # queue producers connect here; None: off
    policy: str = "round_robin"
    heartbeat_interval_s: float = 1.0
    liveness: int = 3                        # missed intervals before a node is dead
    request_timeout_s: float = 600.0         # default deadline of a request
    reserve_lease_s: float = 30.0            # how long a decode node holds a reservation
    max_pending_requests: int = 4096         # past this, new requests get "overloaded"
    curve_dir: str | None = None             # CurveZMQ keys (docs/security.md); None: off
    api_key: str | None = field(default=None, repr=False)  # Bearer token for /v1/*; None: open

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.metrics_port is not None and not 0 < self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [1, 65535], got {self.metrics_port}")
        for name in ("heartbeat_interval_s", "request_timeout_s", "reserve_lease_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.liveness < 1 or self.max_pending_requests < 1:
            raise ValueError("liveness and max_pending_requests must be >= 1")
