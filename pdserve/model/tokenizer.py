"""Tokenizer wrapper over ``tokenizers`` plus incremental detokenization.

Streaming text must never show half a UTF-8 character or a piece that a later
token rewrites, so text is released by offsets, the way the serving systems
users know do it: decode a short window and emit only what is stable.
"""
from __future__ import annotations

import json
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer

from pdserve.model.config import ModelLoadError


def read_chat_templates(model_dir: Path, config: dict) -> dict[str, str]:
    """The folder's chat templates by name, with transformers' precedence: the files
    ``chat_template.jinja`` ("default") and ``chat_templates/NAME.jinja`` (transformers 5
    writes these) replace whatever ``tokenizer_config.json`` holds, which is either one
    template or a list of ``{"name", "template"}``."""
    templates = {}
    if (model_dir / "chat_template.jinja").is_file():
        templates["default"] = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if (model_dir / "chat_templates").is_dir():
        for f in sorted((model_dir / "chat_templates").glob("*.jinja")):
            templates[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if templates:
        return templates
    legacy = config.get("chat_template")
    if isinstance(legacy, list):
        return {t["name"]: t["template"] for t in legacy}
    return {"default": legacy} if legacy else {}


def _token_text(value) -> str:
    """tokenizer_config.json spells a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content", "")
    return value or ""


class Tokenizer:
    """``Tokenizer(path)``: a checkpoint folder's tokenizer.json, or a GGUF file's metadata."""

    def __init__(self, model_path: str | Path):
        model_path = Path(model_path)
        if model_path.is_file():
            from pdserve.model.gguf_tokenizer import tokenizer_from_gguf

            self._tok, self.config = tokenizer_from_gguf(model_path)
            self.chat_templates = ({"default": self.config["chat_template"]}
                                   if self.config.get("chat_template") else {})
        else:
            path = model_path / "tokenizer.json"
            if not path.is_file():
                raise ModelLoadError(
                    f"no tokenizer.json in {model_path}: only fast (tokenizers) tokenizers are "
                    "supported; save one beside the weights "
                    "(AutoTokenizer.from_pretrained(...).save_pretrained(DIR))")
            self._tok = _HFTokenizer.from_file(str(path))
            cfg_path = model_path / "tokenizer_config.json"
            self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
            self.chat_templates = read_chat_templates(model_path, self.config)
        self.chat_template = self.chat_templates.get("default")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = {i for i, t in self._tok.get_added_tokens_decoder().items()
                            if t.special}

    def hf_config(self) -> dict:
        """tokenizer_config.json as transformers reads it, and as vLLM's /tokenizer_info
        serves it: the config without file paths, special tokens as their text, the class
        and the default chat template. A GGUF file's is built from its metadata."""
        cfg = {k: v for k, v in self.config.items()
               if v is not None and k not in ("vocab_file", "merges_file", "chat_template")}
        for key in [k for k in cfg if k.endswith("_token")]:
            cfg[key] = _token_text(cfg[key])
        cfg.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        # pdserve decodes with tokenizers' own decode, which cleans up no spaces.
        cfg.setdefault("clean_up_tokenization_spaces", False)
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        return cfg

    def save_hf(self, out_dir: str | Path) -> Path:
        """Writes a Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json)
        that ``AutoTokenizer.from_pretrained`` loads and that tokenizes as this one does."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps(self.hf_config(), indent=2,
                                                              ensure_ascii=False) + "\n")
        return out

    def longest_token_chars(self) -> int:
        """The most characters of text one token stands for, bounded by its spelling (a
        byte-level token spells each byte of its text as one character, a SentencePiece
        token each character as one): a text of n characters has at least n / this
        many tokens."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1) or 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        if not self.chat_template:
            if self.chat_templates:
                raise ValueError(f"this model has chat templates named "
                                 f"{sorted(self.chat_templates)} but no default one")
            raise ValueError("this model has no chat template (neither chat_template.jinja "
                             "nor a chat_template in tokenizer_config.json)")
        return _render(self.chat_template, messages=messages, tools=tools,
                       add_generation_prompt=add_generation_prompt,
                       bos_token=_token_text(self.config.get("bos_token")),
                       eos_token=_token_text(self.config.get("eos_token")))


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _render(template: str, **context) -> str:
    """Renders a chat template in the environment transformers gives it: sandboxed (the
    template comes with the model), loop controls, and raise_exception for templates that
    refuse a conversation."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    # transformers' tojson: plain JSON, not jinja2's HTML-escaped one (tool schemas, calls)
    env.filters["tojson"] = _tojson
    return env.from_string(template).render(**context)


class IncrementalDetokenizer:
    """Turns a growing list of output ids into stable text deltas."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        # Start the window inside the prompt so the first token's leading space decodes right.
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        """Appends tokens, returns the text they make stable (may be '')."""
        self.ids.extend(token_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the next token
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta
