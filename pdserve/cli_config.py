"""The flag groups of pdserve's commands, each flag's default taken from the config
dataclass it fills (written once, there), and the functions that turn parsed flags into
those configs. cli.py puts them on its commands."""
from __future__ import annotations

import click

from pdserve.common.logs import DEFAULT_LEVEL
from pdserve.common.logs import LEVELS as LOG_LEVELS
from pdserve.engine.config import COMPUTE_MODES, CPU_LINEAR_MODES, DTYPES, EngineConfig
from pdserve.node.config import NodeConfig
from pdserve.router.config import POLICIES, RouterConfig


def default_of(config_class, name: str):
    """A config dataclass field's default: each default is written once, in the dataclass."""
    return config_class.__dataclass_fields__[name].default


def engine_default(name: str):
    return default_of(EngineConfig, name)


def node_default(name: str):
    return default_of(NodeConfig, name)


def router_default(name: str):
    return default_of(RouterConfig, name)


prefix_caching_option = click.option(
    "--enable-prefix-caching/--no-enable-prefix-caching",
    default=engine_default("enable_prefix_caching"), show_default=True,
    help="Reuse the KV cache of full blocks that earlier prompts computed.")


config_env_option = click.option(
    "--config-env", is_flag=True, hidden=True,
    help="Take the whole config from $PDSERVE_CONFIG (JSON), as pdserve launch hands it to "
         "its children; the other flags are not read.")


kv_events_option = click.option(
    "--kv-events-config", default=None, metavar="JSON",
    help="Publish KV-cache events in vLLM's format, with vLLM's keys, e.g. "
         "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5560\"}' "
         "(docs/protocol.md) [default: off].")


def engine_options(fn):
    """Flags every engine owner takes; they build one EngineConfig."""
    opts = [
        click.option("--model", "model_dir", type=click.Path(exists=True), default=None,
                     help="Checkpoint folder or .gguf file [default: the bundled model]."),
        click.option("--dtype", type=click.Choice(DTYPES), default=engine_default("dtype"),
                     show_default=True),
        click.option("--device", default=engine_default("device"), show_default=True),
        click.option("--block-size", type=click.IntRange(min=1),
                     default=engine_default("block_size"),
                     show_default=True),
        click.option("--num-kv-blocks", type=click.IntRange(min=1), default=None,
                     help="KV cache size in blocks [default: from --kv-cache-memory-gb]."),
        click.option("--kv-cache-memory-gb", type=click.FloatRange(min=0, min_open=True),
                     default=engine_default("kv_cache_memory_gb"), show_default=True),
        click.option("--decode-window-memory-gb", type=click.FloatRange(min=0), default=None,
                     help="CPU decode steps keep the batch's context contiguous across "
                     "steps in at most this much memory, instead of gathering it from the KV "
                     "pages in every layer; 0: off [default: half of the KV cache's size]."),
        click.option("--cpu-linear", type=click.Choice(CPU_LINEAR_MODES),
                     default=engine_default("cpu_linear"), show_default=True,
                     help="float32 and bfloat16 linear layers on the CPU: 'onednn' "
                     "reorders each weight once for oneDNN (about 1.6x faster GEMMs at "
                     "decode rows; float32 results differ from F.linear's in the last bits, "
                     "bfloat16 ones do not), 'torch' keeps F.linear (transformers' bits), "
                     "'auto' takes onednn where torch has it."),
        click.option("--max-num-seqs", type=click.IntRange(min=1),
                     default=engine_default("max_num_seqs"),
                     show_default=True),
        click.option("--max-num-batched-tokens", type=click.IntRange(min=1),
                     default=engine_default("max_num_batched_tokens"),
                     show_default=True, help="Token budget of one step; longer prompts are "
                     "prefilled in chunks."),
        click.option("--threads", type=click.IntRange(min=1), default=None,
                     help="torch CPU threads [default: torch's choice]."),
        click.option("--compute", type=click.Choice(COMPUTE_MODES),
                     default=engine_default("compute"),
                     show_default=True, help="'none' is a BENCHMARK mode: skip the forward "
                     "and emit a fixed token, to measure everything around the model."),
        prefix_caching_option,
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def node_options(fn):
    opts = [
        click.option("--router", default=node_default("router"), show_default=True,
                     help="The router's control socket."),
        click.option("--node-id", default=None, help="[default: ROLE-HOST-PID]"),
        click.option("--heartbeat-interval", type=click.FloatRange(min=0, min_open=True),
                     default=node_default("heartbeat_interval_s"), show_default=True,
                     help="Seconds, until the router says."),
        click.option("--metrics-port", type=click.IntRange(0, 65535),
                     default=node_default("metrics_port"),
                     show_default=True, help="Serve Prometheus /metrics on this port; 0: off."),
        click.option("--metrics-host", default=node_default("metrics_host"), show_default=True,
                     help="Bind host of /metrics; 0.0.0.0 lets other machines scrape it."),
        click.option("--curve-dir", type=click.Path(exists=True, file_okay=False), default=None,
                     help="CurveZMQ key folder (pdserve keys generate): encrypt and "
                          "authenticate the control and KV sockets [default: off]."),
        click.option("--curve-key", default=node_default("curve_key"), show_default=True,
                     help="This node's keypair in --curve-dir (NAME.key_secret)."),
        click.option("--log-level", type=click.Choice(LOG_LEVELS), default=DEFAULT_LEVEL,
                     show_default=True),
        kv_events_option,
        click.option("--insecure", is_flag=True, help="Start even though the KV socket is "
                     "open to other machines without CURVE (warned every minute)."),
        config_env_option,
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return engine_options(fn)


def parse_kv_events(text: str | None):
    from pdserve.common.kv_events import KVEventsConfig

    return None if text is None else KVEventsConfig.from_json(text)


def engine_config(kw):
    """An EngineConfig from the engine flags (popped from kw)."""

    return EngineConfig(model=kw.pop("model_dir"), dtype=kw.pop("dtype"),
                        device=kw.pop("device"), block_size=kw.pop("block_size"),
                        num_kv_blocks=kw.pop("num_kv_blocks"),
                        kv_cache_memory_gb=kw.pop("kv_cache_memory_gb"),
                        decode_window_memory_gb=kw.pop("decode_window_memory_gb"),
                        cpu_linear=kw.pop("cpu_linear"),
                        max_num_seqs=kw.pop("max_num_seqs"),
                        max_num_batched_tokens=kw.pop("max_num_batched_tokens"),
                        threads=kw.pop("threads"), compute=kw.pop("compute"),
                        enable_prefix_caching=kw.pop("enable_prefix_caching"))


def router_options(fn):
    """Flags of the router; `launch` takes them too."""
    opts = [
        click.option("--model", "model_dir", type=click.Path(exists=True), default=None,
                     help="Checkpoint folder or .gguf file [default: the bundled model]."),
        click.option("--served-model-name", default=None,
                     help="The model name clients send [default: the folder's name, or the "
                          "file's without .gguf]."),
        click.option("--host", default=router_default("host"), show_default=True,
                     help="HTTP bind host; 0.0.0.0 opens it (and --control/--ingress defaults) "
                          "to other machines."),
        click.option("--http-port", type=click.IntRange(0, 65535),
                     default=router_default("http_port"),
                     show_default=True),
        click.option("--metrics-port", type=click.IntRange(1, 65535), default=None,
                     help="Also serve Prometheus /metrics on this port [default: only on "
                          "the HTTP port, at /metrics]."),
        click.option("--control", default=None,
                     help="Control socket nodes connect to [default: tcp://HOST:5556]."),
        click.option("--ingress", default=None,
                     help="Queue-producer socket, or 'none' [default: tcp://HOST:5557]."),
        click.option("--policy", type=click.Choice(POLICIES), default=router_default("policy"),
                     show_default=True),
        click.option("--heartbeat-interval", type=click.FloatRange(min=0, min_open=True),
                     default=router_default("heartbeat_interval_s"), show_default=True,
                     help="Seconds between heartbeats."),
        click.option("--liveness", type=click.IntRange(min=1), default=router_default("liveness"),
                     show_default=True,
                     help="Missed heartbeats before a node is dead."),
        click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True),
                     default=router_default("request_timeout_s"), show_default=True,
                     help="Default deadline of a request (s)."),
        click.option("--max-pending-requests", type=click.IntRange(min=1),
                     default=router_default("max_pending_requests"),
                     show_default=True, help="Past this, new requests are refused (429)."),
        click.option("--reserve-lease", type=click.FloatRange(min=0, min_open=True),
                     default=router_default("reserve_lease_s"), show_default=True,
                     help="Seconds a decode node holds KV "
                     "blocks for a request's transfer; a prefill node waits as long for the "
                     "decode node's acknowledgement."),
        click.option("--max-stop-strings", type=click.IntRange(min=0),
                     default=router_default("max_stop_strings"),
                     show_default=True, help="Stop strings per request."),
        click.option("--max-stop-bytes", type=click.IntRange(min=1),
                     default=router_default("max_stop_bytes"),
                     show_default=True, help="UTF-8 bytes of one stop string."),
        click.option("--max-prompt-bytes", type=click.IntRange(min=1),
                     default=router_default("max_prompt_bytes"),
                     show_default=True, help="UTF-8 bytes of a prompt's text, checked "
                     "before tokenizing."),
        click.option("--curve-dir", type=click.Path(exists=True, file_okay=False), default=None,
                     help="CurveZMQ key folder (pdserve keys generate): encrypt and "
                          "authenticate the control, ingress and KV sockets [default: off]."),
        click.option("--api-key", envvar="PDSERVE_API_KEY", default=None,
                     help="Require 'Authorization: Bearer KEY' on /v1/* [env: "
                          "PDSERVE_API_KEY; prefer it: flags show in ps]."),
        click.option("--log-level", type=click.Choice(LOG_LEVELS), default=DEFAULT_LEVEL,
                     show_default=True),
        click.option("--insecure", is_flag=True, help="Start even though sockets or HTTP "
                     "are open to other machines without CURVE or an API key (warned every "
                     "minute)."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def router_config(kw):
    """A RouterConfig from the router flags (popped from kw)."""

    host = kw.pop("host")
    bind_host = "*" if host in ("0.0.0.0", "*") else host
    ingress = kw.pop("ingress") or f"tcp://{bind_host}:5557"
    try:
        return RouterConfig(
            model=kw.pop("model_dir"), served_model_name=kw.pop("served_model_name"),
            host=host, http_port=kw.pop("http_port"), metrics_port=kw.pop("metrics_port"),
            control=kw.pop("control") or f"tcp://{bind_host}:5556",
            ingress=None if ingress == "none" else ingress, policy=kw.pop("policy"),
            heartbeat_interval_s=kw.pop("heartbeat_interval"), liveness=kw.pop("liveness"),
            request_timeout_s=kw.pop("request_timeout"),
            max_pending_requests=kw.pop("max_pending_requests"),
            reserve_lease_s=kw.pop("reserve_lease"), max_stop_strings=kw.pop("max_stop_strings"),
            max_stop_bytes=kw.pop("max_stop_bytes"), max_prompt_bytes=kw.pop("max_prompt_bytes"),
            curve_dir=kw.pop("curve_dir"), api_key=kw.pop("api_key") or None,
            insecure=kw.pop("insecure"))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


def node_config(role: str, kw: dict) -> tuple[NodeConfig, str]:
    """(NodeConfig, log level) from a node command's flags."""
    log_level = kw.pop("log_level")
    kw.pop("config_env", None)
    try:
        return NodeConfig(role=role, engine=engine_config(kw), router=kw.pop("router"),
                          node_id=kw.pop("node_id"),
                          kv_events=parse_kv_events(kw.pop("kv_events_config")),
                          heartbeat_interval_s=kw.pop("heartbeat_interval"), **kw), log_level
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
