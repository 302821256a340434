"""The ``pdserve`` command. Each subcommand checks its flags, builds one frozen
config and hands it to the entry function of its role."""
from __future__ import annotations

import sys

import click

from pdserve.common.cli_options import sampling_options
from pdserve.common.config import NodeConfig
from pdserve.common.logs import DEFAULT_LEVEL
from pdserve.common.logs import LEVELS as LOG_LEVELS
from pdserve.engine.config import COMPUTE_MODES, DTYPES, EngineConfig
from pdserve.launch import LaunchConfig
from pdserve.router.config import POLICIES, RouterConfig

ARCHES = ("llama", "qwen2", "mistral")
PRESETS = ("tiny", "small")


def _default(config_class, name: str):
    """A config dataclass field's default: each default is written once, in the dataclass."""
    return config_class.__dataclass_fields__[name].default


def _e(name: str):
    return _default(EngineConfig, name)


def _n(name: str):
    return _default(NodeConfig, name)


def _r(name: str):
    return _default(RouterConfig, name)


prefix_caching_option = click.option(
    "--enable-prefix-caching/--no-enable-prefix-caching",
    default=_e("enable_prefix_caching"), show_default=True,
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
        click.option("--dtype", type=click.Choice(DTYPES), default=_e("dtype"),
                     show_default=True),
        click.option("--device", default=_e("device"), show_default=True),
        click.option("--block-size", type=click.IntRange(min=1), default=_e("block_size"),
                     show_default=True),
        click.option("--num-kv-blocks", type=click.IntRange(min=1), default=None,
                     help="KV cache size in blocks [default: from --kv-cache-memory-gb]."),
        click.option("--kv-cache-memory-gb", type=click.FloatRange(min=0, min_open=True),
                     default=_e("kv_cache_memory_gb"), show_default=True),
        click.option("--max-num-seqs", type=click.IntRange(min=1), default=_e("max_num_seqs"),
                     show_default=True),
        click.option("--max-num-batched-tokens", type=click.IntRange(min=1),
                     default=_e("max_num_batched_tokens"),
                     show_default=True, help="Token budget of one step; longer prompts are "
                     "prefilled in chunks."),
        click.option("--threads", type=click.IntRange(min=1), default=None,
                     help="torch CPU threads [default: torch's choice]."),
        click.option("--compute", type=click.Choice(COMPUTE_MODES), default=_e("compute"),
                     show_default=True, help="'none' is a BENCHMARK mode: skip the forward "
                     "and emit a fixed token, to measure everything around the model."),
        prefix_caching_option,
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def node_options(fn):
    opts = [
        click.option("--router", default=_n("router"), show_default=True,
                     help="The router's control socket."),
        click.option("--node-id", default=None, help="[default: ROLE-HOST-PID]"),
        click.option("--heartbeat-interval", type=click.FloatRange(min=0, min_open=True),
                     default=_n("heartbeat_interval_s"), show_default=True,
                     help="Seconds, until the router says."),
        click.option("--metrics-port", type=click.IntRange(0, 65535),
                     default=_n("metrics_port"),
                     show_default=True, help="Serve Prometheus /metrics on this port; 0: off."),
        click.option("--metrics-host", default=_n("metrics_host"), show_default=True,
                     help="Bind host of /metrics; 0.0.0.0 lets other machines scrape it."),
        click.option("--curve-dir", type=click.Path(exists=True, file_okay=False), default=None,
                     help="CurveZMQ key folder (pdserve keys generate): encrypt and "
                          "authenticate the control and KV sockets [default: off]."),
        click.option("--curve-key", default=_n("curve_key"), show_default=True,
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


def _kv_events(text: str | None):
    from pdserve.common.kv_events import KVEventsConfig

    return None if text is None else KVEventsConfig.from_json(text)


def _engine_config(kw):
    """An EngineConfig from the engine flags (popped from kw)."""

    return EngineConfig(model=kw.pop("model_dir"), dtype=kw.pop("dtype"),
                        device=kw.pop("device"), block_size=kw.pop("block_size"),
                        num_kv_blocks=kw.pop("num_kv_blocks"),
                        kv_cache_memory_gb=kw.pop("kv_cache_memory_gb"),
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
        click.option("--host", default=_r("host"), show_default=True,
                     help="HTTP bind host; 0.0.0.0 opens it (and --control/--ingress defaults) "
                          "to other machines."),
        click.option("--http-port", type=click.IntRange(0, 65535), default=_r("http_port"),
                     show_default=True),
        click.option("--metrics-port", type=click.IntRange(1, 65535), default=None,
                     help="Also serve Prometheus /metrics on this port [default: only on "
                          "the HTTP port, at /metrics]."),
        click.option("--control", default=None,
                     help="Control socket nodes connect to [default: tcp://HOST:5556]."),
        click.option("--ingress", default=None,
                     help="Queue-producer socket, or 'none' [default: tcp://HOST:5557]."),
        click.option("--policy", type=click.Choice(POLICIES), default=_r("policy"),
                     show_default=True),
        click.option("--heartbeat-interval", type=click.FloatRange(min=0, min_open=True),
                     default=_r("heartbeat_interval_s"), show_default=True,
                     help="Seconds between heartbeats."),
        click.option("--liveness", type=click.IntRange(min=1), default=_r("liveness"),
                     show_default=True,
                     help="Missed heartbeats before a node is dead."),
        click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True),
                     default=_r("request_timeout_s"), show_default=True,
                     help="Default deadline of a request (s)."),
        click.option("--max-pending-requests", type=click.IntRange(min=1),
                     default=_r("max_pending_requests"),
                     show_default=True, help="Past this, new requests are refused (429)."),
        click.option("--reserve-lease", type=click.FloatRange(min=0, min_open=True),
                     default=_r("reserve_lease_s"), show_default=True,
                     help="Seconds a decode node holds KV "
                     "blocks for a request's transfer; a prefill node waits as long for the "
                     "decode node's acknowledgement."),
        click.option("--max-stop-strings", type=click.IntRange(min=0),
                     default=_r("max_stop_strings"),
                     show_default=True, help="Stop strings per request."),
        click.option("--max-stop-bytes", type=click.IntRange(min=1),
                     default=_r("max_stop_bytes"),
                     show_default=True, help="UTF-8 bytes of one stop string."),
        click.option("--max-prompt-bytes", type=click.IntRange(min=1),
                     default=_r("max_prompt_bytes"),
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


def _router_config(kw):
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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="pdserve")
def main() -> None:
    """pdserve: serve Llama-family models with prefill and decode disaggregated."""


@main.command("make-model")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--arch", type=click.Choice(ARCHES), default="llama", show_default=True)
@click.option("--preset", type=click.Choice(PRESETS), default="tiny", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def make_model_cmd(out_dir: str, arch: str, preset: str, seed: int) -> None:
    """Write a random-weight checkpoint in Hugging Face layout to OUT_DIR."""
    from pdserve.model.make_model import make_model

    path = make_model(out_dir, arch=arch, preset=preset, seed=seed)
    click.echo(f"wrote {arch} ({preset}, seed {seed}) to {path}")


@main.command("generate")
@click.option("--prompt", "prompts", multiple=True, required=True,
              help="Prompt text; repeat for a batch.")
@sampling_options
@engine_options
def generate_cmd(prompts, max_tokens, temperature, top_p, top_k, seed, **kw) -> None:
    """Generate completions offline with the engine (no servers)."""
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.llm import LLM

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k, seed=seed)
        llm = LLM.from_engine(LLMEngine(_engine_config(kw)))
        outputs = llm.generate(list(prompts), params)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    for out in outputs:
        click.echo(f"--- prompt: {out.prompt!r}")
        click.echo(f"{out.prompt}{out.text}")
        click.echo(f"--- {len(out.token_ids)} tokens, finish_reason={out.finish_reason}")


def _node_config(role: str, kw: dict) -> tuple[NodeConfig, str]:
    """(NodeConfig, log level) from a node command's flags."""
    log_level = kw.pop("log_level")
    kw.pop("config_env", None)
    try:
        return NodeConfig(role=role, engine=_engine_config(kw), router=kw.pop("router"),
                          node_id=kw.pop("node_id"),
                          kv_events=_kv_events(kw.pop("kv_events_config")),
                          heartbeat_interval_s=kw.pop("heartbeat_interval"), **kw), log_level
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


def parse_node_args(role: str, args) -> tuple[NodeConfig, str, set[str]]:
    """(NodeConfig, log level, the parameters ``args`` set) of ``pdserve ROLE ARGS``: how
    ``pdserve launch`` reads its --node-arg flags."""
    from click.core import ParameterSource

    ctx = main.commands[role].make_context(role, list(args))
    given = {name for name in ctx.params
             if ctx.get_parameter_source(name) is not ParameterSource.DEFAULT}
    return (*_node_config(role, dict(ctx.params)), given)


def _run_node(role: str, kw: dict) -> None:
    from pdserve.common import config_io
    from pdserve.common.kv_events import KVEventsConfig
    from pdserve.common.logs import setup_logging

    if kw.get("config_env"):
        try:
            config, log_level = config_io.from_env(
                NodeConfig, {"engine": EngineConfig, "kv_events": KVEventsConfig})
        except ValueError as exc:
            raise click.UsageError(str(exc)) from exc
    else:
        config, log_level = _node_config(role, kw)
    try:
        from pdserve.common.security import node_curves, node_exposures, refuse_insecure
        node_curves(config.curve_dir, role, config.curve_key)  # bad keys: now, not after loading
        refuse_insecure(node_exposures(config), config.insecure)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    setup_logging(log_level, config.node_id or role)
    if role == "prefill":
        from pdserve.prefill_node.main import run_prefill as run
    else:
        from pdserve.decode_node.main import run_decode as run
    try:
        code = run(config)
    except ValueError as exc:  # a model that cannot be loaded, a bad engine setting
        raise click.ClickException(str(exc)) from exc
    sys.exit(code)


@main.command("prefill")
@node_options
@click.option("--kv-checksums/--no-kv-checksums", "kv_checksums",
              default=_n("kv_checksums"),
              show_default=True, help="A 64-bit checksum on every KV frame sent.")
@click.option("--kv-shm/--no-kv-shm", "kv_shm", default=_n("kv_shm"), show_default=True,
              help="Keep the KV cache (CPU) in a /dev/shm segment, so that decode nodes on "
                   "this host copy KV from it instead of receiving it over TCP.")
@click.option("--kv-layers-per-chunk", type=click.IntRange(min=1),
              default=_n("kv_layers_per_chunk"), show_default=True,
              help="Layers per KV message: smaller overlaps transfer with compute more.")
def prefill_cmd(**kw) -> None:
    """Run a prefill node: batch prefill, first token, KV straight to decode nodes."""
    _run_node("prefill", kw)


@main.command("decode")
@node_options
@click.option("--kv-bind", default=_n("kv_bind"), show_default=True,
              help="Where prefill nodes send KV (tcp://*:PORT to accept other machines).")
@click.option("--advertise-host", default=None,
              help="Host prefill nodes should connect to [default: the bound host, or this "
                   "machine's name when bound to *].")
def decode_cmd(**kw) -> None:
    """Run a decode node: receive KV into paged cache, decode in continuous batches."""
    _run_node("decode", kw)


@main.command("colocated")
@node_options
def colocated_cmd(**kw) -> None:
    """Run a colocated node: prefill and decode with one engine (the baseline to disaggregation,
    and the single-GPU setup)."""
    _run_node("colocated", kw)


@main.command("router")
@router_options
@config_env_option
def router_cmd(config_env, **kw) -> None:
    """Run the router: OpenAI HTTP API, queue ingress, dispatch to prefill/decode nodes."""
    from pdserve.common import config_io
    from pdserve.common.logs import setup_logging
    from pdserve.router.main import run_router

    if config_env:
        try:
            config, log_level = config_io.from_env(RouterConfig)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from exc
    else:
        log_level = kw.pop("log_level")
        config = _router_config(kw)
    setup_logging(log_level, "router")
    try:
        sys.exit(run_router(config))
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc


@main.command("launch")
@router_options
@click.option("--prefill", "num_prefill", type=click.IntRange(min=1),
              default=_default(LaunchConfig, "num_prefill"),
              show_default=True, help="Prefill nodes to start.")
@click.option("--decode", "num_decode", type=click.IntRange(min=1),
              default=_default(LaunchConfig, "num_decode"),
              show_default=True, help="Decode nodes to start.")
@click.option("--node-arg", "node_args", multiple=True,
              help="An extra flag for every node, e.g. --node-arg=--num-kv-blocks=512.")
@click.option("--colocated", is_flag=True,
              help="Start one colocated node (prefill + decode in one engine) instead of "
                   "separate prefill and decode nodes.")
@click.option("--dtype", type=click.Choice(DTYPES), default=None, help="Nodes' dtype.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="torch threads per node [default: cores / nodes].")
@click.option("--compute", type=click.Choice(COMPUTE_MODES), default=_e("compute"),
              show_default=True, help="'none': BENCHMARK mode, nodes skip the forward and "
              "emit a fixed token.")
@prefix_caching_option
@kv_events_option
def launch_cmd(num_prefill, num_decode, node_args, colocated, dtype, threads, compute,
               enable_prefix_caching, kv_events_config, **kw) -> None:
    """Start a router and its prefill and decode nodes on this machine."""
    from pdserve.launch import run_launch

    log_level = kw.pop("log_level")
    if kw["model_dir"] is None:  # resolved once here (and built, if it is the random one),
        from pdserve.common.logs import setup_logging  # before the children race for it
        from pdserve.model.default_model import default_model_dir

        setup_logging(log_level, "launch")
        kw["model_dir"] = str(default_model_dir())
    router = _router_config(kw)
    try:
        kv_events = _kv_events(kv_events_config)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    args = list(node_args)
    if dtype:
        args += ["--dtype", dtype]
    if threads:
        args += ["--threads", str(threads)]
    if compute != "model":
        args += ["--compute", compute]
    if not enable_prefix_caching:
        args += ["--no-enable-prefix-caching"]
    roles = ("colocated",) if colocated else ("prefill", "decode")
    sys.exit(run_launch(LaunchConfig(
        router=router, num_prefill=num_prefill, num_decode=num_decode, colocated=colocated,
        compute=compute, log_level=log_level, kv_events=kv_events,
        node_configs={role: parse_node_args(role, args) for role in roles})))


def _register_plugins() -> None:
    """Commands that live beside the code they drive."""
    from pdserve.bench.cli import bench_cmd
    from pdserve.client import submit_cmd
    from pdserve.common.security import keys_group

    main.add_command(submit_cmd, "submit")
    main.add_command(keys_group, "keys")
    main.add_command(bench_cmd, "bench")


_register_plugins()

if __name__ == "__main__":
    sys.exit(main())
