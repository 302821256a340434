"""Writes GGUF files for tests the way llama.cpp's convert_hf_to_gguf.py writes them:
a Hugging Face checkpoint folder in, llama.cpp's names, permuted q/k rows, rope factors
and tokenizer metadata out."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

gguf = __import__("pytest").importorskip("gguf")

LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(name: str) -> str:
    base, suffix = name.rsplit(".", 1)
    if base in GLOBAL:
        return f"{GLOBAL[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{LAYER[rest]}.{suffix}"


def permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama3_rope_factors(cfg: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for rope_type llama3."""
    s = cfg["rope_scaling"]
    freqs = 1.0 / (cfg["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(src: Path, out: Path, qtype: str = "F32", arch: str | None = None,
               pre: str | None = None, add_tokenizer=None) -> Path:
    """``src`` (one of make_model's checkpoints) as a GGUF file; 2-D weights in ``qtype``."""
    cfg = json.loads((src / "config.json").read_text())
    arch = arch or ("qwen2" if cfg["model_type"] == "qwen2" else "llama")
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    if add_tokenizer is not None:
        add_tokenizer(w)
    else:
        _add_tokenizer(w, src, pre or ("qwen2" if arch == "qwen2" else "gpt-2"))
    tensors = load_file(str(src / "model.safetensors"))
    if (cfg.get("rope_scaling") or {}).get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg, head_dim))
    quant = gguf.GGMLQuantizationType[qtype]
    for name, t in tensors.items():
        if arch == "llama" and ".q_proj." in name:
            t = permute(t, heads)
        elif arch == "llama" and ".k_proj." in name:
            t = permute(t, kv)
        t = np.ascontiguousarray(t.astype(np.float32))
        if t.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(t, quant), raw_dtype=quant)
        else:
            w.add_tensor(gguf_name(name), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_tokenizer(w, src: Path, pre: str) -> None:
    tok = json.loads((src / "tokenizer.json").read_text())
    tcfg = json.loads((src / "tokenizer_config.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    types = [1] * len(tokens)
    for added in tok["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = 3 if added["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    ids = {t: i for i, t in enumerate(tokens)}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(ids[tcfg["bos_token"]])
    w.add_eos_token_id(ids[tcfg["eos_token"]])
    w.add_add_bos_token(tok.get("post_processor") is not None)
    w.add_chat_template(tcfg["chat_template"])


def write_unsupported(out: Path, qtype: str = "IQ2_XXS", arch: str = "llama") -> Path:
    """A small GGUF whose one 2-D weight is in ``qtype`` (zeros), with a minimal config."""
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(1)
    w.add_embedding_length(256)
    w.add_feed_forward_length(256)
    w.add_head_count(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(ord("a") + i) for i in range(16)])
    quant = gguf.GGMLQuantizationType[qtype]
    shape = gguf.quants.quant_shape_to_byte_shape((16, 256), quant)
    w.add_tensor("token_embd.weight", np.zeros(shape, dtype=np.uint8), raw_dtype=quant)
    w.add_tensor("output_norm.weight", np.ones(256, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def sentencepiece_vocab(texts: list[str], size: int = 700):
    """A SentencePiece-style BPE vocabulary as Llama 2 / Mistral GGUF files hold it:
    <unk> <s> </s>, 256 byte tokens, then pieces with U+2581 for spaces, each scored by
    its merge rank (earlier merges score higher; single characters lowest)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=size, special_tokens=specials,
                                                       show_progress=False))
    model = json.loads(tok.to_str())["model"]
    tokens = [None] * len(model["vocab"])
    for t, i in model["vocab"].items():
        tokens[i] = t
    merged = {"".join(m if isinstance(m, list) else m.split(" ")): rank
              for rank, m in enumerate(model["merges"])}
    scores = [-float(merged[t]) if t in merged else -1e6 - i for i, t in enumerate(tokens)]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259)
    return tokens, scores, types


def add_sentencepiece(tokens, scores, types):
    def add(w):
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    return add
