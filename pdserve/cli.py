"""The ``pdserve`` command. Each subcommand checks its flags, builds one frozen
config and hands it to the entry function of its role."""
from __future__ import annotations

import sys

import click

ARCHES = ("llama", "qwen2", "mistral")
PRESETS = ("tiny", "small")
DTYPES = ("float32", "bfloat16", "float16", "auto")
LOG_LEVELS = ("debug", "info", "warning", "error")


def engine_options(fn):
    """Flags every engine owner takes; they build one EngineConfig."""
    opts = [
        click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False),
                     default=None, help="Checkpoint folder [default: the bundled default model]."),
        click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True),
        click.option("--device", default="cpu", show_default=True),
        click.option("--block-size", type=click.IntRange(min=1), default=16, show_default=True),
        click.option("--num-kv-blocks", type=click.IntRange(min=1), default=None,
                     help="KV cache size in blocks [default: from --kv-cache-memory-gb]."),
        click.option("--kv-cache-memory-gb", type=click.FloatRange(min=0, min_open=True),
                     default=0.5, show_default=True),
        click.option("--max-num-seqs", type=click.IntRange(min=1), default=64,
                     show_default=True),
        click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=2048,
                     show_default=True, help="Token budget of one step; longer prompts are "
                     "prefilled in chunks."),
        click.option("--threads", type=click.IntRange(min=1), default=None,
                     help="torch CPU threads [default: torch's choice]."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def node_options(fn):
    opts = [
        click.option("--router", default="tcp://127.0.0.1:5556", show_default=True,
                     help="The router's control socket."),
        click.option("--node-id", default=None, help="[default: ROLE-HOST-PID]"),
        click.option("--heartbeat-interval", type=click.FloatRange(min=0, min_open=True),
                     default=1.0, show_default=True, help="Seconds, until the router says."),
        click.option("--log-level", type=click.Choice(LOG_LEVELS), default="info",
                     show_default=True),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return engine_options(fn)


def _engine_config(kw):
    """An EngineConfig from the engine flags (popped from kw)."""
    from pdserve.engine.config import EngineConfig

    return EngineConfig(model=kw.pop("model_dir"), dtype=kw.pop("dtype"),
                        device=kw.pop("device"), block_size=kw.pop("block_size"),
                        num_kv_blocks=kw.pop("num_kv_blocks"),
                        kv_cache_memory_gb=kw.pop("kv_cache_memory_gb"),
                        max_num_seqs=kw.pop("max_num_seqs"),
                        max_num_batched_tokens=kw.pop("max_num_batched_tokens"),
                        threads=kw.pop("threads"))


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
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--temperature", type=click.FloatRange(0, 100), default=0.0, show_default=True)
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0,
              show_default=True)
@click.option("--top-k", type=click.IntRange(min=-1), default=0, show_default=True)
@click.option("--seed", type=int, default=None)
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


def _run_node(role: str, kw: dict) -> None:
    from pdserve.common.config import NodeConfig
    from pdserve.common.logs import setup_logging

    log_level = kw.pop("log_level")
    try:
        config = NodeConfig(role=role, engine=_engine_config(kw), router=kw.pop("router"),
                            node_id=kw.pop("node_id"),
                            heartbeat_interval_s=kw.pop("heartbeat_interval"), **kw)
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
@click.option("--kv-checksums/--no-kv-checksums", "kv_checksums", default=True,
              show_default=True, help="A 64-bit checksum on every KV frame sent.")
@click.option("--kv-layers-per-chunk", type=click.IntRange(min=1), default=4, show_default=True,
              help="Layers per KV message: smaller overlaps transfer with compute more.")
def prefill_cmd(**kw) -> None:
    """Run a prefill node: batch prefill, first token, KV straight to decode nodes."""
    _run_node("prefill", kw)


@main.command("decode")
@node_options
@click.option("--kv-bind", default="tcp://127.0.0.1:*", show_default=True,
              help="Where prefill nodes send KV (tcp://*:PORT to accept other machines).")
@click.option("--advertise-host", default=None,
              help="Host prefill nodes should connect to [default: the bound host, or this "
                   "machine's name when bound to *].")
def decode_cmd(**kw) -> None:
    """Run a decode node: receive KV into paged cache, decode in continuous batches."""
    _run_node("decode", kw)


if __name__ == "__main__":
    sys.exit(main())
