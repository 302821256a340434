"""The ``pdserve`` command. Each subcommand checks its flags, builds one frozen
config and hands it to the entry function of its role."""
from __future__ import annotations

import os
import sys
from dataclasses import replace

import click

from pdserve.cli_config import (
    EngineConfig,
    NodeConfig,
    RouterConfig,
    config_env_option,
    engine_config,
    engine_options,
    flag_value,
    from_flags,
    node_config,
    node_options,
    options,
    router_config,
    router_options,
)
from pdserve.common.cli_options import sampling_options
from pdserve.common.config_fields import flags_of
from pdserve.launch import LaunchConfig

ARCHES = ("llama", "qwen2", "mistral")
# Engine fields that launch does not take as engine flags: the router's flags of the same
# name, handed to the nodes (--model: the checkpoint; --sim-*: what simulated nodes are).
LAUNCH_NOT_ENGINE = ("model", "sim_profile", "sim_kv_bytes_scale")
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
    from pdserve.kernels._dispatch import keep_triton_out
    from pdserve.llm import LLM

    keep_triton_out()

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
    from pdserve.kernels._dispatch import keep_triton_out
    keep_triton_out()
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
@node_options("prefill")
def prefill_cmd(**kw) -> None:
    """Run a prefill node: batch prefill, first token, KV straight to decode nodes."""
    _run_node("prefill", kw)


@main.command("decode")
@node_options("decode")
def decode_cmd(**kw) -> None:
    """Run a decode node: receive KV into paged cache, decode in continuous batches."""
    _run_node("decode", kw)


@main.command("colocated")
@node_options("colocated")
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
@options(LaunchConfig)
@click.option("--node-arg", "node_args", multiple=True,
              help="An extra flag for every node, e.g. --node-arg=--kv-layers-per-chunk=2.")
@options(EngineConfig, skip=LAUNCH_NOT_ENGINE)
@options(NodeConfig, only=("kv_events",))
@click.pass_context
def launch_cmd(ctx, **kw) -> None:
    """Start a router and its prefill and decode nodes on this machine (one colocated
    node on a CPU machine of 2 cores or fewer, unless --prefill or --decode is given).
    The engine flags go to every node; --node-arg passes any other node flag."""
    from pdserve.launch import run_launch

    sys.exit(run_launch(launch_config(ctx, kw)))


# At most this many cores, one colocated node serves more than 1P1D (on 2 cores: every
# column of benchmarks/vs_anchors.py, batch-1 TPOT, 16 concurrent and long prompts; the
# two nodes' threads contend for the same cores): launch's default there.
COLOCATED_CORES = 2


def auto_topology(cfg: LaunchConfig, topology_given: bool, device: str,
                  cores: int | None = None) -> LaunchConfig:
    """One colocated node when no --prefill, --decode or --colocated was given, the model
    runs on this machine's CPU and it has at most COLOCATED_CORES cores; else ``cfg``."""
    cores = cores or os.cpu_count() or 1
    if topology_given or cfg.colocated or cfg.compute != "model" or device != "cpu" \
            or cores > COLOCATED_CORES:
        return cfg
    return replace(cfg, colocated=True, topology_why=(
        f"chosen for {cores} CPU cores: one colocated node serves more than separate "
        f"prefill and decode nodes there; --prefill 1 --decode 1 starts them apart"))


def launch_config(ctx: click.Context, kw: dict) -> LaunchConfig:
    """The LaunchConfig of a parsed ``pdserve launch`` command line (its flags popped from
    ``kw``): each role's node config is its --node-arg flags, then launch's engine flags."""
    from click.core import ParameterSource

    log_level = kw.pop("log_level")
    if kw["model"] is None:  # resolved once here (and built, if it is the random one),
        from pdserve.common.logs import setup_logging  # before the children race for it
        from pdserve.model.default_model import default_model_dir

        setup_logging(log_level, "launch")
        kw["model"] = str(default_model_dir())
    node_args = kw.pop("node_args")
    engine_given = _given(ctx, kw, EngineConfig, skip=LAUNCH_NOT_ENGINE)
    (_, kv_spec, kv_type), = [f for f in flags_of(NodeConfig) if f[0].name == "kv_events"]
    kv_events = flag_value(kv_spec, kv_type, kw.pop("kv_events"))
    router = router_config(kw)
    if router.sim_profile is not None:
        engine_given.update(sim_profile=router.sim_profile,
                            sim_kv_bytes_scale=router.sim_kv_bytes_scale)
    launch = from_flags(LaunchConfig, kw, router=router, log_level=log_level,
                        compute=engine_given.get("compute", EngineConfig.compute),
                        kv_events=kv_events)
    topology_given = any(ctx.get_parameter_source(name) is not ParameterSource.DEFAULT
                         for name in ("num_prefill", "num_decode", "colocated"))
    launch = auto_topology(launch, topology_given,
                           str(engine_given.get("device", EngineConfig.device)))
    roles = ("colocated",) if launch.colocated else ("prefill", "decode")
    return replace(launch, node_configs={
        role: _launch_node_config(role, node_args, engine_given) for role in roles})


def _given(ctx: click.Context, kw: dict, config_class, skip=()) -> dict:
    """The flags of ``config_class`` set on the command line, popped from ``kw``."""
    from click.core import ParameterSource

    names = [f.name for f, _, _ in flags_of(config_class) if f.name in kw and f.name not in skip]
    values = {name: kw.pop(name) for name in names}
    return {name: value for name, value in values.items()
            if ctx.get_parameter_source(name) is not ParameterSource.DEFAULT}


def _launch_node_config(role: str, node_args, engine: dict):
    """One role's (config, log level, flags given): its --node-arg flags, then the engine
    flags given to launch itself."""
    config, log_level, given = parse_node_args(role, node_args)
    try:
        config = replace(config, engine=replace(config.engine, **engine))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    return config, log_level, given | set(engine)


def _register_plugins() -> None:
    """Commands that live beside the code they drive."""
    from pdserve.bench.cli import bench_cmd
    from pdserve.cli_kernels import kernels_group
    from pdserve.cli_model import model_group
    from pdserve.cli_plan import plan_cmd
    from pdserve.client import submit_cmd
    from pdserve.common.security import keys_group

    main.add_command(submit_cmd, "submit")
    main.add_command(keys_group, "keys")
    main.add_command(bench_cmd, "bench")
    main.add_command(kernels_group, "kernels")
    main.add_command(model_group, "model")
    main.add_command(plan_cmd, "plan")


_register_plugins()

if __name__ == "__main__":
    sys.exit(main())
