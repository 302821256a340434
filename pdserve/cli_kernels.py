"""``pdserve kernels compile``: every Triton kernel compiled for GPU targets, no GPU needed.

Beside cli.py rather than inside pdserve/kernels/, because importing anything under
that package imports torch, and ``pdserve`` (the router among its commands) starts
without torch; the work is in pdserve/aot.py, imported when the command runs.
"""
from __future__ import annotations

import os
import sys
import time

import click

from pdserve.engine.config import EngineConfig

DTYPE_CHOICES = ("all", "auto", "float32", "bfloat16", "float16")


def _parse_archs(value: str) -> list[int]:
    from pdserve.aot import MAX_SHARED_BYTES

    try:
        archs = [int(a.strip().removeprefix("sm_")) for a in value.split(",") if a.strip()]
    except ValueError:
        archs = []
    if not archs or any(a not in MAX_SHARED_BYTES for a in archs):
        raise click.BadParameter(f"expected a comma-separated list of CUDA architectures "
                                 f"among {', '.join(map(str, MAX_SHARED_BYTES))}, got {value!r}",
                                 param_hint="--arch")
    return archs


@click.group("kernels")
def kernels_group() -> None:
    """The Triton kernels of pdserve/kernels/."""


@kernels_group.command("compile")
@click.option("--arch", "arch_list", default="80,90", show_default=True,
              help="CUDA architectures to compile for (80: A100, 90: H100/H200).")
@click.option("--model", "model_path", default=None,
              help="Checkpoint folder or .gguf file whose shapes to compile for "
                   "(only its config is read); default: the default model.")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="all", show_default=True,
              help="The engine's --dtype; all: float32, bfloat16 and float16.")
@click.option("--block-size", type=int, default=EngineConfig.block_size, show_default=True,
              help="KV cache block size (the engine's --block-size).")
def compile_cmd(arch_list: str, model_path: str | None, dtype: str, block_size: int) -> None:
    """Compile every Triton kernel, at every specialization a model's forward launches
    (head dim, GQA group, block sizes, dtype), for GPU targets, without a GPU.

    One line per kernel x specialization x arch: KERNEL KEY sm_XX ok|FAILED shared=BYTES
    regs=N spills=BYTES (registers and local memory per thread, from cuobjdump); a
    failure adds the compiler's message. Exit status 1 if any failed.
    """
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"):
        raise click.UsageError("TRITON_INTERPRET is set: the kernels would be defined for the "
                               "interpreter, not compiled; unset it for this command")
    archs = _parse_archs(arch_list)
    try:
        EngineConfig(block_size=block_size)  # the engine's own check of the block size
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--block-size") from exc
    import torch

    from pdserve import aot
    from pdserve.kernels._dispatch import LOAD_TRITON_ENV, TRITON_INSTALLED, triton
    from pdserve.model.config import ModelConfig, ModelLoadError
    from pdserve.model.loader import DTYPES, resolve_dtype

    if not TRITON_INSTALLED:
        raise click.ClickException("the triton package is not installed")
    if triton is None:  # pdserve.kernels was imported earlier in this process
        raise click.ClickException(f"triton was not loaded: set {LOAD_TRITON_ENV}=1 before "
                                   "pdserve.kernels is imported")
    if model_path is None:
        from pdserve.model.default_model import default_model_dir
        model_path = str(default_model_dir())
    try:
        cfg = ModelConfig.from_dir(model_path)
    except ModelLoadError as exc:
        raise click.ClickException(str(exc)) from exc
    dtypes = list(DTYPES.values()) if dtype == "all" else [resolve_dtype(dtype, cfg, "cuda")]
    click.echo(f"# {model_path}: {cfg.architecture}, hidden {cfg.hidden_size}, heads "
               f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} kv, head_dim "
               f"{cfg.head_dim}; block size {block_size}; triton {triton.__version__}, "
               f"torch {torch.__version__}")
    start, compiled, failed = time.monotonic(), 0, 0
    for torch_dtype in dtypes:
        launches = aot.distinct(aot.model_launches(cfg, torch_dtype, block_size), torch_dtype)
        for arch in archs:
            for key, launch in launches:
                result = aot.compile_launch(launch, key, arch)
                click.echo(result.line())
                compiled, failed = compiled + result.ok, failed + (not result.ok)
    click.echo(f"# {time.monotonic() - start:.1f} s")
    click.echo(f"{compiled} compiled, {failed} failed")
    sys.exit(1 if failed else 0)
