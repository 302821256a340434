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
    if kind not in ("gpt2", "llama"):
        raise ModelLoadError(
            f"{path}: tokenizer.ggml.model {kind!r} is not supported; supported: 'gpt2' "
            "(byte-level BPE: SmolLM, Llama 3, Qwen2, ...) and 'llama' (SentencePiece BPE: "
            "Llama 2, Mistral 7B, ...)")
    tokens = r.fields["tokenizer.ggml.tokens"].contents()

    def array(key, default):
        return r.fields[key].contents() if key in r.fields else default
    types = array("tokenizer.ggml.token_type", [1] * len(tokens))
    if kind == "gpt2":
        tok = _byte_level_bpe(tokens, types, array("tokenizer.ggml.merges", []),
                              meta.get("tokenizer.ggml.pre") or "default", path)
    else:
        tok = _sentencepiece_bpe(tokens, types, array("tokenizer.ggml.scores", None),
                                 meta.get("tokenizer.ggml.add_space_prefix", True))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    if meta.get("tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None:
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


def _sentencepiece_bpe(tokens: list[str], types: list[int], scores: list[float] | None,
                       add_space_prefix: bool) -> Tokenizer:
    """A SentencePiece BPE vocabulary (pieces spelled with U+2581 for spaces, byte tokens
    <0xNN> for everything else) as transformers' LlamaTokenizer builds it: the merges
    recovered from the pieces' scores, byte fallback, a space marker before the text."""
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges_from_scores(vocab, tokens, scores),
                               unk_token=tokens[0] if types and types[0] == 2 else None,
                               fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_space_prefix else "never",
        split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(tokens, types) if ty == CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    return tok


def _merges_from_scores(vocab: dict[str, int], tokens: list[str],
                        scores: list[float] | None) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary is a merge, ranked by the
    merged piece's score (best first), as transformers' generate_merges ranks them."""
    merges = []
    for piece, score in zip(tokens, scores if scores is not None else
                            [-float(i) for i in range(len(tokens))]):
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]
