"""The router's frozen configuration, built once by the CLI."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.router import policies

POLICIES = tuple(policies.POLICIES)  # the names --policy takes (policies.py defines them)


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
    max_stop_strings: int = 16               # stop strings per request
    max_stop_bytes: int = 256                # UTF-8 bytes of one stop string
    max_prompt_bytes: int = 4 << 20          # prompt text (all messages for chat), before
    #                                          tokenizing
    tokenizer_threads: int = 2               # tokenization and chat templates run here
    max_tokenizing: int = 64                 # requests tokenizing or waiting to; past it: 429
    curve_dir: str | None = None             # CurveZMQ keys (docs/security.md); None: off
    api_key: str | None = field(default=None, repr=False)  # Bearer token for /v1/*; None: open
    insecure: bool = False                   # allow other machines in without CURVE / API key

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
        for name in ("liveness", "max_pending_requests", "max_stop_bytes", "max_prompt_bytes",
                     "tokenizer_threads", "max_tokenizing"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_stop_strings < 0:
            raise ValueError(f"max_stop_strings must be >= 0, got {self.max_stop_strings}")
