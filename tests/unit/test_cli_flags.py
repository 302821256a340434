"""Flags generated from the config fields: each flag shows its help and range, the CLI and
the config refuse the same values, and `pdserve launch` hands its engine flags and its
--node-arg flags to the nodes."""
import click
import pytest
from click.testing import CliRunner

from pdserve.cli import LAUNCH_NOT_ENGINE, launch_config, main
from pdserve.common.config_fields import flags_of
from pdserve.engine.config import EngineConfig
from pdserve.launch import LaunchConfig
from pdserve.node.config import NodeConfig
from pdserve.router.config import RouterConfig

COMMANDS = {RouterConfig: ["router", "launch"], EngineConfig: ["prefill", "decode",
            "colocated", "generate", "launch"], LaunchConfig: ["launch"]}


def help_of(command: str) -> str:
    out = CliRunner().invoke(main, [command, "--help"], terminal_width=10_000)
    assert out.exit_code == 0, out.output
    return " ".join(out.output.split())


@pytest.mark.parametrize("config_class", [RouterConfig, EngineConfig, NodeConfig,
                                          LaunchConfig])
def test_every_flag_field_is_on_its_commands_with_its_help(config_class):
    for field, spec, _ in flags_of(config_class):
        name = spec.name or "--" + field.name.replace("_", "-")
        commands = COMMANDS.get(config_class) or [
            r for r in ("prefill", "decode", "colocated") if spec.roles in (None,) or
            r in spec.roles]
        for command in commands:
            if command == "launch" and field.name in LAUNCH_NOT_ENGINE and \
                    config_class is EngineConfig:
                continue  # launch's --model and --sim-* are the router's, handed to the nodes
            text = help_of(command)
            assert name in text and " ".join(spec.help.split()) in text, (command, name)


def test_role_flags_only_on_their_roles():
    assert "--kv-bind" in help_of("decode") and "--kv-bind" not in help_of("prefill")
    assert "--kv-shm" in help_of("prefill") and "--kv-shm" not in help_of("colocated")


@pytest.mark.parametrize("args, words", [
    (["prefill", "--kv-layers-per-chunk", "0"], "x>=1"),
    (["router", "--http-port", "70000"], "0<=x<=65535"),
    (["router", "--policy", "random"], "'round_robin', 'least_loaded', 'cache_aware'"),
    (["decode", "--kv-cache-memory-gb", "0"], "x>0"),
])
def test_the_cli_refuses_out_of_range_values(args, words):
    out = CliRunner().invoke(main, args, terminal_width=10_000)
    assert out.exit_code == 2 and words in out.output, out.output


@pytest.mark.parametrize("make, words", [
    (lambda: NodeConfig(role="prefill", engine=EngineConfig(), kv_layers_per_chunk=0),
     "kv_layers_per_chunk must be an integer >= 1, got 0"),
    (lambda: RouterConfig(http_port=70000), "http_port must be an integer in [0, 65535]"),
    (lambda: RouterConfig(policy="random"), "policy must be one of"),
    (lambda: EngineConfig(kv_cache_memory_gb=float("inf")),
     "kv_cache_memory_gb must be a finite number > 0, got inf"),
    (lambda: EngineConfig(max_num_seqs=True), "max_num_seqs must be an integer >= 1"),
    (lambda: EngineConfig(block_size=24), "block_size must be a power of two"),
])
def test_configs_built_without_the_cli_are_held_to_the_same_rules(make, words):
    with pytest.raises(ValueError) as err:
        make()
    assert words in str(err.value)


def test_launch_hands_its_engine_flags_and_node_args_to_the_nodes(tiny_model):
    args = ["--model", str(tiny_model()), "--compute", "none", "--max-num-seqs", "7",
            "--node-arg=--max-num-seqs=5", "--node-arg=--curve-key=k",
            "--node-arg=--block-size=8", "--ingress", "none", "--host", "0.0.0.0"]
    ctx = main.commands["launch"].make_context("launch", args)
    cfg = launch_config(ctx, dict(ctx.params))
    assert cfg.compute == "none" and cfg.router.ingress is None
    assert cfg.router.model == str(tiny_model())  # --model is both the router's and the nodes'
    assert cfg.router.control == "tcp://*:5556"
    prefill, _, given = cfg.node_configs["prefill"]
    decode = cfg.node_configs["decode"][0]
    for node in (prefill, decode):  # launch's own flag wins over --node-arg
        assert (node.engine.max_num_seqs, node.engine.block_size) == (7, 8)
        assert node.engine.compute == "none"
    assert prefill.curve_key == decode.curve_key == "k"
    assert {"max_num_seqs", "block_size", "curve_key"} <= given


def test_launch_refuses_a_node_arg_of_the_wrong_role(tiny_model):
    ctx = main.commands["launch"].make_context(
        "launch", ["--model", str(tiny_model()), "--node-arg=--kv-bind=tcp://*:5600"])
    with pytest.raises(click.UsageError, match="--kv-bind"):
        launch_config(ctx, dict(ctx.params))


@pytest.mark.parametrize("cores, args, colocated", [
    (2, [], True),                                    # a small CPU machine: one node
    (1, [], True),
    (4, [], False),                                   # more cores: 1P1D as before
    (2, ["--prefill", "1"], False),                   # a topology asked for is kept
    (2, ["--decode", "2"], False),
    (2, ["--colocated"], True),
    (2, ["--compute", "none"], False),                # no model on the CPU: no contention
    (2, ["--device", "cuda"], False),
])
def test_launch_picks_one_colocated_node_on_a_small_cpu_machine(tiny_model, monkeypatch, cores,
                                                                args, colocated):
    monkeypatch.setattr("pdserve.cli.os.cpu_count", lambda: cores)
    ctx = main.commands["launch"].make_context("launch", ["--model", str(tiny_model()), *args])
    cfg = launch_config(ctx, dict(ctx.params))
    assert cfg.colocated == colocated
    assert set(cfg.node_configs) == ({"colocated"} if colocated else {"prefill", "decode"})
    # said in the ready table only when launch chose it
    assert ("--prefill 1 --decode 1 starts them apart" in cfg.topology_why) == \
        (colocated and not args)
