"""`pdserve model info` and `pdserve model export-tokenizer DIR`: where the served model lies,
and its tokenizer as a Hugging Face folder that transformers loads and that tokenizes as
pdserve does (what guidellm's --processor and lm-eval's tokenizer= need)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.model.tokenizer import Tokenizer

TEXTS = ["Hello world", "The café costs 3.50 €, ok?", "  spaces\tand\nnewlines  "]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def pdserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True,
                          text=True, timeout=120)


def bundled_or_skip():
    from pdserve.model.default_model import bundled_model

    path, why = bundled_model()
    if path is None:
        pytest.skip(why)
    return path


def check_export(model_path, out_dir, *model_flag: str) -> None:
    import transformers

    out = pdserve("model", "export-tokenizer", str(out_dir), *model_flag)
    assert out.returncode == 0, out.stderr
    assert "tokenizer.json" in out.stdout
    ours = Tokenizer(model_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(out_dir))
    for text in TEXTS:
        assert hf.encode(text) == ours.encode(text), text
        ids = ours.encode(text, add_special_tokens=False)
        assert hf.decode(ids) == ours.decode(ids, skip_special_tokens=False), text
    assert hf.eos_token == ours.hf_config()["eos_token"]
    assert hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == \
        ours.apply_chat_template(MESSAGES)


def test_export_a_checkpoint_folders_tokenizer(tiny_model, tmp_path):
    model = tiny_model("llama")
    check_export(model, tmp_path / "tok", "--model", str(model))


def test_export_a_gguf_files_tokenizer(tiny_model, tmp_path):
    from tests.gguf_files import write_gguf

    gguf = write_gguf(tiny_model("llama"), tmp_path / "tiny.gguf")
    check_export(gguf, tmp_path / "tok", "--model", str(gguf))


def test_the_default_models_info_and_tokenizer(tmp_path):
    path = bundled_or_skip()
    out = pdserve("model", "info")
    assert out.returncode == 0, out.stderr
    assert "SmolLM2-135M-Instruct.Q4_1" in out.stdout and str(path.resolve()) in out.stdout
    check_export(path, tmp_path / "tok")


def test_model_help_names_the_default():
    out = pdserve("launch", "--help")
    assert "SmolLM2-135M-Instruct" in " ".join(out.stdout.split())
