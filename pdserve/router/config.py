"""The router's frozen configuration, built once by the CLI. Each field that is a
command-line flag says so once, here (common/config_fields.py)."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.config_fields import check_fields, flag
from pdserve.common.discovery import check_discovery, cluster_flag, discovery_flag, ttl_flag
from pdserve.router.dispatch import policies
from pdserve.router.http.tool_parsers import PARSERS
from pdserve.sim.profile import check_sim_fields

POLICIES = tuple(policies.POLICIES)  # the names --policy takes (dispatch/policies.py defines them)


@dataclass(frozen=True)
class RouterConfig:
    model: str | None = flag(None, "Checkpoint folder or .gguf file (its config and "
                             "tokenizer).", kind="path",
                             default_text="the bundled model, SmolLM2-135M-Instruct; "
                                          "pdserve model info prints its path")
    served_model_name: str | None = flag(
        None, "The model name clients send.",
        default_text="the folder's name, or the file's without .gguf")
    host: str = flag("127.0.0.1", "HTTP bind host; 0.0.0.0 opens it (and the --control and "
                     "--ingress defaults) to other machines.")
    http_port: int = flag(8000, "HTTP port.", min=0, max=65535)
    metrics_port: int | None = flag(None, "Also serve Prometheus /metrics on this port.",
                                    min=1, max=65535,
                                    default_text="only on the HTTP port, at /metrics")
    control: str = flag("tcp://127.0.0.1:5556", "Control socket nodes connect to.",
                        default_text="tcp://HOST:5556")
    ingress: str | None = flag("tcp://127.0.0.1:5557", "Queue-producer socket, or 'none'.",
                               default_text="tcp://HOST:5557")
    discovery: str | None = discovery_flag()
    cluster: str = cluster_flag()
    discovery_ttl_s: int = ttl_flag()
    policy: str = flag("round_robin", "How nodes are picked.", choices=POLICIES)
    heartbeat_interval_s: float = flag(1.0, "Seconds between heartbeats.",
                                       name="--heartbeat-interval", min=0, min_open=True)
    liveness: int = flag(3, "Missed heartbeats before a node is dead.", min=1)
    request_timeout_s: float = flag(600.0, "Default deadline of a request (s).",
                                    name="--request-timeout", min=0, min_open=True)
    reserve_lease_s: float = flag(30.0, "Seconds a decode node holds KV blocks for a "
                                  "request's transfer; a prefill node waits as long for the "
                                  "decode node's acknowledgement.", name="--reserve-lease",
                                  min=0, min_open=True)
    max_pending_requests: int = flag(4096, "Past this, new requests are refused (429).",
                                     min=1)
    max_stop_strings: int = flag(16, "Stop strings per request.", min=0)
    max_stop_bytes: int = flag(256, "UTF-8 bytes of one stop string.", min=1)
    max_prompt_bytes: int = flag(4 << 20, "UTF-8 bytes of a prompt's text (all messages of "
                                 "a chat), checked before tokenizing.", min=1)
    tokenizer_threads: int = flag(2, "Threads that tokenize and render chat templates.",
                                  min=1)
    max_tokenizing: int = flag(64, "Requests tokenizing or waiting to; past this, new "
                               "requests are refused (429).", min=1)
    responses_store_max_entries: int = flag(
        1024, "Responses kept for GET /v1/responses/{id} and previous_response_id (the "
        "oldest dropped first); 0 stores none.", min=0)
    responses_store_ttl_s: float = flag(3600.0, "Seconds a stored response is kept.",
                                        name="--responses-store-ttl", min=0, min_open=True)
    responses_store_max_bytes: int = flag(
        256 << 20, "JSON bytes of the stored responses and their conversations, all "
        "together (the oldest dropped first).", min=1, default_text="256 MiB")
    tool_call_parser: str | None = flag(
        None, "How the model writes tool calls (docs/http-api.md, tools).", choices=PARSERS,
        default_text="read from the chat template: hermes for one that knows no tools")
    curve_dir: str | None = flag(None, "CurveZMQ key folder (pdserve keys generate): "
                                 "encrypt and authenticate the control, ingress and KV "
                                 "sockets.", kind="dir", default_text="off")
    api_key: str | None = flag(None, "Require 'Authorization: Bearer KEY' on /v1/* (prefer "
                               "the environment variable: flags show in ps).",
                               envvar="PDSERVE_API_KEY", repr=False, default_text="open")
    sim_profile: str | None = flag(None, "Serve --compute simulated nodes of this profile "
                                   "(sim/ profiles: the model identity and KV shape they "
                                   "announce); the tokenizer stays --model's.",
                                   metavar="NAME|FILE", default_text="real nodes")
    sim_kv_bytes_scale: float = flag(1.0, "The simulated nodes' --sim-kv-bytes-scale (part of "
                                     "the KV shape they announce).", min=0, max=1,
                                     min_open=True)
    insecure: bool = flag(False, "Start even though sockets or HTTP are open to other "
                          "machines without CURVE or an API key (warned every minute).")

    def __post_init__(self):
        check_fields(self)
        check_discovery(self.discovery)
        check_sim_fields("simulated" if self.sim_profile else "model", self.sim_profile,
                         self.sim_kv_bytes_scale)
