"""A ``tokenizers`` tokenizer built from a GGUF file's metadata.

A GGUF carries no tokenizer.json: llama.cpp keeps the vocabulary (``tokenizer.ggml.tokens``),
the merges, each token's type (1 normal, 3 control, 4 user-defined, ...), the special ids,
and names the pre-tokenizer (``tokenizer.ggml.pre``) whose splitting the merges were
learned with. Byte-level BPE files (``tokenizer.ggml.model == "gpt2"``: SmolLM, Llama 3,
Qwen2, ...) are rebuilt here the way their tokenizer.json has them.
"""
from __future__ import annotations

import logging
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from pdserve.model.config import ModelLoadError

log = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre → (regex the text is split by, digits split one by one first,
# merges ignored for whole-word tokens, NFC-normalized); as llama.cpp's llama-vocab.cpp has them.
PRE_TOKENIZERS = {
    "default": (_GPT2_SPLIT, False, False, False),
    "gpt-2": (_GPT2_SPLIT, False, False, False),
    "smollm": (_GPT2_SPLIT, True, False, False),
    "llama-bpe": (_LLAMA3_SPLIT, False, True, False),
    "llama3": (_LLAMA3_SPLIT, False, True, False),
    "smaug-bpe": (_LLAMA3_SPLIT, False, False, False),
    "qwen2": (_QWEN2_SPLIT, False, False, True),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False, False, True),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table, in which byte-level vocabularies are spelled."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tokenizer_from_gguf(path: str | Path) -> tuple[Tokenizer, dict]:
    """(tokenizer, tokenizer_config-like dict with bos_token, eos_token, chat_template)."""
    from pdserve.model.gguf import metadata, reader

    r = reader(path)
    meta = metadata(r)
    kind = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in r.fields:
        raise ModelLoadError(f"{path} has no tokenizer (tokenizer.ggml.tokens)")
    if kind != "gpt2":
        raise ModelLoadError(
            f"{path}: tokenizer.ggml.model {kind!r} is not supported; supported: 'gpt2' "
            "(byte-level BPE: SmolLM, Llama 3, Qwen2 and most files since 2024)")
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    types = (r.fields["tokenizer.ggml.token_type"].contents()
             if "tokenizer.ggml.token_type" in r.fields else [1] * len(tokens))
    merges = (r.fields["tokenizer.ggml.merges"].contents()
              if "tokenizer.ggml.merges" in r.fields else [])
    tok = _byte_level_bpe(tokens, types, merges, meta.get("tokenizer.ggml.pre") or "default",
                          path)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]}:0 $A:0", pair=f"{tokens[bos]}:0 $A:0 {tokens[bos]}:1 $B:1",
            special_tokens=[(tokens[bos], bos)])
    config = {"chat_template": meta.get("tokenizer.chat_template")}
    for name in ("bos", "eos", "unknown", "padding"):
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            config[{"unknown": "unk", "padding": "pad"}.get(name, name) + "_token"] = \
                tokens[token_id]
    return tok, config


def _byte_level_bpe(tokens: list[str], types: list[int], merges: list[str], pre: str,
                    path) -> Tokenizer:
    if pre not in PRE_TOKENIZERS:
        log.warning("%s: pre-tokenizer %r is not known to pdserve; splitting text as GPT-2 "
                    "does, which may tokenize some text differently from llama.cpp", path, pre)
    split, digits, ignore_merges, nfc = PRE_TOKENIZERS.get(pre, PRE_TOKENIZERS["default"])
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # Byte-level vocabularies spell every token in the byte alphabet; a token stored as
    # plain text (an added token with a space, say) is respelled so that it still matches.
    vocab = {}
    for i, t in enumerate(tokens):
        spelled = t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode())
        vocab.setdefault(spelled, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
    if nfc:
        tok.normalizer = normalizers.NFC()
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_end|>) are matched whole and are special; user-defined ones
    # (<think>) are matched whole but are text. A control token spelled outside the byte
    # alphabet is a mislabel of llama.cpp's converter (transformers skips them too).
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(tokens, types)
                            if ty == CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in vocab])
    return tok
