"""Random-weight Llama-family checkpoints in Hugging Face layout.

Tests and benchmarks need real checkpoints, and the test machines cannot
download any, so we make our own: a byte-level BPE tokenizer trained on the
corpus shipped in ``data/``, a hand-written ``config.json`` and random
weights.  The three architectures deliberately differ (llama3 RoPE scaling,
q/k/v biases with tied embeddings, an explicit ``head_dim`` and a sliding
window) so that every loader path we support gets exercised.

The weights are scaled for *testability*, not for training.  Our engine is
compared token for token with ``transformers``' greedy ``generate``; with the
usual 0.02-std init the top two logits are nearly tied and float noise flips
the argmax.  Here the logits have a standard deviation of about 12, so the
top-1/top-2 gap is typically 2.5 (about 3% of steps are below 0.1 and 0.03%
below 1e-3, while float32 noise is about 1e-5); attention and MLP outputs are as
large as the embeddings, so the output depends on the context rather than
on the last token alone; norm weights are random around 1, so a loader that
drops them is caught; and the lm_head rows of the special tokens are near
zero, so greedy decoding never stops early on EOS by chance.
"""
from __future__ import annotations

import errno
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from pdserve.model.loader import DTYPES

ARCHS = ("llama", "qwen2", "mistral")
PRESETS = ("tiny", "small")

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
# The trainer gives special tokens the first ids, in this order.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START, IM_END, PAD_TOKEN)
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID, PAD_ID = range(len(SPECIAL_TOKENS))

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# What transformers' Qwen2Tokenizer hard-codes (models/qwen2/tokenization_qwen2.py).
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Weight scales (see the module docstring), chosen by measuring greedy
# margins and output variety over many seeds with transformers.
LOGIT_STD = 12.0  # std of the logits over the vocabulary at a position
QK_SCORE_STD = 3.0  # std of q.k/sqrt(head_dim): attention neither flat nor one-hot
MLP_GAIN = 3.0  # down_proj std is MLP_GAIN/sqrt(intermediate); weaker: more repetition
TIED_EMBED_STD = 0.15  # tied: a small embedding keeps a token from predicting itself
QKV_BIAS_STD = 0.1  # qwen2: larger biases make every position attend alike (repetition)


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    max_positions: int
    vocab: int


# (arch, preset) -> shape.  Grouped-query attention everywhere; mistral's
# head_dim differs from hidden/heads so that it must be read from the config.
SHAPES = {
    ("llama", "tiny"): Shape(64, 2, 4, 2, 16, 192, 1024, 1024),
    ("qwen2", "tiny"): Shape(64, 2, 4, 2, 16, 160, 1024, 1024),
    ("mistral", "tiny"): Shape(64, 2, 4, 2, 32, 192, 1024, 1024),
    ("llama", "small"): Shape(512, 8, 8, 4, 64, 1536, 4096, 2048),
    ("qwen2", "small"): Shape(512, 8, 8, 2, 64, 1536, 4096, 2048),
    ("mistral", "small"): Shape(512, 8, 8, 4, 128, 1536, 4096, 2048),
}


def _check_choice(name: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(allowed)}")


def build_config(arch: str = "llama", preset: str = "tiny", dtype: str = "float32") -> dict:
    """The ``config.json`` contents, written by hand so we need no transformers."""
    _check_choice("arch", arch, ARCHS)
    _check_choice("preset", preset, PRESETS)
    _check_choice("dtype", dtype, DTYPES)
    s = SHAPES[arch, preset]
    config = {
        "architectures": [
            {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "mistral": "MistralForCausalLM"}[arch]
        ],
        "model_type": arch,
        "vocab_size": s.vocab,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": s.max_positions,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if arch == "llama":
        # Llama 3.1 style: legacy rope keys with llama3 frequency scaling.  An
        # original length of a quarter of the maximum puts rotary pairs in all
        # three bands (kept, interpolated, divided by factor).
        config.update(
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": s.max_positions // 4,
            },
            attention_bias=False,
            mlp_bias=False,
        )
    elif arch == "qwen2":
        config.update(
            rope_theta=1000000.0,
            rope_scaling=None,
            tie_word_embeddings=True,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=s.layers,
        )
    else:
        # A window longer than any sequence: present in the config, never in effect.
        config.update(
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            head_dim=s.head_dim,
            sliding_window=2 * s.max_positions,
        )
    return config


def build_tokenizer(vocab_size: int, arch: str = "llama") -> Tokenizer:
    """Byte-level BPE trained on the packaged corpus; deterministic, well under a second.

    transformers 5 ignores tokenizer.json's normalizer and pre-tokenizer for
    qwen2 and imposes Qwen's own (NFC, then a split regex that isolates every
    digit), so the qwen2 tokenizer is trained with exactly those; the others
    use the GPT-2 byte-level split, which round-trips any UTF-8 text.
    """
    corpus = resources.files("pdserve.model").joinpath("data/corpus.txt").read_text("utf-8")
    tokenizer = Tokenizer(models.BPE())
    if arch == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,  # the corpus is small: 2048 tokens needs the once-seen pairs too
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.split("\n\n"), trainer=trainer)
    # Prepend BOS to single sequences, as Llama 3 does, so that the raw
    # tokenizer and transformers' tokenizer(text) give the same ids.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"corpus gives {tokenizer.get_vocab_size()} tokens, not {vocab_size}")
    if [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError("special tokens did not get the first ids")
    return tokenizer


def _tokenizer_configs(arch: str, max_positions: int) -> dict[str, dict]:
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    tokenizer_config = {
        # transformers 5 always loads qwen2 with Qwen2Tokenizer; name it so
        # that it does not also add its default "<|endoftext|>" unk token.
        "tokenizer_class": "Qwen2Tokenizer" if arch == "qwen2" else "PreTrainedTokenizerFast",
        **special,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": max_positions,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    special_tokens_map = {**special, "additional_special_tokens": [IM_START, IM_END]}
    return {
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": special_tokens_map,
    }


def init_weights(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Float32 weights named as transformers names them; see the module docstring for the scales."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm_weight(size: int, scale: float = 1.0) -> torch.Tensor:
        return scale * (0.8 + 0.4 * torch.rand(size, generator=gen))

    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    inter = config["intermediate_size"]
    tied = config["tie_word_embeddings"]
    has_bias = config["model_type"] == "qwen2"
    # q and k entries ~ N(0, qk^2) make q.k/sqrt(head_dim) ~ N(0, qk^4) = N(0, QK_SCORE_STD^2).
    qk = math.sqrt(QK_SCORE_STD) / head_dim**0.25

    embed = normal(vocab, hidden, std=TIED_EMBED_STD if tied else 1.0)
    weights = {"model.embed_tokens.weight": embed}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm_weight(hidden)
        weights[p + "self_attn.q_proj.weight"] = normal(q_dim, hidden, std=qk / hidden**0.5)
        weights[p + "self_attn.k_proj.weight"] = normal(kv_dim, hidden, std=qk / hidden**0.5)
        weights[p + "self_attn.v_proj.weight"] = normal(kv_dim, hidden, std=hidden**-0.5)
        if has_bias:
            # Still large enough that a loader which drops them gets other tokens.
            weights[p + "self_attn.q_proj.bias"] = normal(q_dim, std=QKV_BIAS_STD * qk)
            weights[p + "self_attn.k_proj.bias"] = normal(kv_dim, std=QKV_BIAS_STD * qk)
            weights[p + "self_attn.v_proj.bias"] = normal(kv_dim, std=QKV_BIAS_STD)
        weights[p + "self_attn.o_proj.weight"] = normal(hidden, q_dim, std=q_dim**-0.5)
        weights[p + "post_attention_layernorm.weight"] = norm_weight(hidden)
        weights[p + "mlp.gate_proj.weight"] = normal(inter, hidden, std=hidden**-0.5)
        weights[p + "mlp.up_proj.weight"] = normal(inter, hidden, std=hidden**-0.5)
        weights[p + "mlp.down_proj.weight"] = normal(hidden, inter, std=MLP_GAIN * inter**-0.5)
    if tied:
        # lm_head is embed_tokens, so the final norm sets the logit scale.  Its
        # random signs decorrelate the chosen token's embedding from the hidden
        # state that chose it; without them greedy output often locks onto one
        # token, since each step's input would echo the last step's output.
        signs = torch.randint(0, 2, (hidden,), generator=gen) * 2.0 - 1.0
        final_scale = LOGIT_STD / (TIED_EMBED_STD * hidden**0.5)
        weights["model.norm.weight"] = signs * norm_weight(hidden, final_scale)
        embed[: len(SPECIAL_TOKENS)] *= 0.01
    else:
        weights["model.norm.weight"] = norm_weight(hidden)
        lm_head = normal(vocab, hidden, std=LOGIT_STD / hidden**0.5)
        lm_head[: len(SPECIAL_TOKENS)] *= 0.01
        weights["lm_head.weight"] = lm_head
    return weights


def make_model(
    out_dir: str | os.PathLike,
    arch: str = "llama",
    preset: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a random-weight checkpoint to ``out_dir`` and return its path.

    The files are written into a temporary sibling folder that is renamed to
    ``out_dir`` at the end, so no process ever sees half a checkpoint.  Raises
    FileExistsError if ``out_dir`` already exists and is not empty.
    """
    out = Path(out_dir).expanduser().absolute()
    config = build_config(arch, preset, dtype)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} already exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tokenizer = build_tokenizer(config["vocab_size"], arch)
        tokenizer.save(str(tmp / "tokenizer.json"))
        files = _tokenizer_configs(arch, config["max_position_embeddings"])
        files["config.json"] = config
        files["generation_config.json"] = {
            "bos_token_id": BOS_ID,
            "eos_token_id": [EOS_ID, IM_END_ID],  # <|im_end|> ends a chat turn
            "pad_token_id": PAD_ID,
        }
        for name, content in files.items():
            (tmp / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
        weights = init_weights(config, seed)
        weights = {k: v.to(DTYPES[dtype]).contiguous() for k, v in weights.items()}
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tmp.chmod(0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, out)  # atomic; replaces only an empty directory
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            raise FileExistsError(f"{out} appeared while it was being written") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
