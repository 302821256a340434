"""The engine's greedy output equals transformers' generate(), token for token."""
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.model import llama

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
# Lengths straddle the 16-token block: 1 token, exact multiples, one past a boundary.
PROMPT_LENGTHS = [1, 5, 15, 16, 17, 31, 33, 48, 70]


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def hf_greedy(model_dir, prompts, new_tokens=NEW_TOKENS):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # no early stop: compare raw argmax chains
    model.generation_config.pad_token_id = 0
    outs = []
    for ids in prompts:
        with torch.no_grad():
            seq = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                 dtype=torch.long), max_new_tokens=new_tokens, do_sample=False)
        outs.append(seq[0, len(ids):].tolist())
    return outs


# cpu_linear: oneDNN's reordered weights (the CPU default) and F.linear (transformers' own),
# whose LM head runs in vocabulary blocks: made small here, so that the tiny vocabulary
# takes several.
@pytest.mark.parametrize("arch,cpu_linear", [("llama", "onednn"), ("qwen2", "onednn"),
                                             ("mistral", "onednn"), ("llama", "torch"),
                                             ("qwen2", "torch")])
def test_greedy_batch_matches_transformers(tiny_model, arch, cpu_linear, monkeypatch):
    monkeypatch.setattr(llama, "LM_HEAD_CPU_BLOCK", 96)
    model_dir = tiny_model(arch)
    # A small token budget makes the 70-token prompt prefill in several chunks and
    # mixes prefill chunks with decode tokens in one step.
    llm = LLM(dtype="float32", model=model_dir, max_num_batched_tokens=32, cpu_linear=cpu_linear)
    assert llm.engine.runner.linear == cpu_linear
    prompts = make_prompts(llm.engine.model_config.vocab_size)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    ours = [o.token_ids for o in llm.generate(prompts, params)]
    assert ours == hf_greedy(model_dir, prompts)
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks


def test_text_prompts_and_chunked_prefill_match_transformers(tiny_model):
    model_dir = tiny_model("llama")
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    texts = ["The quick brown fox", "Serving systems batch requests " * 8, "é ü ß 日本"]
    hf_ids = [tok(t).input_ids for t in texts]
    llm = LLM(dtype="float32", model=model_dir, max_num_batched_tokens=16)
    outs = llm.generate(texts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                              ignore_eos=True))
    assert [o.prompt_token_ids for o in outs] == hf_ids
    assert [o.token_ids for o in outs] == hf_greedy(model_dir, hf_ids)
    for out in outs:
        # An incomplete UTF-8 character at the very end is held back, not shown as U+FFFD.
        hf_text = tok.decode(out.token_ids, skip_special_tokens=True)
        assert out.text == hf_text.rstrip("\ufffd")
        assert out.finish_reason == "length"


def test_stop_token_ends_after_the_token(tiny_model):
    """A stop token id ends the sequence right after it, with finish_reason 'stop'."""
    model_dir = tiny_model("qwen2")
    llm = LLM(dtype="float32", model=model_dir)
    prompts = make_prompts(llm.engine.model_config.vocab_size, seed=3)[:4]
    free = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8,
                                                                      temperature=0,
                                                                      ignore_eos=True))]
    stop_tok = free[0][3]
    outs = llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0,
                                                    stop_token_ids=[stop_tok]))
    first = free[0].index(stop_tok)
    assert outs[0].token_ids == free[0][:first + 1]
    assert outs[0].finish_reason == "stop"


HF_CONFIGS = {  # written by transformers itself (rope_parameters, its own defaults)
    "llama-tied-biases-linear-rope-mqa": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=1, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama-explicit-head-dim": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=2, head_dim=32)),
    "qwen2-defaults": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2)),
    "mistral-no-window": ("MistralConfig", "MistralForCausalLM", dict(
        num_key_value_heads=3, sliding_window=None)),
}


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_checkpoints_saved_by_transformers_match(name, tiny_model, tmp_path):
    """Configurations we did not write: transformers builds and saves them; its weights
    are rescaled so that greedy choices are clear, as make-model does for ours."""
    import shutil

    cfg_cls, model_cls, kw = HF_CONFIGS[name]
    cfg = getattr(transformers, cfg_cls)(vocab_size=300, hidden_size=96, intermediate_size=160,
                                         num_hidden_layers=2, num_attention_heads=6,
                                         max_position_embeddings=512, **kw)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() >= 2:
                gain = 3.0 if ("embed" in pname or "lm_head" in pname) else 1.0
                p.normal_(0, gain / p.shape[-1] ** 0.5)
            elif pname.endswith("bias"):
                p.normal_(0, 0.1)
            else:
                p.uniform_(0.8, 1.2)
    model.save_pretrained(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # ours: ids only matter here
        shutil.copy(tiny_model("llama") / f, tmp_path)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (1, 7, 20, 45)]
    ours = LLM(dtype="float32", model=tmp_path).generate(
        prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    for p, out in zip(prompts, ours):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p),
                                 dtype=torch.long), max_new_tokens=24, do_sample=False)
        assert out.token_ids == ref[0, len(p):].tolist()
