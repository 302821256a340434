"""The ``pdserve`` command. Each subcommand checks its flags, builds one frozen
config and hands it to the entry function of its role."""
from __future__ import annotations

import sys

import click

from pdserve.cli_config import (
    COMPUTE_MODES,
    DTYPES,
    EngineConfig,
    NodeConfig,
    RouterConfig,
    config_env_option,
    default_of,
    engine_config,
    engine_default,
    engine_options,
    kv_events_option,
    node_config,
    node_default,
    node_options,
    parse_kv_events,
    prefix_caching_option,
    router_config,
    router_options,
)
from pdserve.common.cli_options import sampling_options
from pdserve.launch import LaunchConfig

ARCHES = ("llama", "qwen2", "mistral")
PRESETS = ("tiny", "small")


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
    from pdserve.common.sampling import SamplingParams
    from pdserve.engine.engine import Engine
    from pdserve.llm import LLM

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k, seed=seed)
        llm = LLM.from_engine(Engine(engine_config(kw)))
        outputs = llm.generate(list(prompts), params)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    for out in outputs:
        click.echo(f"--- prompt: {out.prompt!r}")
        click.echo(f"{out.prompt}{out.text}")
        click.echo(f"--- {len(out.token_ids)} tokens, finish_reason={out.finish_reason}")


def parse_node_args(role: str, args) -> tuple[NodeConfig, str, set[str]]:
    """(NodeConfig, log level, the parameters ``args`` set) of ``pdserve ROLE ARGS``: how
    ``pdserve launch`` reads its --node-arg flags."""
    from click.core import ParameterSource

    ctx = main.commands[role].make_context(role, list(args))
    given = {name for name in ctx.params
             if ctx.get_parameter_source(name) is not ParameterSource.DEFAULT}
    return (*node_config(role, dict(ctx.params)), given)


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
        config, log_level = node_config(role, kw)
    try:
        from pdserve.common.security import node_curves, node_exposures, refuse_insecure
        node_curves(config.curve_dir, role, config.curve_key)  # bad keys: now, not after loading
        refuse_insecure(node_exposures(config), config.insecure)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    setup_logging(log_level, config.node_id or role)
    if role == "prefill":
        from pdserve.node.prefill import run_prefill as run
    elif role == "colocated":
        from pdserve.node.colocated import run_colocated as run
    else:
        from pdserve.node.decode import run_decode as run
    try:
        code = run(config)
    except ValueError as exc:  # a model that cannot be loaded, a bad engine setting
        raise click.ClickException(str(exc)) from exc
    sys.exit(code)


@main.command("prefill")
@node_options
@click.option("--kv-checksums/--no-kv-checksums", "kv_checksums",
              default=node_default("kv_checksums"),
              show_default=True, help="A 64-bit checksum on every KV frame sent.")
@click.option("--kv-shm/--no-kv-shm", "kv_shm", default=node_default("kv_shm"), show_default=True,
              help="Keep the KV cache (CPU) in a /dev/shm segment, so that decode nodes on "
                   "this host copy KV from it instead of receiving it over TCP.")
@click.option("--kv-layers-per-chunk", type=click.IntRange(min=1),
              default=node_default("kv_layers_per_chunk"), show_default=True,
              help="Layers per KV message: smaller overlaps transfer with compute more.")
def prefill_cmd(**kw) -> None:
    """Run a prefill node: batch prefill, first token, KV straight to decode nodes."""
    _run_node("prefill", kw)


@main.command("decode")
@node_options
@click.option("--kv-bind", default=node_default("kv_bind"), show_default=True,
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
        config = router_config(kw)
    setup_logging(log_level, "router")
    try:
        sys.exit(run_router(config))
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc


@main.command("launch")
@router_options
@click.option("--prefill", "num_prefill", type=click.IntRange(min=1),
              default=default_of(LaunchConfig, "num_prefill"),
              show_default=True, help="Prefill nodes to start.")
@click.option("--decode", "num_decode", type=click.IntRange(min=1),
              default=default_of(LaunchConfig, "num_decode"),
              show_default=True, help="Decode nodes to start.")
@click.option("--node-arg", "node_args", multiple=True,
              help="An extra flag for every node, e.g. --node-arg=--num-kv-blocks=512.")
@click.option("--colocated", is_flag=True,
              help="Start one colocated node (prefill + decode in one engine) instead of "
                   "separate prefill and decode nodes.")
@click.option("--dtype", type=click.Choice(DTYPES), default=None, help="Nodes' dtype.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="torch threads per node [default: cores / nodes].")
@click.option("--compute", type=click.Choice(COMPUTE_MODES), default=engine_default("compute"),
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
    router = router_config(kw)
    try:
        kv_events = parse_kv_events(kv_events_config)
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
